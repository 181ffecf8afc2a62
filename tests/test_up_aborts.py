"""`tape up` and the drills stop at once, saying why, when the run cannot go on: a node
that exits unbidden (a port taken at start-up, a crash) is named; a run that outlives its
deadline is failed; and when `tape up` itself is killed, its nodes die with it (a test's
timeout must not leave a cluster running). Real processes; the faults are planted by a
`sitecustomize` module the test writes, chosen by a word of the process's command line."""

import os
import signal
import subprocess

import pytest
from conftest import TAPE, wait_for

pytestmark = pytest.mark.process

PLANT = '''
import os, threading, time
spec = os.environ.get("TAPE_TEST_PLANT", "")  # "<word of the command line>:exit" or ":hang"
if spec:
    word, what = spec.split(":")
    if word.encode() in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
        if what == "exit":
            threading.Timer(4.0, os._exit, (3,)).start()
        elif what == "shares":  # a leader that adds a share to every purchase it stamps
            from tape.protocol import messages as M
            original = M.stamp_blocks
            def more(r):
                kind, order, shares, *rest = M.INBOUND.unpack(r[:M.INBOUND_SIZE])
                return M.INBOUND.pack(kind, order, shares + 1, *rest) + r[M.INBOUND_SIZE:]
            M.stamp_blocks = lambda *a: [more(r) if r[0] == M.PURCHASE else r for r in original(*a)]
        else:
            while True:
                time.sleep(1)
'''


@pytest.fixture
def plant(tmp_path, monkeypatch):
    """Set TAPE_TEST_PLANT for the processes this test starts (it reaches every node through the environment)."""
    d = tmp_path / "plant"
    d.mkdir()
    (d / "sitecustomize.py").write_text(PLANT)
    monkeypatch.setenv("PYTHONPATH", str(d))
    return lambda spec: monkeypatch.setenv("TAPE_TEST_PLANT", spec)


def test_a_node_that_exits_unbidden_aborts_the_run_naming_it(tmp_path, plant):
    plant("rw-2:exit")  # 3 of 4 voters are still a majority: without the check the run would pass
    out = subprocess.run(TAPE + ["up", "--rate", "1000", "--duration", "10", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stdout[-3000:]
    import json
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["verdict"] == "fail" and report["aborted"].startswith("rw-2 exited with 3"), report
    assert "run aborted: rw-2 exited with 3" in out.stdout


def test_a_run_that_outlives_its_deadline_fails(tmp_path, plant):
    from tape.ops.verification.up import run_up

    plant("load:hang")  # the load generator never submits, so the load never finishes
    report = run_up(1000, 1.0, 0.0, str(tmp_path / "run"), 1, slack_s=2.0)
    assert report["verdict"] == "fail", report
    assert report["aborted"].startswith("still waiting for the load to finish"), report


def test_a_sequencer_that_alters_shares_fails_the_verdict_on_content_alone(tmp_path, plant):
    """Behind the test's plant, every sequencer adds a share to each purchase it stamps: the log
    agrees with itself, the replicas and the alerts follow it, so only the comparison of each
    sequenced trade with what its client submitted can see it."""
    from tape.ops.verification.up import run_up

    plant("sequencer:shares")
    report = run_up(2000, 2.0, 0.0, str(tmp_path / "run"), 1)
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert failed == ["content: each trade as its client submitted it"], report["checks"]
    assert report["altered_trades"] and "purchase" in report["altered_trades"][0], report["altered_trades"][:2]


def test_the_nodes_die_with_tape_up(tmp_path):
    proc = subprocess.Popen(TAPE + ["up", "--rate", "500", "--duration", "60", "--out", str(tmp_path / "run")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children_file = f"/proc/{proc.pid}/task/{proc.pid}/children"
    try:
        children = wait_for(lambda: (c := open(children_file).read().split()) and len(c) >= 9 and c,
                            "tape up to start 8 nodes and the load generator", timeout=90)
    finally:
        proc.kill()
        proc.wait()
    alive = lambda: [p for p in children if os.path.exists(f"/proc/{p}") and "Z" not in state(p)]  # noqa: E731
    try:
        wait_for(lambda: not alive(), "the nodes to die with tape up", timeout=20)
    finally:
        for p in alive():
            os.kill(int(p), signal.SIGKILL)


def state(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
