"""The default topology over five hosts (issue 14): network namespaces on a bridge, one config
file for all (`tape config --hosts`), each process in its host's namespace, multicast
between hosts. Judged by the verdict of DESIGN.md section 9, as `tape up` is."""

import json
import os
import shutil
import subprocess

import pytest
from conftest import TAPE, wait_for

from tape.ops.verification.drill import LAN_DRILLS
from tape.ops.verification.lan import Lan, LanCluster
from tape.ops.verification.verdict import judge, read_run

pytestmark = pytest.mark.process
VOTERS = ("seq-a", "seq-b", "rw-1", "rw-2")
REPLICAS = ("replica-A", "replica-B", "replica-C")
TRADES = 12_000


def test_five_hosts_one_config_file_pass_the_verdict(tmp_path, lan):
    cluster = LanCluster(tmp_path, lan)
    try:
        checked = [subprocess.run(["ip", "netns", "exec", ns, *TAPE, "config", "check", str(cluster.config_path)],
                                  capture_output=True, text=True) for ns in lan.hosts]
        assert all(c.returncode == 0 for c in checked), [c.stdout for c in checked]
        assert all("config ok here" in c.stdout for c in checked)
        hosts = {n.name: n.host for n in cluster.cfg.nodes}
        assert len({hosts[v] for v in VOTERS}) == 4 and len({hosts[r] for r in REPLICAS}) == len(REPLICAS)
        cluster.start_all()
        # The runbook's override of the client's interface, by name (every host's NIC is eth0).
        load = cluster.start("load", "load", "--rate", "3000", "--messages", str(TRADES), "--seed", "3",
                             "--interface", "eth0")
        wait_for(lambda: load.poll() is not None, "the load to finish", 120)
        assert load.returncode == 0, cluster.output("load")
        leader = cluster.leader()
        assert leader in ("seq-a", "seq-b")
        cluster.stop(leader)  # the end of the session: the replicas finish there
        for r in REPLICAS:
            wait_for(lambda: not cluster.alive(r), f"{r} to exit at the end of the session", 60)
        for n in (*VOTERS, "emitter"):
            cluster.stop(n)
        run = read_run(cluster.cfg, VOTERS, REPLICAS, ("seq-a", "seq-b"), cluster.output("load"), TRADES)
        checks, figures, report = judge(run)
        assert all(checks.values()), {k: figures[k] for k, ok in checks.items() if not ok}
        assert report["sequenced"] == TRADES and len(set(report["digests"].values())) == 1
        assert json.loads(cluster.output("load"))["acked"] == TRADES
    finally:
        cluster.close()


def test_plain_lan_runs_elect_one_term_each(tmp_path):
    """The runbook's check for failovers without a fault: `tape up --lan --runs N`."""
    if os.geteuid() != 0:
        pytest.skip("the LAN tests make network namespaces: they need root (ip netns)")
    out = subprocess.run(TAPE + ["up", "--lan", "--runs", "2", "--rate", "3000", "--duration", "4", "--out",
                                 str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    reports = [json.loads((tmp_path / f"run-{i}" / "report.json").read_text()) for i in (1, 2)]
    assert all(r["verdict"] == "pass" and len(r["terms"]) == 1 and len(r["hosts"]) == 5 for r in reports)
    assert all(r["checks"]["no fault, one term: no spurious election"] for r in reports)
    assert all(set(r["voters"]) == set(VOTERS) and all("stalls" in v for v in r["voters"].values()) for r in reports)
    assert "2 of 2 runs" in out.stdout


def namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_a_lan_removes_every_namespace_it_made_and_nothing_else(lan):
    with Lan(2) as other:
        names = {other.switch, *other.hosts}
        assert names <= namespaces()
    assert not names & namespaces() and set(lan.hosts) <= namespaces()


@pytest.mark.parametrize("drill", LAN_DRILLS)
def test_every_lan_drill_passes_its_verdict(tmp_path, drill):
    """Real network faults on the LAN: the leader's link cut (a new leader, the old one back as a
    follower), a rewinder's host unplugged then plugged back, 5% loss on two hosts' links, and
    those links delayed, jittered (reordered) and duplicating through a forwarder."""
    if os.geteuid() != 0:
        pytest.skip("the LAN drills make network namespaces: they need root (ip netns)")
    if drill == "lossy-links" and not shutil.which("nft"):
        pytest.skip("lossy-links drops packets with nftables (this kernel has no netem): apt-get install nftables")
    if drill == "slow-links" and not shutil.which("ethtool"):
        pytest.skip("slow-links' forwarder needs checksums computed in software (ethtool): apt-get install ethtool")
    before = namespaces()  # (a run killed elsewhere may have left its own: not this drill's to remove)
    out = subprocess.run(TAPE + ["drill", drill, "--lan", "--rate", "3000", "--duration", "5", "--out",
                                 str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "pass" and report["drill"] == drill and all(report["checks"].values())
    assert report["sequenced"] == 15_000 and len(report["hosts"]) == 5
    if drill == "cut-leader-link":
        assert report["failover_ms"] > 0 and len(report["terms"]) >= 2
    assert not [n for n in namespaces() - before if n.startswith("tape-")]  # it removed its hosts and switch
