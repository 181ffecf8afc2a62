"""Failover drills against real processes (issue 5), at a reduced rate and
duration: kill -9 the leader, and SIGSTOP/SIGCONT it."""

import json
import subprocess

import pytest
from conftest import TAPE

pytestmark = pytest.mark.process


@pytest.mark.parametrize("drill", ["kill-leader", "pause-leader"])
def test_the_leader_drills_pass_and_print_the_failover_time(tmp_path, drill):
    out = subprocess.run(TAPE + ["drill", drill, "--rate", "5000", "--duration", "5", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "pass" and report["drill"] == drill
    assert report["sequenced"] == 25_000 and report["duplicates"] == 0
    assert report["new_leader"] != report["old_leader"]
    assert 0 < report["failover_ms"] < 5000
    assert "failover" in out.stdout and f"{report['failover_ms']:.0f} ms" in out.stdout
    if drill == "pause-leader":
        assert report["checks"]["old leader published nothing in the new term"]
        assert report["checks"]["old leader stepped down and follows"]
