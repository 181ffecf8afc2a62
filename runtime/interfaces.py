"""Which of this host's addresses a node uses: its `host` (what it binds) and its multicast
`interface` (an IPv4 address or a network interface's name, e.g. "eth0"), checked at start so
that a config written for another host fails with a clear line, not a socket traceback."""

from __future__ import annotations

import ipaddress
import socket

import psutil


class InterfaceError(ValueError):
    """An address or interface this host does not have."""


def local_ipv4() -> dict[str, list[str]]:
    """Network interface name -> its IPv4 addresses, on this host (in its network namespace)."""
    return {nic: [a.address for a in addrs if a.family == socket.AF_INET]
            for nic, addrs in sorted(psutil.net_if_addrs().items())}


def _have(nics: dict[str, list[str]]) -> str:
    return ", ".join(f"{nic} {' '.join(addrs)}" for nic, addrs in nics.items() if addrs) or "none"


def is_local(address: str) -> bool:
    """Can a socket bind `address` here? (0.0.0.0 and all of 127/8 always can.)"""
    if address in ("", "0.0.0.0") or address.startswith("127."):
        return True
    return any(address in addrs for addrs in local_ipv4().values())


def resolve(spec: str) -> str:
    """The IPv4 address of `spec`, an address of this host or the name of one of its interfaces."""
    nics = local_ipv4()
    try:
        ipaddress.IPv4Address(spec)
    except ValueError:
        if nics.get(spec):
            return nics[spec][0]
        raise InterfaceError(f"interface {spec!r}: no network interface of that name with an IPv4 address "
                             f"on this host (have: {_have(nics)})") from None
    if spec.startswith("127.") or any(spec in addrs for addrs in nics.values()):
        return spec
    raise InterfaceError(f"interface {spec}: not an address of this host (have: {_have(nics)})")
