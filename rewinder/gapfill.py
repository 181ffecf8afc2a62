"""Gap-fill decisions for a rewinder. Pure: the shell passes the request,
the sender's address, the time and the committed seq; the core answers
which messages to send back or why the request is dropped.

Safety against amplification: at most `max_count` messages per answer
(what fits one datagram), only committed seqs, and a token bucket per
requester address.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tape.protocol import moldudp64
from tape.protocol.errors import ProtocolError
from tape.protocol.streamauth import seal_covers


@dataclass(frozen=True)
class Answer:
    seq: int  # the first seq to send back
    count: int


@dataclass(frozen=True)
class Refuse:
    reason: str  # counted in `dropped`


class GapFillCore:
    def __init__(
        self, session: bytes, max_count: int, rate_per_s: float = 2000.0, burst: float = 200.0, max_peers: int = 10_000
    ):
        self.session = session
        self.max_count = max_count
        self.rate = rate_per_s
        self.burst = burst
        self.max_peers = max_peers
        self._buckets: OrderedDict = OrderedDict()  # addr -> [tokens, last time]
        self.served = 0
        self.dropped: dict[str, int] = {}

    def on_request(self, data: bytes, addr, now: float, committed_seq: int) -> Answer | Refuse:
        """What to send back, or why the request is dropped."""
        try:
            session, seq, count = moldudp64.decode_request(data)
        except ProtocolError as e:
            return self._drop(e.reason)
        if session != self.session:
            return self._drop("foreign_session")
        if seq > committed_seq:
            return self._drop("not_committed")
        if not self._take_token(addr, now):
            return self._drop("rate_limited")
        count = min(count, self.max_count, committed_seq - seq + 1)
        self.served += 1
        return Answer(seq, count)

    def entries(self, answer: Answer, read, sealed: bool, committed_seq: int) -> tuple[int, list[bytes]]:
        """(first seq, log entries) to send for `answer`; `read(first, count)` reads the log.
        With a sealed stream, the whole sealed range that holds the seq asked for (it verifies
        as it is), or nothing while that range is open or not all committed (asked again)."""
        msgs = read(answer.seq, answer.count)
        if not sealed:
            return answer.seq, msgs
        cover = next(filter(None, map(seal_covers, msgs)), None)
        if cover is None or cover[0] + cover[1] > committed_seq:
            return answer.seq, []
        return cover[0], read(cover[0], cover[1] + 1)

    def _drop(self, reason: str) -> Refuse:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return Refuse(reason)

    def _take_token(self, addr, now: float) -> bool:
        bucket = self._buckets.get(addr)
        if bucket is None:
            if len(self._buckets) >= self.max_peers:
                self._buckets.popitem(last=False)
            bucket = self._buckets[addr] = [self.burst, now]
        else:
            self._buckets.move_to_end(addr)
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        if bucket[0] < 1.0:
            return False
        bucket[0] -= 1.0
        return True
