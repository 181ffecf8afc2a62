"""Stream-receiver state: puts a MoldUDP64 stream back in seq order.

Sans-I/O. Feed it packets (live or retransmitted, in any order) as their
validated header fields and raw bytes; it returns what can be delivered in
order, as Deliver(seq of the first new message, packet bytes, index of that
message in the packet), and tells the shell what is missing so that the
shell can ask a rewinder. Packets are held whole, never split per message. With next expected seq N and
packet (S, C): S > N is a gap (the packet is held), S + C <= N a duplicate,
otherwise the messages from N are delivered.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from sortedcontainers import SortedDict

from tape.protocol.errors import ProtocolError
from tape.protocol.limits import MAX_HELD_SCANNED, RECEIVER_MAX_HELD
from tape.protocol.moldudp64 import MAX_BLOCKS


@dataclass(slots=True)  # (not frozen: one is made for every packet, and a frozen one's __init__ costs 3x)
class Deliver:
    """Messages skip.. of `packet`, in order, the first of them numbered first_seq."""
    first_seq: int
    packet: bytes
    skip: int


class StreamReceiver:
    def __init__(self, session: bytes | None = None, next_seq: int = 1, max_held: int = RECEIVER_MAX_HELD):
        self.session = session  # None: adopt the first session seen
        self.next_seq = next_seq  # the next seq to deliver
        self.high_seq = next_seq  # one past the highest seq known to exist
        self.max_held = max_held
        self.ended = False  # end of session seen
        self._held: SortedDict = SortedDict()  # first seq -> (count, packet bytes)
        self._held_count = 0
        # Counters, read by the shell's metrics collector.
        self.packets = 0
        self.duplicates = 0
        self.gaps_detected = 0
        self.held_dropped = 0

    @property
    def held(self) -> int:
        return self._held_count

    def on_packet(self, session: bytes, seq: int, count: int, data) -> list[Deliver]:
        """The runs deliverable in order now (what a listener hands on as they are)."""
        if self.session is None:
            self.session = session
        elif session != self.session:
            raise ProtocolError("foreign_session", f"session {session!r}, this stream is {self.session!r}", 0)
        self.packets += 1
        if seq == 0:
            raise ProtocolError("bad_seq", "sequence number 0 (the first seq is 1)", 10)
        if count == 0 or count == 0xFFFF:  # heartbeat / end of session carry the next seq
            if count == 0xFFFF:
                self.ended = True
            self._saw(seq, seq)
            return []
        end = seq + count
        next_seq = self.next_seq
        if end <= next_seq:
            self.duplicates += 1
            return []
        if seq > next_seq:
            self._hold(seq, count, data)
            return []
        if end > self.high_seq:  # (_saw: no new gap starts at or before next_seq)
            self.high_seq = end
        out = [Deliver(next_seq, data, next_seq - seq)]
        self.next_seq = end
        if self._held:
            self._drain(out)
        return out

    def missing(self) -> tuple[int, int] | None:
        """(first seq, count) of the first run of messages known to be missing."""
        if self._held:
            end = self._held.keys()[0]
        else:
            end = self.high_seq
        if end <= self.next_seq:
            return None
        return self.next_seq, min(end - self.next_seq, MAX_BLOCKS)

    def missing_runs(self, limit: int) -> list[tuple[int, int]]:
        """(first seq, count) of the first `limit` runs known to be missing, in seq order: the gap
        before the first held packet, those between held packets, the one up to the highest seq
        known (counts at most MAX_BLOCKS, what one request asks). Looks at MAX_HELD_SCANNED held
        packets at most."""
        runs = []
        start = self.next_seq
        for seq, (count, _) in islice(self._held.items(), MAX_HELD_SCANNED):
            if seq > start:
                runs.append((start, min(seq - start, MAX_BLOCKS)))
                if len(runs) == limit:
                    return runs
            start = max(start, seq + count)
        if self.high_seq > start and len(self._held) <= MAX_HELD_SCANNED:
            runs.append((start, min(self.high_seq - start, MAX_BLOCKS)))
        return runs

    def lag(self) -> int:
        """How many messages known to exist are not delivered yet."""
        return self.high_seq - self.next_seq

    def _saw(self, start: int, end: int) -> None:
        """Messages [start, end) exist; a start beyond all known is a new gap."""
        if start > self.high_seq:
            self.gaps_detected += 1
        if end > self.high_seq:
            self.high_seq = end

    def _hold(self, seq: int, count: int, data) -> None:
        old = self._held.get(seq)
        if old is not None:
            if old[0] >= count:
                self.duplicates += 1
                return
            self._held_count -= old[0]
        self._saw(seq, seq + count)
        self._held[seq] = (count, data)
        self._held_count += count
        while self._held_count > self.max_held:
            _, (dropped, _) = self._held.popitem(-1)  # the furthest: it will be asked for again
            self._held_count -= dropped
            self.held_dropped += dropped

    def _drain(self, out: list) -> None:
        held = self._held
        while held:
            seq = held.keys()[0]
            if seq > self.next_seq:
                return
            count, data = held.pop(seq)
            self._held_count -= count
            end = seq + count
            if end <= self.next_seq:
                self.duplicates += 1
                continue
            out.append(Deliver(self.next_seq, data, self.next_seq - seq))
            self.next_seq = end
