"""The journal store: append-only segment files with recovery, rolling,
group commit, a sparse index and reads from any seq.

Used by sequencers and rewinders (writing) and by tools and Spark (reading,
with `readonly=True`, possibly while a writer appends).
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Iterator

from tape.protocol import journal as fmt
from tape.protocol.commit_mark import COMMIT_MARK_FILE, decode_mark, encode_mark
from tape.protocol.messages import SEQUENCED_SIZE
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.storage import preallocate
from tape.runtime.storage.diskspace import DiskFull, no_space
from tape.runtime.tuning import (
    JOURNAL_CACHED_BYTES,
    JOURNAL_RECENT_RECORDS,
    MAX_UNFLUSHED_BYTES,
    RESERVE_AHEAD_BYTES,
    SEALED_INDEXES_KEPT,
    SLOW_FSYNC_LOG_S,
    SLOW_FSYNC_S,
)

_SEQ_TERM_MESSAGE = itemgetter(0, 1, 2)  # a scanned record less its offset

log = logging.getLogger("tape.journal")

DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_INDEX_EVERY = 256
_READ_CHUNK = 1 << 18
_MIN_READ = 4096  # bytes: the least a bounded read asks the file for
LARGEST_FOLIO = 2 << 20  # a page cache folio's largest size (x86-64: a PMD's)
WHOLE_FILE = 1 << 62  # (a finished segment gives all its pages back)
_RECORD_GUESS = fmt.RECORD_HEADER_SIZE + SEQUENCED_SIZE  # bytes of a typical record, to size a bounded read


class JournalCorruption(Exception):
    """A record that fails its check with good data after it: never skipped."""

    def __init__(self, path: Path, offset: int, seq: int | None, reason: str):
        self.path, self.offset, self.seq, self.reason = Path(path), offset, seq, reason
        where = f"seq {seq}" if seq is not None else "a record"
        super().__init__(f"journal corrupt at {where}, {path} offset {offset}: {reason}")


@dataclass
class Recovery:
    """What opening the journal found at its tail."""

    truncated_bytes: int = 0
    offset: int = 0
    reason: str = ""
    segment: str = ""

    def __bool__(self) -> bool:
        return self.truncated_bytes > 0


@dataclass
class Segment:
    first_seq: int
    path: Path
    last_seq: int  # first_seq - 1 while empty
    size: int = fmt.SEGMENT_HEADER_SIZE
    idx_seqs: list | array = field(default_factory=list)  # sparse index, loaded lazily for sealed segments
    idx_offsets: list | array = field(default_factory=list)
    indexed: bool = False

    def forget_index(self) -> None:
        self.idx_seqs, self.idx_offsets, self.indexed = [], [], False


def parse_fsync(policy: str | int | float) -> float | None:
    """'batch' -> 0 (every append), 'never' -> None, a number -> every N ms."""
    if policy == "batch":
        return 0.0
    if policy == "never":
        return None
    try:
        ms = float(policy)
    except (TypeError, ValueError):
        raise ValueError(f"fsync policy {policy!r}: use 'batch', 'never' or a number of milliseconds") from None
    if ms < 0:
        raise ValueError(f"fsync interval {ms} ms is negative")
    return ms / 1000.0


class Journal:
    def __init__(
        self,
        directory: str | os.PathLike,
        session: bytes | None = None,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        fsync: str | int | float = "batch",
        flush_every_s: float | None = None,
        index_every: int = DEFAULT_INDEX_EVERY,
        recent_records: int = JOURNAL_RECENT_RECORDS,
        readonly: bool = False,
    ):
        self.dir = Path(directory)
        self.session = session
        self.segment_bytes = segment_bytes
        self.fsync_interval = None if flush_every_s is not None else parse_fsync(fsync)
        self.index_every = index_every
        self.readonly = readonly
        self.recovery = Recovery()
        self.segments: list[Segment] = []
        self.last_term = 0
        self._fd: int | None = None
        self._reserved_to = 0  # the tail's offset up to which disk space is reserved
        self._dropped_to = 0  # the tail's offset below which its synced pages were given back
        self._drop_behind = True  # False once the file system refused the advice
        self._last_sync = 0.0
        self._dirty = False
        # The newest appends as they came, (first seq, records), for reads of the log's tail
        # (gap fills, catch-ups): ~130 µs to find a packet's worth in the file, ~12 from here.
        self._recent: deque = deque()
        self._recent_count = 0
        self._indexes_held: deque[Segment] = deque()  # finished segments whose index is loaded, oldest first
        self.recent_records = recent_records
        # Metrics (plain numbers: the shell exposes them).
        self.fsyncs = 0
        self.fsync_seconds = 0.0
        self.fsync_max_seconds = 0.0
        self.slow_fsyncs = 0
        self._slow_log = RateLimitedLog(log, SLOW_FSYNC_LOG_S)
        self._mark_log = RateLimitedLog(log)
        self._mark_fd: int | None = None  # the commit mark's file, once written
        self.bytes_written = 0
        self.bytes_flushed = 0  # of bytes_written, what the last fdatasync covered
        self._fd_lock = threading.RLock()  # the tail's descriptor, between the flusher and what replaces it
        self._flusher: Flusher | None = None
        if not readonly:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._open()
        if flush_every_s is not None and not readonly:
            self._flusher = Flusher(self, flush_every_s)

    # --- opening and recovery ------------------------------------------------

    def _open(self) -> None:
        names = sorted(p for p in self.dir.glob("*" + fmt.SEGMENT_SUFFIX)) if self.dir.exists() else []
        for path in names:
            try:
                first = int(path.stem)
            except ValueError:
                continue
            self.segments.append(Segment(first, path, first - 1))
        for seg in self.segments[:-1]:
            self._check_header(seg)
            seg.size = seg.path.stat().st_size
        for prev, nxt in zip(self.segments, self.segments[1:]):
            prev.last_seq = nxt.first_seq - 1
        while self.segments:
            tail = self.segments[-1]
            if self._recover_tail(tail):
                break
            # An empty tail segment (crash right after a roll): drop it.
            if not self.readonly:
                tail.path.unlink()
                tail.path.with_suffix(fmt.INDEX_SUFFIX).unlink(missing_ok=True)
            self.segments.pop()
            if self.readonly:
                break
        if not self.readonly and self.segments:
            self._open_tail(self.segments[-1].path)

    def _check_header(self, seg: Segment) -> None:
        with open(seg.path, "rb") as f:
            head = f.read(fmt.SEGMENT_HEADER_SIZE)
        try:
            session, first = fmt.decode_segment_header(head)
        except fmt.FormatError as e:
            raise JournalCorruption(seg.path, 0, None, f"bad segment header: {e}") from None
        if first != seg.first_seq:
            raise JournalCorruption(seg.path, 0, None, f"header says first seq {first}, file name {seg.first_seq}")
        if self.session is None:
            self.session = session
        elif session != self.session:
            raise JournalCorruption(seg.path, 0, None, f"segment of session {session!r}, journal is {self.session!r}")

    def _recover_tail(self, seg: Segment) -> bool:
        """Scan the tail segment, truncate a torn tail; False if it holds nothing."""
        data = seg.path.read_bytes()
        if len(data) < fmt.SEGMENT_HEADER_SIZE:
            self._note_torn(seg, fmt.SEGMENT_HEADER_SIZE, len(data), "incomplete segment header", truncate=False)
            return False
        self._check_header(seg)
        res = fmt.scan(data, fmt.SEGMENT_HEADER_SIZE, seg.first_seq)
        if res.problem is not None:
            expect = res.records[-1][0] + 1 if res.records else seg.first_seq
            if not fmt.is_torn_tail(data, res.end, expect):
                raise JournalCorruption(seg.path, res.end, expect, res.problem)
            self._note_torn(seg, res.end, len(data) - res.end, res.problem, truncate=not self.readonly)
        seg.size = res.end
        seg.last_seq = seg.first_seq - 1 + len(res.records)
        self._index_scanned(seg, res.records)
        if res.records:
            self.last_term = res.records[-1][1]
            return True
        return False

    def _note_torn(self, seg: Segment, offset: int, nbytes: int, reason: str, truncate: bool) -> None:
        self.recovery = Recovery(nbytes, offset, reason, seg.path.name)
        if truncate:
            with open(seg.path, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
            log.warning("journal %s: torn tail truncated: %d bytes at offset %d (%s)", seg.path, nbytes, offset, reason)

    def _index_scanned(self, seg: Segment, records: list) -> None:
        seg.idx_seqs = [r[0] for r in records[:: self.index_every]]
        seg.idx_offsets = [r[3] for r in records[:: self.index_every]]
        seg.indexed = True

    # --- state ---------------------------------------------------------------

    @property
    def first_seq(self) -> int:
        return self.segments[0].first_seq if self.segments else 1

    @property
    def last_seq(self) -> int:
        """The highest seq held, 0 if none."""
        return self.segments[-1].last_seq if self.segments else 0

    # --- appending -------------------------------------------------------------

    def append(self, records, sync: bool = True) -> None:
        """Append [(seq, term, message), ...] (a list, or a protocol.journal.RecordRun) in one
        write (group commit). With sync=False the caller calls maybe_sync() before it tells
        anyone the records are held (several appends, one fsync).
        Seqs must continue the journal with no gap. A write refused for want of
        space leaves the journal as it was and raises DiskFull."""
        if self.readonly:
            raise RuntimeError("journal opened read-only")
        if not records:
            return
        first, (last, last_term, _) = records[0][0], records[-1]  # (once: a RecordRun makes each record asked for)
        expect = self.last_seq + 1 if self.segments else first
        if first != expect or last != first + len(records) - 1:
            raise ValueError(f"append of seqs {first}..{last} does not continue the journal at {expect}")
        try:
            self._append(records, first, last, last_term)
        except OSError as e:
            if not no_space(e):
                raise
            raise DiskFull(self.segments[-1].path if self.segments else self.dir, "journal append to") from None
        if self._flusher is not None:
            self._flusher.written()
        elif sync:
            self.maybe_sync()

    def _append(self, records: list, first: int, last: int, last_term: int) -> None:
        """The write of append(); a write that fails leaves the journal as it was."""
        if not self.segments or (
            self.segments[-1].size >= self.segment_bytes and self.segments[-1].last_seq >= self.segments[-1].first_seq
        ):
            self._roll(first)
        seg = self.segments[-1]
        offset = seg.size
        indexed = len(seg.idx_seqs)
        run = isinstance(records, fmt.RecordRun)
        buf = records.encoded() if run else fmt.encode_records(records)
        # The sparse index: the offsets of every index_every-th record.
        nxt = seg.idx_seqs[-1] + self.index_every if seg.idx_seqs else seg.first_seq
        if first <= nxt <= last:
            seg.idx_seqs.extend(range(nxt, last + 1, self.index_every))
            starts = (records.offsets(nxt - first, self.index_every) if run
                      else fmt.record_offsets(records, nxt - first, self.index_every))
            seg.idx_offsets.extend(offset + at for at in starts)
        if offset + len(buf) > self._reserved_to:
            self._reserve(offset, len(buf))
        try:
            self._write(buf)
        except OSError:
            os.ftruncate(self._fd, offset)  # a partial write would be a torn record mid-journal
            del seg.idx_seqs[indexed:], seg.idx_offsets[indexed:]
            raise
        seg.size = offset + len(buf)
        seg.last_seq, self.last_term = last, last_term
        self._dirty = True
        self._remember(first, records if run else list(records))

    def _remember(self, first: int, records) -> None:
        recent = self._recent
        recent.append((first, records))
        self._recent_count += len(records)
        while self._recent_count - len(recent[0][1]) >= self.recent_records:
            self._recent_count -= len(recent.popleft()[1])

    def _forget_recent(self) -> None:
        self._recent.clear()
        self._recent_count = 0

    def _write(self, buf: bytes) -> None:
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.bytes_written += len(buf)

    def _roll(self, first_seq: int) -> None:
        if self.session is None:
            raise ValueError("a new journal needs a session")
        if self.segments:
            self._seal(self.segments[-1])
        path = self.dir / fmt.segment_name(first_seq)
        try:
            with open(path, "wb") as f:
                f.write(fmt.encode_segment_header(self.session, first_seq))
                f.flush()
                os.fsync(f.fileno())
            self._fsync_dir()
        except OSError:
            path.unlink(missing_ok=True)  # the next append rolls again
            raise
        self.segments.append(Segment(first_seq, path, first_seq - 1, indexed=True))
        self._open_tail(path)

    def _open_tail(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._reserved_to = 0
        self._dropped_to = 0

    def _close_tail(self) -> None:
        """Close the tail segment, giving back the space reserved past its end."""
        preallocate.release(self._fd)
        os.close(self._fd)
        self._fd = None

    def _reserve(self, offset: int, need: int) -> None:
        """Reserve the space of the next appends, RESERVE_AHEAD_BYTES at a time: an append's
        fdatasync then writes its data and the file's size, not the blocks' allocation too. A
        file system that cannot (or has no space) is asked again a reserve's worth later."""
        length = max(need, RESERVE_AHEAD_BYTES)
        preallocate.reserve(self._fd, offset, length)
        self._reserved_to = offset + length

    def _seal(self, seg: Segment) -> None:
        """Make a finished segment durable and persist its sparse index."""
        with self._fd_lock:
            if self._fd is not None:
                self._fsync()
                self._give_back(WHOLE_FILE)
                self._close_tail()
        idx = b"".join(fmt.INDEX_ENTRY.pack(s, o) for s, o in zip(seg.idx_seqs, seg.idx_offsets))
        tmp = seg.path.with_suffix(".idx.tmp")
        tmp.write_bytes(idx)
        os.replace(tmp, seg.path.with_suffix(fmt.INDEX_SUFFIX))
        seg.forget_index()  # (on disk now: read back if a read needs it)

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_due_s(self) -> float | None:
        """The monotonic time at which `maybe_sync` next syncs (None: only an append makes one due)."""
        if not self.fsync_interval or not self._dirty:
            return None
        return self._last_sync + self.fsync_interval

    def maybe_sync(self) -> None:
        """fsync if the policy says one is due (call on a timer too)."""
        if self.fsync_interval is None or not self._dirty:
            return
        if self.fsync_interval == 0 or time.monotonic() - self._last_sync >= self.fsync_interval:
            self._fsync()

    def _fsync(self) -> None:
        with self._fd_lock:
            if self._fd is None or not self._dirty:
                return
            self._dirty = False  # (before the flush: a write the flush may miss marks it again)
            written = self.bytes_written
            t0 = time.perf_counter()
            os.fdatasync(self._fd)
            took = time.perf_counter() - t0
            self.bytes_flushed = written
            self._synced(took)
            self._give_back(self.segments[-1].size - JOURNAL_CACHED_BYTES)

    def _synced(self, took: float) -> None:
        self.fsync_seconds += took
        self.fsync_max_seconds = max(self.fsync_max_seconds, took)
        self.fsyncs += 1
        if took > SLOW_FSYNC_S:
            self.slow_fsyncs += 1
            self._slow_log.warn("slow", "fsync of %s took %.0f ms%s", self.dir, took * 1000,
                                "" if self._flusher else ": everything this node does waited for it")
        self._last_sync = time.monotonic()

    def _give_back(self, below: int) -> None:
        """Drop the tail's synced pages below offset `below` (WHOLE_FILE: all) from the page cache.
        A journal is written once and read back rarely (its newest records are in memory), so its
        pages would only grow the cache, each append into a page never used before; given back,
        they are the next appends' pages, still warm (here ~10x cheaper to write; decisions.md)."""
        below -= below % mmap.PAGESIZE
        if not self._drop_behind or below <= self._dropped_to:
            return
        # The kernel drops only folios wholly inside the range, and the page cache's folios go up
        # to 2 MiB: each range starts a folio's worth back, so one cut last time goes this time.
        start = max(0, self._dropped_to - LARGEST_FOLIO)
        try:
            os.posix_fadvise(self._fd, start, below - start if below < WHOLE_FILE else 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            self._drop_behind = False
            log.warning("the file system of %s takes no page-cache advice (%s): its pages stay cached", self.dir, e)
            return
        self._dropped_to = below

    def sync(self) -> None:
        """Flush to disk now, whatever the policy (call on a timer with 'N ms')."""
        self._fsync()

    def truncate_after(self, seq: int) -> None:
        """Remove every record after `seq` (a follower dropping a conflicting,
        uncommitted suffix)."""
        with self._fd_lock:
            self._truncate_after(seq)

    def _truncate_after(self, seq: int) -> None:
        if self.readonly:
            raise RuntimeError("journal opened read-only")
        if seq >= self.last_seq:
            return
        if seq < self.first_seq - 1:
            raise ValueError(f"cannot truncate to {seq}: the journal starts at {self.first_seq}")
        self._forget_recent()
        while self.segments and self.segments[-1].first_seq > seq:
            seg = self.segments.pop()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            seg.path.unlink()
            seg.path.with_suffix(fmt.INDEX_SUFFIX).unlink(missing_ok=True)
        if not self.segments:
            self.last_term = 0
            return
        seg = self.segments[-1]
        keep_offset, keep_term = seg.size, self.last_term
        for s, term, _msg, off in self._iter_segment(seg, seq + 1, with_offsets=True):
            keep_offset = off
            break
        for s, term, _msg in self._iter_segment(seg, seq):
            keep_term = term
            break
        if self._fd is not None:
            os.close(self._fd)
        with open(seg.path, "r+b") as f:
            f.truncate(keep_offset)
            os.fsync(f.fileno())
        seg.path.with_suffix(fmt.INDEX_SUFFIX).unlink(missing_ok=True)
        seg.size, seg.last_seq, self.last_term = keep_offset, seq, keep_term
        if seg in self._indexes_held:  # a finished segment is the tail again: its index (read to find
            self._indexes_held.remove(seg)  # the cut) is the tail's, which appends extend
        cut = bisect.bisect_right(seg.idx_seqs, seq)
        del seg.idx_seqs[cut:], seg.idx_offsets[cut:]
        self._open_tail(seg.path)

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.stop()
        with self._fd_lock:
            if self._fd is not None:
                self._fsync()
                self._close_tail()
        if self._mark_fd is not None:
            os.close(self._mark_fd)
            self._mark_fd = None

    @property
    def unflushed_bytes(self) -> int:
        """Written but not yet on the disk (durability "replicated": what the flusher has to do)."""
        return self.bytes_written - self.bytes_flushed

    # --- the commit mark (protocol/commit_mark.py): for readers of the directory --------

    def commit_mark(self) -> int:
        """The seq in the directory's commit mark (0: none, or not one)."""
        try:
            return decode_mark((self.dir / COMMIT_MARK_FILE).read_bytes()) or 0
        except FileNotFoundError:
            return 0

    def mark_committed(self, seq: int) -> None:
        """Write the mark over the last in place, one pwrite of a fixed width (the first in a new
        file renamed over the old: the file always holds a whole mark of that width, and a reader
        that reads while it is written sees a check sum fail): no rename on the voter's loop to
        wait behind the disk's flush (docs/decisions.md). Not synced: after a crash an older mark
        (or one that is not one) only makes a reader wait for the next. A mark that cannot be
        written (a full disk) is logged and left: readers wait, the log goes on."""
        mark = encode_mark(seq)
        try:
            if self._mark_fd is None:
                self._mark_fd = self._new_mark_file(mark)
            elif os.pwrite(self._mark_fd, mark, 0) != len(mark):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            self._mark_log.warn("mark", "cannot write the commit mark in %s: %s", self.dir, e)

    def _new_mark_file(self, mark: bytes) -> int:
        tmp = self.dir / (COMMIT_MARK_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, mark)
            os.replace(tmp, self.dir / COMMIT_MARK_FILE)
        except OSError:
            os.close(fd)
            raise
        return fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- reading ---------------------------------------------------------------

    def read(self, from_seq: int = 1, to_seq: int | None = None) -> Iterator[tuple[int, int, bytes]]:
        """Records (seq, term, message) from `from_seq` through `to_seq`: each read chunk's
        records are consecutive seqs, so what is wanted of it is one slice."""
        last = self.last_seq if to_seq is None else min(to_seq, self.last_seq)
        from_seq = max(from_seq, self.first_seq)
        if from_seq > last:
            return
        i = max(0, bisect.bisect_right([s.first_seq for s in self.segments], from_seq) - 1)
        for seg in self.segments[i:]:
            if seg.first_seq > last:
                return
            upto = min(last, seg.last_seq)
            for _, records in self._chunks(seg, from_seq, upto):
                first = records[0][0]
                yield from map(_SEQ_TERM_MESSAGE, records[max(0, from_seq - first):upto - first + 1])
                if records[-1][0] >= upto:
                    break
            from_seq = seg.last_seq + 1

    def read_batch(self, from_seq: int, max_count: int) -> list[tuple[int, int, bytes]]:
        """Up to `max_count` records from `from_seq`: from memory when the newest appends hold
        them all (what this process appended since it opened the journal), else from the files."""
        recent = self._recent
        if recent and recent[0][0] <= from_seq:
            return self._read_recent(from_seq, max_count)
        return list(self.read(from_seq, from_seq + max_count - 1))

    def _read_recent(self, from_seq: int, max_count: int) -> list[tuple[int, int, bytes]]:
        at = len(self._recent) - 1
        while self._recent[at][0] > from_seq:  # the newest first: gap fills ask for the last moments
            at -= 1
        out = []
        for k in range(at, len(self._recent)):
            first, records = self._recent[k]
            start = max(0, from_seq - first)
            out.extend(records[start:start + max_count - len(out)])
            if len(out) >= max_count:
                break
        return out

    def _load_index(self, seg: Segment) -> None:
        """A finished segment's index from its .idx (empty if missing or damaged: reads then scan
        from the segment's start), held while it is among the SEALED_INDEXES_KEPT last loaded."""
        idx = seg.path.with_suffix(fmt.INDEX_SUFFIX)
        seqs, offs = array("Q"), array("Q")
        try:
            raw = idx.read_bytes()
            if len(raw) % fmt.INDEX_ENTRY.size == 0:
                for s, o in fmt.INDEX_ENTRY.iter_unpack(raw):
                    seqs.append(s)
                    offs.append(o)
        except FileNotFoundError:
            pass
        seg.idx_seqs, seg.idx_offsets, seg.indexed = seqs, offs, True
        self._indexes_held.append(seg)
        while len(self._indexes_held) > SEALED_INDEXES_KEPT:
            self._indexes_held.popleft().forget_index()

    def _chunks(self, seg: Segment, from_seq: int, upto_seq: int | None = None):
        """segment_chunks of `seg` from the indexed record at or before `from_seq`."""
        if not seg.indexed:
            self._load_index(seg)
        k = bisect.bisect_right(seg.idx_seqs, from_seq) - 1
        if k >= 0:
            start, seq = seg.idx_offsets[k], seg.idx_seqs[k]
        else:
            start, seq = fmt.SEGMENT_HEADER_SIZE, seg.first_seq
        limit = seg.size if seg is self.segments[-1] and not self.readonly else None
        return segment_chunks(seg.path, start, seq, limit, sealed=seg is not self.segments[-1], upto_seq=upto_seq)

    def _iter_segment(self, seg: Segment, from_seq: int, with_offsets: bool = False):
        for base, records in self._chunks(seg, from_seq):
            for seq, term, msg, off in records:
                if seq < from_seq:
                    continue
                if seq > seg.last_seq:
                    return
                yield (seq, term, msg, base + off) if with_offsets else (seq, term, msg)


def iter_segment_file(path: Path, offset: int, expect_seq: int, limit: int | None = None, sealed: bool = True,
                      upto_seq: int | None = None):
    """Records (seq, term, message, offset) of one segment file from `offset`: segment_chunks'
    records one by one, their offsets in the file."""
    for base, records in segment_chunks(path, offset, expect_seq, limit, sealed, upto_seq):
        for seq, term, msg, off in records:
            yield seq, term, msg, base + off


def segment_chunks(path: Path, offset: int, expect_seq: int, limit: int | None = None, sealed: bool = True,
                   upto_seq: int | None = None):
    """(base, records) of one segment file from `offset`, a chunk read at a
    time: its records (seq, term, message, offset from base), consecutive
    seqs. A failing record raises JournalCorruption, except an incomplete
    record at the end of an unsealed (still written) segment, where reading
    simply stops. With `upto_seq`, reading stops there and reads
    (and checks) little more than the records asked for: a gap-fill answer
    wants a packet's worth, not a chunk's (2.9 ms a request before, issue 13)."""
    with open(path, "rb") as f:
        f.seek(offset)
        buf = b""
        base = offset  # file offset of buf[0]
        while True:
            wanted = None if upto_seq is None else upto_seq - expect_seq + 1
            if wanted is not None and wanted <= 0:
                return
            want = _READ_CHUNK if wanted is None else min(_READ_CHUNK, max(_MIN_READ, wanted * _RECORD_GUESS))
            if limit is not None:
                want = min(want, limit - base - len(buf))
            chunk = f.read(want) if want > 0 else b""
            at_eof = not chunk
            buf = buf + chunk if buf else chunk
            res = fmt.scan(buf, 0, expect_seq, wanted)
            if res.records:
                yield base, res.records
                expect_seq = res.records[-1][0] + 1
            if res.problem is None and at_eof:
                return
            if res.problem is not None and (not res.incomplete or at_eof):
                if at_eof and res.incomplete and not sealed:
                    return
                raise JournalCorruption(path, base + res.end, expect_seq, res.problem)
            buf = buf[res.end:]
            base += res.end


class Flusher:
    """durability = "replicated": the journal's writes reach the disk from a thread of their own,
    so that no append waits for the disk and the event loop never blocks on a flush. The first
    write after a flush wakes it; it lets `every_s` of writes gather (one flush for all: the
    disk sees a steady trickle, never a burst), then fdatasyncs them (the GIL released). A disk
    that falls MAX_UNFLUSHED_BYTES behind makes the appends wait for it: what a power loss can
    take is bounded in bytes as well as in time."""

    def __init__(self, journal: Journal, every_s: float):
        self.journal, self.every_s = journal, every_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.waited = 0  # appends that waited for the disk (too far behind)
        self._thread = threading.Thread(target=self._run, name="journal-flusher", daemon=True)
        self._thread.start()

    def written(self) -> None:
        """An append made: wake the flusher, or wait for the disk if it is too far behind."""
        if self.journal.unflushed_bytes > MAX_UNFLUSHED_BYTES:
            self.waited += 1
            self.journal._fsync()
        elif not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait()
            self._stopping.wait(self.every_s)
            self._wake.clear()  # (before the flush: a write meanwhile wakes it again)
            try:
                self.journal._fsync()
            except OSError as e:  # a disk that fails a flush: the process cannot keep its promise
                log.critical("the journal's background flush failed on %s: %s", self.journal.dir, e)
                os._exit(4)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join()
