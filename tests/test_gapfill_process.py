"""Gap fill against real rewinders (issue 13): loss repaired with and without
keys, no answer larger than its request unless the request is signed by
the stream key and names the address it came from, and a request ahead of
what a rewinder knows committed answered once it commits."""

import json
import socket
from pathlib import Path

import pytest
from conftest import wait_for

from tape.ops.cli.journal_tool import digest as journal_digest
from tape.ops.verification.local import LocalCluster
from tape.protocol import moldudp64
from tape.protocol.messages import SEQUENCED_BLOCK_SIZE
from tape.runtime.config import load

pytestmark = pytest.mark.process
TOTAL = 10_000


def run_with_loss(cluster: LocalCluster) -> None:
    """10,000 trades with 5% loss at every receiver; `tape tail` (5% loss too) must see the journal."""
    cluster.start_all(drop=0.05)
    tail = cluster.start("tail", "tail", "--summary", "--until", str(TOTAL + 1), "--drop", "0.05", "--seed", "7")
    load = cluster.start("load", "load", "--rate", "5000", "--messages", str(TOTAL), "--drop", "0.05", "--seed", "3")
    assert load.wait(timeout=120) == 0, cluster.logs["load"].read_text()[-2000:]
    assert json.loads(cluster.output("load"))["acked"] == TOTAL
    assert tail.wait(timeout=60) == 0, cluster.logs["tail"].read_text()[-2000:]
    seen = json.loads(cluster.output("tail"))
    assert seen["first_seq"] == 1 and seen["gaps_detected"] > 0
    n, digest = journal_digest(Path(cluster.cfg.node("seq-a").data) / "journal", seen["last_seq"])
    assert (n, digest) == (seen["last_seq"], seen["digest"])
    served = sum(cluster.metrics(rw)[f'tape_rewinder_gapfill_requests_served_total{{node="{rw}"}}']
                 for rw in ("rw-1", "rw-2"))
    assert served > 0


def dropped(cluster: LocalCluster, reason: str) -> float:
    return cluster.metrics("rw-1").get(f'tape_rewinder_dropped_datagrams_total{{node="rw-1",reason="{reason}"}}', 0)


def ask(cluster: LocalCluster, sock: socket.socket, request: bytes) -> bytes | None:
    sock.sendto(request, ("127.0.0.1", cluster.cfg.node("rw-1").gapfill_port))
    try:
        return sock.recv(65536)
    except TimeoutError:
        return None


def refused(cluster: LocalCluster, sock: socket.socket, request: bytes, reason: str) -> None:
    """Ask until rw-1 counts the request as `reason`, never answering it: the rewinders run
    with 5% injected loss, which may drop any one probe before it is judged."""
    before = dropped(cluster, reason)

    def judged() -> bool:
        assert ask(cluster, sock, request) is None
        return dropped(cluster, reason) > before

    wait_for(judged, f"a gap request refused as {reason}")


def answered(cluster: LocalCluster, sock: socket.socket, request: bytes) -> bytes:
    """Ask until answered (injected loss may drop a probe, as above)."""
    return wait_for(lambda: ask(cluster, sock, request), "an answer to the gap request")


@pytest.fixture
def requester():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(1.0)
    yield s
    s.close()


