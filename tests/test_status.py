"""`tape status` (issue 14) against a running cluster: every node's row from its metrics
endpoint, and an exit status a script can use."""

import json
import subprocess

import pytest
from conftest import TAPE, wait_for

from tape.ops.verification.local import LocalCluster

pytestmark = pytest.mark.process


def status(cluster: LocalCluster, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(TAPE + ["status", "--config", str(cluster.config_path), *extra], capture_output=True,
                          text=True, timeout=60)


def test_status_shows_every_node_and_fails_when_one_is_gone_or_no_one_leads(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=3, sequencers=2)
    try:
        cluster.start_all()
        load = cluster.start("load", "load", "--rate", "4000", "--messages", "10000", "--seed", "2")
        assert load.wait(timeout=120) == 0, cluster.output("load")
        got = status(cluster, "--json")
        assert got.returncode == 0, got.stdout
        report = json.loads(got.stdout)
        rows = {r["node"]: r for r in report["nodes"]}
        assert set(rows) == {n.name for n in cluster.cfg.nodes} and all(r["up"] for r in rows.values())
        assert report["leader"] in ("seq-a", "seq-b") and report["problems"] == []
        leader = rows[report["leader"]]
        assert leader["committed"] >= 10_000 and leader["term"] >= 1 and leader["leader"] == 1
        wait_for(lambda: all(r["applied"] >= 10_000 for r in json.loads(status(cluster, "--json").stdout)["nodes"]
                             if r["role"] == "replica"), "the replicas to apply the 10,000 trades")
        rows = {r["node"]: r for r in json.loads(status(cluster, "--json").stdout)["nodes"]}
        assert all(rows[r]["applied"] >= 10_000 and "digest" in rows[r] for r in ("replica-A", "replica-B"))
        assert rows["emitter"]["delivered"] > 0 and rows["rw-1"]["journal"] >= 10_000
        table = status(cluster)
        assert table.returncode == 0 and "cluster ok" in table.stdout and "replica-C" in table.stdout
        cluster.kill("rw-2")
        gone = status(cluster, "--json")
        assert gone.returncode == 1 and json.loads(gone.stdout)["problems"][0].startswith("rw-2 (127.0.0.1:")
        for s in ("seq-a", "seq-b"):
            cluster.kill(s)
        headless = json.loads(status(cluster, "--json").stdout)
        assert "no sequencer leads" in headless["problems"] and headless["leader"] is None
    finally:
        cluster.close()
