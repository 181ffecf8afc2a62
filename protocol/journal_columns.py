"""Journal records decoded into columns, for columnar readers (Spark's Arrow
batches, Parquet export). Pure: bytes in, column lists out.

Every record has the same size (24-byte header + one 75-byte message), so a
chunk is unpacked with one `iter_unpack` call; each record's CRC, length and
seq are still checked. A record that fails either raises (mode "fail") or,
in mode "skip", is skipped up to the next record that checks out (found by
trying every later byte offset), and reported as a `Corrupt` stretch.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from tape.protocol import journal as fmt
from tape.protocol import messages as M

RECORD_SIZE = fmt.RECORD_HEADER_SIZE + M.SEQUENCED_SIZE
_RECORD = struct.Struct(">IIQQ" + M.SEQUENCED.format.lstrip(">!"))
_TRADES = (M.REQUEST, M.PURCHASE)
COLUMNS = ("seq", "term", "type", "stamp_ns", "origin", "client_seq", "order_id", "purchase_id", "shares", "client",
           "stock", "leader")


class Corrupt(NamedTuple):
    offset: int  # in the segment file
    expected_seq: int
    skipped_bytes: int
    problem: str

    def describe(self, segment: str) -> str:
        return (f"{segment} offset {self.offset}: {self.problem}; {self.skipped_bytes} bytes skipped "
                f"where seq {self.expected_seq} was expected")


class ChunkResult(NamedTuple):
    rows: list  # unpacked records: (crc, length, seq, term, *message fields)
    consumed: int  # bytes of the chunk used; the rest starts an incomplete record
    corrupt: list  # [Corrupt]
    next_seq: int


class CorruptRecord(Exception):
    def __init__(self, offset: int, expected_seq: int, problem: str):
        super().__init__(f"offset {offset}: {problem} (seq {expected_seq} expected)")
        self.offset, self.expected_seq, self.problem = offset, expected_seq, problem


def decode_chunk(data: bytes, base: int, expect_seq: int, skip: bool, final: bool) -> ChunkResult:
    """Whole records of `data` (the file's bytes from offset `base`). With
    `final`, the data ends the file, and a trailing partial record counts as
    corrupt rather than waiting for more bytes."""
    view = memoryview(data)
    crc32 = zlib.crc32
    rows, corrupt = [], []
    pos = 0
    end = len(data)
    while end - pos >= RECORD_SIZE:
        n = (end - pos) // RECORD_SIZE
        batch = list(_RECORD.iter_unpack(view[pos:pos + n * RECORD_SIZE]))
        bad = None
        for i, r in enumerate(batch):
            at = pos + i * RECORD_SIZE
            if r[1] != M.SEQUENCED_SIZE:
                bad = (i, f"record length {r[1]}, not {M.SEQUENCED_SIZE}")
            elif r[2] != expect_seq + i:
                bad = (i, f"seq {r[2]} where {expect_seq + i} was expected")
            elif crc32(view[at + 4:at + RECORD_SIZE]) != r[0]:
                bad = (i, "CRC mismatch")
            if bad:
                break
        good = batch if bad is None else batch[:bad[0]]
        rows.extend(good)
        expect_seq += len(good)
        pos += len(good) * RECORD_SIZE
        if bad is None:
            continue
        if not skip:
            raise CorruptRecord(base + pos, expect_seq, bad[1])
        resume = _next_good_record(view, pos + 1)
        if resume is None and not final:
            return ChunkResult(rows, pos, corrupt, expect_seq)  # decide once more bytes are here
        stop = end if resume is None else resume
        corrupt.append(Corrupt(base + pos, expect_seq, stop - pos, bad[1]))
        pos = stop
        if resume is not None:
            expect_seq = _RECORD.unpack_from(view, pos)[2]
    if final and pos < end:
        problem = f"incomplete record at the end ({end - pos} bytes)"
        if not skip:
            raise CorruptRecord(base + pos, expect_seq, problem)
        corrupt.append(Corrupt(base + pos, expect_seq, end - pos, problem))
        pos = end
    return ChunkResult(rows, pos, corrupt, expect_seq)


def _next_good_record(view: memoryview, start: int) -> int | None:
    """The first offset >= start where a whole record with a good CRC and length begins."""
    for q in range(start, len(view) - RECORD_SIZE + 1):
        crc, length = struct.unpack_from(">II", view, q)
        if length == M.SEQUENCED_SIZE and zlib.crc32(view[q + 4:q + RECORD_SIZE]) == crc:
            return q
    return None


def to_columns(rows: list) -> dict:
    """Rows from decode_chunk as {column: list}, None where a message type has no such field."""
    h = 4  # the record header's fields come first
    t, o, p, s, c, k = h + M.TYPE, h + M.ORDER_ID, h + M.PURCHASE_ID, h + M.SHARES, h + M.CLIENT, h + M.STOCK
    names = M.TYPE_NAMES
    trade = [r[t] in _TRADES for r in rows]
    text = _text
    return {
        "seq": [r[2] for r in rows],
        "term": [r[3] for r in rows],
        "type": [names.get(r[t], "unknown") for r in rows],
        "stamp_ns": [r[h + M.STAMP] for r in rows],
        "origin": [text(r[h + M.ORIGIN]) for r in rows],
        "client_seq": [r[h + M.CLIENT_SEQ] if r[t] != M.AUTH else None for r in rows],  # a seal's: its listener tag
        "order_id": [r[o] if tr else None for r, tr in zip(rows, trade)],
        "purchase_id": [r[p] if r[t] == M.PURCHASE else None for r in rows],
        "shares": [r[s] if tr else None for r, tr in zip(rows, trade)],
        "client": [text(r[c]) if tr else None for r, tr in zip(rows, trade)],
        "stock": [text(r[k]) if tr else None for r, tr in zip(rows, trade)],
        "leader": [text(r[h + M.LEADER]) if r[t] == M.TERM_START else None for r in rows],
    }


def _text(raw: bytes) -> str:
    return raw.decode("ascii", "replace").rstrip()
