"""Fail-stop (issue 12): a core that finds its own state impossible stops its
process with exit 4 and one CRITICAL line, wherever in the shell it surfaces:
the leader's election task, a voter's connection handler, a replica's
delivery callback, the emitter's connection handler. Real processes; the
impossibility is planted by a `sitecustomize` module the test writes (the
code under test has no hook for it)."""

from pathlib import Path

import pytest

from tape.ops.verification.local import LocalCluster

pytestmark = pytest.mark.process

PLANT = '''
import os
spec = os.environ.get("TAPE_TEST_IMPOSSIBLE")
if spec:
    import importlib
    from tape.protocol.errors import InvariantViolation
    module, attr = spec.split(":")
    cls_name, method = attr.split(".")
    cls = getattr(importlib.import_module(module), cls_name)

    def impossible(self, *args, **kwargs):
        raise InvariantViolation(f"planted by the test in {cls_name}.{method}")

    setattr(cls, method, impossible)
'''


def wait_exit(proc, timeout: float = 30.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except Exception:
        raise AssertionError(f"the process did not stop within {timeout} s") from None


@pytest.mark.parametrize("node, where", [
    ("seq-a", "tape.sequencer.leader_core:LeaderCore.on_journaled"),  # raised in the election task, on taking office
    ("rw-1", "tape.protocol.follower:FollowerCore.on_append"),  # raised in the voter's connection handler
    ("replica-A", "tape.replicas.audit_core:AuditMachine.apply_runs"),  # raised in the stream's reader callback
    ("emitter", "tape.replicas.emitter_core:EmitterCore.on_alerts"),  # raised in the alert link's connection handler
])
def test_an_impossible_state_stops_the_process_with_exit_4(tmp_path, node, where):
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT)
    cluster = LocalCluster(tmp_path, replicas=1, sequencers=1, rewinders=1)
    cluster.planted = ("planted by the test", r"Traceback \(most recent call last\)")  # (its trace, as it must)
    env = {"PYTHONPATH": str(plant), "TAPE_TEST_IMPOSSIBLE": where}
    try:
        for n in ("rw-1", "seq-a", "emitter", "replica-A"):
            # the planted node may stop before it serves metrics (a replica applies the term start at once)
            cluster.start_node(n, env=env if n == node else None, wait=n != node)
        if node in ("replica-A", "emitter"):  # these need trades to reach the impossible point
            load = cluster.start("load", "load", "--rate", "2000", "--messages", "2000", "--overfill", "1.0")
        code = wait_exit(cluster.procs[node])
        log = cluster.logs[node].read_text()
        assert code == 4, log[-3000:]
        critical = [line for line in log.splitlines() if " CRITICAL " in line]
        assert len(critical) == 1 and "planted by the test" in critical[0], log[-3000:]
        for other in cluster.procs:
            if other not in (node, "load"):
                assert cluster.alive(other), f"{other} stopped too"
        if node in ("replica-A", "emitter"):
            load.kill()
    finally:
        cluster.close()


def test_an_unreadable_election_state_stops_the_voter_at_start_with_exit_4(tmp_path):
    """Loaded before the process runs, still the one fail-stop path: one CRITICAL line, exit 4
    (systemd does not restart it), no traceback; the other voters go on."""
    cluster = LocalCluster(tmp_path, replicas=1, sequencers=1, rewinders=1)
    cluster.planted = ("unreadable election state",)
    try:
        cluster.start_node("rw-1")
        election = Path(cluster.cfg.node("seq-a").data) / "election.json"
        election.parent.mkdir(parents=True, exist_ok=True)
        election.write_text('{"term": "three"}')
        cluster.start_node("seq-a", wait=False)
        code = wait_exit(cluster.procs["seq-a"])
        log = cluster.logs["seq-a"].read_text()
        critical = [line for line in log.splitlines() if " CRITICAL " in line]
        assert code == 4 and len(critical) == 1 and "unreadable election state" in critical[0], log[-3000:]
        assert "Traceback" not in log and cluster.alive("rw-1")
    finally:
        cluster.close()
