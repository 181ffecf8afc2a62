"""A full disk is a state to wait out, not a crash.

A write that fails for want of space (ENOSPC, or a quota's EDQUOT) is undone by
the writer (the journal cuts its file back; the vote's temporary file is
removed) and raised as DiskFull: nothing is counted as written, and no reply
that depends on it is sent. The voter then stops taking appends and votes and its
shell tells its node core the free space every DISK_CHECK_EVERY_S, until there is
FREE_SPACE.resume (runtime/tuning.py; protocol/voter_node.py on_free_space decides), so
that it does not flap on the last few blocks.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(Exception):
    """A write refused for want of space, already undone. Not an OSError on purpose: the
    handlers of network errors must not swallow it."""

    def __init__(self, path: Path, what: str):
        self.path = Path(path)
        super().__init__(f"disk full: {what} {path} failed (no space left on the device)")


def no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
