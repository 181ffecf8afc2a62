"""A stream listener's decisions (clients, `tape tail`, replicas). Pure.

Events in: a datagram (from the multicast stream, or a rewinder's unicast
answer, which is the committed log itself), and the time. Actions out:

    Deliver(first_seq, packet, skip)   messages skip.. of packet, in order
    Undecodable(seq, error)            a rewinder's committed answer holds a
                                       message at the next seq that cannot be
                                       decoded: skipping it would diverge
    AskRewinder(index, request)        send this MoldUDP64 request packet to
                                       rewinder number `index`

Gap-request policy: ask for the first missing run (at most one packet's
worth is answered); ask again for the same run only after `gap_request_ns`,
and then of the next rewinder (the last one did not answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.protocol import messages, moldudp64
from tape.protocol.errors import ProtocolError
from tape.protocol.receiver import StreamReceiver


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
    def __init__(self, session: bytes, rewinders: int, gap_request_ns: int, next_seq: int = 1):
        self.session = session
        self.receiver = StreamReceiver(session, next_seq)
        self.rewinders = rewinders
        self.gap_request_ns = gap_request_ns
        self.bad: dict[str, int] = {}  # datagrams dropped, by reason
        self.requests_sent = 0
        self._asked_seq = 0
        self._asked_ns = 0
        self._which = 0

    def on_datagram(self, data: bytes, committed: bool = False) -> list[Deliver | Undecodable] | ProtocolError:
        """What to deliver, or the error for which the datagram was dropped (counted in `bad`)."""
        try:
            session, seq, count = moldudp64.decode_header(data)
            if 0 < count < 0xFFFF:
                try:
                    messages.check_packet_messages(data, count)
                except ProtocolError as e:
                    undecodable = self._undecodable(session, seq, count, committed, e)
                    if undecodable is not None:
                        return [undecodable]
                    raise
            runs = self.receiver.on_packet(session, seq, count, data)
        except ProtocolError as e:
            self.bad[e.reason] = self.bad.get(e.reason, 0) + 1
            return e
        return [Deliver(first, pkt, skip) for first, pkt, skip in runs]

    def _undecodable(self, session: bytes, seq: int, count: int, committed: bool, e: ProtocolError):
        """A committed answer covering the next seq whose messages cannot be decoded."""
        rx = self.receiver
        if committed and session == rx.session and e.reason in ("unknown_type", "bad_length") \
                and seq <= rx.next_seq < seq + count:
            bad_seq = seq + max(0, e.offset - moldudp64.HEADER_SIZE) // messages.SEQUENCED_BLOCK_SIZE
            return Undecodable(bad_seq, e)
        return None

    def on_timer(self, now_ns: int) -> AskRewinder | None:
        """A gap request, if one is missing and due."""
        gap = self.receiver.missing()
        if gap is None or not self.rewinders:
            return None
        if gap[0] == self._asked_seq:
            if now_ns - self._asked_ns < self.gap_request_ns:
                return None
            self._which += 1  # no answer in time: try the next rewinder
        self._asked_seq, self._asked_ns = gap[0], now_ns
        self.requests_sent += 1
        return AskRewinder(self._which % self.rewinders, moldudp64.encode_request(self.session, gap[0], gap[1]))
