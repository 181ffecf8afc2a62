"""The C extensions, hidden with TAPE_PURE=1 so that each part runs its pure-Python twin.

An import of a compiled module (`tape.protocol._speedups`, `tape.replicas._audit`,
`tape.replicas._alertlines`, `tape.replicas._snapshot`, `tape.runtime._mmsg`) then raises ImportError, as where Tape was
built without a compiler; every importer already falls back on that (`make test-pure`). Installed
by the packages that own an extension, before any of their modules is imported. Not a core: it
reads the environment once, to choose which implementation loads, and decides nothing else.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

COMPILED = frozenset({"tape.protocol._speedups", "tape.replicas._audit", "tape.replicas._alertlines",
                      "tape.replicas._snapshot", "tape.runtime._mmsg"})
PURE = os.environ.get("TAPE_PURE", "") not in ("", "0")


class _HideCompiled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in COMPILED:
            raise ImportError(f"{name} hidden: TAPE_PURE is set", name=name)
        return None


def install() -> None:
    if PURE and not any(isinstance(f, _HideCompiled) for f in sys.meta_path):
        sys.meta_path.insert(0, _HideCompiled())


install()


def missing() -> list[str]:
    """The compiled modules that do not load here (none built: no C compiler at install; or hidden)."""
    import importlib

    out = []
    for name in sorted(COMPILED):
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out
