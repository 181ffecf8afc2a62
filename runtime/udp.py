"""UDP sockets for the shells: multicast senders and receivers on any
interface (loopback by default), receive buffers sized and reported, free
ports for tests and local clusters."""

from __future__ import annotations

import os
import random
import socket
import struct
import tempfile
import time

from tape.runtime.tuning import RECEIVE_BUFFER

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
PORT_CLAIMS = os.path.join(tempfile.gettempdir(), "tape-port-claims")  # ports recently given out, one file each
PORT_CLAIM_S = 120.0  # a claim older than this is stale: its run has bound the port long since, or is gone


def set_rcvbuf(sock: socket.socket, size: int = RECEIVE_BUFFER) -> int:
    """Ask for `size` bytes of receive buffer (forced where we are root);
    return what the kernel granted (Linux reports double the request)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def multicast_receiver(
    group: str, port: int, interface: str = "127.0.0.1", rcvbuf: int = RECEIVE_BUFFER, sources: tuple = ()
) -> tuple[socket.socket, int]:
    """A non-blocking socket joined to `group:port` on `interface`; returns
    (socket, granted receive buffer bytes). With `sources` (IPv4 addresses), joined to the group
    from those senders only (source-specific multicast: the kernel drops what any other host
    sends to the group before this process sees it), where the kernel can; else from any."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    granted = set_rcvbuf(sock, rcvbuf)
    sock.bind((group, port))
    if not (sources and _join_sources(sock, group, interface, sources)):
        mreq = struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton(interface))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    sock.setblocking(False)
    return sock, granted


def _join_sources(sock: socket.socket, group: str, interface: str, sources: tuple) -> bool:
    """Join (source, group) for each source: True, or False with none joined (no kernel support)."""
    joined = []
    for source in sources:  # struct ip_mreq_source: the group, the interface, the source
        mreq = socket.inet_aton(group) + socket.inet_aton(interface) + socket.inet_aton(source)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_ADD_SOURCE_MEMBERSHIP, mreq)
        except OSError:
            for done in joined:
                sock.setsockopt(socket.IPPROTO_IP, IP_DROP_SOURCE_MEMBERSHIP, done)
            return False
        joined.append(mreq)
    return True


IP_ADD_SOURCE_MEMBERSHIP = getattr(socket, "IP_ADD_SOURCE_MEMBERSHIP", 39)  # Linux's, where Python names none
IP_DROP_SOURCE_MEMBERSHIP = getattr(socket, "IP_DROP_SOURCE_MEMBERSHIP", 40)


def multicast_sender(interface: str = "127.0.0.1", ttl: int = 1, loop: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, ttl)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1 if loop else 0)
    sock.setblocking(False)
    return sock


def udp_socket(host: str = "127.0.0.1", port: int = 0, rcvbuf: int = RECEIVE_BUFFER) -> tuple[socket.socket, int]:
    """A non-blocking unicast UDP socket bound to host:port (0 = any free)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    granted = set_rcvbuf(sock, rcvbuf)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock, granted


def free_port(host: str = "127.0.0.1") -> int:
    """A port free for both TCP and UDP on `host` right now. Drawn below the
    kernel's ephemeral range (32768+ here), so that the sockets other
    processes open meanwhile cannot take it before it is bound, and outside
    the embedded default's fixed ports (31400-31499). Claimed for PORT_CLAIM_S
    in PORT_CLAIMS, so that test suites and drills running side by side do not
    hand out the same port before either has bound it."""
    pick = random.SystemRandom()
    os.makedirs(PORT_CLAIMS, exist_ok=True)
    while True:
        port = pick.randrange(20000, 31400)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t, \
                    socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                t.bind((host, port))
                u.bind((host, port))
        except OSError:
            continue
        if _claim(port):
            return port


def _claim(port: int) -> bool:
    path = os.path.join(PORT_CLAIMS, str(port))
    try:
        if time.time() - os.stat(path).st_mtime < PORT_CLAIM_S:
            return False
        os.unlink(path)  # stale
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another process claimed it just now
        return False
    return True
