"""A follower's handling of the leader's appends (Raft's AppendEntries).

Pure: the log is reached through the `term_at(seq)` function the shell
passes in. `on_append` returns what to do: how far to truncate a
conflicting suffix, which records to append, and the ack to send back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tape.protocol.journal import RecordRun
from tape.protocol.messages import SEQUENCED_SIZE
from tape.protocol.replication import Append


@dataclass
class AppendResult:
    truncate_after: int | None = None  # drop records after this seq first
    records: list | RecordRun = field(default_factory=list)  # (seq, term, message) to append
    success: bool = True
    last_seq: int = 0  # for the ack


class FollowerCore:
    def __init__(self, name: bytes, last_seq: int, last_term: int, term_at: Callable[[int], int], term: int = 0):
        self.name = name
        self.last_seq = last_seq
        self.last_term = last_term
        self.term = max(term, last_term)
        self.commit_seq = 0
        self.leader: bytes | None = None
        self._term_at = term_at

    def term_at(self, seq: int) -> int:
        if seq == 0:
            return 0
        if seq == self.last_seq:
            return self.last_term
        return self._term_at(seq)

    def on_append(self, a: Append) -> AppendResult:
        if a.term < self.term:
            return AppendResult(success=False, last_seq=self.last_seq)
        self.term = a.term
        self.leader = a.leader
        if a.prev_seq > self.last_seq:
            return AppendResult(success=False, last_seq=self.last_seq)
        conflict = self.term_at(a.prev_seq)
        if conflict != a.prev_term:
            # Our entry at prev_seq is from another term: the leader backs up
            # past all of that term at once (not one seq per round trip).
            lo, hi = 1, a.prev_seq
            while lo < hi:  # the first seq of the conflicting term (terms only grow along the log)
                mid = (lo + hi) // 2
                if self.term_at(mid) < conflict:
                    lo = mid + 1
                else:
                    hi = mid
            return AppendResult(success=False, last_seq=lo - 1)
        count = a.count
        result = AppendResult()
        first_new = 0
        # Entries we already hold: keep them if their term matches, else drop our suffix.
        for i in range(count):
            seq = a.prev_seq + 1 + i
            if seq > self.last_seq:
                break
            if self.term_at(seq) != a.entries_term:
                result.truncate_after = seq - 1
                self.last_seq = seq - 1
                self.last_term = self.term_at(seq - 1) if seq > 1 else 0
                break
            first_new = i + 1
        else:
            first_new = count
        start = a.prev_seq + 1 + first_new
        if start <= self.last_seq:  # the loop stopped at a match beyond: nothing to add
            first_new = self.last_seq - a.prev_seq
            start = self.last_seq + 1
        if first_new < count:
            new = a.entries if first_new == 0 else a.entries[first_new * SEQUENCED_SIZE:]
            result.records = RecordRun(start, a.entries_term, new, SEQUENCED_SIZE)
            self.last_seq = start + count - first_new - 1
            self.last_term = a.entries_term
        # Commit: what the leader says is committed, as far as we hold its log.
        match = a.prev_seq + count
        self.commit_seq = max(self.commit_seq, min(a.commit_seq, match))
        result.last_seq = match
        return result
