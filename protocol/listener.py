"""A stream listener's decisions (clients, `tape tail`, replicas). Pure.

Events in: a datagram (from the multicast stream, or a rewinder's unicast
answer) and the time. Actions out:

    Deliver(first_seq, packet, skip)   messages skip.. of packet, in order
    Undecodable(seq, error)            a sealed (authenticated, committed) packet holds a
                                       message at the next seq that cannot be
                                       decoded: skipping it would diverge
    AskRewinder(index, request)        send this MoldUDP64 request packet to
                                       rewinder number `index` (signed with a
                                       stream key, else padded to the answer's size)

Gap-request policy: ask for the first missing run (at most one packet's
worth is answered); ask again for the same run only after `gap_request_ns`,
and then of the next rewinder (the last one did not answer).

With stream keys, a data packet counts only if it is one whole sealed range
whose tag verifies (protocol/streamauth.py); anything else is counted by
reason and dropped before it can take a seq. Heartbeats and end-of-session
packets cannot carry a seal (they would stop being MoldUDP64): they are
hints, which make the listener ask the rewinders what follows (once per
`gap_request_ns`, at most HINT_TRIES times without progress, so that a
forged hint costs a few requests) but never claim that a seq exists.
Without keys a hint further ahead than MAX_HINT_AHEAD is dropped as
far-fetched.
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.protocol import messages, moldudp64
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import HINT_TRIES, MAX_HINT_AHEAD
from tape.protocol.receiver import StreamReceiver
from tape.protocol.streamauth import StreamKeys


@dataclass(frozen=True)
class Deliver:
    first_seq: int
    packet: bytes
    skip: int


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
                 keys: StreamKeys | None = None, max_packet: int = moldudp64.DEFAULT_MAX_PACKET):
        self.session = session
        self.keys = keys
        self.max_packet = max_packet  # unsigned requests are padded to this: no answer is larger than its request
        self.reply: tuple[str, int] | None = None  # where answers come back to (signed into requests)
        self.receiver = StreamReceiver(session, next_seq)
        self._hint_seq = 0  # with keys: a heartbeat said seqs before this may exist
        self._hint_from = 0  # the next seq when the hint was last asked about
        self._hint_tries = 0  # requests for the hint since the stream last moved
        self.rewinders = rewinders
        self.gap_request_ns = gap_request_ns
        self.bad: dict[str, int] = {}  # datagrams dropped, by reason
        self.requests_sent = 0
        self._asked_seq = 0
        self._asked_ns = 0
        self._which = 0

    def on_datagram(self, data: bytes) -> list[Deliver | Undecodable] | ProtocolError:
        """What to deliver, or the error for which the datagram was dropped (counted in `bad`)."""
        try:
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
            runs = self.receiver.on_packet(session, seq, count, data)
        except ProtocolError as e:
            self.bad[e.reason] = self.bad.get(e.reason, 0) + 1
            return e
        return [Deliver(first, pkt, skip) for first, pkt, skip in runs]

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

    def reply_at(self, host: str, port: int) -> None:
        """The address the shell receives answers on (a signed request names it)."""
        self.reply = (host, port)

    def _request(self, seq: int, count: int) -> bytes:
        request = moldudp64.encode_request(self.session, seq, count)
        if self.keys is None:
            return request.ljust(self.max_packet, b"\0")
        if self.reply is None:
            raise InvariantViolation("a signed gap request before the shell said where answers come back")
        return self.keys.sign_request(request, self.reply)

    def on_timer(self, now_ns: int) -> AskRewinder | None:
        """A gap request, if one is missing and due."""
        gap = self.receiver.missing()
        hinted = gap is None
        gap = gap or self._hinted_gap()
        if gap is None or not self.rewinders:
            return None
        if gap[0] == self._asked_seq:
            if now_ns - self._asked_ns < self.gap_request_ns:
                return None
            self._which += 1  # no answer in time: try the next rewinder
        self._hint_tries += hinted
        self._asked_seq, self._asked_ns = gap[0], now_ns
        self.requests_sent += 1
        return AskRewinder(self._which % self.rewinders, self._request(gap[0], gap[1]))
