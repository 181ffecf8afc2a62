"""The install an operator makes on a node host (docs/runbook.md, step 4): the wheel built from the
checkout where no C compiler works, into a fresh virtual environment with constraints.txt and no
extras: the node processes' dependencies only, `tape --version` says the C speed-ups are off, and a
Spark command says which extra it needs (issue 62). Needs the package registry, as `make` does."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.process


def checkout_copy(dest: Path) -> Path:
    """The files git tracks, as they are in the working tree (no build/ of an earlier compile)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)


def test_the_wheel_installs_without_a_c_compiler_or_extras_and_says_the_speedups_are_off(tmp_path):
    src = checkout_copy(tmp_path / "src")
    built = run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", src,
                env={**os.environ, "CC": "/bin/false"})  # every compile fails: the optional extensions are skipped
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("tape-*.whl"))
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", venv).returncode == 0
    installed = run(venv / "bin" / "pip", "install", "-q", "-c", ROOT / "constraints.txt", wheel)
    assert installed.returncode == 0, installed.stderr[-3000:]
    missing = run(venv / "bin" / "python", "-c", "import importlib.util as u; "
                  "print([m for m in ('pyspark', 'pyarrow', 'matplotlib', 'pytest') if u.find_spec(m)])")
    assert missing.stdout.strip() == "[]"  # the base install: no Spark, plots or test tools on a node host
    version = run(venv / "bin" / "tape", "--version")
    assert version.returncode == 0 and "C speed-ups off for 5 of 5" in version.stdout, version.stderr
    audit = run(venv / "bin" / "tape", "audit", "--journal", tmp_path, "--alerts", tmp_path / "a.jsonl")
    assert audit.returncode == 2 and "needs pyspark, of the spark extra: pip install 'tape[spark]'" in audit.stderr
    assert "Traceback" not in audit.stderr
