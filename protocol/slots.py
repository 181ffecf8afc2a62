"""Who may hold a connection on a TCP listener (replication, alerts, replay): configured peers in
slots of their own, strangers in a small shared pool.

A listener knows the addresses its configured peers connect from (the `host` of each node that
dials it). Each such address has PEER_SLOTS_PER_HOST slots that no stranger can take, so a flood
of strangers never refuses a voter reconnecting after a restart or an election. Every other
address shares STRANGER_SLOTS, at most STRANGER_SLOTS_PER_HOST each: enough for `tape tail`, a
trading client's replay or a probe, never enough for a few hosts to fill. A peer's slots are
granted by address only; the link's handshake (runtime/links.py) then proves the key, and a
stranger that sends no hello is closed after HANDSHAKE_TIMEOUT_S, keys or not.
"""

from __future__ import annotations

from tape.protocol.limits import PEER_SLOTS_PER_HOST, STRANGER_SLOTS, STRANGER_SLOTS_PER_HOST


class Slots:
    def __init__(self, peers: frozenset[str] = frozenset(), per_peer: int = PEER_SLOTS_PER_HOST,
                 strangers: int = STRANGER_SLOTS, per_stranger: int = STRANGER_SLOTS_PER_HOST):
        assert 0 < per_stranger <= strangers and per_peer > 0
        self.peers = peers
        self.per_peer, self.strangers, self.per_stranger = per_peer, strangers, per_stranger
        self.open: dict[str, int] = {}
        self.strangers_open = 0

    def admit(self, host: str) -> str | None:
        """Take a slot for a connection from `host`; the reason it is refused, or None."""
        held = self.open.get(host, 0)
        if host in self.peers:
            if held >= self.per_peer:
                return "host_busy"
        elif self.strangers_open >= self.strangers:
            return "too_many_connections"
        elif held >= self.per_stranger:
            return "host_busy"
        else:
            self.strangers_open += 1
        self.open[host] = held + 1
        return None

    def release(self, host: str) -> None:
        """A connection that admit() let in has closed."""
        held = self.open[host]
        assert held > 0, f"a slot of {host} released twice"
        if held == 1:
            del self.open[host]
        else:
            self.open[host] = held - 1
        if host not in self.peers:
            self.strangers_open -= 1
            assert self.strangers_open >= 0
