"""What every node core asks of its shell about connections. Pure.

A node core (one per process role: everything that process decides) takes
events and returns one list of typed actions, which the shell carries out in
order; the simulator drives the same core over the same bytes. The calling
convention, shared by every node core:

    on_connected(conn, now[, peer])  a connection is up (authenticated, where keys are set: `peer`
                                   is the node its handshake proved is at the other end)
    on_data(conn, data, now)       bytes read from it, cut anywhere
    on_closed(conn, now)           it closed
    on_timer(now)                  at or after next_deadline()
    on_<done>(action, now)         the shell finished carrying out a durable action
                                   (recorded, flushed, delivered) or failed to

`conn` is whatever the shell names a connection by (opaque here); `now` is
monotonic time in ns. Besides its role's own actions, a core returns these:
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Hashable


@dataclass(frozen=True, slots=True)
class Send:
    """Write `data` to `conn`."""

    conn: Hashable
    data: bytes


@dataclass(frozen=True, slots=True)
class Close:
    """Close `conn`; `reason` (a role's enum) when the peer sent what it must not: the shell
    counts it by `reason.value` and logs `detail`."""

    conn: Hashable
    reason: Enum | None = None
    detail: str = ""


def checked_after(cls: type, events: tuple[str, ...]) -> None:
    """Each of `cls`'s `events` ends with `self.check()`: a node's invariants hold after every
    event, whatever the network sent (else InvariantViolation: exit 4; a failed seed)."""
    for name in events:
        setattr(cls, name, _then_check(getattr(cls, name)))


def _then_check(event: Callable) -> Callable:
    def checked(self, *args, **kwargs):
        out = event(self, *args, **kwargs)
        self.check()
        return out
    checked.__name__, checked.__doc__ = event.__name__, event.__doc__
    return checked
