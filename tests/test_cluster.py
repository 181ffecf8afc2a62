"""The whole cluster with real processes (issue 4): tape up, replica
restarts from LMDB, emitter crashes at every point of its delivery step."""

import json
import operator
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import TAPE, wait_for

from tape.ops.verification.local import LocalCluster
from tape.ops.verification.reference import expected_alerts
from tape.protocol import messages as M
from tape.protocol.stamping import messages_per_packet
from tape.replicas.audit_core import AuditMachine
from tape.replicas.emitter_core import CRASH_POINTS
from tape.replicas.snapshot import SnapshotStore
from tape.runtime.config import load
from tape.runtime.storage.journal_store import Journal

pytestmark = pytest.mark.process
REPLICAS = ("replica-A", "replica-B", "replica-C")


def test_tape_up_with_5_percent_loss_and_ethernet_sized_packets_passes(tmp_path):
    """(The drills run loopback's default 8,972-byte packets; here the gap fills answer a LAN's 1,400-byte ones.)"""
    out = subprocess.run(TAPE + ["up", "--rate", "8000", "--duration", "3", "--drop", "0.05", "--max-packet", "1400",
                                 "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "pass" and report["sequenced"] == 24_000
    assert len(set(report["digests"].values())) == 1 and len(report["digests"]) == 3
    assert report["alerts_delivered"] == report["alerts_expected"] > 0 and report["duplicates"] == 0
    assert report["submitted"] == report["acknowledged"] == 24_000 and report["divergences"] == 0
    assert set(report["applied"].values()) == {report["log_length"]} and report["rate_msgs_per_s"] > 0
    assert all(report["checks"].values()) and report["term_problems"] == []
    lat = report["latency_ms"]  # inbound (sequencer stamp) to applied, measured by the replicas
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    # Each process's CPU, and the time its threads were ready to run but waited for a core
    assert set(report["cpu_s"]) == set(report["wait_s"]) == set(report["scheduled"]) == {
        "seq-a", "seq-b", "rw-1", "rw-2", *REPLICAS, "emitter", "load"}
    assert all(report["cpu_s"][p] > 0 and report["wait_s"][p] > 0 for p in ("seq-a", "replica-A", "load"))
    # ... and how often its threads were put on a core (each wake-up, each return after a preemption)
    assert all(isinstance(n, int) and n > 0 for n in report["scheduled"].values()), report["scheduled"]
    assert 0 <= report["host_steal_cores"] <= os.cpu_count()  # ... and what this machine's host took meanwhile
    assert (tmp_path / "alerts.jsonl").exists() and (tmp_path / "journal" / "rw-1").is_dir()
    # Each packet ends with a seal that counts its entries: as many as a 1,400-byte packet holds (17), no more.
    seals = [M.SEQUENCED.unpack(raw)[2] for _, _, raw in Journal(tmp_path / "journal" / "seq-a", readonly=True).read()
             if raw[0] == M.AUTH]
    assert report["max_packet"] == 1400 and 0 < max(seals) <= messages_per_packet(1400) == 17


def finish(cluster: LocalCluster, load) -> None:
    assert load.wait(timeout=120) == 0, cluster.output("load")
    cluster.stop("seq-a")  # the end of session: each replica applies everything, then exits by itself
    for r in REPLICAS:
        wait_for(lambda: cluster.procs[r].poll() is not None, f"{r} to exit at the end of the session", 60)
        assert cluster.procs[r].returncode == 0, cluster.logs[r].read_text()[-2000:]
    for n in ("emitter", "rw-1", "rw-2"):
        cluster.stop(n)


def expected_ids(cluster: LocalCluster) -> set:
    cfg = cluster.cfg
    decoded = [
        (s, M.SEQUENCED.unpack(raw)) for s, _, raw in Journal(cluster.journal_dir("seq-a"), readonly=True).read()
    ]
    alerts, _ = expected_alerts(decoded, int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9))
    return {f"{cfg.session}:{a['purchase_seq']}" for a in alerts}


def sink_lines(cluster: LocalCluster) -> list[str]:
    return (Path(cluster.cfg.node("emitter").data) / "alerts.jsonl").read_text().splitlines()


def delivered_ids(cluster: LocalCluster) -> list:
    return [json.loads(line)["alert_id"] for line in sink_lines(cluster)]


def test_kill_9_a_replica_and_it_resumes_from_its_snapshot(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=3, extra="[audit]\nsnapshot_every = 5000\nsnapshot_ms = 200\n")
    try:
        cluster.start_all()
        load = cluster.start("load", "load", "--rate", "10000", "--messages", "50000", "--seed", "4")

        def replica_b(metric: str) -> float:
            return cluster.metrics("replica-B")[f'tape_replica_{metric}{{node="replica-B"}}']

        wait_for(lambda: replica_b("applied_seq") > 10_000 and replica_b("snapshots_total") >= 2,
                 "replica-B to apply 10,000 messages and snapshot twice")
        cluster.kill("replica-B")
        wait_for(lambda: cluster.metrics("seq-a")['tape_sequencer_commit_seq{node="seq-a"}'] > 30_000,
                 "30,000 committed while replica-B is down")
        cluster.start_node("replica-B", 0.0, 21, "--exit-on-end")
        resumed = cluster.metrics("replica-B")['tape_replica_resumed_from_seq{node="replica-B"}']
        assert resumed > 5000  # from its LMDB snapshot, not from seq 1
        finish(cluster, load)
        status = {r: json.loads((Path(cluster.cfg.node(r).data) / "status.json").read_text()) for r in REPLICAS}
        assert status["replica-B"]["resumed_from"] == resumed
        assert len({s["digest"] for s in status.values()}) == 1
        assert len({s["last_seq"] for s in status.values()}) == 1
        ids = delivered_ids(cluster)
        assert len(ids) == len(set(ids)) and set(ids) == expected_ids(cluster)
    finally:
        cluster.close()


@pytest.mark.parametrize("point, sinks", [(point, "jsonl") for point in CRASH_POINTS] +
                         [("after_intent", "jsonl,stdout"), ("after_deliver", "jsonl,stdout")])
def test_emitter_crash_at_each_point_delivers_every_alert_once(tmp_path, point, sinks):
    """Every sink idempotent (the file alone): batches are delivered, then recorded together; a crash
    between leaves alerts above the mark, which the replicas send again and the file skips. With
    stdout (not idempotent) the intent comes first: a crash after it leaves alerts in doubt, which
    the restarted emitter (the file alone) writes again where missing."""
    cluster = LocalCluster(tmp_path, replicas=3)
    try:
        cluster.start_all(emitter_args=("--crash-at", point, "--crash-after", "5", "--sinks", sinks))
        load = cluster.start("load", "load", "--rate", "8000", "--messages", "24000", "--seed", "6")
        emitter = cluster.procs["emitter"]
        assert emitter.wait(timeout=60) == 99  # died at the crash point
        held = max(json.loads(line)["emit_seq"] for line in sink_lines(cluster))  # what the file had
        cluster.start_node("emitter")  # restarted without the hook
        finish(cluster, load)
        ids = delivered_ids(cluster)
        assert Counter(ids).most_common(1)[0][1] == 1  # each once
        assert set(ids) == expected_ids(cluster)
        log = cluster.logs["emitter"].read_text()
        assert ("in doubt after a crash" in log) == (sinks != "jsonl" and point in ("after_intent", "after_deliver"))
        restarted_at = int(re.findall(r"emitter at mark (\d+)", log)[-1])
        recorded_vs_held = {("jsonl", "before_intent"): operator.le, ("jsonl", "after_deliver"): operator.lt,
                            ("jsonl,stdout", "after_intent"): operator.gt}.get((sinks, point), operator.eq)
        assert recorded_vs_held(restarted_at, held), (restarted_at, held)
    finally:
        cluster.close()


def test_a_replica_with_a_wrong_state_is_outvoted_rebuilds_itself_and_no_wrong_alert_is_delivered(tmp_path):
    """replica-C's snapshot altered with a valid checksum (every open book's request cut to 1, as a
    bug or a bad memory would write it): after its restart its digest at the next fold point differs
    from the other two; the emitter (delivery = quorum) tells it to rebuild and ignores its alerts;
    it applies again from seq 1 by itself and ends with the others' digest."""
    cluster = LocalCluster(tmp_path, replicas=3, extra="[audit]\nsnapshot_every = 2000\nsnapshot_ms = 200\n")
    cluster.config_path.write_text(cluster.config_path.read_text().replace('delivery = "first"', 'delivery = "quorum"'))
    cluster.cfg = load(cluster.config_path)
    try:
        cluster.start_all()
        trades = cluster.start("load", "load", "--rate", "8000", "--messages", "40000", "--seed", "6")
        metric = lambda node, name: cluster.metrics(node)[f'tape_{cluster.cfg.node(node).role}_{name}{{node="{node}"}}']  # noqa: E731
        wait_for(lambda: metric("replica-C", "applied_seq") > 8_000 and metric("replica-C", "snapshots_total") >= 1,
                 "replica-C to apply 8,000 messages and snapshot")
        cluster.kill("replica-C")
        altered = alter_snapshot(cluster, "replica-C")
        assert altered > 0, "no open book in replica-C's snapshot to alter"
        cluster.start_node("replica-C", 0.0, 22, "--exit-on-end")
        wait_for(lambda: metric("replica-C", "rebuilds_total") == 1, "replica-C to be told to rebuild", 90)
        ordered = metric("emitter", "rebuilds_ordered_total")
        assert ordered == 1, f"{ordered} rebuilds ordered: {cluster.logs['emitter'].read_text()[-3000:]}"
        assert "DIVERGED: the other replicas agree on another digest" in cluster.logs["replica-C"].read_text()
        finish(cluster, trades)
        status = {r: json.loads((Path(cluster.cfg.node(r).data) / "status.json").read_text()) for r in REPLICAS}
        assert len({s["digest"] for s in status.values()}) == 1, status
        assert status["replica-C"]["resumed_from"] == 0, status["replica-C"]
        assert list((tmp_path / "data" / "replica-C").glob("lmdb.bad-*"))  # the wrong state, kept aside
        log = cluster.logs["replica-C"].read_text()  # it caught up over TCP in the leader's sealed packets
        assert "catching up over TCP" in log and "unsealed" not in log, log[-3000:]
        ids, expected = delivered_ids(cluster), expected_ids(cluster)
        assert len(ids) == len(set(ids)), "an alert delivered twice"
        assert set(ids) == expected, (sorted(set(ids) - expected)[:10], sorted(expected - set(ids))[:10])
    finally:
        cluster.close()


def alter_snapshot(cluster: LocalCluster, replica: str) -> int:
    """Cut every open book's requested quantity to 1 and save: a wrong state with a valid checksum."""
    cfg = cluster.cfg
    store = SnapshotStore(Path(cfg.node(replica).data) / "lmdb")
    machine = AuditMachine(int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9))
    store.load(machine)
    for order_id, book in machine.books.items():
        machine.books[order_id] = [1, *book[1:]]  # (a book is read as a copy: written back)
        machine.dirty.add(order_id)
    store.save(machine, outbox=store.outbox())
    store.close()
    return len(machine.books)
