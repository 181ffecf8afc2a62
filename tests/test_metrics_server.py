"""The metrics endpoint is bounded (runtime/metrics_server.py, issue 63): strangers holding silent
connections or scraping as fast as they can take neither its threads nor the collection's GIL
time beyond its budget. A real server on loopback, in this process."""

import socket
import ssl
import urllib.error
import urllib.request

import pytest
from conftest import wait_for

from tape.ops.verification.certs import make_certificates
from tape.runtime import metrics_server
from tape.runtime.tuning import (
    METRICS_ACCEPTS_PER_S,
    METRICS_CONNECTIONS,
    METRICS_HANDSHAKES_PER_S,
    METRICS_SCRAPES_PER_S,
)


@pytest.fixture
def server():
    s = metrics_server.start("127.0.0.1", 0, clock=lambda: 1000.0)  # time stands still: no refill
    yield s
    s.shutdown()
    s.server_close()


def scrape(port: int) -> int | str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # closed unanswered
        return "closed"


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_silent_connections_hold_a_few_slots_for_a_while_and_then_the_endpoint_answers(server):
    port = server.server_address[1]
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(METRICS_CONNECTIONS)]
    wait_for(lambda: server.slots._value == 0, "every slot taken by a silent connection")
    extra = socket.create_connection(("127.0.0.1", port))
    extra.settimeout(5)
    assert closed(extra) and server.refused["busy"] == 1  # closed at once: no thread for it
    for s in silent:
        s.settimeout(10)
    assert all(closed(s) for s in silent)  # each dropped after the read timeout
    assert scrape(port) == 200
    for s in (*silent, extra):
        s.close()


def test_scrapes_beyond_the_budget_are_answered_429_without_a_collection(server):
    port = server.server_address[1]
    answers = [scrape(port) for _ in range(3 * METRICS_SCRAPES_PER_S)]
    n, threads = METRICS_SCRAPES_PER_S, METRICS_ACCEPTS_PER_S - METRICS_SCRAPES_PER_S
    assert answers == [200] * n + [429] * threads + ["closed"] * (3 * n - n - threads)  # the burst, then none;
    assert server.refused["rate_limited"] == 2 * n  # then not even a thread to answer 429
    server.clock = lambda: 1001.0  # a second later: a second's worth again
    assert [scrape(port) for _ in range(METRICS_SCRAPES_PER_S + 1)] == [200] * METRICS_SCRAPES_PER_S + [429]


@pytest.mark.process  # (openssl makes the certificates)
def test_with_tls_a_silent_connection_holds_its_own_thread_never_the_accepting_one(tmp_path):
    """The handshake runs in the request's thread: while one connection says nothing, another
    scrapes at once; the silent one is dropped after the read timeout and counted."""
    make_certificates(tmp_path, ["node"], ip="127.0.0.1")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "node.pem", tmp_path / "node.key")
    server = metrics_server.start("127.0.0.1", 0, tls=tls)
    port = server.server_address[1]
    silent = socket.create_connection(("127.0.0.1", port))
    try:
        client = ssl.create_default_context(cafile=tmp_path / "ca.pem")
        url = f"https://127.0.0.1:{port}/metrics"
        assert urllib.request.urlopen(url, timeout=5, context=client).status == 200
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):  # answered while the silent handshake still waits: not behind it
            silent.recv(1)
        silent.settimeout(10)
        assert closed(silent)
        wait_for(lambda: server.refused["tls"] == 1, "the silent handshake counted")
    finally:
        silent.close()  # (first: a server whose accept() waited on its handshake would never shut down)
        server.shutdown()
        server.server_close()


@pytest.mark.process  # (openssl makes the certificates)
def test_with_tls_handshakes_beyond_the_budget_are_refused_before_they_cost_the_host_one(tmp_path):
    make_certificates(tmp_path, ["node"], ip="127.0.0.1")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "node.pem", tmp_path / "node.key")
    server = metrics_server.start("127.0.0.1", 0, clock=lambda: 1000.0, tls=tls)  # time stands still
    client = ssl.create_default_context(cafile=tmp_path / "ca.pem")
    url = f"https://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        statuses = []
        for _ in range(METRICS_HANDSHAKES_PER_S + 1):
            try:
                statuses.append(urllib.request.urlopen(url, timeout=5, context=client).status)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
            except OSError:
                statuses.append("closed")
        assert statuses[-1] == "closed" and "closed" not in statuses[:-1]  # the one beyond: no handshake
        assert server.refused["rate_limited"] >= 1 and server.refused["tls"] == 0
    finally:
        server.shutdown()
        server.server_close()
