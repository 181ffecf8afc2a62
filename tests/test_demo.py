"""`tape demo` (what `make demo` runs) as a real process, with loss."""

import json
import subprocess

import pytest

from conftest import TAPE

pytestmark = pytest.mark.process


def test_demo_passes_under_loss_and_keeps_its_journal(tmp_path):
    out = subprocess.run(TAPE + ["demo", "--messages", "30000", "--drop", "0.05", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "identical to the journal" in out.stdout
    gaps = next(line for line in out.stdout.splitlines() if "gaps detected" in line)
    assert int(gaps.split("│")[2].split("/")[0].replace(",", "")) > 0  # loss happened and was repaired
    dump = subprocess.run(TAPE + ["journal", "dump", str(tmp_path / "journal"), "--from", "29999"],
                          capture_output=True, text=True, check=True)
    assert [json.loads(line)["seq"] for line in dump.stdout.splitlines()] == [29999, 30000]
