"""The journal store and the Spark source, each held against a reader written from
docs/journal-format.md alone (tests/independent_journal.py): random journals across
segments, torn tails at every kind of offset, and corruption."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from independent_journal import Corrupt, read_journal

from tape.protocol import messages as M
from tape.runtime.storage.journal_store import Journal, JournalCorruption

SESSION = b"TAPE      "


def message(i: int) -> bytes:
    return M.stamp(M.purchase(i, i // 3, i % 500 - 50, "c%d" % (i % 7), "S%d" % (i % 5)), 10**18 + i,
                   b"load0".ljust(10), i)


def write(path, n: int, segment_bytes: int, terms: list[int]) -> list:
    records = [(s, terms[min(len(terms) - 1, (s - 1) * len(terms) // n)], message(s)) for s in range(1, n + 1)]
    with Journal(path, SESSION, segment_bytes=segment_bytes, fsync="never") as j:
        for start in range(0, n, 37):
            j.append(records[start:start + 37])
    return records


def independent_fields(raw: bytes) -> tuple:
    """The message fields docs/protocol.md places at fixed offsets (75 bytes, big-endian)."""
    u = lambda a, b: int.from_bytes(raw[a:b], "big")  # noqa: E731
    return (u(1, 9), int.from_bytes(raw[9:17], "big", signed=True), u(49, 57), u(67, 75))


def spark_source_rows(path) -> list:
    """The Spark data source's reader, run without a cluster: (seq, term, order_id, shares, stamp, client seq)."""
    from tape.ops.spark.source import TapeReader

    reader = TapeReader({"path": str(path)})
    out = []
    for part in reader.partitions():
        for batch in reader.read(part):
            cols = batch.to_pydict()
            out += zip(cols["seq"], cols["term"], cols["order_id"], cols["shares"], cols["stamp_ns"],
                       cols["client_seq"])
    return out


def as_rows(records) -> list:
    return [(s, t, *independent_fields(m)) for s, t, m in records]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), seg=st.integers(300, 6000), terms=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_store_and_spark_source_read_what_the_format_says(tmp_path_factory, n, seg, terms):
    path = tmp_path_factory.mktemp("j")
    written = write(path, n, seg, sorted(terms))
    independent = read_journal(str(path))
    assert independent == written
    assert list(Journal(path, readonly=True).read()) == independent
    assert spark_source_rows(path) == as_rows(independent)


@given(cut=st.integers(1, 98))
@settings(max_examples=40, deadline=None)
def test_a_torn_tail_is_ignored_by_all_and_cut_by_the_writer(tmp_path_factory, cut):
    path = tmp_path_factory.mktemp("j")
    write(path, 50, 1 << 20, [1])
    seg = path / sorted(os.listdir(path))[-1]
    size = seg.stat().st_size
    os.truncate(seg, size - cut)  # inside the last record (24 + 75 = 99 bytes)
    independent = read_journal(str(path))
    assert len(independent) == 49  # the torn record is not data
    assert list(Journal(path, readonly=True).read()) == independent
    assert spark_source_rows(path) == as_rows(independent)
    with Journal(path, SESSION) as j:  # the writer truncates the torn record on open
        assert j.last_seq == len(independent) and j.recovery.truncated_bytes == 99 - cut
    assert read_journal(str(path)) == independent


@pytest.mark.parametrize("where", [40, 500, 2000])
def test_corruption_before_the_end_is_refused_by_all(tmp_path, where):
    write(tmp_path, 60, 1 << 20, [1])
    seg = tmp_path / sorted(os.listdir(tmp_path))[0]
    data = bytearray(seg.read_bytes())
    data[where] ^= 0x40
    seg.write_bytes(bytes(data))
    with pytest.raises(Corrupt):
        read_journal(str(tmp_path))
    with pytest.raises(JournalCorruption):
        list(Journal(tmp_path, readonly=True).read())
    with pytest.raises(ValueError, match="corrupt journal record"):
        spark_source_rows(tmp_path)
