"""Bounded connections (issues 13 and 63): no stranger exhausts a node's file descriptors or
takes a configured peer's slot, and a silent replay client is dropped. Real processes; the
strangers connect from other loopback addresses (127.0.0.2...), the cluster's nodes from 127.0.0.1."""

import selectors
import socket
import threading
import time

import psutil
import pytest
from conftest import connect, wait_for

from tape.ops.verification.local import LocalCluster
from tape.protocol import alertlink
from tape.protocol import soupbintcp as soup
from tape.protocol.limits import REPLAY_IDLE_TIMEOUT_S, STRANGER_SLOTS, STRANGER_SLOTS_PER_HOST
from tape.runtime.linkclient import LinkSocket

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


def stranger(address: str, port: int) -> socket.socket:
    """A connection to 127.0.0.1:`port` from `address`, which is not a configured node's."""
    sock = socket.socket()
    sock.bind((address, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


STRANGERS = [f"127.0.0.{i}" for i in range(2, 2 + STRANGER_SLOTS // STRANGER_SLOTS_PER_HOST)]


def test_strangers_hold_a_few_slots_each_a_small_pool_in_all_and_never_a_peers(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=1)
    try:
        cluster.start_node("emitter")
        port = cluster.cfg.node("emitter").alert_port
        held = [stranger(STRANGERS[0], port) for _ in range(STRANGER_SLOTS_PER_HOST)]  # silent: no hello
        extra = stranger(STRANGERS[0], port)
        assert closed(extra)  # over that address's share: closed at once, before any hello
        wait_for(lambda: refused(cluster, "emitter", "host_busy") == 1, "the extra connection counted")
        held += [stranger(a, port) for a in STRANGERS[1:] for _ in range(STRANGER_SLOTS_PER_HOST)]
        wait_for(lambda: accepted(cluster, "emitter", port) == STRANGER_SLOTS, "the strangers' pool full")
        assert closed(stranger("127.0.0.250", port))  # a new stranger: the pool is full
        wait_for(lambda: refused(cluster, "emitter", "too_many_connections") == 1, "the pool's refusal counted")
        replica = LinkSocket(connect(port, "the alert port"), cluster.cfg.links_of(cluster.cfg.node("replica-A")),
                             cluster.cfg.node("emitter").wire_name)  # replica-A's own slot
        replica.sendall(alertlink.hello(b"replica-A "))
        assert alertlink.Reader().feed(replica.recv(64))[0][0] == alertlink.WELCOME
        assert all(closed(s) for s in held)  # none said hello: each dropped after the handshake timeout
        wait_for(lambda: refused(cluster, "emitter", "hello_timeout") == STRANGER_SLOTS,
                 "the silent connections counted")
        for s in (*held, extra, replica):
            s.close()
    finally:
        cluster.close()


class Flood:
    """Strangers that keep every stranger slot of `ports` taken, and one address more that keeps
    trying: each connection dropped (the handshake timeout, or refused) is opened again as soon as
    its close arrives (epoll), so that a freed slot goes to a stranger unless it is reserved.
    Bounded: it stops at `stop()` or after `limit_s`."""

    def __init__(self, ports: list[int], limit_s: float = 120.0):
        self.deadline = time.monotonic() + limit_s
        self.where = {}  # socket -> (address, port)
        self.pending: list[tuple[str, int]] = []
        self.poll = selectors.DefaultSelector()
        for port in ports:
            for address in [*STRANGERS, "127.0.0.250"]:
                for _ in range(STRANGER_SLOTS_PER_HOST):
                    self.open(address, port)
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def open(self, address: str, port: int) -> None:
        try:
            sock = stranger(address, port)
        except OSError:  # (the port closed: its node is restarting) tried again each turn
            self.pending.append((address, port))
            return
        self.where[sock] = (address, port)
        self.poll.register(sock, selectors.EVENT_READ)

    def run(self) -> None:
        while not self.halt.is_set() and time.monotonic() < self.deadline:
            retry, self.pending = self.pending, []
            for address, port in retry:
                self.open(address, port)
            for key, _ in self.poll.select(0.01):
                sock = key.fileobj
                self.poll.unregister(sock)
                sock.close()
                self.open(*self.where.pop(sock))

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()
        for sock in self.where:
            sock.close()


def test_a_restarted_follower_rejoins_while_strangers_keep_every_replication_slot_taken(tmp_path):
    cluster = LocalCluster(tmp_path)
    flood = None
    try:
        cluster.start_all()
        leader = cluster.wait_leader()
        voters = [v.name for v in cluster.cfg.voters]
        flood = Flood([cluster.cfg.node(v).replication_port for v in voters])
        wait_for(lambda: all(refused(cluster, v, "too_many_connections") > 0 for v in voters),
                 "every voter's stranger pool full (a stranger refused)", timeout=60)
        cluster.kill("rw-2")
        cluster.restart("rw-2")
        committed = cluster.metrics(leader)[f'tape_sequencer_commit_seq{{node="{leader}"}}']
        wait_for(lambda: cluster.metrics("rw-2").get('tape_rewinder_commit_seq{node="rw-2"}', 0) > committed,
                 "rw-2 back, following the leader's commits", timeout=60)
        assert cluster.leader() == leader  # no election: the leader kept its majority throughout
    finally:
        if flood:
            flood.stop()
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
