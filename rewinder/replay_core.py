"""A rewinder's replay rules (SoupBinTCP over TCP). Pure.

A replay session starts with a login naming a session (blank: this one) and
the seq to start from (0: from the newest committed message on). The server
accepts it or rejects it, then streams committed messages only, at most
REPLAY_CHUNK per write, and heartbeats when there is nothing to send.
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.protocol import soupbintcp as soup
from tape.protocol.limits import REPLAY_CHUNK


@dataclass(frozen=True)
class Accept:
    seq: int  # the first seq the session will get


@dataclass(frozen=True)
class Reject:
    reason: bytes  # soup.REJECT_*


def on_login(payload: bytes, session: bytes, commit_seq: int) -> Accept | Reject:
    """A login frame's payload (raises ProtocolError if malformed)."""
    _user, _password, wanted, seq = soup.parse_login(payload)
    if wanted and wanted != session.rstrip(b" "):
        return Reject(soup.REJECT_SESSION_UNAVAILABLE)
    return Accept(seq or commit_seq + 1)


def next_chunk(seq: int, commit_seq: int) -> tuple[int, int] | None:
    """(first seq, count) of committed messages to send next, or None: wait for more."""
    if seq > commit_seq:
        return None
    return seq, min(REPLAY_CHUNK, commit_seq - seq + 1)

