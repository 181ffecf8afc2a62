"""A hostile LAN (issue 13) against real processes. With keys, `tape drill hostile`
(tests/test_drills.py) must find nothing forged applied, delivered or journaled.
Here: without keys the same attacks may forge data but must stop nothing and leave
nothing stuck; and every socket of every process, found as an attacker on the host
would (/proc), takes hypothesis-generated datagrams and connections without harm."""

import asyncio
import json
import socket

import pytest
from conftest import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tape.ops.cli.onramp import submit_all
from tape.ops.verification import hostile
from tape.ops.verification.local import LocalCluster
from tape.protocol import messages as M
from tape.protocol import moldudp64

pytestmark = pytest.mark.process
TOTAL = 20_000


def run_under_attack(cluster: LocalCluster, attack) -> None:
    """Load, `attack()` once a fifth is committed, then: every node alive, every trade acknowledged,
    and the replicas finish at the end of the session (none stuck)."""
    cluster.start_all()
    load = cluster.start("load", "load", "--rate", "5000", "--messages", str(TOTAL), "--seed", "5")
    wait_for(lambda: hostile._commit_seq(cluster) > TOTAL // 5, "a fifth of the trades committed")
    attack()
    assert load.wait(timeout=120) == 0, cluster.logs["load"].read_text()[-2000:]
    assert json.loads(cluster.output("load"))["acked"] == TOTAL
    cluster.check_running(ignore=("load",))  # raises naming a node that stopped
    commit = hostile._commit_seq(cluster)
    for r in ("replica-A", "replica-B", "replica-C"):
        wait_for(lambda: cluster.metrics(r)[f'tape_replica_applied_seq{{node="{r}"}}'] >= commit,
                 f"{r} to apply through the commit point {commit} (not stuck)")
    assert cluster.stop("seq-a") == 0  # the end of the session: the replicas finish where they apply it
    for r in ("replica-A", "replica-B", "replica-C"):
        assert cluster.procs[r].wait(timeout=60) == 0, cluster.logs[r].read_text()[-2000:]


def test_without_keys_the_attacks_stop_nothing_and_leave_nothing_stuck(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=3, keys=False)
    try:
        sent = []
        run_under_attack(cluster, lambda: sent.extend(hostile.run_all(cluster)))
        assert len(sent) == len(hostile.ATTACKS)
    finally:
        cluster.close()


PAYLOADS = st.one_of(
    st.binary(max_size=2000),
    st.builds(lambda seq, count, tail: moldudp64.HEADER.pack(b"TAPE      ", seq, count) + tail,
              st.integers(0, 2**64 - 1), st.integers(0, 0xFFFF), st.binary(max_size=600)),
)


def test_every_socket_of_every_process_takes_fuzz_without_harm(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=3)

    def fuzz():
        targets = [s for name, proc in cluster.procs.items() if name != "load"
                   for s in hostile.sockets_of(proc.pid)]
        assert {s.proto for s in targets} == {"udp", "tcp"} and len(targets) > 20
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

        @settings(max_examples=400, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(target=st.sampled_from(targets), data=PAYLOADS)
        def hit(target, data):
            if target.proto == "udp":
                udp.sendto(data, (target.host, target.port))
            else:
                try:
                    with socket.create_connection((target.host, target.port), timeout=2) as t:
                        t.sendall(data)
                except OSError:
                    pass  # refused, reset or closed on us: what a stranger should get

        try:
            hit()
        finally:
            udp.close()

    try:
        run_under_attack(cluster, fuzz)
    finally:
        cluster.close()


def test_a_client_with_its_key_cannot_sequence_what_the_rules_cannot_apply(tmp_path):
    """Purchases of 2^62 shares (twice would overflow a replica's i64): sequenced as rejects in
    their client seqs, reported to the client; the replicas apply the log and finish."""
    cluster = LocalCluster(tmp_path, replicas=3)
    try:
        cluster.start_all()
        huge = [M.purchase_request(1, 2**62, "X", "Y"), M.purchase(1, 1, 2**62, "X", "Y"),
                M.purchase(2, 1, 2**62, "X", "Y"), M.purchase_request(2, 100, "X", "Y")]
        result = asyncio.run(submit_all(cluster.cfg, "load1", huge, 30))
        assert result["all_acked"] and result["acked"] == 4, result
        assert result["rejected"] == [{"client_seq": s, "reason": "shares_out_of_range"} for s in (1, 2, 3)]
        assert cluster.stop("seq-a") == 0
        for r in ("replica-A", "replica-B", "replica-C"):
            assert cluster.procs[r].wait(timeout=60) == 0, cluster.logs[r].read_text()[-2000:]
        mine = [(row["type"], row["client_seq"]) for row in cluster.journal_dump("rw-1") if row["origin"] == "load1"]
        assert mine == [("rejected", 1), ("rejected", 2), ("rejected", 3), ("purchase_request", 4)]
    finally:
        cluster.close()
