"""runtime/_mmsg.c (recvmmsg, sendmmsg) against the Python loops it replaces, on real sockets:
the same datagrams, whole and in order, the same limit, the same refusals and errors (fixed cases,
and random batches read by both); and where a C compiler exists it was built. Receives read a Unix
datagram pair, where a send is queued at the peer before it returns (a loopback UDP datagram may
still be in the kernel's softirq queue); sends go over loopback UDP and are read until all came."""

import socket
import time

import pytest
from compilers import where_built
from conftest import wait_for
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import moldudp64
from tape.runtime import mmsg
from tape.runtime.udp import udp_socket

RECEIVERS = [mmsg.recv_datagrams, mmsg.recv_datagrams_pure]
SENDERS = [mmsg.send_datagrams, mmsg.send_datagrams_pure]


@where_built
def test_the_c_calls_were_built_where_a_compiler_exists():
    assert mmsg.recv_datagrams is not mmsg.recv_datagrams_pure
    assert mmsg.send_datagrams is not mmsg.send_datagrams_pure


@pytest.fixture
def pair():
    """(sender, receiver) of loopback UDP."""
    rx, _ = udp_socket(rcvbuf=16 << 20)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    yield tx, rx
    tx.close()
    rx.close()


def queued_pair() -> tuple[socket.socket, socket.socket]:
    """(sender, non-blocking receiver) of datagrams that wait at the receiver once sent."""
    tx, rx = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.setblocking(False)
    for s in (tx, rx):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    return tx, rx


def everything(rx: socket.socket, want: int) -> list[bytes]:
    """What loopback UDP brings, read until `want` datagrams came (bounded)."""
    got = []
    wait_for(lambda: got.extend(mmsg.recv_datagrams_pure(rx, 1000)) or len(got) >= want,
             f"{want} datagrams", timeout=10, every=0.005)
    return got


@pytest.mark.parametrize("recv", RECEIVERS)
def test_what_waits_comes_whole_in_order_up_to_the_limit(recv):
    tx, rx = queued_pair()
    sizes = [0, 1, 1400, moldudp64.MAX_UDP_PAYLOAD] + [i % 300 for i in range(200)]
    sent = [bytes([i % 256]) * size for i, size in enumerate(sizes)]
    for data in sent:
        tx.send(data)
    first = recv(rx, 70)  # more than one system call's 64
    assert first == sent[:70]
    assert recv(rx, 1000) == sent[70:]
    assert recv(rx, 10) == []  # empty: nothing, no error
    tx.close(), rx.close()


@pytest.mark.parametrize("recv", RECEIVERS)
def test_a_limit_of_one_reads_one(recv):
    tx, rx = queued_pair()
    for data in (b"a", b"b"):
        tx.send(data)
    assert recv(rx, 1) == [b"a"] and recv(rx, 1) == [b"b"]
    tx.close(), rx.close()


@given(st.lists(st.integers(0, moldudp64.MAX_UDP_PAYLOAD), max_size=150), st.lists(st.integers(1, 100), min_size=1))
def test_random_batches_come_the_same_from_recvmmsg_and_the_loop(sizes, limits):
    """Both receivers, limit by limit over the same queue: the same datagrams each call."""
    pairs = [queued_pair() for _ in RECEIVERS]
    sent = [bytes([i % 256]) * size for i, size in enumerate(sizes)]
    for tx, _ in pairs:
        for data in sent:
            tx.send(data)
    got = [[], []]
    for limit in limits + [len(sent) + 1]:
        calls = [recv(rx, limit) for recv, (_, rx) in zip(RECEIVERS, pairs)]
        assert calls[0] == calls[1] and len(calls[0]) <= limit
        for out, call in zip(got, calls):
            out.extend(call)
    assert got[0] == got[1] == sent
    for tx, rx in pairs:
        tx.close(), rx.close()


@pytest.mark.parametrize("recv", RECEIVERS)
def test_an_error_the_kernel_reports_first_is_raised(recv):
    """A connected socket's send to a closed port comes back as ICMP, reported by the next receive."""
    closed, _ = udp_socket()
    port = closed.getsockname()[1]
    closed.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        sock.connect(("127.0.0.1", port))
        sock.send(b"anyone?")
        with pytest.raises(ConnectionRefusedError):  # once the ICMP report came back
            for _ in range(2000):  # (bounded: 10 s)
                assert recv(sock, 10) == []
                time.sleep(0.005)
        assert recv(sock, 10) == []  # reported once
    finally:
        sock.close()


@pytest.mark.parametrize("send", SENDERS)
def test_each_datagram_goes_in_order_and_a_refused_one_is_counted_not_the_rest(pair, send):
    tx, rx = pair
    too_big = b"x" * (moldudp64.MAX_UDP_PAYLOAD + 1)  # EMSGSIZE
    datagrams = [bytes([i]) * (i * 7) for i in range(150)]
    batch = datagrams[:3] + [too_big] + datagrams[3:100] + [too_big, too_big] + datagrams[100:]
    assert send(tx, batch, rx.getsockname()) == 3
    assert everything(rx, len(datagrams)) == datagrams
    assert send(tx, [], rx.getsockname()) == 0


@pytest.mark.parametrize("send", SENDERS)
def test_a_host_named_not_numbered_is_sent_to_as_well(pair, send):
    tx, rx = pair
    assert send(tx, [b"one", b"two"], ("localhost", rx.getsockname()[1])) == 0
    assert everything(rx, 2) == [b"one", b"two"]
