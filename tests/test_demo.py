"""`tape demo` (what `make demo` runs) as a real process, with loss."""

import json
import subprocess

import pytest
from conftest import TAPE

pytestmark = pytest.mark.process


def test_demo_passes_under_loss_and_keeps_its_data(tmp_path):
    out = subprocess.run(TAPE + ["demo", "--messages", "20000", "--rate", "20000", "--drop", "0.05",
                                 "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "FAIL" not in out.stdout
    resends = next(line for line in out.stdout.splitlines() if "client resends" in line)
    assert int(resends.split("│")[2].replace(",", "")) > 0  # loss happened and was repaired
    dump = subprocess.run(TAPE + ["journal", "dump", str(tmp_path / "data" / "rw-2" / "journal"), "--from", "20000"],
                          capture_output=True, text=True, check=True)
    assert [json.loads(line)["seq"] for line in dump.stdout.splitlines()][:2] == [20000, 20001]
