"""Gap-fill decisions for a rewinder. Pure: the shell passes the request,
the sender's address, the time and the committed seq; the core answers
which messages to send back or why the request is dropped.

No amplification: with a stream key only signed requests are answered (one
sealed range, to the address the request names and came from, once a nonce:
a recorded request sent again is refused); without,
an answer is no larger than the request's datagram (a listener pads its
requests to the size of the answer it wants), so a forged source address
gets no more bytes than the forger sent. Floods: only committed seqs, a token bucket per
requester *host* (a sender rotating its ports shares one bucket) and one
for the whole server, so that however many hosts ask, answering takes a
bounded share of the rewinder's loop, which also acknowledges appends and
votes (docs/stream.md: a rewinder whose loop gap fill took could do
neither, and the cluster lost its leader).

A request for seqs this rewinder does not yet know committed waits (is
*parked*) up to `park_s` for the commit point to reach them: a listener sees
a packet only once the leader has committed it, and a follower learns of
that commit with the leader's next append, so most such requests are for
what will be committed within a batch. Refused at once, each cost its
listener a whole gap-request timeout (a third of the requests at 2% loss).
At most GAP_PARKED_MAX wait at once, each paid for with a token as an
answer is, and none further ahead of the commit point than one batch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from tape.protocol import moldudp64
from tape.protocol.budgets import PerHost, TokenBucket
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import (
    GAP_PARKED_MAX,
    GAPFILL_HOST_BURST,
    GAPFILL_HOST_RATE,
    GAPFILL_MAX_HOSTS,
    GAPFILL_TOTAL_BURST,
    GAPFILL_TOTAL_RATE,
    MAX_BATCH_MESSAGES,
)
from tape.protocol.messages import SEQUENCED_BLOCK_SIZE
from tape.protocol.streamauth import StreamKeys


@dataclass(frozen=True)
class Answer:
    seq: int  # the first seq to send back
    count: int


@dataclass(frozen=True)
class Parked:
    """Held until the commit point reaches the seqs asked for: `due` answers it then."""


PARKED = Parked()


@dataclass(frozen=True)
class Refuse:
    reason: str  # counted in `dropped`


class GapFillCore:
    def __init__(self, session: bytes, max_packet: int, keys: StreamKeys | None = None,
                 rate_per_s: float = GAPFILL_HOST_RATE, burst: float = GAPFILL_HOST_BURST,
                 max_peers: int = GAPFILL_MAX_HOSTS, total_rate_per_s: float = GAPFILL_TOTAL_RATE,
                 total_burst: float = GAPFILL_TOTAL_BURST, park_s: float = 0.0):
        self.session = session
        self.max_packet = max_packet  # the stream's packet size: no answer is larger
        self.keys = keys
        self.max_peers = max_peers
        self._hosts = PerHost(rate_per_s, burst, max_peers)
        self._nonces: OrderedDict = OrderedDict()  # (host, port) -> its last signed request's nonce
        self._total = TokenBucket(total_rate_per_s, total_burst, 0.0)
        self.park_s = park_s  # how long a request for seqs not yet known committed waits (0: refused)
        self._parked: deque = deque()  # (expires, seq, count, addr), oldest first
        self.served = 0
        self.dropped: dict[str, int] = {}

    def on_request(self, data: bytes, addr: tuple, now: float, committed_seq: int) -> Answer | Parked | Refuse:
        """What to send back to a request from `addr` (host, port), that it waits for the commit
        point, or why it is dropped. Budgets are per host: the port is the sender's to choose."""
        if self.keys is not None:
            nonce = self.keys.verify_request(data, addr)
            if isinstance(nonce, str):
                return self._drop(nonce)
            if not self._fresh(tuple(addr), nonce):
                return self._drop("replayed_request")
            answer_bytes = self.max_packet
        else:
            answer_bytes = min(len(data), self.max_packet)
            if answer_bytes < moldudp64.HEADER_SIZE + SEQUENCED_BLOCK_SIZE:
                return self._drop("unpadded")  # its answer could hold no message
        try:
            session, seq, count = moldudp64.decode_request(data[:moldudp64.HEADER_SIZE])
        except ProtocolError as e:
            return self._drop(e.reason)
        if session != self.session:
            return self._drop("foreign_session")
        if seq > committed_seq and (not self.park_s or seq > committed_seq + MAX_BATCH_MESSAGES):
            return self._drop("not_committed")
        if seq > committed_seq and len(self._parked) >= GAP_PARKED_MAX:
            return self._drop("parked_full")
        if not self._take_token(addr[0], now):
            return self._drop("rate_limited")
        if not self._total.take(now):
            return self._drop("server_busy")
        count = min(count, (answer_bytes - moldudp64.HEADER_SIZE) // SEQUENCED_BLOCK_SIZE)
        if seq > committed_seq:
            self._parked.append((now + self.park_s, seq, count, addr))
            return PARKED
        return self._serve(seq, count, committed_seq)

    def _fresh(self, addr: tuple, nonce: int) -> bool:
        """A signed request's nonce above the last one its address used: a request recorded on the
        LAN and sent again (from its signer's address, the only one its signature allows) is
        answered once, not each time. The addresses remembered are bounded as the budgets are."""
        last = self._nonces.get(addr)
        if last is not None and nonce <= last:
            return False
        self._nonces[addr] = nonce
        self._nonces.move_to_end(addr)
        if len(self._nonces) > self.max_peers:
            self._nonces.popitem(last=False)
        return True

    def due(self, committed_seq: int, now: float) -> list[tuple[Answer, tuple]]:
        """(answer, address) for each parked request the commit point now covers whole, or that
        has waited `park_s` (answered with what is committed, if any: its listener asks again for
        the rest). Called as the commit point moves."""
        out, waiting = [], deque()
        for parked in self._parked:
            expires, seq, count, addr = parked
            if seq + count - 1 <= committed_seq or (expires <= now and seq <= committed_seq):
                out.append((self._serve(seq, count, committed_seq), addr))
            elif expires <= now:
                self._drop("not_committed")
            else:
                waiting.append(parked)
        self._parked = waiting
        return out

    @property
    def parked(self) -> int:
        return len(self._parked)

    def _serve(self, seq: int, count: int, committed_seq: int) -> Answer:
        self.served += 1
        return Answer(seq, min(count, committed_seq - seq + 1))

    def _drop(self, reason: str) -> Refuse:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return Refuse(reason)

    def _take_token(self, host, now: float) -> bool:
        return self._hosts.take(host, now)
