"""A voter's disk lost (issue 15), with real processes: the wiped voter recovers its
election state from every other voter before it votes or follows, then catches up; what
was committed survives."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import wait_for

from tape.ops.journal_tool import digest as journal_digest
from tape.ops.local import TAPE, LocalCluster
from tape.protocol.election import VOTE_LOST

pytestmark = pytest.mark.process
TOTAL = 24_000


def gauge(cluster: LocalCluster, node: str, name: str) -> float:
    role = cluster.cfg.node(node).role
    return cluster.metrics(node)[f'tape_{role}_{name}{{node="{node}"}}']


def replace(cluster: LocalCluster, node: str) -> subprocess.CompletedProcess:
    """The runbook's procedure for a voter whose disk failed: `tape node replace NAME`."""
    return subprocess.run([*TAPE, "node", "replace", node, "--config", str(cluster.config_path)],
                          capture_output=True, text=True, timeout=60)


def test_a_wiped_rewinder_waits_for_every_voter_then_rejoins(tmp_path):
    cluster = LocalCluster(tmp_path, sequencers=2, extra="[timeouts]\nclient_resend_ms = 100\n")
    try:
        cluster.start_all()
        load = cluster.start("load", "load", "--rate", "3000", "--messages", str(TOTAL), "--seed", "5")
        wait_for(lambda: gauge(cluster, "seq-a", "commit_seq") >= 3000, "3,000 trades committed")
        cluster.kill("seq-b")  # a voter down: the replaced one cannot hear all
        refused = replace(cluster, "rw-1")
        assert refused.returncode == 1 and "stop it first" in refused.stdout  # never under a running node
        cluster.kill("rw-1")
        done = replace(cluster, "rw-1")
        assert done.returncode == 0 and "moved" in done.stdout, done.stdout + done.stderr
        old = Path(cluster.cfg.node("rw-1").data)
        assert not any(old.iterdir()) and list(old.parent.glob("rw-1.replaced-*/election.json"))  # kept aside
        cluster.restart("rw-1")
        wait_for(lambda: "recovering it from the other voters" in cluster.logs["rw-1"].read_text(),
                 "rw-1 to find its election state missing")
        assert gauge(cluster, "rw-1", "recovering") == 1  # seq-b is down: it cannot have heard every voter
        assert gauge(cluster, "rw-1", "last_seq") == 0  # nor followed anyone
        term = gauge(cluster, "seq-a", "term")
        cluster.restart("seq-b")
        wait_for(lambda: gauge(cluster, "rw-1", "recovering") == 0, "rw-1 to recover once seq-b is back")
        state = json.loads((Path(cluster.cfg.node("rw-1").data) / "election.json").read_text())
        assert state["term"] >= term and (state["voted_for"] == VOTE_LOST.decode() or state["term"] > term)
        assert load.wait(timeout=180) == 0, cluster.output("load")
        assert json.loads(cluster.output("load"))["acked"] == TOTAL
        leader = max(("seq-a", "seq-b"), key=lambda s: gauge(cluster, s, "leader"))
        last = gauge(cluster, leader, "sequenced_seq")
        wait_for(lambda: all(gauge(cluster, rw, "last_seq") >= last for rw in ("rw-1", "rw-2")),
                 f"both rewinders to hold seq {last}")
        voters = ("seq-a", "seq-b", "rw-1", "rw-2")
        for name in voters:
            assert cluster.stop(name) == 0
        digests = {n: journal_digest(Path(cluster.cfg.node(n).data) / "journal") for n in voters}
        assert len(set(digests.values())) == 1, digests
    finally:
        cluster.close()
