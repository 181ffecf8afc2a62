"""The runbook, executed (issue 62): docs/runbook.md's `<!-- run: NAME -->` blocks run in order,
as an operator would, on five hosts with a file system each (tests/hosts.py). The build machine
builds the wheel, downloads its dependencies and writes one config a host; each host gets dist/,
constraints.txt, ops/ and its own config only, and reaches no registry. On each, the runbook adds
the user, installs without extras into a fresh virtual environment, checks its config and starts
its units (tests/systemctl_stub.py starts them as their unit files say); then `tape status`, the
Prometheus files checked by promtool, a failover drill under a trading client's load, and a
rewinder's disk replaced. Needs root (namespaces) and the package registry (the build machine's
download), as tests/test_install.py does."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from hosts import Host, runbook_blocks
from test_install import checkout_copy

from tape.runtime.config import node_names, place

pytestmark = pytest.mark.process
USER = "tapelog"  # the units' User=
BLOCKS = runbook_blocks()


def ok(done: subprocess.CompletedProcess, what: str) -> str:
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def build(tmp_path: Path, hosts: list[str]) -> Path:
    """The runbook's build block, in a copy of the checkout: dist/ and cluster/."""
    checkout = checkout_copy(tmp_path / "checkout")
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # this Tape, and its Python as python3
    ok(subprocess.run(["sh", "-euxc", BLOCKS["build"]], cwd=checkout, capture_output=True, text=True, timeout=600,
                      env={**os.environ, "PATH": path, "HOSTS": ",".join(hosts)}), "the build block")
    return checkout


def release_for(checkout: Path, host: str, dest: Path) -> Path:
    """What the operator copies to one host: the build, and of the configs that host's alone."""
    for part in ("dist", "ops"):
        shutil.copytree(checkout / part, dest / part)
    shutil.copy(checkout / "constraints.txt", dest)
    (dest / "cluster").mkdir()
    shutil.copy(checkout / "cluster" / f"{host}.toml", dest / "cluster")
    return dest


def status(host: Host) -> dict:
    """The runbook's status command, as data (its exit is 1 while a node does not answer)."""
    done = host.run(BLOCKS["status"].replace("tape status", "tape status --json"))
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


def node_uid_and_files(host: Host, unit: str) -> tuple[int, str]:
    """(the uid its main process runs as, the files under /var/lib/tape not the user's own or not 0600/0700)."""
    main = int(host.read(f"/run/systemctl-stub/{unit}.main"))
    uid = next(int(line.split()[1]) for line in Path(f"/proc/{main}/status").read_text().splitlines()
               if line.startswith("Uid:"))
    loose = ok(host.run(f"find /var/lib/tape \\( ! -user {USER} -o -perm /077 \\) ! -type l"), "find")
    return uid, loose


def test_the_runbook_deploys_a_cluster_drills_it_and_replaces_a_disk(tmp_path, lan):
    assert set(BLOCKS) == {"build", "host", "status", "metrics", "load", "kill-leader", "replace"}
    checkout = build(tmp_path, lan.addresses)
    machines = {address: Host(ns, address, tmp_path / f"host-{i}", release_for(checkout, address,
                                                                               tmp_path / f"release-{i}"))
                for i, (ns, address) in enumerate(zip(lan.hosts, lan.addresses))}
    for address, machine in machines.items():
        out = ok(machine.run(BLOCKS["host"], HOST=address), f"the host block on {address}")
        assert "config ok here" in out and "C speed-ups on" in out
        assert not machine.run("ls /opt/tape/.venv/lib/python3*/site-packages/ | grep -i -e pyspark -e pytest"
                               ).stdout  # no extras on a node host
    where = place(lan.addresses, node_names(2, 2, 3, 2))
    first = machines[lan.addresses[0]]
    wait_for(lambda: first.run(BLOCKS["status"]).returncode == 0, "every node up and one leader", timeout=90)
    tapelog = int(first.run(f"id -u {USER}").stdout)
    for node in ("seq-a", "rw-2", "replica-A", "emitter"):
        role = {"seq": "sequencer", "rw": "rewinder", "replica": "replica"}.get(node.split("-")[0], "emitter")
        uid, loose = node_uid_and_files(machines[where[node]], f"tape-{role}@{node}.service")
        assert uid == tapelog and loose == "", (node, uid, loose)
    ok(first.run(BLOCKS["metrics"]), "the metrics block")

    leader = status(first)["leader"]
    client = machines[where["load0"]]
    load = client.start(BLOCKS["load"], CLIENT="load0")
    wait_for(lambda: (status(first)["nodes"][0].get("committed") or 0) > 4000, "the load under way", timeout=60)
    ok(machines[where[leader]].run(BLOCKS["kill-leader"], LEADER=leader), "the kill-leader block")
    wait_for(lambda: (s := status(first))["leader"] not in (None, leader) and all(n["up"] for n in s["nodes"]),
             "another sequencer leading and the killed one back", timeout=60)
    out, err = load.communicate(timeout=180)
    assert load.returncode == 0 and json.loads(out.splitlines()[-1])["all_acked"], err[-3000:]

    replaced = ok(machines[where["rw-1"]].run(BLOCKS["replace"], NODE="rw-1"), "the replace block")
    assert "moved /var/lib/tape/rw-1 to" in replaced
    try:
        final = wait_for(lambda: caught_up(status(first)), "rw-1 recovered and caught up", timeout=90)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{machines[where['rw-1']].run('systemctl status tape-rewinder@rw-1').stdout}")
    digests = [n.get("digest") for n in final["nodes"] if n["role"] == "replica"]
    assert digests[0] and digests.count(digests[0]) == 3, digests


def caught_up(s: dict) -> dict | None:
    """The status once every voter holds what the leader committed and none is recovering."""
    rows = {n["node"]: n for n in s["nodes"]}
    if not s["leader"] or not all(n["up"] for n in s["nodes"]):
        return None
    committed = rows[s["leader"]]["committed"]
    voters = [n for n in s["nodes"] if n["role"] in ("sequencer", "rewinder")]
    positions = {n.get("sequenced", n.get("journal")) for n in voters}
    recovering = [n for n in voters if n.get("recovering")]
    applied = {n["applied"] for n in s["nodes"] if n["role"] == "replica"}
    return s if positions == {committed} and not recovering and applied == {committed} else None
