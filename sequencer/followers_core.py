"""The leader's view of each follower: what to send it next. Pure.

A follower is *live* when it holds everything the leader stamped: each new
batch goes to it as one append, straight away. Otherwise it is caught up
from the leader's journal, CATCHUP_CHUNK entries per append, and goes live
once it holds the leader's last entry. A follower that refuses an append
(its log ends, or disagrees, before what was sent) is rewound to its hint;
a refusal that arrives while a catch-up is being sent is kept and honoured
at the next chunk, never overwritten by the sender's own progress. A
follower whose connection has too much queued (it is slow) drops out of
live and is caught up from the journal instead, so the leader's memory
stays bounded.

Commit beats: empty appends tell live followers the commit point (they
serve gap fills and replays only up to it) and that the leader lives.
Every append carries the commit point too, so a beat goes out only when
the commit point moved past what the last append carried and no append
went for COMMIT_BEAT_AFTER_NS (under load the next append tells it: a beat
per timer tick was a quarter of what followers read and acknowledged),
and at least every `beat_ns`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.protocol.limits import CATCHUP_CHUNK, COMMIT_BEAT_AFTER_NS, MAX_LIVE_BUFFER


@dataclass
class Progress:
    next_seq: int  # the next seq to send
    live: bool = False
    rewind: int | None = None  # a refusal's hint, not yet honoured


class FollowerLinks:
    def __init__(self, beat_ns: int, catchup_chunk: int = CATCHUP_CHUNK, max_live_buffer: int = MAX_LIVE_BUFFER):
        self.beat_ns = beat_ns
        self.catchup_chunk = catchup_chunk
        self.max_live_buffer = max_live_buffer
        self.links: dict[bytes, Progress] = {}
        self._commit_sent = -1  # the commit point the last frame to the live followers carried
        self._beat_at: int | None = None  # when that frame went

    def connected(self, follower: bytes, follower_last_seq: int, leader_last_seq: int) -> None:
        """A follower's hello: it holds its log through follower_last_seq (not yet checked against ours)."""
        self.links[follower] = Progress(min(follower_last_seq, leader_last_seq) + 1)

    def disconnected(self, follower: bytes) -> None:
        self.links.pop(follower, None)

    def live_for(self, first_seq: int, last_seq: int, commit_seq: int, now_ns: int) -> tuple[list[bytes], list[bytes]]:
        """A new batch, whose append carries `commit_seq`: (followers to send it to as an append,
        followers that just dropped out of live and must be woken to catch up)."""
        send, wake = [], []
        for f, p in self.links.items():
            if p.live and p.next_seq == first_seq:
                send.append(f)
                p.next_seq = last_seq + 1
            elif p.live:
                p.live = False
                wake.append(f)
        if send:
            self._commit_sent, self._beat_at = commit_seq, now_ns
        return send, wake

    def backlog(self, follower: bytes, queued_bytes: int) -> bool:
        """What its connection has queued; True if it must now be caught up from the journal."""
        p = self.links.get(follower)
        if p is not None and p.live and queued_bytes > self.max_live_buffer:
            p.live = False
            return True
        return False

    def next_chunk(self, follower: bytes, leader_last_seq: int) -> tuple[int, int] | None:
        """(from seq, count) to read from the journal and send next, or None:
        caught up, and live from now on."""
        p = self.links[follower]
        if p.rewind is not None:
            p.next_seq, p.rewind = min(p.next_seq, p.rewind), None
        if p.next_seq > leader_last_seq:
            p.live = True
            return None
        return p.next_seq, min(self.catchup_chunk, leader_last_seq - p.next_seq + 1)

    def sent(self, follower: bytes, last_seq: int) -> None:
        """A catch-up append through last_seq was sent."""
        self.links[follower].next_seq = last_seq + 1

    def refused(self, follower: bytes, follower_last_seq: int) -> bool:
        """A refusal with its hint; True if the follower must be woken to catch up."""
        p = self.links.get(follower)
        if p is None:
            return False
        hint = follower_last_seq + 1
        p.rewind = hint if p.rewind is None else min(p.rewind, hint)
        p.live = False
        return True

    def cut(self) -> list[bytes]:
        """A partition (fault injection): nothing is live; every follower catches up afterwards."""
        for p in self.links.values():
            p.live = False
        return list(self.links)

    def beat_due_ns(self, commit_seq: int) -> int:
        """When `beat` next sends, if no append goes first."""
        if self._beat_at is None:
            return 0
        if commit_seq != self._commit_sent:
            return self._beat_at + COMMIT_BEAT_AFTER_NS
        return self._beat_at + self.beat_ns + 1

    def beat(self, now_ns: int, commit_seq: int, force: bool = False) -> list[bytes]:
        """The live followers to send an empty append (the commit point) to now."""
        quiet = now_ns - self._beat_at if self._beat_at is not None else self.beat_ns + 1
        moved = commit_seq != self._commit_sent and quiet >= COMMIT_BEAT_AFTER_NS
        if not (force or moved or quiet > self.beat_ns):
            return []
        self._commit_sent, self._beat_at = commit_seq, now_ns
        return [f for f, p in self.links.items() if p.live]
