"""The client library's decisions: submit trades exactly once. Pure.

`submit(messages, now)` numbers them with the client's own sequence
numbers and returns the inbound batches (datagrams) to send to `leader`:
the sequencer whose seal ends the newest packet read (with stream keys a
seal names the leader that cut it), or every sequencer while none is known.
A follower drops what it gets; sending it every batch only woke it.
`on_timer(now)` returns what is due to be sent again, to every sequencer: a
batch not seen sequenced in time may have gone to a leader that is gone,
and new batches go to every one too until a packet names a leader again.

`on_read(read_drain(runs))` reads the public stream: a message
sequenced with this client as origin acknowledges everything up to its
client seq (the sequencer accepts each client's messages in order);
`on_ahead(packet)` reads a sealed packet held ahead of a gap, whose
messages of this client are sequenced but not acknowledged yet (their
rejects are read in order): they are no longer sent again.

A client seq names one trade forever: the leader sequences each client seq
once and drops it when it comes again. A client that restarts therefore
resubmits the same trade under the same client seq (from its own durable
outbox, or, like `tape load`, regenerated from its seed); `resume(acked)`
goes on after the last one it found sequenced in the stream, so that it
does not send again what is already in the log.

Advice from the leader (protocol/backoff.py), read by `on_advice`: a
back-off (the leader is overloaded) is honoured if it names a batch in
flight, newer than any it honoured: new batches and resends pause for its
retry-after (at most MAX_RETRY_MS). A resend request (the leader holds a
batch ahead of one it never got) makes the batch holding that client seq
due at once, unless it was sent in the last RESEND_ASK_FLOOR_NS; the shell
then sends what `on_timer` returns.

Resend policy: at most RESENDS_PER_ROUND batches per call, the oldest
first. The oldest one blocks everything behind it (the leader holds what
arrives ahead of it), so it is resent at the timeout; the ones behind it
back off (up to 8x), so that a loaded cluster is not sent everything
again. The timeout follows what submitting takes: the measured
submit-to-sequenced time and its variation (TCP's, RFC 6298: srtt +
4 rttvar, from batches sent once only), never less than the configured
`resend_ns` and at most MAX_RESEND_TIMEOUT_NS. A fixed timeout below a
loaded cluster's commit time resent more batches than were sent (2% loss
at 100,000 msg/s), which loaded the leader further; a lost batch is asked
for by the leader anyway.
"""

from __future__ import annotations

from collections import deque

from tape.protocol import backoff, clientmac, messages, moldudp64
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import MAX_RESEND_TIMEOUT_NS, MAX_RETRY_MS, RESEND_ASK_FLOOR_NS, RESENDS_PER_ROUND
from tape.protocol.receiver import Deliver
from tape.protocol.rtt import RoundTrip
from tape.protocol.streamauth import seal_origin

MAX_BACKOFF = 8  # times the resend timeout, for batches behind the oldest


class Unacked:
    """An inbound batch sent and not yet seen sequenced."""

    __slots__ = ("first_cseq", "count", "datagram", "sent_ns", "last_sent_ns", "due_ns", "resends")

    def __init__(self, first_cseq: int, count: int, datagram: bytes, now_ns: int, timeout_ns: int):
        self.first_cseq, self.count, self.datagram = first_cseq, count, datagram
        self.sent_ns = self.last_sent_ns = now_ns
        self.due_ns, self.resends = now_ns + timeout_ns, 0

    @property
    def last_cseq(self) -> int:
        return self.first_cseq + self.count - 1


class Recovery:
    """A restarted client reads the stream (from seq 1) up to the head known when it first
    heard the live stream (a packet or heartbeat); then it may resume numbering."""

    def __init__(self):
        self.head: int | None = None

    def done(self, listener) -> bool:
        """`listener`: the ListenerCore. With keys a heartbeat is only a hint of the head, and the
        first packet may be a rewinder's answer to it: the head is the furthest either says."""
        rx = listener.receiver
        if self.head is None and (rx.packets or listener.hinted_head()):
            self.head = max(rx.high_seq, listener.hinted_head())
        return self.head is not None and rx.next_seq >= self.head


