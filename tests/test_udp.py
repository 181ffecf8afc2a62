"""runtime/udp.py on real sockets (loopback): a listener joined to the stream's group from the
sequencers' addresses alone takes nothing another host sends to the group."""

import random
import socket
import time
import tomllib

from tape.runtime.config import default_toml, parse
from tape.runtime.udp import free_port, multicast_receiver


def _sender(source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))  # the datagram's source address
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    return sock


def _received(sock: socket.socket, wait_s: float = 0.5) -> list[tuple[bytes, str]]:
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            data, (host, _) = sock.recvfrom(2048)
            got.append((data, host))
        except BlockingIOError:
            time.sleep(0.01)
    return got


def test_a_source_specific_join_takes_the_sequencers_datagrams_and_drops_another_hosts():
    group, port = f"239.{random.randrange(1, 255)}.{random.randrange(1, 255)}.7", free_port()
    only, _ = multicast_receiver(group, port, "127.0.0.1", sources=("127.0.0.1",))
    anyone, _ = multicast_receiver(group, port, "127.0.0.1")
    try:
        for source in ("127.0.0.1", "127.0.0.3"):
            with _sender(source) as s:
                s.sendto(source.encode(), (group, port))
        assert _received(only) == [(b"127.0.0.1", "127.0.0.1")]  # the stranger's never reached the socket
        assert sorted(_received(anyone)) == [(b"127.0.0.1", "127.0.0.1"), (b"127.0.0.3", "127.0.0.3")]
    finally:
        only.close()
        anyone.close()


def test_the_stream_sources_are_the_sequencers_interfaces_unless_one_is_named_by_its_interface_name():
    hosts = ["10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.4", "10.9.0.5"]
    lan = parse(tomllib.loads(default_toml("/x", sequencers=2, replicas=0, hosts=hosts)))
    assert lan.stream_sources == ("10.9.0.1", "10.9.0.2")
    assert parse(tomllib.loads(default_toml("/x", sequencers=2))).stream_sources == ("127.0.0.1",)
    named = default_toml("/x", sequencers=2, replicas=0, hosts=hosts).replace('interface = "10.9.0.2"',
                                                                                'interface = "eth0"', 1)
    assert parse(tomllib.loads(named)).stream_sources == ()  # its address is its host's to know: any source
