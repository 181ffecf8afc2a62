"""Disk faults for the drills and the tests: a small file system to fill, a byte flipped
under a journal record's CRC, a snapshot altered behind its checksum. Each does to real
files what a failing disk does; none reaches into a process."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import lmdb

from tape.protocol import journal as fmt
from tape.replicas.audit_core import PACKED_BOOK
from tape.runtime.storage.journal_store import iter_segment_file

FILL_CHUNK = 1 << 20


class FaultUnavailable(Exception):
    """This machine cannot inject the fault (mounting needs root)."""


def mount_tmpfs(path: Path, size: str) -> None:
    """A tmpfs of `size` ("256m") at `path`, which must exist and be empty."""
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise FaultUnavailable(f"cannot mount a tmpfs at {path} (needs root): {done.stderr.strip()}")


def unmount_keeping(path: Path) -> None:
    """Unmount the tmpfs at `path`, leaving a copy of what it held in its place."""
    with tempfile.TemporaryDirectory(dir=path.parent) as keep:
        copy = Path(keep) / "copy"
        shutil.copytree(path, copy, symlinks=True)
        subprocess.run(["umount", "-l", str(path)], check=True)
        shutil.copytree(copy, path, symlinks=True, dirs_exist_ok=True)


def fill(filler: Path) -> None:
    """Write `filler` until its file system refuses: every block taken."""
    chunk = bytes(FILL_CHUNK)
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
        while True:  # (unbuffered: the last, partial write leaves nothing for close to refuse)
            f.write(chunk)


def flip_record_byte(segment: Path) -> tuple[int, int]:
    """Flip one bit of the message of the record in the middle of `segment` (under its CRC):
    returns (seq, offset of the record)."""
    first = int(segment.stem)
    records = list(iter_segment_file(segment, fmt.SEGMENT_HEADER_SIZE, first, sealed=False))
    seq, _, _, offset = records[len(records) // 2]
    with open(segment, "r+b") as f:
        f.seek(offset + fmt.RECORD_HEADER_SIZE + 20)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    return seq, offset


def alter_books(lmdb_dir: Path, every: int = 2) -> int:
    """Change a byte of every `every`-th book in a replica's snapshot, leaving the LMDB valid and
    its checksum as it was (a disk or a bug that changed data under the file system): returns
    how many."""
    env = lmdb.open(str(lmdb_dir), max_dbs=4, subdir=True)
    altered = 0
    try:
        books = env.open_db(b"books")
        with env.begin(write=True) as txn:
            buckets = [(bytes(k), bytearray(v)) for k, v in txn.cursor(db=books)]
            seen = 0
            for key, value in buckets:  # each the (id, record) pairs of its books (replicas/snapshot.py)
                for at in range(0, len(value), PACKED_BOOK):
                    if seen % every == 0:
                        value[at + 8 + 7] ^= 0x01  # the low byte of the book's requested quantity
                        altered += 1
                    seen += 1
                txn.put(key, bytes(value), db=books)
    finally:
        env.close()
    return altered