def read_drain(runs: list[Deliver]) -> tuple[bytes | None, dict[bytes, int], list[tuple[bytes, int]]]:
    """What every client reads in a drain's in-order packets of the stream (each from its `skip`):
    the leader the newest seal names, each origin's highest client seq, and the (packet, skip) of
    those holding a reject (rare: each client looks for its own in them). Read once a drain for all
    the clients of a process (`sharing_listeners`): a read a packet and a call a client for each
    cost the load ~1.5 us a packet."""
    leader = None
    for run in reversed(runs):
        if leader := seal_origin(run.packet):
            break
    block = messages.SEQUENCED_BLOCK_SIZE
    blocks = b"".join([memoryview(run.packet)[moldudp64.HEADER_SIZE + run.skip * block:] for run in runs])
    rejected = []
    if messages.REJECTED in blocks[2::block]:
        rejected = [(run.packet, run.skip) for run in runs
                    if messages.REJECTED in run.packet[moldudp64.HEADER_SIZE + run.skip * block + 2::block]]
    return leader, messages.client_seq_maxima(blocks, 2), rejected


class ClientCore:
    def __init__(self, origin: bytes, key: bytes | None, max_packet: int, resend_ns: int):
        self.origin = origin
        self.key = key
        room = max_packet - moldudp64.HEADER_SIZE - (messages.INBOUND_MAC_SIZE if key else 0)
        self.per_batch = room // messages.INBOUND_BLOCK_SIZE
        assert self.per_batch >= 1, f"max_packet {max_packet} holds no inbound message"
        self.submitting = RoundTrip(resend_ns, MAX_RESEND_TIMEOUT_NS)  # submit to seen sequenced
        self.next_cseq = 1
        self.leader: bytes | None = None  # where new batches go (None: every sequencer)
        self.acked = 0  # highest client seq seen sequenced
        self.unacked: deque[Unacked] = deque()
        self.resends = 0
        self.latencies_ns: list[int] = []  # submit -> seen sequenced, a sample a batch (the shell takes them)
        self.rejected: list[tuple[int, str]] = []  # (client seq, reason): sequenced as ingress rejects
        self.paused_until_ns = 0  # told to back off until then
        self.backed_off_seq = 0  # the newest batch (first client seq) a back-off named
        self.backoffs = 0  # back-offs honoured
        self.resends_asked = 0  # resend requests honoured
        self.paused_ns = 0  # time paused by them, in all
        self.advice_drops: dict[str, int] = {}  # back-offs and resend requests not acted on, by reason

    @property
    def in_flight(self) -> int:
        return self.next_cseq - 1 - self.acked

    @property
    def resend_timeout_ns(self) -> int:
        """How long a batch waits to be seen sequenced before it is sent again."""
        return self.submitting.timeout_ns

    def resume(self) -> int:
        """After a restart, once the stream was read up to its head: number from
        the client seq after the last one sequenced. Returns that last one."""
        if self.unacked or self.next_cseq != 1:
            raise InvariantViolation("resume() after submitting")
        self.next_cseq = self.acked + 1
        return self.acked

    def submit(self, msgs: list[bytes], now_ns: int) -> list[bytes]:
        """Number and batch inbound messages; returns the datagrams to send."""
        out = []
        for start in range(0, len(msgs), self.per_batch):
            chunk = msgs[start:start + self.per_batch]
            if self.next_cseq + len(chunk) - 1 <= self.acked:  # a restarted client's earlier run got them in
                self.next_cseq += len(chunk)
                continue
            data = moldudp64.encode_packet(self.origin, self.next_cseq, chunk)
            if self.key:
                data += clientmac.mac(self.key, data)
            self.unacked.append(Unacked(self.next_cseq, len(chunk), data, now_ns, self.resend_timeout_ns))
            self.next_cseq += len(chunk)
            out.append(data)
        return out

    def on_delivered(self, packet: bytes, skip: int, now_ns: int) -> bool:
        """Messages skip.. of an in-order packet of the stream; True if they acknowledged something
        (`on_read` of a drain of one packet)."""
        return self.on_read(read_drain([Deliver(0, packet, skip)]), now_ns)

    def on_read(self, read: tuple, now_ns: int) -> bool:
        """A drain of in-order packets of the stream, as `read_drain` read them; True if they
        acknowledged something."""
        leader, maxima, rejected = read
        self.leader = leader or self.leader
        for packet, skip in rejected:  # rare: a reject; one of ours?
            self._note_rejects(packet, skip)
        top = maxima.get(self.origin, 0)
        if top <= self.acked:
            return False
        self.acked = top
        self._sequenced(top, now_ns)
        return True

    def on_ahead(self, packet: bytes, now_ns: int) -> None:
        """A sealed packet held ahead of a gap (the listener verified it: committed). The leader
        takes each client's seqs in order, so one of ours in it says that all before it are
        sequenced: they are not sent again, though a lost stream packet holds them back. They
        are acknowledged (`acked`, with their rejects read) when delivered in order."""
        self.leader = seal_origin(packet) or self.leader
        self._sequenced(messages.client_seq_maxima(memoryview(packet)[moldudp64.HEADER_SIZE:], 2).get(self.origin, 0),
                        now_ns)

    def _sequenced(self, top: int, now_ns: int) -> None:
        """Client seqs up to `top` are in the log: their batches are no longer sent again."""
        q = self.unacked
        while q and q[0].last_cseq <= top:
            u = q.popleft()
            self.latencies_ns.append(now_ns - u.sent_ns)
            if u.resends == 0:  # (a resent batch's time is ambiguous)
                self.submitting.sample(now_ns - u.sent_ns)

    def _note_rejects(self, packet: bytes, skip: int) -> None:
        n = moldudp64.HEADER.unpack_from(packet)[2]
        for i in range(skip, n):
            at = moldudp64.HEADER_SIZE + i * messages.SEQUENCED_BLOCK_SIZE + 2
            if packet[at] == messages.REJECTED and packet[at + 57:at + 67] == self.origin:
                m = messages.SEQUENCED.unpack_from(packet, at)
                code, reasons = m[messages.SHARES], messages.INGRESS_REJECTS
                self.rejected.append((m[messages.CLIENT_SEQ], reasons[code - 1] if 0 < code <= len(reasons) else "?"))

    def on_advice(self, data: bytes, now_ns: int, from_sequencer: bool = True) -> str | None:
        """A datagram on the send socket, from a sequencer's inbound address or not: returns
        the drop reason, or None if honoured (a back-off, or a resend request)."""
        if not from_sequencer:
            return self._drop_advice("not_a_sequencer")
        try:
            b = backoff.decode(data, self.key)
        except ProtocolError as e:
            return self._drop_advice(e.reason)
        if b.client != self.origin:
            return self._drop_advice("wrong_client")
        if isinstance(b, backoff.Resend):
            return self._on_resend(b.client_seq, now_ns)
        if not self.acked < b.client_seq < self.next_cseq or b.client_seq <= self.backed_off_seq:
            return self._drop_advice("stale")  # not in flight, or named before: a replay asks for nothing
        self.backed_off_seq = b.client_seq
        until = now_ns + min(b.retry_ms, MAX_RETRY_MS) * 1_000_000
        if until > self.paused_until_ns:
            self.paused_ns += until - max(now_ns, self.paused_until_ns)
            self.paused_until_ns = until
        self.backoffs += 1
        return None

    def _on_resend(self, client_seq: int, now_ns: int) -> str | None:
        """The leader lacks this client seq: the batch holding it is due now."""
        if not self.acked < client_seq < self.next_cseq:
            return self._drop_advice("stale")
        for u in self.unacked:  # the oldest first: a missing batch is near the head of the line
            if u.first_cseq <= client_seq <= u.last_cseq:
                if now_ns - u.last_sent_ns < RESEND_ASK_FLOOR_NS:
                    return self._drop_advice("sent_recently")
                u.due_ns = min(u.due_ns, now_ns)
                self.resends_asked += 1
                return None
        return self._drop_advice("stale")  # (acknowledged in between)

    def _drop_advice(self, reason: str) -> str:
        self.advice_drops[reason] = self.advice_drops.get(reason, 0) + 1
        return reason

    def pause_left_ns(self, now_ns: int) -> int:
        """How long the client must still hold new batches (0: it may send)."""
        return max(0, self.paused_until_ns - now_ns)

    def on_timer(self, now_ns: int) -> list[bytes]:
        """The batches due to be sent again, the oldest first; none while backing off."""
        out = []
        if now_ns < self.paused_until_ns:
            return out
        timeout = self.resend_timeout_ns
        for i, u in enumerate(self.unacked):
            if len(out) == RESENDS_PER_ROUND:
                break
            if now_ns >= u.due_ns:
                u.resends += 1
                backoff = 1 if i == 0 else min(1 << u.resends, MAX_BACKOFF)
                u.due_ns = now_ns + timeout * backoff
                u.last_sent_ns = now_ns
                out.append(u.datagram)
        self.resends += len(out)
        if out:  # not seen sequenced in time: the leader may be gone, until the stream names one again
            self.leader = None
        return out
