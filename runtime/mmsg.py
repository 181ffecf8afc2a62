"""Datagrams in and out a batch per system call where Tape was built with a compiler
(`runtime/_mmsg.c`: recvmmsg, sendmmsg); the loops here are the definition and the fallback.

A 1,400-byte multicast packet costs its sender ~5.2 µs with one `sendto` each and its listeners
~0.95 µs with one `recv` each here; a batch per call saves ~1.3 and ~0.5 of them (docs/performance.md).
A receive holds its datagrams at once: at most `limit` of at most 64 KiB each (a listener's drain of
DRAIN_DATAGRAMS, whatever a flood sends)."""

from __future__ import annotations

import socket

from tape.runtime.tuning import DATAGRAM_BUFFER


def recv_datagrams_pure(sock: socket.socket, limit: int) -> list[bytes]:
    """Up to `limit` datagrams waiting on the non-blocking `sock`. An error (an ICMP report of an
    earlier send) raises OSError only when nothing was read before it; behind datagrams it is left
    for the next call."""
    out = []
    while len(out) < limit:
        try:
            out.append(sock.recv(DATAGRAM_BUFFER))
        except BlockingIOError:
            break
        except OSError:
            if out:
                break
            raise
    return out


def send_datagrams_pure(sock: socket.socket, datagrams: list[bytes], dest: tuple[str, int]) -> int:
    """Each datagram to `dest` (an IPv4 address); how many the kernel refused (the rest still go)."""
    refused = 0
    for data in datagrams:
        try:
            sock.sendto(data, dest)
        except OSError:
            refused += 1
    return refused


try:
    from tape.runtime import _mmsg
except ImportError:  # built without a compiler
    recv_datagrams, send_datagrams = recv_datagrams_pure, send_datagrams_pure
else:
    def recv_datagrams(sock: socket.socket, limit: int) -> list[bytes]:
        return _mmsg.recv_datagrams(sock.fileno(), limit)

    def send_datagrams(sock: socket.socket, datagrams: list[bytes], dest: tuple[str, int]) -> int:
        try:
            return _mmsg.send_datagrams(sock.fileno(), datagrams, *dest)
        except ValueError:  # a host name, not an address: the kernel's send resolves it, one a datagram
            return send_datagrams_pure(sock, datagrams, dest)
