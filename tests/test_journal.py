import ctypes
import errno
import itertools
import json
import mmap
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import TAPE, small_disk, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from tape.ops.verification.faults import fill as fill_disk
from tape.protocol import journal as fmt
from tape.protocol import messages as msg
from tape.runtime.storage import journal_store
from tape.runtime.storage.diskspace import DiskFull
from tape.runtime.storage.journal_store import LARGEST_FOLIO, Journal, JournalCorruption
from tape.runtime.tuning import JOURNAL_CACHED_BYTES, RESERVE_AHEAD_BYTES, SEALED_INDEXES_KEPT

S = b"TAPE      "


def message(i: int) -> bytes:
    return msg.stamp(msg.purchase(i, i // 3, i % 500, "Sendence", "AAPL"), 10 * i, b"client1   ", i)


def fill(path, n, batch=10, **kw) -> Journal:
    j = Journal(path, S, **kw)
    for start in range(1, n + 1, batch):
        j.append([(s, 1 + s // 50, message(s)) for s in range(start, min(n, start + batch - 1) + 1)])
    return j


def seqs(j, *a):
    return [r[0] for r in j.read(*a)]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 300),
    seg=st.integers(300, 5000),
    every=st.integers(1, 40),
    lo=st.integers(1, 300),
    span=st.integers(0, 300),
)
def test_reads_from_any_seq_across_segments(tmp_path_factory, n, seg, every, lo, span):
    path = tmp_path_factory.mktemp("j")
    j = fill(path, n, segment_bytes=seg, index_every=every, fsync="never")
    hi = lo + span
    expect = list(range(lo, min(hi, n) + 1))
    assert seqs(j, lo, hi) == expect
    j.close()
    j2 = Journal(path, index_every=every)  # sealed segments now read through their .idx files
    assert j2.last_seq == n and seqs(j2, lo, hi) == expect
    assert [m for _, _, m in j2.read(lo, hi)] == [message(s) for s in expect]


def test_records_keep_seq_term_and_message(tmp_path):
    j = fill(tmp_path, 120, segment_bytes=2000)
    assert len(j.segments) > 3
    assert list(j.read(49, 51)) == [(s, 1 + s // 50, message(s)) for s in (49, 50, 51)]
    assert j.last_term == 3
    j.close()
    assert sorted(p.name for p in tmp_path.glob("*.seg"))[:2] == [
        fmt.segment_name(1),
        fmt.segment_name(21),
    ]  # rolls between batches of 10


def test_append_must_continue_the_log(tmp_path):
    j = fill(tmp_path, 5)
    with pytest.raises(ValueError):
        j.append([(7, 1, message(7))])
    with pytest.raises(ValueError):
        j.append([(6, 1, message(6)), (8, 1, message(8))])


def test_torn_write_at_every_byte_of_the_last_record(tmp_path):
    src = tmp_path / "src"
    fill(src, 30).close()
    seg = sorted(src.glob("*.seg"))[-1]
    data = seg.read_bytes()
    last_start = len(data) - (fmt.RECORD_HEADER_SIZE + msg.SEQUENCED_SIZE)
    for cut in range(last_start, len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / seg.name).write_bytes(data[:cut])
        j = Journal(d)
        assert j.last_seq == 29, cut
        assert j.recovery.truncated_bytes == cut - last_start
        assert seqs(j) == list(range(1, 30))
        assert (d / seg.name).stat().st_size == last_start
        j.append([(30, 1, message(30))])  # and the log goes on
        assert seqs(j, 28) == [28, 29, 30]
        j.close()


def test_zero_filled_tail_is_torn_not_corrupt(tmp_path):
    fill(tmp_path, 10).close()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    with open(seg, "ab") as f:
        f.write(bytes(4096))
    j = Journal(tmp_path)
    assert j.last_seq == 10 and j.recovery.truncated_bytes == 4096


@pytest.mark.process
@pytest.mark.parametrize("where", ["crc", "length", "seq", "message"])
def test_flipped_byte_mid_file_is_reported_with_seq_and_offset(tmp_path, where):
    fill(tmp_path, 40).close()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    rec = fmt.RECORD_HEADER_SIZE + msg.SEQUENCED_SIZE
    start = fmt.SEGMENT_HEADER_SIZE + 19 * rec  # record of seq 20
    data[start + {"crc": 1, "length": 6, "seq": 15, "message": 60}[where]] ^= 0x40
    seg.write_bytes(bytes(data))
    with pytest.raises(JournalCorruption) as e:
        Journal(tmp_path)
    assert e.value.seq == 20 and e.value.offset == start
    assert seg.stat().st_size == len(data)  # nothing truncated
    out = subprocess.run(TAPE + ["journal", "verify", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "seq 20" in out.stdout and f"offset {start}" in out.stdout


def test_corruption_in_a_sealed_segment_fails_the_read(tmp_path):
    fill(tmp_path, 100, segment_bytes=2000).close()
    first = sorted(tmp_path.glob("*.seg"))[0]
    data = bytearray(first.read_bytes())
    data[fmt.SEGMENT_HEADER_SIZE + 5 * 99 + 50] ^= 1  # inside seq 6
    first.write_bytes(bytes(data))
    j = Journal(tmp_path)  # the tail is fine: opening works
    assert seqs(j, 50, 52) == [50, 51, 52]
    with pytest.raises(JournalCorruption) as e:
        list(j.read(1, 10))
    assert e.value.seq == 6


def test_empty_segment_left_by_a_crash_during_a_roll_is_removed(tmp_path):
    j = fill(tmp_path, 20)
    j.close()
    (tmp_path / fmt.segment_name(21)).write_bytes(fmt.encode_segment_header(S, 21)[:17])
    j = Journal(tmp_path)
    assert j.last_seq == 20 and not (tmp_path / fmt.segment_name(21)).exists()
    j.append([(21, 1, message(21))])
    assert seqs(j, 20) == [20, 21]


def test_a_journal_holds_the_index_of_its_tail_and_of_a_few_finished_segments_only(tmp_path):
    j = fill(tmp_path, 3000, segment_bytes=2000, index_every=4, fsync="never", recent_records=1)  # ~150 segments
    assert len(j.segments) > 4 * SEALED_INDEXES_KEPT
    assert sum(seg.indexed for seg in j.segments[:-1]) == 0  # each dropped once written to its .idx
    for lo in range(1, 3000, 97):  # reads load them back, a bounded few at a time
        assert [r[0] for r in itertools.islice(j.read(lo), 5)] == list(range(lo, lo + 5))
        assert sum(seg.indexed for seg in j.segments[:-1]) <= SEALED_INDEXES_KEPT
    j.truncate_after(1234)  # into a finished segment whose index is on disk only: it is the tail again
    for lo in range(1, 1200, 37):  # as many finished segments' indexes loaded as may be: the tail's stays
        next(iter(j.read(lo)))
    assert j.segments[-1].indexed
    for first in range(1235, 1300, 5):
        j.append([(s, 2, message(s)) for s in range(first, first + 5)])
    assert [r[0] for r in j.read(1200)] == list(range(1200, 1300))
    assert [m for _, _, m in j.read(1260, 1262)] == [message(s) for s in range(1260, 1263)]
    j.close()
    assert [r[0] for r in Journal(tmp_path, index_every=4).read(1230, 1240)] == list(range(1230, 1241))


def test_truncate_after_drops_a_suffix_across_segments(tmp_path):
    j = fill(tmp_path, 100, segment_bytes=2000)
    j.truncate_after(37)
    assert j.last_seq == 37 and seqs(j, 30) == list(range(30, 38)) and j.last_term == 1
    j.append([(38, 9, b"x" * 75)])
    j.close()
    j = Journal(tmp_path)
    assert j.last_seq == 38 and j.last_term == 9 and list(j.read(38))[0][2] == b"x" * 75


def test_a_reader_sees_a_consistent_prefix_while_the_writer_appends(tmp_path):
    j = fill(tmp_path, 50, segment_bytes=3000)
    reader = Journal(tmp_path, readonly=True)
    for s in range(51, 90):
        j.append([(s, 1, message(s))])
    assert seqs(reader) == list(range(1, 51))
    assert seqs(Journal(tmp_path, readonly=True)) == list(range(1, 90))


def test_fsync_policies(tmp_path):
    j = fill(tmp_path / "b", 50, fsync="batch")
    assert j.fsyncs == 5
    j = fill(tmp_path / "n", 50, fsync="never")
    assert j.fsyncs == 0
    j.sync()
    assert j.fsyncs == 1
    j = fill(tmp_path / "t", 50, fsync=60_000)
    assert j.fsyncs == 1  # the first append syncs, then not again within the minute
    with pytest.raises(ValueError):
        Journal(tmp_path / "x", S, fsync="sometimes")


def test_background_flush_keeps_appends_off_the_disk(tmp_path):
    """Durability "replicated": an append returns before any flush; the flusher thread makes the
    writes durable (here held off by a long interval until close, which flushes and stops it)."""
    j = fill(tmp_path, 50, flush_every_s=3600)
    assert j.fsyncs == 0 and j.unflushed_bytes == j.bytes_written > 0
    j.close()
    assert j.fsyncs == 1 and j.unflushed_bytes == 0
    assert seqs(Journal(tmp_path, readonly=True)) == list(range(1, 51))


def test_background_flush_catches_up(tmp_path):
    j = fill(tmp_path, 50, flush_every_s=0.001)
    wait_for(lambda: j.unflushed_bytes == 0, "the background flush")
    assert j.fsyncs >= 1
    j.close()


def test_background_flush_too_far_behind_makes_appends_wait(tmp_path, monkeypatch):
    """A disk that falls MAX_UNFLUSHED_BYTES behind bounds what a power loss can take: the append
    past it flushes before it returns."""
    monkeypatch.setattr(journal_store, "MAX_UNFLUSHED_BYTES", 1000)
    j = fill(tmp_path, 50, flush_every_s=3600)
    assert j._flusher.waited >= 1 and j.fsyncs >= 1
    assert j.unflushed_bytes <= 1000 + 10 * (fmt.RECORD_HEADER_SIZE + msg.SEQUENCED_SIZE)  # (at most a batch past)
    j.close()


def test_session_of_a_segment_must_match(tmp_path):
    fill(tmp_path, 5).close()
    with pytest.raises(JournalCorruption):
        Journal(tmp_path, b"OTHER     ")


@pytest.mark.process
def test_dump_cli_prints_every_record(tmp_path):
    fill(tmp_path, 60, segment_bytes=2000).close()
    out = subprocess.run(
        TAPE + ["journal", "dump", str(tmp_path), "--from", "10"], capture_output=True, text=True, check=True
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["seq"] for r in rows] == list(range(10, 61))
    out = subprocess.run(TAPE + ["journal", "dump", str(tmp_path), "--from", "10", "--to", "12"],
                         capture_output=True, text=True, check=True)
    assert [json.loads(line)["seq"] for line in out.stdout.splitlines()] == [10, 11, 12]
    assert rows[0] == {"seq": 10, "term": 1, "type": "purchase", "purchase_id": 10, "order_id": 3, "shares": 10,
                       "client": "Sendence", "stock": "AAPL", "stamp_ns": 100, "origin": "client1", "client_seq": 10}
    out = subprocess.run(TAPE + ["journal", "verify", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0 and "60 records" in out.stdout


@pytest.mark.process
def test_a_write_refused_for_want_of_space_leaves_the_journal_as_it_was(tmp_path):
    """A real full file system (a 2 MiB tmpfs): the refused append raises DiskFull and leaves no
    partial record; with space back the same seqs append, and a reopen reads every record once."""
    with small_disk(tmp_path, "2m") as filler:
        j = Journal(tmp_path / "journal", S, segment_bytes=4 << 20)
        j.append(batch(1, 100))
        fill_disk(filler)
        size = j.segments[-1].path.stat().st_size
        with pytest.raises(DiskFull, match="disk full: journal append to"):
            j.append(batch(101, 15_000))  # larger than what is left (its reserve too)
        assert j.last_seq == 100 and j.segments[-1].path.stat().st_size == size
        filler.unlink()
        j.append(batch(101, 15_000))
        j.close()
        again = Journal(tmp_path / "journal", readonly=True)
        assert [r[0] for r in again.read()] == list(range(1, 15_101)) and not again.recovery


def allocated(path) -> int:
    return path.stat().st_blocks * 512


@pytest.mark.process
def test_the_tail_has_its_next_appends_space_reserved_and_gives_it_back(tmp_path):
    """The tail segment holds disk space past its end for the next appends (its size is still its
    data, byte for byte); a roll, a truncation and a close give it back. On a 2 MiB tmpfs filled
    behind it, the journal still appends into what it reserved."""
    with small_disk(tmp_path, "2m") as filler:
        j = Journal(tmp_path / "journal", S, segment_bytes=1 << 20)
        j.append(batch(1, 100))
        tail = j.segments[-1].path
        assert tail.stat().st_size == fmt.SEGMENT_HEADER_SIZE + 100 * 99
        assert allocated(tail) >= RESERVE_AHEAD_BYTES
        fill_disk(filler)
        j.append(batch(101, 5_000))  # (fits in the reserve: no DiskFull)
        filler.unlink()
        j.append(batch(5_101, 6_000))  # past 1 MiB: the next append rolls
        j.append(batch(11_101, 10))  # the finished segment gave its reserve back
        assert len(j.segments) == 2 and allocated(tail) < tail.stat().st_size + 64 * 1024
        j.truncate_after(5_000)
        assert len(j.segments) == 1 and allocated(tail) < tail.stat().st_size + 64 * 1024
        j.append(batch(5_001, 10))
        j.close()
        assert allocated(tail) < tail.stat().st_size + 64 * 1024
        again = Journal(tmp_path / "journal", readonly=True)
        assert list(again.read()) == batch(1, 5_010) and not again.recovery


def batch(first: int, n: int) -> list:
    return [(s, 1, message(s)) for s in range(first, first + n)]


APPENDS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 30), st.booleans()),  # count, as a RecordRun
    st.tuples(st.just("truncate"), st.integers(0, 40), st.just(False)),  # records dropped from the end
), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=APPENDS, reads=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 40)), max_size=30))
def test_reads_of_the_newest_records_from_memory_are_what_the_files_hold(tmp_path_factory, ops, reads):
    """The journal answers reads of its tail from the appends it keeps in memory (a handful here,
    so that the oldest are forgotten): across RecordRuns, lists, truncations and segment rolls,
    each read is what a journal opened afresh on the same files reads."""
    path = tmp_path_factory.mktemp("j")
    j = Journal(path, S, segment_bytes=2000, fsync="never", recent_records=25)
    term = 1
    for op, n, as_run in ops:
        if op == "truncate":
            j.truncate_after(max(0, j.last_seq - n))
            term += 1  # a new leader's entries follow
            continue
        first = j.last_seq + 1
        msgs = [message(s) for s in range(first, first + n)]
        j.append(fmt.RecordRun(first, term, b"".join(msgs), len(msgs[0])) if as_run
                 else [(s, term, m) for s, m in enumerate(msgs, first)])
        files = Journal(path, S, readonly=True)
        tail = [(seq, count) for seq in range(max(1, first - 30), j.last_seq + 2) for count in (1, 3, 40)]
        for seq, count in reads + tail:
            assert j.read_batch(seq, count) == files.read_batch(seq, count)
    assert all(len(r) == 3 for r in j.read_batch(max(1, j.last_seq - 5), 10))


def test_a_record_run_slices_as_the_list_it_stands_for():
    msgs = [message(s) for s in range(1, 8)]
    run = fmt.RecordRun(1, 3, b"".join(msgs), len(msgs[0]))
    as_list = [(s, 3, m) for s, m in enumerate(msgs, 1)]
    for sl in (slice(0, 7), slice(2, 5), slice(5, 100), slice(-3, None), slice(4, 2), slice(0, 7, 2)):
        assert run[sl] == as_list[sl]


def cached_pages(path) -> list[bool]:
    """Which of a file's pages the page cache holds (mincore(2) on a private mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        window = ctypes.c_char.from_buffer(mm)
        pages = (len(mm) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(window)), ctypes.c_size_t(len(mm)), vec)
        del window
    assert rc == 0, os.strerror(ctypes.get_errno())
    return [bool(v & 1) for v in vec]


def file_system(path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()


@pytest.fixture
def on_disk(tmp_path):
    """A directory on a file system with a page cache to give back to: tmp_path, or where /tmp is a
    tmpfs (which keeps every page), one under /var/tmp."""
    if file_system(tmp_path) != "tmpfs":
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tape-test-"))
    try:
        if file_system(path) == "tmpfs":
            pytest.skip("no file system but tmpfs here: the advice has nothing to give back")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.process
def test_synced_pages_behind_the_tail_are_given_back_to_the_page_cache(on_disk):
    """After each fsync the tail's pages more than JOURNAL_CACHED_BYTES behind its end leave the
    page cache (the next appends' pages come warm), give or take a large folio at the edge; a
    finished segment leaves it whole; reads go to the file as before. Unsynced pages (fsync never)
    stay, dirty."""
    tmp_path = on_disk
    page, per_batch = mmap.PAGESIZE, 2_000
    batches = (JOURNAL_CACHED_BYTES + (6 << 20)) // (per_batch * 99) + 1
    j = Journal(tmp_path / "synced", S, segment_bytes=1 << 30)
    for k in range(batches):
        j.append(batch(1 + k * per_batch, per_batch))
    tail = j.segments[-1].path
    cached = cached_pages(tail)
    behind = (tail.stat().st_size - JOURNAL_CACHED_BYTES) // page
    assert not any(cached[:behind - LARGEST_FOLIO // page]) and all(cached[behind + LARGEST_FOLIO // page:])
    j.append(batch(1 + batches * per_batch, 10))
    j._roll(2 + batches * per_batch + 10)  # a finished segment: synced and given back whole
    assert not any(cached_pages(tail))
    again = Journal(tmp_path / "synced", readonly=True)
    assert [r[0] for r in again.read()] == list(range(1, batches * per_batch + 11))
    unsynced = fill(tmp_path / "never", 40_000, batch=2_000, fsync="never")
    assert all(cached_pages(unsynced.segments[-1].path))


def test_a_file_system_that_refuses_the_advice_keeps_its_pages_and_the_journal_appends(tmp_path, monkeypatch, caplog):
    advised = []

    def refuse(fd, offset, length, advice):
        advised.append(offset)
        raise OSError(errno.ESPIPE, "refused")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    j = fill(tmp_path, 60_000, batch=2_000)
    assert len(advised) == 1 and "takes no page-cache advice" in caplog.text
    assert [r[0] for r in j.read()] == list(range(1, 60_001))
