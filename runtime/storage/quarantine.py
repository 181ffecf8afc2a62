"""Where damaged or replaced data goes: beside the original, named by what happened and when,
kept for a post-mortem and never deleted by Tape."""

from __future__ import annotations

import datetime
from pathlib import Path


def aside_path(path: Path, label: str) -> Path:
    """A free name `NAME.LABEL-<UTC time>` (with -2, -3, ... if taken) next to `path`."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    candidate = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{label}-{stamp}-{n}")
    return candidate
