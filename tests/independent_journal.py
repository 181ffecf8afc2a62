"""A journal reader written from docs/journal-format.md alone: it shares no code or
constant with protocol/journal.py, runtime/storage/journal_store.py or the Spark source, so the
tests can hold each of them against it."""

import binascii
import os


class Corrupt(Exception):
    pass


def _u(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


def read_journal(directory: str) -> list[tuple[int, int, bytes]]:
    """Every record (seq, term, message) in order. An incomplete record at the very end of
    the last segment is a write in progress: ignored. Anything else that fails is Corrupt."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".seg"))
    out = []
    expect = None
    for k, name in enumerate(names):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        last = k == len(names) - 1
        first = int(name[:-4])
        if len(data) < 32:
            if last:
                break  # a segment whose header was never fully written
            raise Corrupt(f"{name}: short header")
        if data[0:8] != b"TAPEJNL1" or _u(data[8:10]) != 1 or _u(data[22:30]) != first:
            raise Corrupt(f"{name}: bad header")
        if expect is not None and first != expect:
            raise Corrupt(f"{name}: starts at {first}, {expect} expected")
        expect = first
        pos = 32
        while pos < len(data):
            if len(data) - pos < 24 or len(data) - pos < 24 + _u(data[pos + 4:pos + 8]):
                if last:
                    break  # the incomplete final record
                raise Corrupt(f"{name}: incomplete record at {pos}")
            length = _u(data[pos + 4:pos + 8])
            end = pos + 24 + length
            if binascii.crc32(data[pos + 4:end]) != _u(data[pos:pos + 4]):
                raise Corrupt(f"{name}: CRC at offset {pos}")
            seq, term = _u(data[pos + 8:pos + 16]), _u(data[pos + 16:pos + 24])
            if seq != expect:
                raise Corrupt(f"{name}: seq {seq} at offset {pos}, {expect} expected")
            out.append((seq, term, data[pos + 24:end]))
            expect += 1
            pos = end
    return out
