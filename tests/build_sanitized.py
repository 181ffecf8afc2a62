"""Build every C extension with AddressSanitizer and UndefinedBehaviorSanitizer into a copy of the
package at `build/sanitize/tape` (make test-sanitize runs the C's tests against it, with the
sanitizers' runtime preloaded into Python). Not optional here: an extension that fails to build
fails this."""

import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "runtime", "sequencer", "rewinder", "replicas", "ops")
FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, out / "tape" / package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    extensions = runpy.run_path(str(ROOT / "setup.py"), run_name="extensions")["EXTENSIONS"]
    for e in extensions:
        e.sources = [f"tape/{s}" for s in e.sources]
        e.depends = [f"tape/{s}" for s in e.depends]
        e.optional = False
        e.extra_compile_args = FLAGS.split()
        e.extra_link_args = ["-fsanitize=address,undefined"]
    os.chdir(out)
    setup(script_args=["-q", "build_ext", "--inplace"], ext_modules=extensions)
    built = sorted(p.relative_to(out) for p in (out / "tape").rglob("_*.so"))
    assert len(built) == len(extensions), built
    print("built with the sanitizers:", ", ".join(map(str, built)))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
