"""The leader sequencer's logic. Pure: no sockets, files or clock.

Events in: inbound batches (bytes, the time they arrived, where from), the
shell's report after each drain of the inbound socket, acks from followers,
the shell's report that its own journal holds a batch, timer ticks. Actions
out: a `Batch` to journal and replicate, packets to publish (only committed
ones), heartbeats, advice to clients (back-offs while overloaded, requests to
resend a batch that later ones overtook).

Commit before publish: packets are cut when a batch is stamped and released
only when a majority of voters (this leader included) holds the batch.
Followers ack whole batches, so the commit point is always a batch boundary
and a packet is either wholly committed or not at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tape.protocol import backoff, clientmac, messages, moldudp64
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.journal import RecordRun
from tape.protocol.limits import (
    BACKOFF_INTERVAL_NS,
    BACKOFF_RETRY_MS,
    MAX_HELD_BATCHES,
    OVERLOAD_NS,
    PACE_FROM_MESSAGES,
    RESEND_ASK_INTERVAL_NS,
)
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import StreamKeys


@dataclass
class Batch:
    """Stamped messages to append to the journal and replicate."""

    first_seq: int
    prev_seq: int
    prev_term: int
    term: int
    messages: list  # sequenced messages (messages.SEQUENCED_SIZE bytes each)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.messages) - 1

    def records(self) -> RecordRun:
        """Its (seq, term, message) records, to journal."""
        return RecordRun(self.first_seq, self.term, b"".join(self.messages), messages.SEQUENCED_SIZE)



class LeaderCore:
    def __init__(
        self,
        session: bytes,
        name: bytes,
        term: int,
        followers: list[bytes],
        clients: dict[bytes, bytes | None],
        last_seq: int = 0,
        last_term: int = 0,
        client_last: dict[bytes, int] | None = None,
        max_packet: int = moldudp64.DEFAULT_MAX_PACKET,
        tick_ns: int = 1_000_000_000,
        heartbeat_ns: int = 1_000_000_000,
        batch_interval_ns: int = 0, pace_from: int = PACE_FROM_MESSAGES,
        last_stamp_ns: int = 0,
        stream_keys: StreamKeys | None = None,
        open_range: tuple[int, list[bytes]] | None = None,
    ):
        """`stream_keys`: seal every packet (protocol/streamauth.py). `open_range`: (first seq,
        entries) after the log's last seal, which this leader's first entry seals. `batch_interval_ns`,
        `pace_from`: the pacing of batches while messages come fast (`batch_due_ns`; 0, none)."""
        if term <= last_term:
            raise InvariantViolation(f"new term {term} must exceed the log's last term {last_term}")
        self.session = session
        self.name = name
        self.term = term
        self.followers = list(followers)
        self.clients = clients  # client id (10 bytes) -> HMAC key or None
        self.client_last = dict(client_last or {})  # highest client seq sequenced, per client
        self.last_seq = last_seq  # highest seq stamped
        self.last_term = last_term
        self.commit_seq = 0
        # Last seq released to the public stream. Entries of earlier terms that
        # commit with this term are not re-published: listeners fill them as a gap.
        self.published_seq = last_seq
        self.journaled_seq = last_seq  # what this leader's own journal holds
        self.match = {f: 0 for f in self.followers}
        self.tick_ns = tick_ns
        self.heartbeat_ns = heartbeat_ns
        self.batch_interval_ns, self.pace_from = batch_interval_ns, pace_from
        self._last_batch = (0, 0)  # (when it was stamped, monotonic; its messages)
        self._builder = PacketBuilder(session, last_seq + 1, max_packet)
        self.keys = stream_keys
        self._open_range = open_range
        if open_range is not None and (stream_keys is None or len(open_range[1]) >= self._builder.per_packet
                                       or open_range[0] + len(open_range[1]) != last_seq + 1):
            raise InvariantViolation(f"the log ends with {last_seq - open_range[0] + 1:,} unsealed entries (a packet "
                                     "holds fewer): keys apply from a new session (docs/security.md)")
        self._held: dict[bytes, dict[int, tuple]] = {}  # client -> first cseq -> (count, batch, its rejects)
        # Accepted, not stamped: (origin, first client seq, (batch, skip, count)) a client batch's messages
        # skip..count-1, or (None, 0, [sequenced message]) a control message.
        self._pending: list = []
        self._pending_count = 0
        self._unpublished: deque = deque()  # (last seq, [packets]) stamped, not committed
        self._last_stamp_ns = last_stamp_ns  # the log's last stamp: stamps never go backwards across terms
        self._last_sequenced_ns = 0
        self._last_published_ns = 0
        self.term_start_seq = 0
        self._busy_since_ns: int | None = None  # the first drain since which none emptied the inbound socket
        self._backoff_at: dict[bytes, int] = {}  # client -> when it was last told to back off
        self._resend_asked: dict[bytes, tuple[int, int]] = {}  # client -> (missing client seq, when asked)
        self.advice: list[tuple[object, bytes]] = []  # (source, back-off or resend) to send; the shell takes them
        # Counters (the shell exposes them as metrics).
        self.accepted = 0
        self.dropped: dict[str, int] = {}
        self.rejected: dict[str, int] = {}  # client messages sequenced as ingress rejects, by reason
        self.published_packets = 0
        self.published_messages = 0
        self.backoffs_sent = 0
        self.resends_asked = 0

    # --- inbound ---------------------------------------------------------------

    def start_term(self, now_ns: int, wall_ns: int, ended: bool = False) -> Batch:
        """A new leader's first entry: the term start, committed before anything new; on a log
        that holds the session's end (`ended`: its leader died before it committed), the
        session's end follows it, the term's last entry. A range the log ends with, cut short (the
        old leader died mid-catch-up), is sealed first: it is not published (it is an earlier
        term's); listeners fill it from the rewinders."""
        prev_seq, prev_term = self.last_seq, self.last_term
        closing = []
        if self._open_range is not None:
            first, entries = self._open_range
            closing = [self.keys.seal_packet(self.session, first, entries, self._stamp(wall_ns), self.name)[0]]
            self.last_seq += 1
            self.published_seq = self.last_seq  # heartbeats announce it: listeners ask the rewinders
            self._builder.next_seq = self.last_seq + 1
        stamp = self._stamp(wall_ns)
        self._sequence_control(messages.term_start(stamp, self.name, self.term, self.name))
        if ended:
            self._sequence_control(messages.session_end(stamp, self.name))
        batch = self.flush(now_ns, wall_ns)
        self.term_start_seq = batch.first_seq
        return Batch(prev_seq + 1, prev_seq, prev_term, self.term, closing + batch.messages)

    def on_inbound(self, data: bytes, now_ns: int, source: object = None) -> str | None:
        """Accept an inbound batch; returns the drop reason, or None. `source`: where the batch
        came from, opaque here: a back-off (overloaded) or a resend request (a batch missing
        ahead of this one) to it is queued in `advice`."""
        try:
            client, cseq, count = moldudp64.decode_header(data)
        except ProtocolError as e:
            return self._drop(e.reason)
        if client not in self.clients:
            return self._drop("unknown_client")
        key = self.clients[client]
        if key is not None:
            if len(data) < moldudp64.HEADER_SIZE + messages.INBOUND_MAC_SIZE:
                return self._drop("unauthenticated")
            body, mac = data[:-messages.INBOUND_MAC_SIZE], data[-messages.INBOUND_MAC_SIZE:]
            if not clientmac.verify(key, body, mac):
                return self._drop("unauthenticated")
            data = body
        if count == 0 or count == 0xFFFF or cseq == 0:
            return self._drop("bad_batch")
        if source is not None and self.overloaded(now_ns):
            self._back_off(client, cseq, key, source, now_ns)
        try:
            rejects = messages.inbound_rejects(data, count)
        except ProtocolError as e:
            return self._drop(e.reason)
        last = self.client_last.get(client, 0)
        if cseq + count - 1 <= last:
            return self._drop("duplicate")
        if cseq > last + 1:
            # Ahead of a lost batch: hold it until the client resends the gap, and ask for that now.
            held = self._held.setdefault(client, {})
            if cseq not in held and len(held) >= MAX_HELD_BATCHES:
                return self._drop("client_seq_gap")
            held[cseq] = (count, data, rejects)
            if source is not None:
                self._ask_resend(client, last + 1, key, source, now_ns)
            return None
        self._accept(client, cseq, count, data, rejects, last)
        held = self._held.get(client)
        while held:
            last = self.client_last[client]
            for k in [k for k in held if k <= last]:  # now duplicates
                if held[k][0] + k - 1 <= last:
                    del held[k]
            nxt = held.pop(last + 1, None)
            if nxt is None:
                overlap = [k for k in held if k <= last + 1]
                if not overlap:
                    break
                nxt = held.pop(overlap[0])
                self._accept(client, overlap[0], *nxt, last)
            else:
                self._accept(client, last + 1, *nxt, last)
        return None

    def _accept(self, client: bytes, cseq: int, count: int, data: bytes, bad: list, last: int) -> None:
        """`bad`: the batch's `inbound_rejects`."""
        skip = last + 1 - cseq
        if bad:  # sequenced as rejects in their place: the client sees why, and its seqs go on
            blocks = bytearray(data)
            for i, code in bad:
                if i >= skip:
                    at = messages.HEADER_SIZE + i * messages.INBOUND_BLOCK_SIZE + 2
                    blocks[at:at + messages.INBOUND_SIZE] = messages.rejected(data[at:at + messages.INBOUND_SIZE], code)
                    reason = messages.INGRESS_REJECTS[code - 1]
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
            data = bytes(blocks)
        self._pending.append((client, last + 1, (data, skip, count)))  # stamped from the batch's bytes
        self._pending_count += count - skip
        self.client_last[client] = cseq + count - 1
        self.accepted += count - skip

    def _back_off(self, client: bytes, cseq: int, key: bytes | None, source: object, now_ns: int) -> None:
        """Answered only after the client's MAC checked out (or it has no key), once per interval
        per configured client, smaller than the batch: no reflector for forged sources."""
        if now_ns - self._backoff_at.get(client, now_ns - BACKOFF_INTERVAL_NS) < BACKOFF_INTERVAL_NS:
            return
        self._backoff_at[client] = now_ns
        self.advice.append((source, backoff.encode(client, self.term, cseq, BACKOFF_RETRY_MS, key)))
        self.backoffs_sent += 1

    def _ask_resend(self, client: bytes, missing: int, key: bytes | None, source: object, now_ns: int) -> None:
        """Once per missing client seq, again after RESEND_ASK_INTERVAL_NS if it is still missing."""
        asked = self._resend_asked.get(client)
        if asked is not None and asked[0] == missing and now_ns - asked[1] < RESEND_ASK_INTERVAL_NS:
            return
        self._resend_asked[client] = (missing, now_ns)
        self.advice.append((source, backoff.encode_resend(client, self.term, missing, key)))
        self.resends_asked += 1

    def note_drain(self, emptied: bool, now_ns: int) -> None:
        """The shell read its inbound socket empty (or stopped at its drain limit)."""
        if emptied:
            self._busy_since_ns = None
        elif self._busy_since_ns is None:
            self._busy_since_ns = now_ns

    def overloaded(self, now_ns: int) -> bool:
        """No drain has emptied the inbound socket for OVERLOAD_NS: batches arrive faster than
        this leader sequences them."""
        return self._busy_since_ns is not None and now_ns - self._busy_since_ns >= OVERLOAD_NS

    def take_advice(self) -> list[tuple[object, bytes]]:
        """The back-offs and resend requests to send, each to the source address of a batch."""
        out, self.advice = self.advice, []
        return out

    def _drop(self, reason: str) -> str:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return reason

    @property
    def pending(self) -> int:
        return self._pending_count

    def _stamp(self, now_ns: int) -> int:
        # Stamps never go backwards, whatever the clock does.
        self._last_stamp_ns = max(self._last_stamp_ns, now_ns)
        return self._last_stamp_ns

    def _sequence_control(self, msg: bytes) -> None:
        self._pending.append((None, 0, [msg]))
        self._pending_count += 1

    def flush(self, now_ns: int, wall_ns: int) -> Batch | None:
        """Stamp everything accepted into one batch (one journal write, one
        replication frame per follower), with the wall clock (`wall_ns`); `now_ns` is the
        monotonic clock every timer of this core runs on."""
        if not self._pending:
            return None
        stamp = self._stamp(wall_ns)
        out = []
        stamp_bytes = stamp.to_bytes(8, "big")
        for origin, first_cseq, run in self._pending:
            if origin is None:
                out.extend(run)  # control messages come stamped
            else:
                out.extend(messages.stamp_blocks(*run, stamp_bytes + origin, first_cseq))  # stamp, origin, cseq
        self._pending = []
        self._pending_count = 0
        if stamp < self._last_sequenced_ns:
            raise InvariantViolation(f"stamp {stamp} before the last one, {self._last_sequenced_ns}")
        if self.keys is not None:
            out, packets = self._seal(out, stamp)
        else:
            packets = self._builder.add_sequenced(out)
        batch = Batch(self.last_seq + 1, self.last_seq, self.last_term, self.term, out)
        self._unpublished.append((batch.last_seq, packets))
        self.last_seq = batch.last_seq
        self.last_term = self.term
        self._last_sequenced_ns = stamp
        self._last_batch = (now_ns, len(out))
        return batch

    def batch_due_ns(self, now_ns: int) -> int:
        """When to stamp what is pending: now, unless the last batch held `pace_from` messages or
        more (messages come fast) and began less than `batch_interval_ns` ago; then that long
        after it, and what arrives meanwhile joins this batch. A batch costs the cluster the same
        whatever it holds (four fsyncs, a wake-up of every process on its path): paced at 10 ms,
        at 250,000 msg/s a batch held 2,700-3,800 messages, not 1,200-1,800 (docs/performance.md). Never
        further off than one interval (a wall clock stepped back does not hold a batch longer)."""
        at, size = self._last_batch
        if size < self.pace_from or not self.batch_interval_ns:
            return now_ns
        return max(now_ns, min(at + self.batch_interval_ns, now_ns + self.batch_interval_ns))

    def _seal(self, entries: list[bytes], stamp: int) -> tuple[list[bytes], list[bytes]]:
        """The entries with a seal ending every packet's worth, and those packets."""
        sealed, packets = self.keys.seal_run(self.session, self._builder.next_seq, entries,
                                             self._builder.per_packet - 1, stamp, self.name)
        self._builder.next_seq += len(sealed)
        return sealed, packets

    # --- replication -----------------------------------------------------------

    def on_journaled(self, last_seq: int) -> list[bytes]:
        """The leader's own journal now holds everything through last_seq."""
        if last_seq > self.last_seq:
            raise InvariantViolation(f"journal claims seq {last_seq}, only {self.last_seq} were stamped")
        self.journaled_seq = max(self.journaled_seq, last_seq)
        return self._advance_commit()

    def on_ack(self, follower: bytes, term: int, success: bool, last_seq: int) -> list[bytes]:
        """Returns packets now committed. An ack of a later term steps the leader down before it
        comes here (the election sees it first: sequencer/sequencer_node_core.py)."""
        if term > self.term:
            raise InvariantViolation(f"an ack of term {term} reached the leader of term {self.term}")
        if follower not in self.match or term < self.term or not success:
            return []
        if last_seq > self.last_seq:  # a peer's word, not this leader's state: counted and dropped
            self._drop("ack_beyond_log")
            return []
        if last_seq > self.match[follower]:
            self.match[follower] = last_seq
        return self._advance_commit()

    def check(self) -> None:
        """What must hold whatever came in (asserted after each step that moves it; the simulator
        checks the same from outside): each follower's match and the commit point within the
        log, nothing published that is not committed."""
        if self.commit_seq > self.last_seq or max(self.match.values(), default=0) > self.last_seq:
            raise InvariantViolation(f"commit {self.commit_seq} or a follower's match {self.match} beyond the "
                                     f"log's last seq {self.last_seq}")
        if self._unpublished and self._unpublished[0][0] <= self.commit_seq:
            raise InvariantViolation(f"seq {self._unpublished[0][0]} committed ({self.commit_seq}) and not published")

    def majority(self) -> int:
        return (len(self.followers) + 1) // 2 + 1

    def _advance_commit(self) -> list[bytes]:
        held = sorted([self.journaled_seq, *self.match.values()], reverse=True)
        candidate = held[self.majority() - 1]
        # Raft: only entries of the current term commit by counting replicas;
        # earlier ones commit with them. The term start is this term's first entry.
        if candidate <= self.commit_seq or candidate < self.term_start_seq:
            return []
        self.commit_seq = candidate
        out = []
        # A follower catching up from the journal may ack mid-batch: a batch
        # is released only once all of it is committed.
        while self._unpublished and self._unpublished[0][0] <= candidate:
            last, packets = self._unpublished.popleft()
            out.extend(packets)
            self.published_seq = last
        self.check()
        return out

    def note_published(self, packets: int, msgs: int, now_ns: int) -> None:
        self.published_packets += packets
        self.published_messages += msgs
        self._last_published_ns = now_ns

    # --- time ------------------------------------------------------------------

    def on_timer(self, now_ns: int, wall_ns: int, tick: bool = True) -> tuple[Batch | None, bytes | None]:
        """A time tick batch if idle for tick_ns, and a heartbeat packet if
        nothing was published for heartbeat_ns. `tick`: False once the session's end is
        stamped (no entry follows it)."""
        batch = None
        if tick and not self._pending and now_ns - self._last_batch[0] >= self.tick_ns:
            self._sequence_control(messages.time_tick(self._stamp(wall_ns), self.name))
            batch = self.flush(now_ns, wall_ns)
        heartbeat = None
        if now_ns - self._last_published_ns >= self.heartbeat_ns:
            heartbeat = moldudp64.encode_heartbeat(self.session, self.published_seq + 1)
            self._last_published_ns = now_ns
        return batch, heartbeat

    def timer_due_ns(self, tick: bool = True) -> int:
        """When `on_timer` next has something to do, if nothing is sequenced or published first."""
        heartbeat = self._last_published_ns + self.heartbeat_ns
        return min(self._last_batch[0] + self.tick_ns, heartbeat) if tick else heartbeat

    def sequenced_client_last(self) -> dict[bytes, int]:
        """Highest client seq per client that is in the log (accepted but not
        yet stamped messages excluded): what a follower continues from."""
        out = dict(self.client_last)
        for origin, first_cseq, _ in self._pending:
            if origin is not None and out.get(origin, 0) >= first_cseq:
                out[origin] = first_cseq - 1
        return out

    def end_session(self, now_ns: int, wall_ns: int) -> Batch:
        """What is pending, then the session's last entry: listeners finish where it is applied
        (an end-of-session packet cannot be sealed, so it is only a hint)."""
        self._sequence_control(messages.session_end(self._stamp(wall_ns), self.name))
        return self.flush(now_ns, wall_ns)

    def end_of_session(self) -> bytes:
        return moldudp64.encode_end_of_session(self.session, self.published_seq + 1)


def rebuild_client_state(records) -> tuple[dict, int, int]:
    """(highest client seq per client, last seq, last term) from journal
    records: a new leader dedupes retransmits of what the old one sequenced."""
    last_cseq: dict[bytes, int] = {}
    last_seq = last_term = 0
    ORIGIN, CSEQ, TYPE = messages.ORIGIN, messages.CLIENT_SEQ, messages.TYPE
    for seq, term, raw in records:
        m = messages.SEQUENCED.unpack(raw)
        if m[TYPE] in messages.CLIENT_SEQ_TYPES:
            if m[CSEQ] > last_cseq.get(m[ORIGIN], 0):
                last_cseq[m[ORIGIN]] = m[CSEQ]
        last_seq, last_term = seq, term
    return last_cseq, last_seq, last_term
