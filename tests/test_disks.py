"""Voters' disks failing (issue 15), with real processes: a wiped voter recovers its
election state from every other voter before it votes or follows, then catches up; a
damaged journal is cut at the damage and refilled; a full disk (a real tmpfs) stops a
voter taking part until space returns. What was committed survives each."""

import contextlib
import json
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import small_disk, wait_for

from tape.ops.cli.journal_tool import digest as journal_digest
from tape.ops.verification.faults import fill, flip_record_byte
from tape.ops.verification.local import TAPE, LocalCluster
from tape.protocol import moldudp64
from tape.protocol.election import VOTE_LOST
from tape.runtime.config import load
from tape.runtime.tuning import JOURNAL_RECENT_RECORDS

pytestmark = pytest.mark.process
TOTAL = 24_000


def gauge(cluster: LocalCluster, node: str, name: str) -> float:
    role = cluster.cfg.node(node).role
    return cluster.metrics(node)[f'tape_{role}_{name}{{node="{node}"}}']


def assert_one_journal(cluster: LocalCluster, voters: tuple) -> None:
    """Stop the voters in order (the leader first: its session end reaches the others) and check
    their journals are one."""
    for name in voters:
        assert cluster.stop(name) == 0, cluster.logs[name].read_text()[-2000:]
    digests = {n: journal_digest(Path(cluster.cfg.node(n).data) / "journal") for n in voters}
    assert len(set(digests.values())) == 1, digests


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
        election = Path(cluster.cfg.node("rw-1").data) / "election.json"  # (written just after the gauge flips)
        wait_for(lambda: gauge(cluster, "rw-1", "recovering") == 0 and election.exists(),
                 "rw-1 to recover once seq-b is back")
        state = json.loads(election.read_text())
        assert state["term"] >= term and (state["voted_for"] == VOTE_LOST.decode() or state["term"] > term)
        assert load.wait(timeout=180) == 0, cluster.output("load")
        assert json.loads(cluster.output("load"))["acked"] == TOTAL
        leader = max(("seq-a", "seq-b"), key=lambda s: gauge(cluster, s, "leader"))
        last = gauge(cluster, leader, "sequenced_seq")
        wait_for(lambda: all(gauge(cluster, rw, "last_seq") >= last for rw in ("rw-1", "rw-2")),
                 f"both rewinders to hold seq {last}")
        assert_one_journal(cluster, ("seq-a", "seq-b", "rw-1", "rw-2"))
    finally:
        cluster.close()


def test_a_damaged_sealed_segment_stops_the_rewinder_and_its_restart_repairs_it(tmp_path, requester):
    """A flipped byte in an old segment: met while serving, exit 5 naming it; the restart cuts the
    journal at the damage (kept aside), recovers as a voter that lost its disk, and catches up."""
    cluster = LocalCluster(tmp_path, extra="[timeouts]\nclient_resend_ms = 100\n")
    cluster.planted = ("CRITICAL rw-1: journal corrupt at seq ", "CRITICAL journal damaged at ")
    cluster.config_path.write_text(cluster.config_path.read_text().replace("[journal]", "[journal]\nsegment_mb = 1"))
    cluster.cfg = load(cluster.config_path)
    try:
        cluster.start_all()
        load_proc = cluster.start("load", "load", "--rate", "8000", "--messages", "30000", "--seed", "5")
        assert load_proc.wait(timeout=120) == 0, cluster.output("load")
        segments = sorted(cluster.journal_dir("rw-1").glob("*.seg"))
        assert len(segments) >= 2, segments  # the first is sealed
        seq, offset = flip_record_byte(segments[0])  # one bit of a message, under its CRC
        assert seq < 30_000 - JOURNAL_RECENT_RECORDS - 1_000  # older than the tail kept in memory: read from the file
        keys = cluster.cfg.stream_auth
        request = keys.sign_request(moldudp64.encode_request(cluster.cfg.session_bytes, seq, 1),
                                    requester.getsockname(), 1)
        requester.sendto(request, ("127.0.0.1", cluster.cfg.node("rw-1").gapfill_port))
        cluster.let_go.add("rw-1")
        assert cluster.procs["rw-1"].wait(timeout=30) == 5
        assert f"journal corrupt at seq {seq}, {segments[0]} offset {offset}" in cluster.logs["rw-1"].read_text()
        cluster.restart("rw-1")
        wait_for(lambda: gauge(cluster, "rw-1", "journal_repaired") == 1 and gauge(cluster, "rw-1", "recovering") == 0,
                 "rw-1 to cut its journal and recover")
        last = gauge(cluster, "seq-a", "sequenced_seq")
        wait_for(lambda: gauge(cluster, "rw-1", "last_seq") >= last, f"rw-1 to catch up to seq {last}")
        assert list((tmp_path / "data" / "rw-1").glob("journal.damaged-*/" + segments[0].name))  # kept aside
        assert_one_journal(cluster, ("seq-a", "rw-1", "rw-2"))
    finally:
        cluster.close()


@pytest.fixture
def requester():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    yield s
    s.close()


