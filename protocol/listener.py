"""A stream listener's decisions (clients, `tape tail`, replicas). Pure.

Events in: a datagram (from the multicast stream, or a rewinder's unicast
answer) and the time. Actions out:

    Deliver(first_seq, packet, skip)   messages skip.. of packet, in order
    Ahead(packet)                      with keys: a sealed packet held ahead of a gap;
                                       committed, so a client stops resending
                                       what it shows before the gap fills
    Undecodable(seq, error)            a sealed (authenticated, committed) packet holds a
                                       message at the next seq that cannot be
                                       decoded: skipping it would diverge
    AskRewinder(index, request)        send this MoldUDP64 request packet to
                                       rewinder number `index` (signed with a
                                       stream key, else padded to the answer's size)

Gap-request policy: ask for each of the first GAPS_ASKED_AT_ONCE missing
runs (at most one packet's worth of each is answered), all at once and
spread over the rewinders: asked one after the other, a stream losing 2%
of 8,800 packets a second waits a round trip per gap in turn and falls
behind. A run is first asked of GAP_ASKED_OF rewinders at once, and the
first answer fills it (the other is dropped as a duplicate): rewinders are
voters, whose loop waits out each fsync of their journal (~1 ms, up to
~8 on a loaded host), and a run asked of one alone waited out that one's.
Ask again for the same run only after the answer timeout, and then of the
next rewinder (the last one asked did not answer). The timeout follows
how long answers take (protocol/rtt.py, from runs asked for once, timed at
the drain that fills them: `asking` tells the shell to call `on_timer` then),
never under `gap_request_ns`: a loaded rewinder
answers later than that, and asking everything twice loads it further.

With stream keys, a data packet counts only if it is one whole sealed range
whose tag verifies (protocol/streamauth.py); anything else is counted by
reason and dropped before it can take a seq. Heartbeats and end-of-session
packets cannot carry a seal (they would stop being MoldUDP64): they are
hints, which make the listener ask the rewinders what follows (once per
answer timeout, at most HINT_TRIES times without progress, so that a
forged hint costs a few requests) but never claim that a seq exists.
Without keys a hint further ahead than MAX_HINT_AHEAD is dropped as
far-fetched.
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.protocol import messages, moldudp64
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import GAP_ASKED_OF, GAPS_ASKED_AT_ONCE, HINT_TRIES, MAX_GAP_TIMEOUT_NS, MAX_HINT_AHEAD
from tape.protocol.receiver import Deliver, StreamReceiver
from tape.protocol.rtt import RoundTrip
from tape.protocol.streamauth import ListenerKeys, StreamKeys

try:
    from tape.protocol._speedups import good_stream_packet
except ImportError:  # built without a C compiler: every packet is checked in Python
    good_stream_packet = None


@dataclass(frozen=True)
class Ahead:
    packet: bytes


@dataclass(frozen=True)
class Undecodable:
    seq: int
    error: ProtocolError


@dataclass(frozen=True)
class AskRewinder:
    index: int
    request: bytes


class ListenerCore:
    def __init__(self, session: bytes, rewinders: int, gap_request_ns: int, next_seq: int = 1,
                 keys: StreamKeys | ListenerKeys | None = None, max_packet: int = moldudp64.DEFAULT_MAX_PACKET):
        self.session = session
        self.keys = keys
        self._key_ids = keys.verifying if keys is not None else None  # for the C check
        self.max_packet = max_packet  # unsigned requests are padded to this: no answer is larger than its request
        self.reply: tuple[str, int] | None = None  # where answers come back to (signed into requests)
        self.nonce = 0  # the last signed request's
        self.receiver = StreamReceiver(session, next_seq)
        self._hint_seq = 0  # with keys: a heartbeat said seqs before this may exist
        self._hint_from = 0  # the next seq when the hint was last asked about
        self._hint_tries = 0  # requests for the hint since the stream last moved
        self.rewinders = rewinders
        self.bad: dict[str, int] = {}  # datagrams dropped, by reason
        self.requests_sent = 0
        self._asked: dict[int, tuple[int, int, int]] = {}  # first seq of a missing run -> (when, whom last, times)
        self.answers = RoundTrip(gap_request_ns, MAX_GAP_TIMEOUT_NS)  # a gap request to its run filled
        self._which = 0

    @property
    def asking(self) -> bool:
        """Runs were asked for that `on_timer` has not seen filled (it times those that were)."""
        return bool(self._asked)

    @property
    def waiting(self) -> bool:
        """`on_timer` has something to do: a run is missing or asked for, or a hint is worth asking
        about (an idle listener needs no timer)."""
        rx = self.receiver
        if self._asked or rx.missing() is not None:
            return True
        return self._hint_seq > rx.next_seq and (rx.next_seq != self._hint_from or self._hint_tries < HINT_TRIES)

    def on_datagram(self, data: bytes) -> list[Deliver | Ahead | Undecodable] | ProtocolError:
        """What to deliver, or the error for which the datagram was dropped (counted in `bad`)."""
        actions = self.on_datagrams([data])
        return actions[0] if len(actions) == 1 and isinstance(actions[0], ProtocolError) else actions

    def on_datagrams(self, datagrams: list[bytes]) -> list[Deliver | Ahead | Undecodable | ProtocolError]:
        """`on_datagram` of each in turn, their actions in one list in order (a dropped one's
        ProtocolError in its place): a drain's datagrams in one call."""
        out: list = []
        receiver, key_ids, keyed = self.receiver, self._key_ids, self.keys is not None
        for data in datagrams:
            try:
                header = good_stream_packet(data, moldudp64.MAX_UDP_PAYLOAD, messages.ALL_TYPES, key_ids) \
                    if good_stream_packet else None
                if header is None:  # not a good data packet, or no C: the checks in Python say what it is
                    header = self._check(data)
                    if isinstance(header, list):
                        out += header
                        continue
                runs = receiver.on_packet(header[0], header[1], header[2], data)
            except ProtocolError as e:
                self.bad[e.reason] = self.bad.get(e.reason, 0) + 1
                out.append(e)
                continue
            if runs:
                out += runs
            elif keyed and header[1] > receiver.next_seq:
                out.append(Ahead(data))
        return out

    def _check(self, data: bytes) -> tuple[bytes, int, int] | list:
        """A data packet's (session, seq, count) once every check passes (`good_stream_packet` is
        the same checks in C, for the packets that pass them), or what a hint or an undecodable
        message comes to; raises ProtocolError for the rest."""
        session, seq, count = moldudp64.decode_header(data)
        if count == 0 or count == 0xFFFF:
            return self._hint(session, seq, count, data)
        if self.keys is not None:
            reason = self.keys.verify(data)
            if reason is not None:
                raise ProtocolError(reason, "not one whole sealed range with a good tag", 0)
        try:
            messages.check_packet_messages(data, count)
        except ProtocolError as e:
            undecodable = self._undecodable(session, seq, count, e)
            if undecodable is not None:
                return [undecodable]
            raise
        return session, seq, count

    def _hint(self, session: bytes, seq: int, count: int, data: bytes) -> list:
        """A heartbeat or end of session: believed as far as keys allow."""
        rx = self.receiver
        if self.keys is None:
            if rx.session is not None and session == rx.session and seq > rx.high_seq + MAX_HINT_AHEAD:
                raise ProtocolError("far_future", f"a hint of seq {seq:,}, {seq - rx.high_seq:,} ahead", 10)
            return rx.on_packet(session, seq, count, data)
        if session != self.session:
            raise ProtocolError("foreign_session", f"session {session!r}, this stream is {self.session!r}", 0)
        if seq > rx.next_seq:
            self._hint_seq = max(self._hint_seq, min(seq, rx.next_seq + MAX_HINT_AHEAD))
            self._hint_tries = 0
        return []

    def hinted_head(self) -> int:
        """One past the furthest seq a hint announced (0: none)."""
        return self._hint_seq

    def _hinted_gap(self) -> tuple[int, int] | None:
        """What a hint says may follow the stream, while it is worth asking again."""
        nxt = self.receiver.next_seq
        if self._hint_seq <= nxt:
            return None
        if nxt != self._hint_from:  # the stream moved: the hint is worth its tries again
            self._hint_from, self._hint_tries = nxt, 0
        if self._hint_tries >= HINT_TRIES:
            return None
        return nxt, min(self._hint_seq - nxt, moldudp64.MAX_BLOCKS)

    def _undecodable(self, session: bytes, seq: int, count: int, e: ProtocolError):
        """Authenticated committed data covering the next seq whose messages cannot be decoded:
        with keys, any verified packet (the leader publishes only what is committed); without,
        nothing (whoever sent it, the listener counts it and asks again)."""
        rx = self.receiver
        if self.keys is not None and session == rx.session and e.reason in ("unknown_type", "bad_length") \
                and seq <= rx.next_seq < seq + count:
            bad_seq = seq + max(0, e.offset - moldudp64.HEADER_SIZE) // messages.SEQUENCED_BLOCK_SIZE
            return Undecodable(bad_seq, e)
        return None

    def reply_at(self, host: str, port: int, nonce: int) -> None:
        """The address the shell receives answers on (a signed request names it), and the nonce
        its requests count up from: above any this address used before (the shell's wall clock
        in ns at start; a rewinder answers a nonce once)."""
        self.reply = (host, port)
        self.nonce = nonce

    def _request(self, seq: int, count: int) -> bytes:
        request = moldudp64.encode_request(self.session, seq, count)
        if self.keys is None:
            return request.ljust(self.max_packet, b"\0")
        if self.reply is None:
            raise InvariantViolation("a signed gap request before the shell said where answers come back")
        self.nonce += 1
        return self.keys.sign_request(request, self.reply, self.nonce)

    def on_timer(self, now_ns: int) -> list[AskRewinder]:
        """The gap requests due: for missing runs not asked for within the answer timeout. New
        runs go round the rewinders; a run asked for again, to the one after its last."""
        if not self.rewinders:
            return []
        runs = self.receiver.missing_runs(GAPS_ASKED_AT_ONCE)
        hinted = not runs
        if hinted:
            runs = [gap] if (gap := self._hinted_gap()) else []
        timeout = self.answers.timeout_ns
        asked, out = {}, []
        for first, count in runs:
            when, which, times = self._asked.pop(first, (0, None, 0))
            if which is not None and now_ns - when < timeout:
                asked[first] = (when, which, times)
                continue
            if which is None:  # a new run: of GAP_ASKED_OF rewinders at once, the first of them in turn
                whom = range(self._which, self._which + min(GAP_ASKED_OF, self.rewinders))
                self._which += 1
            else:
                whom = range(which + 1, which + 2)  # no answer in time: the next rewinder
            asked[first] = (now_ns, whom[-1], times + 1)
            request = self._request(first, count)
            out += [AskRewinder(i % self.rewinders, request) for i in whom]
        for when, _, times in self._asked.values():  # runs filled since: timed now (the shell calls as they fill)
            if times == 1:
                self.answers.sample(now_ns - when)
        self._asked = asked
        self._hint_tries += hinted and bool(out)
        self.requests_sent += len(out)
        return out
