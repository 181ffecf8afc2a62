"""Journal byte format: segment header and records. Pure, no I/O.

Segment file `<first seq, 20 digits>.seg`:

    header (32 bytes): magic "TAPEJNL1", version u16 = 1, flags u16 = 0,
                       session 10 ASCII, first_seq u64, 2 bytes zero
    records:           crc u32, length u32, seq u64, term u64, message

The CRC is CRC-32 (zlib / IEEE 802.3, as java.util.zip.CRC32) over every
byte of the record after the CRC field: length, seq, term and message.
All integers are big-endian. Seqs are contiguous within and across segments.
"""

from __future__ import annotations

import struct
import zlib
from itertools import accumulate, repeat
from typing import NamedTuple

MAGIC = b"TAPEJNL1"
VERSION = 1
SEGMENT_HEADER = struct.Struct(">8sHH10sQ2x")
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size  # 32
RECORD_HEADER = struct.Struct(">IIQQ")
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 24
_BODY_HEADER = struct.Struct(">IQQ")  # length, seq, term: what the CRC covers first
MAX_MESSAGE = 0xFFFF
SEGMENT_SUFFIX = ".seg"
INDEX_SUFFIX = ".idx"
INDEX_ENTRY = struct.Struct(">QQ")  # seq, byte offset of its record


class FormatError(Exception):
    pass


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def encode_segment_header(session: bytes, first_seq: int) -> bytes:
    return SEGMENT_HEADER.pack(MAGIC, VERSION, 0, session, first_seq)


def decode_segment_header(data: bytes) -> tuple[bytes, int]:
    """(session, first_seq); raises FormatError if not a Tape segment."""
    if len(data) < SEGMENT_HEADER_SIZE:
        raise FormatError(f"segment header is {len(data)} bytes, needs {SEGMENT_HEADER_SIZE}")
    magic, version, _flags, session, first_seq = SEGMENT_HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FormatError(f"unsupported journal version {version}")
    return session, first_seq


def encode_record(seq: int, term: int, message: bytes) -> bytes:
    body = _BODY_HEADER.pack(len(message), seq, term) + message
    return struct.pack(">I", zlib.crc32(body)) + body


def encode_records_pure(records, crc32=zlib.crc32, pack_body=_BODY_HEADER.pack,
                        pack_crc=struct.Struct(">I").pack) -> bytes:
    """Many (seq, term, message) records as one contiguous buffer. The definition of
    `encode_records`, which is this in C (`_speedups.c`) where Tape was built with a compiler."""
    parts = []
    append = parts.append
    for seq, term, message in records:
        if len(message) > MAX_MESSAGE:
            raise ValueError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        body = pack_body(len(message), seq, term) + message
        append(pack_crc(crc32(body)) + body)
    return b"".join(parts)


def record_offsets_pure(records, start: int, every: int) -> list[int]:
    """The offset in encode_records(records) of records start, start + every, ... (a journal
    segment's sparse index). The definition of `record_offsets`, in C where built."""
    if start < 0 or every < 1:
        raise ValueError("record_offsets needs start >= 0 and every >= 1")
    before = list(accumulate((RECORD_HEADER_SIZE + len(message) for _, _, message in records), initial=0))
    return before[start:len(records):every]


def encode_run_pure(first_seq: int, term: int, messages, size: int) -> bytes:
    """encode_records of the records (first_seq + i, term, message i), message i being
    messages[i * size:(i + 1) * size]. The definition of `encode_run`, in C where built."""
    if not 1 <= size <= MAX_MESSAGE or len(messages) % size:
        raise ValueError(f"encode_run: {len(messages)} bytes are not whole messages of {size}")
    return encode_records_pure(RecordRun(first_seq, term, messages, size))


try:
    from tape.protocol._speedups import encode_records, encode_run, record_offsets, scan_good
except ImportError:  # installed without a C compiler: the same bytes, several times slower
    encode_records, encode_run, record_offsets = encode_records_pure, encode_run_pure, record_offsets_pure
    scan_good = None


