"""runtime/_mmsg.c (recvmmsg, sendmmsg) against the Python loops it replaces, on real loopback
sockets: the same datagrams, whole and in order, the same limit, the same refusals and errors; and
where a C compiler exists it was built."""

import socket
import time

import pytest
from compilers import where_built

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
    rx, _ = udp_socket(rcvbuf=16 << 20)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    yield tx, rx
    tx.close()
    rx.close()


def _arrived():
    """Loopback delivers within the send; a moment for a busy host anyway."""
    time.sleep(0.05)


@pytest.mark.parametrize("recv", RECEIVERS)
def test_what_waits_comes_whole_in_order_up_to_the_limit(pair, recv):
    tx, rx = pair
    sizes = [0, 1, 1400, moldudp64.MAX_UDP_PAYLOAD] + [i % 300 for i in range(200)]
    sent = [bytes([i % 256]) * size for i, size in enumerate(sizes)]
    for data in sent:
        tx.sendto(data, rx.getsockname())
    _arrived()
    first = recv(rx, 70)  # more than one system call's 64
    assert first == sent[:70]
    assert recv(rx, 1000) == sent[70:]
    assert recv(rx, 10) == []  # empty: nothing, no error


@pytest.mark.parametrize("recv", RECEIVERS)
def test_a_limit_of_one_reads_one(pair, recv):
    tx, rx = pair
    for data in (b"a", b"b"):
        tx.sendto(data, rx.getsockname())
    _arrived()
    assert recv(rx, 1) == [b"a"] and recv(rx, 1) == [b"b"]


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
        _arrived()
        with pytest.raises(ConnectionRefusedError):
            recv(sock, 10)
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
    _arrived()
    assert mmsg.recv_datagrams_pure(rx, 1000) == datagrams
    assert send(tx, [], rx.getsockname()) == 0


@pytest.mark.parametrize("send", SENDERS)
def test_a_host_named_not_numbered_is_sent_to_as_well(pair, send):
    tx, rx = pair
    assert send(tx, [b"one", b"two"], ("localhost", rx.getsockname()[1])) == 0
    _arrived()
    assert mmsg.recv_datagrams_pure(rx, 10) == [b"one", b"two"]
