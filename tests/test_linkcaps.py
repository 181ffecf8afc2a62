"""Bounded connections (issue 13): no peer exhausts a node's file descriptors or
its peers' slots, and a silent replay client is dropped. Real processes."""

import socket

import psutil
import pytest
from conftest import connect, wait_for
from linkclient import LinkSocket

from tape.ops.verification.local import LocalCluster
from tape.protocol import alertlink
from tape.protocol import soupbintcp as soup
from tape.protocol.limits import REPLAY_IDLE_TIMEOUT_S
from tape.runtime.tuning import MAX_CONNECTIONS_PER_HOST

pytestmark = pytest.mark.process


def refused(cluster: LocalCluster, node: str, reason: str) -> float:
    role = cluster.cfg.node(node).role
    return cluster.metrics(node).get(f'tape_{role}_link_refused_total{{node="{node}",reason="{reason}"}}', 0)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def accepted(cluster: LocalCluster, node: str, port: int) -> int:
    """Connections the node's process has accepted on `port`."""
    return sum(c.laddr.port == port for c in psutil.Process(cluster.procs[node].pid).net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED)


def test_one_host_holds_a_bounded_number_of_connections_and_they_time_out(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=1)
    try:
        cluster.start_node("emitter")
        port = cluster.cfg.node("emitter").alert_port
        held = [connect(port, "the alert port") for _ in range(MAX_CONNECTIONS_PER_HOST)]  # silent: no hello
        wait_for(lambda: accepted(cluster, "emitter", port) == MAX_CONNECTIONS_PER_HOST, "every connection accepted")
        extra = connect(port, "the alert port")
        assert closed(extra)  # over the host's share: closed at once, before any hello
        wait_for(lambda: refused(cluster, "emitter", "host_busy") == 1, "the extra connection counted")
        assert all(closed(s) for s in held)  # none said hello: each dropped after the handshake timeout
        wait_for(lambda: refused(cluster, "emitter", "hello_timeout") == MAX_CONNECTIONS_PER_HOST,
                 "the silent connections counted")
        replica = LinkSocket(connect(port, "the alert port"), cluster.cfg.cluster_link)  # the slots are free again
        replica.sendall(alertlink.hello(b"replica-A "))
        assert alertlink.Reader().feed(replica.recv(64))[0][0] == alertlink.WELCOME
        for s in (*held, extra, replica):
            s.close()
    finally:
        cluster.close()


def test_a_silent_replay_client_is_dropped(tmp_path):
    cluster = LocalCluster(tmp_path)
    try:
        cluster.start_all()
        node = cluster.cfg.node("rw-1")
        client = LinkSocket(connect(node.replay_port, "the replay port"), cluster.cfg.replay_link)
        client.sendall(soup.login("test", "", "", 1))
        client.settimeout(REPLAY_IDLE_TIMEOUT_S + 10)
        # Login accepted, then a server heartbeat a second; we never answer. Bounded: a few
        # records a heartbeat, for twice the idle timeout.
        reads = 0
        while client.recv(4096):
            reads += 1
            assert reads < 10 * REPLAY_IDLE_TIMEOUT_S, "the silent client was never dropped"
        wait_for(lambda: cluster.metrics("rw-1")['tape_rewinder_replay_idle_closed_total{node="rw-1"}'] == 1,
                 "the silent replay client counted")
        client.close()
    finally:
        cluster.close()