@pytest.mark.parametrize("node", ["rw-1", "seq-a"])
def test_a_full_disk_stops_a_voter_taking_part_until_space_returns(tmp_path, node):
    """The journal on a 32 MiB tmpfs, filled mid-load: the refused write is undone (or, first, the
    node finds nothing free), the node logs 'disk full' and takes no part (a leader steps down; the
    others go on), never exits; once the filler is removed it takes part again and catches up, with
    a journal equal to the others'."""
    cluster = LocalCluster(tmp_path, sequencers=2, extra="[timeouts]\nclient_resend_ms = 100\n")
    data = Path(cluster.cfg.node(node).data)
    data.mkdir(parents=True)
    with small_disk(data, "32m") as filler:
        try:
            cluster.start_all()
            load = cluster.start("load", "load", "--rate", "3000", "--messages", str(TOTAL), "--seed", "7")
            wait_for(lambda: gauge(cluster, "seq-a", "commit_seq") >= 3000, "3,000 trades committed")
            fill(filler)
            wait_for(lambda: gauge(cluster, node, "disk_full") == 1, f"{node} to find its disk full")
            text = cluster.logs[node].read_text()
            # refused at a write, or stopped first at its look at the free space (the journal's reserve
            # may hold the next appends)
            assert any(why in text for why in ("disk full: journal append to", "disk full: saving the election state",
                                               "disk nearly full: "))
            if node == "seq-a":
                wait_for(lambda: gauge(cluster, "seq-b", "leader") == 1, "seq-b to lead")
                steps = cluster.metrics("seq-a")
                assert steps['tape_sequencer_step_downs_total{node="seq-a",reason="disk full"}'] == 1, steps
            held = gauge(cluster, node, "last_seq" if node.startswith("rw") else "sequenced_seq")
            wait_for(lambda: gauge(cluster, "rw-2", "last_seq") > held + 3000, "3,000 more trades without it")
            assert cluster.alive(node) and gauge(cluster, node, "disk_full") == 1
            filler.unlink()
            wait_for(lambda: gauge(cluster, node, "disk_full") == 0, f"{node} to see space again")
            assert load.wait(timeout=180) == 0, cluster.output("load")
            assert json.loads(cluster.output("load"))["acked"] == TOTAL
            leader = max(("seq-a", "seq-b"), key=lambda s: gauge(cluster, s, "leader"))
            last = gauge(cluster, leader, "sequenced_seq")
            position = "last_seq" if node.startswith("rw") else "sequenced_seq"
            wait_for(lambda: gauge(cluster, node, position) >= last, f"{node} to catch up to seq {last}")
            assert_one_journal(cluster, (leader, *(v for v in ("seq-a", "seq-b", "rw-1", "rw-2") if v != leader)))
        finally:
            cluster.close()


def test_a_full_disk_under_the_emitter_and_a_replica_holds_alerts_and_snapshots_until_space_returns(tmp_path):
    """The emitter's and replica-B's data each on a 64 MiB tmpfs, filled mid-load: the emitter records
    no intent and delivers nothing (its links close; replicas send again from the mark), the
    replica's snapshots fail and it goes on applying; neither exits. Once the fillers are removed,
    every alert is delivered exactly once and the three replicas end with one digest."""
    cluster = LocalCluster(tmp_path, replicas=3, extra="[audit]\nsnapshot_every = 2000\nsnapshot_ms = 100\n")
    disks = [Path(cluster.cfg.node(n).data) for n in ("emitter", "replica-B")]
    with contextlib.ExitStack() as stack:
        fillers = []
        for data in disks:
            data.mkdir(parents=True)
            fillers.append(stack.enter_context(small_disk(data, "64m")))
        try:
            cluster.start_all()
            trades = cluster.start("load", "load", "--rate", "6000", "--messages", "36000", "--seed", "8")
            wait_for(lambda: gauge(cluster, "emitter", "alerts_delivered_total") > 100, "100 alerts delivered")
            for filler in fillers:
                fill(filler)
            wait_for(lambda: refused(cluster) > 0 and gauge(cluster, "replica-B", "snapshot_failures_total") > 0,
                     "the full disks to refuse writes", 60)
            held = gauge(cluster, "replica-A", "applied_seq")
            wait_for(lambda: gauge(cluster, "replica-A", "applied_seq") > held + 4000, "4,000 more trades applied")
            assert cluster.alive("emitter") and cluster.alive("replica-B")
            for filler in fillers:
                filler.unlink()
            finish_replicas(cluster, trades)
            status = {r: json.loads((Path(cluster.cfg.node(r).data) / "status.json").read_text())
                      for r in ("replica-A", "replica-B", "replica-C")}
            assert len({s["digest"] for s in status.values()}) == 1
            sink = Path(cluster.cfg.node("emitter").data) / "alerts.jsonl"
            ids = [json.loads(line)["alert_id"] for line in sink.read_text().splitlines()]
            assert len(ids) == len(set(ids)) == status["replica-A"]["alerts_raised"]
        finally:
            cluster.close()


def refused(cluster: LocalCluster) -> float:
    """The emitter's writes the disk refused: LMDB transactions, and sink writes retried."""
    m = cluster.metrics("emitter")
    return m['tape_emitter_record_failures_total{node="emitter"}'] + sum(
        v for k, v in m.items() if k.startswith("tape_emitter_sink_retries_total"))


def finish_replicas(cluster: LocalCluster, trades) -> None:
    """The load done, the session ended: each replica applies everything, then exits by itself."""
    assert trades.wait(timeout=180) == 0, cluster.output("load")
    cluster.stop("seq-a")
    for r in ("replica-A", "replica-B", "replica-C"):
        wait_for(lambda: cluster.procs[r].poll() is not None, f"{r} to exit at the end of the session", 90)
        assert cluster.procs[r].returncode == 0, cluster.logs[r].read_text()[-2000:]
    assert cluster.stop("emitter") == 0, cluster.logs["emitter"].read_text()[-2000:]
