"""Disk space reserved past a file's end without changing its size (Linux `fallocate` with
FALLOC_FL_KEEP_SIZE; Python has no call for it). A journal reserves the space its next appends
will take, so that their `fdatasync` need not also write the block allocation each time
(measured on this project's ext4: docs/performance.md). Readers see the same
file: its size is its data, and `os.ftruncate(fd, size)` gives the reserve back."""

from __future__ import annotations

import ctypes
import os

FALLOC_FL_KEEP_SIZE = 0x01


def _libc_fallocate():
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not glibc or musl on Linux
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


_fallocate = _libc_fallocate()


def reserve(fd: int, offset: int, length: int) -> bool:
    """Reserve `length` bytes from `offset` in the open file `fd`, its size unchanged. False when
    the file system cannot (no support, no space): a reserve is only ever an optimisation, and a
    write that finds no space still fails as it would have."""
    assert offset >= 0 and length > 0
    if _fallocate is None:
        return False
    return _fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) == 0


def release(fd: int) -> None:
    """Give back what was reserved past the file's end (its data untouched)."""
    os.ftruncate(fd, os.fstat(fd).st_size)