def test_without_keys_loss_is_repaired_and_no_answer_outweighs_its_request(tmp_path, requester):
    cluster = LocalCluster(tmp_path, keys=False)
    try:
        run_with_loss(cluster)
        session = cluster.cfg.session_bytes
        spec_sized = moldudp64.encode_request(session, 1, 100)  # 20 bytes: its answer could hold no message
        refused(cluster, requester, spec_sized, "unpadded")
        padded = spec_sized.ljust(200, b"\0")
        answer = answered(cluster, requester, padded)
        assert len(answer) <= len(padded)
        assert moldudp64.decode_header(answer)[1:] == (1, (200 - 20) // SEQUENCED_BLOCK_SIZE)
    finally:
        cluster.close()


def test_with_keys_only_signed_requests_naming_their_source_are_answered(tmp_path, requester):
    cluster = LocalCluster(tmp_path, extra="[timeouts]\ngap_request_ms = 10\n")
    try:
        run_with_loss(cluster)
        session, keys = cluster.cfg.session_bytes, cluster.cfg.stream_auth
        request = moldudp64.encode_request(session, 1, 5)
        refused(cluster, requester, request.ljust(1400, b"\0"), "unsigned_request")
        host, port = requester.getsockname()
        refused(cluster, requester, keys.sign_request(request, (host, port + 1), 1), "wrong_source")  # aimed elsewhere
        answer = answered(cluster, requester, keys.sign_request(request, (host, port), 1))
        assert keys.verify(answer) is None  # one whole sealed range, as the leader cut it
        assert moldudp64.decode_header(answer)[1] == 1 and len(answer) <= cluster.cfg.max_packet
    finally:
        cluster.close()


def test_a_request_ahead_of_the_commit_point_is_answered_once_it_commits(tmp_path, requester):
    """With no load, the log grows by the leader's time tick, one entry a second: a request for the
    third entry to come waits two or three seconds, parked, and is answered without being asked again."""
    cluster = LocalCluster(tmp_path, keys=False, extra="[timeouts]\ngap_request_ms = 8000\n")  # parked up to 8 s
    try:
        cluster.start_all()
        commit = lambda: cluster.metrics("rw-1")['tape_rewinder_commit_seq{node="rw-1"}']  # noqa: E731
        wait_for(lambda: commit() >= 1, "rw-1 to know the first tick committed")
        ahead = int(commit()) + 3
        request = moldudp64.encode_request(cluster.cfg.session_bytes, ahead, 1).ljust(200, b"\0")
        assert ask(cluster, requester, request) is None  # not committed yet: no answer, no refusal
        requester.settimeout(10)
        answer = requester.recv(65536)
        assert moldudp64.decode_header(answer)[1:] == (ahead, 1) and commit() >= ahead
        assert dropped(cluster, "not_committed") == 0
    finally:
        cluster.close()


def test_a_rewinder_hears_each_commit_point_soon_after_it_moves_not_with_the_next_append(tmp_path):
    """An idle leader's timer sleeps until something falls due (here the time tick, each second;
    beats to followers and stream heartbeats are further apart): when the tick commits, the
    commit point's beat must still go out COMMIT_BEAT_AFTER_NS after the append, else a rewinder
    answers gap requests for it only with the next tick's append, a second later."""
    cluster = LocalCluster(tmp_path, keys=False, extra="[timeouts]\nleader_heartbeat_ms = 1500\nelection_ms = 4500\n")
    cluster.config_path.write_text(cluster.config_path.read_text().replace("heartbeat_ms = 200", "heartbeat_ms = 3000"))
    cluster.cfg = load(cluster.config_path)
    try:
        cluster.start_all()
        rw = lambda: cluster.metrics("rw-1")  # noqa: E731  (one scrape: both gauges at one instant)
        wait_for(lambda: rw()['tape_rewinder_commit_seq{node="rw-1"}'] >= 2, "rw-1 to know a tick committed")
        for _ in range(3):
            leader = cluster.metrics("seq-a")['tape_sequencer_commit_seq{node="seq-a"}']
            heard = wait_for(lambda: (m := rw())['tape_rewinder_commit_seq{node="rw-1"}'] > leader and m,
                             "rw-1 to hear the next tick commit", every=0.005)
            # Heard from the beat, the commit point reaches the entry rw-1 holds last; heard only
            # with the next tick's append, it would stay one behind the log's end.
            assert heard['tape_rewinder_commit_seq{node="rw-1"}'] == heard['tape_rewinder_last_seq{node="rw-1"}'], heard
    finally:
        cluster.close()