class RecordRun:
    """Records of consecutive seqs and one term whose messages are one size, held as the
    messages back to back: an append as it arrives, journaled and noted without a Python
    object per record. Reads as the list of (seq, term, message) it stands for."""

    __slots__ = ("first_seq", "term", "messages", "size", "count")

    def __init__(self, first_seq: int, term: int, messages: bytes, size: int):
        assert size > 0 and len(messages) % size == 0, "a run holds whole messages"
        self.first_seq, self.term, self.messages, self.size = first_seq, term, messages, size
        self.count = len(messages) // size  # asked for several times an append

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        size, blob = self.size, self.messages
        return zip(range(self.first_seq, self.first_seq + len(self)), repeat(self.term),
                   (blob[at:at + size] for at in range(0, len(blob), size)))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = self.count
        if not -n <= i < n:
            raise IndexError("record run index out of range")
        i %= n
        return self.first_seq + i, self.term, self.messages[i * self.size:(i + 1) * self.size]

    def __eq__(self, other) -> bool:
        return isinstance(other, (RecordRun, list)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RecordRun(seqs {self.first_seq}..{self.first_seq + len(self) - 1}, term {self.term})"

    def encoded(self) -> bytes:
        """encode_records(self)."""
        return encode_run(self.first_seq, self.term, self.messages, self.size)

    def offsets(self, start: int, every: int) -> list[int]:
        """record_offsets(self, start, every): records of one size need no sum."""
        step = RECORD_HEADER_SIZE + self.size
        return list(range(start * step, len(self) * step, every * step))


class ScanResult(NamedTuple):
    records: list  # [(seq, term, message bytes, offset)]
    end: int  # offset just past the last good record
    problem: str | None  # None, or why scanning stopped before the data ended
    incomplete: bool = False  # the problem is only that the data ends mid-record


def scan(data, pos: int, expect_seq: int | None, limit: int | None = None) -> ScanResult:
    """Parse records from `pos` until the data ends, a record fails, or
    `limit` records were read. A record fails if incomplete, if its CRC does
    not match, or if its seq is not the one expected. Where Tape was built with
    a compiler the good records are read in C (`scan_good`, ~3.6× faster here), and
    `scan_pure` goes on from where it stopped: it alone decides every refusal."""
    if scan_good is None or (expect_seq is not None and expect_seq >= 1 << 62):
        return scan_pure(data, pos, expect_seq, limit)
    good, pos = scan_good(data, pos, -1 if expect_seq is None else expect_seq, -1 if limit is None else limit)
    if not good:
        return scan_pure(data, pos, expect_seq, limit)
    rest = scan_pure(data, pos, good[-1][0] + 1, None if limit is None else limit - len(good))
    return rest._replace(records=good + rest.records)


def scan_pure(data, pos: int, expect_seq: int | None, limit: int | None = None) -> ScanResult:
    """The definition of `scan`, record by record."""
    end = len(data)
    out = []
    unpack = RECORD_HEADER.unpack_from
    crc32 = zlib.crc32
    view = memoryview(data)
    while pos < end:
        if limit is not None and len(out) >= limit:
            return ScanResult(out, pos, None)
        if end - pos < RECORD_HEADER_SIZE:
            return ScanResult(out, pos, f"incomplete record header ({end - pos} bytes)", True)
        crc, length, seq, term = unpack(data, pos)
        stop = pos + RECORD_HEADER_SIZE + length
        if length > MAX_MESSAGE:
            return ScanResult(out, pos, f"record length {length} exceeds {MAX_MESSAGE}")
        if stop > end:
            return ScanResult(out, pos, f"incomplete record: needs {stop - pos} bytes, {end - pos} remain", True)
        if crc32(view[pos + 4:stop]) != crc:
            return ScanResult(out, pos, "CRC mismatch")
        if expect_seq is not None and seq != expect_seq:
            return ScanResult(out, pos, f"seq {seq} where {expect_seq} was expected")
        out.append((seq, term, bytes(view[pos + RECORD_HEADER_SIZE:stop]), pos))
        pos = stop
        expect_seq = seq + 1
    return ScanResult(out, pos, None)


def is_torn_tail(data, pos: int, expect_seq: int) -> bool:
    """After a failure at `pos`, is the rest of the data a torn final write
    (safe to truncate) rather than corruption with good records after it?

    Torn: the rest is all zeros, or it is shorter than one maximal record
    and no valid later record starts anywhere in it."""
    rest = memoryview(data)[pos:]
    if not any(rest):
        return True
    if len(rest) > RECORD_HEADER_SIZE + MAX_MESSAGE:
        return False
    for q in range(1, len(rest) - RECORD_HEADER_SIZE + 1):
        _, length, seq, _ = RECORD_HEADER.unpack_from(rest, q)
        if expect_seq < seq <= expect_seq + len(rest) and q + RECORD_HEADER_SIZE + length <= len(rest):
            if scan(rest, q, seq, limit=1).records:
                return False
    return True
