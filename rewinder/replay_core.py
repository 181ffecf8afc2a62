"""A rewinder's replay rules (SoupBinTCP over TCP). Pure.

A replay session starts with a login naming a session (blank: this one) and
the seq to start from (0: from the newest committed message on). The server
accepts it or rejects it (on the standard port, a username and password
that are not the config's: not authorized), then streams committed
messages only, at most REPLAY_CHUNK per write, and heartbeats when there is
nothing to send.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from tape.protocol import soupbintcp as soup
from tape.protocol.limits import REPLAY_CHUNK


@dataclass(frozen=True)
class Accept:
    seq: int  # the first seq the session will get


@dataclass(frozen=True)
class Reject:
    reason: bytes  # soup.REJECT_*


def on_login(payload: bytes, session: bytes, commit_seq: int, users: dict[bytes, bytes] | None = None
             ) -> Accept | Reject:
    """A login frame's payload (raises ProtocolError if malformed). `users` (username -> password):
    the login must name one of them with its password (a standard client's, on the soup_port; on
    the replay port the link's key has proved who it is)."""
    user, password, wanted, seq = soup.parse_login(payload)
    if users is not None and not hmac.compare_digest(users.get(user, b"\0" * 11), password):
        return Reject(soup.REJECT_NOT_AUTHORIZED)
    if wanted and wanted != session.rstrip(b" "):
        return Reject(soup.REJECT_SESSION_UNAVAILABLE)
    return Accept(seq or commit_seq + 1)


def next_chunk(seq: int, commit_seq: int) -> tuple[int, int] | None:
    """(first seq, count) of committed messages to send next, or None: wait for more."""
    if seq > commit_seq:
        return None
    return seq, min(REPLAY_CHUNK, commit_seq - seq + 1)

