"""How far a voter tells its journal's readers the log is committed. Pure.

A voter's journal holds records a majority has not yet taken; a new leader may cut them. A reader
of the directory (the Spark streaming source, ops/spark/stream.py) must read only what is
committed, so each voter keeps its commit point beside its segments, in the file
`COMMIT_MARK_FILE`, at most COMMIT_MARK_EVERY_NS stale. The mark only rises: a restarted voter
learns the commit point again from its leader, and what it marked before stays committed (a
committed record is never cut). Readers also stop at the journal's last whole record, since a
disk replaced or a journal cut for damage refills behind the mark.

    CommitMark(marked)              `marked`: what the file says at start (0: none)
    on_tick(commit_seq, now)        [MarkCommitted(seq)] when due, else []
    on_stop(commit_seq)             [MarkCommitted(seq)] if the commit point moved since
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from tape.protocol.limits import COMMIT_MARK_EVERY_NS

COMMIT_MARK_FILE = "committed"


@dataclass(frozen=True, slots=True)
class MarkCommitted:
    """Write `seq` into the journal's COMMIT_MARK_FILE (a reader sees a whole mark or one it can tell is not)."""

    seq: int


MARK_DIGITS = 20  # a seq (u64) in decimal, zero-padded: every mark is MARK_SIZE bytes
MARK_SIZE = MARK_DIGITS + 1 + 8 + 1


def encode_mark(seq: int) -> bytes:
    """The seq, zero-padded, and the CRC-32 of those digits: one fixed width, so the store writes
    each mark in place over the last (one pwrite, no new file), and a reader that read while it
    was written sees a check sum that fails rather than a wrong seq."""
    digits = b"%0*d" % (MARK_DIGITS, seq)
    return b"%s %08x\n" % (digits, zlib.crc32(digits))


def decode_mark(raw: bytes) -> int | None:
    """The mark's seq; None for a file that is not one, or read half-written (a reader then reads
    nothing new as committed). A bare decimal and a newline is a mark of an older Tape's."""
    text = raw.strip()
    if len(raw) == MARK_SIZE:
        digits, _, check = text.partition(b" ")
        ok = digits.isdigit() and len(digits) == MARK_DIGITS and check == b"%08x" % zlib.crc32(digits)
        return int(digits) if ok else None
    return int(text) if text.isdigit() and len(text) <= MARK_DIGITS else None


class CommitMark:
    def __init__(self, marked: int = 0, every_ns: int = COMMIT_MARK_EVERY_NS):
        self.marked, self.every_ns = marked, every_ns
        self.at: int | None = None  # when it was last written (None: not yet)

    def on_tick(self, commit_seq: int, now: int) -> list:
        if commit_seq <= self.marked or (self.at is not None and now - self.at < self.every_ns):
            return []
        self.marked, self.at = commit_seq, now
        return [MarkCommitted(commit_seq)]

    def on_stop(self, commit_seq: int) -> list:
        if commit_seq <= self.marked:
            return []
        self.marked = commit_seq
        return [MarkCommitted(commit_seq)]
