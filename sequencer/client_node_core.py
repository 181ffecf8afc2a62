"""Every decision of a process's clients that read the stream on one interface. Pure: the
node core that the client library (runtime/stream_sockets.py's StreamListener with
sequencer/client_shell.py's Clients) and the simulator both drive.

The clients of a process (`tape load`'s, a gateway's) read the stream once per
interface: one ListenerCore orders it and asks the rewinders for what is missing; each
client's ClientCore finds its own acknowledgements in a drain's in-order runs (read once
for all of them: `read_drain`), stops resending what a packet held ahead of a gap shows,
and resends what times out; a restarted client reads the stream up to its head before it
numbers on (Recovery). With no clients it is `tape tail`'s listener. Events:

    on_datagrams(datagrams, now)                  a drain of the stream's socket or the answers'
    on_timer(now)                                 at next_deadline(now) (None: nothing waits)
    submit(client, msgs, now)                     new trades of a client
    on_advice(client, data, from_sequencer, now)  a datagram on a client's own socket
    recover(client, now)                          a restarted client: the stream to its head first

Actions, in order:

    Delivered(runs)                    a drain's in-order runs (Deliver), for the shell's callback
    AskRewinder(index, request)        a gap request (protocol/listener.py)
    SendInbound(client, datagrams, to) to the sequencer `to` names, else to every one
    Acked(client)                      a client's acknowledgements moved (its waiters)
    Recovered(client, acked)           a recovery ended: the client numbers on after `acked`
    Undecodable(seq, error)            a sealed packet holds what this listener cannot decode
    Dropped(reason)                    a datagram refused (counted by the cores; for the log)
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.protocol import moldudp64
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import GAP_TICK_MS
from tape.protocol.listener import Ahead, AskRewinder, Deliver, ListenerCore, Undecodable
from tape.protocol.streamauth import StreamKeys
from tape.sequencer.client_core import ClientCore, Recovery, read_drain

__all__ = ["Acked", "AskRewinder", "ClientNode", "Delivered", "Dropped", "Recovered", "SendInbound", "Undecodable"]
RESEND_TICKS = 4  # a client's resend timer looks this many times a resend timeout


@dataclass(frozen=True)
class Delivered:
    runs: list


@dataclass(frozen=True)
class SendInbound:
    client: str
    datagrams: list
    to: bytes | None  # the leader's wire name (None: every sequencer)


@dataclass(frozen=True)
class Acked:
    client: str


@dataclass(frozen=True)
class Recovered:
    client: str
    acked: int


@dataclass(frozen=True)
class Dropped:
    reason: str
    detail: str


class ClientNode:
    def __init__(self, session: bytes, rewinders: int, gap_request_ns: int, resend_ns: int, next_seq: int = 1,
                 keys: StreamKeys | None = None, max_packet: int = moldudp64.DEFAULT_MAX_PACKET):
        """`gap_request_ns`, `resend_ns`: the configured gap request and resend timeouts
        (`gap_request_ms`, `client_resend_ms`); `next_seq`: where the stream is read from."""
        self.listener = ListenerCore(session, rewinders, gap_request_ns, next_seq, keys, max_packet)
        self.resend_ns, self.max_packet = resend_ns, max_packet
        self.clients: dict[str, ClientCore] = {}
        self.recoveries: dict[str, Recovery] = {}
        self.listen_tick_ns = max(gap_request_ns, GAP_TICK_MS * 1_000_000) // 2
        self.resend_tick_ns = resend_ns // RESEND_TICKS
        self._listen_at: int | None = None  # the listener's next look, while it waits for something
        self._resend_at: int | None = None  # the clients', while anything waits for its acknowledgement

    def add(self, name: str, key: bytes | None) -> ClientCore:
        """A client of this process (`key`: its inbound MAC key, if any); its core, for what the
        tools read of it."""
        self.clients[name] = ClientCore(moldudp64.session_bytes(name), key, self.max_packet, self.resend_ns)
        return self.clients[name]

    @property
    def missing(self) -> bool:
        return self.listener.receiver.missing() is not None

    # --- events ----------------------------------------------------------------------

    def on_datagrams(self, datagrams: list[bytes], now: int) -> list:
        """The stream, or the rewinders' answers (the committed log again, checked as any stream
        packet); then what is still missing is asked for at once, not at the next tick."""
        out, runs = [], []
        for a in self.listener.on_datagrams(datagrams):
            kind = type(a)
            if kind is Deliver:
                runs.append(a)
                continue
            out += self._read(runs, now)
            runs = []
            if kind is Ahead:
                for core in self.clients.values():
                    core.on_ahead(a.packet, now)
            elif kind is Undecodable:
                out.append(a)
            elif isinstance(a, ProtocolError):
                out.append(Dropped(a.reason, str(a)))
        out += self._read(runs, now)
        if self.missing or self.listener.asking:  # (asking: time the answers that filled a gap now)
            out += self.listener.on_timer(now)
        out += self._recovered()
        self._arm(now)
        return out

    def on_timer(self, now: int) -> list:
        out = []
        if self._listen_at is not None and now >= self._listen_at:
            out += self.listener.on_timer(now)
            self._listen_at = None
        if self._resend_at is not None and now >= self._resend_at:
            self._resend_at = None
            for name, core in self.clients.items():
                if (due := core.on_timer(now)):
                    out.append(SendInbound(name, due, None))
        self._arm(now)
        return out

    def next_deadline(self, now: int) -> int | None:
        due = [t for t in (self._listen_at, self._resend_at) if t is not None]
        return min(due) if due else None

    def submit(self, client: str, msgs: list[bytes], now: int) -> list:
        core = self.clients[client]
        out = [SendInbound(client, core.submit(msgs, now), core.leader)]
        self._arm(now)
        return out

    def on_advice(self, client: str, data: bytes, from_sequencer: bool, now: int) -> list:
        """A back-off (new batches and resends pause) or a resend request (sent at once)."""
        core = self.clients[client]
        reason = core.on_advice(data, now, from_sequencer)
        if reason is None:
            return [SendInbound(client, core.on_timer(now), None)]
        return [] if reason == "sent_recently" else [Dropped(reason, f"{len(data)} bytes of advice")]

    def recover(self, client: str, now: int) -> list:
        self.recoveries[client] = Recovery()
        return self._recovered()

    # --- within -------------------------------------------------------------------------

    def _read(self, runs: list[Deliver], now: int) -> list:
        if not runs:
            return []
        out = [Delivered(runs)]
        if self.clients:
            read = read_drain(runs)  # once for every client
            out += [Acked(name) for name, core in self.clients.items() if core.on_read(read, now)]
        return out

    def _recovered(self) -> list:
        done = [name for name, r in self.recoveries.items() if r.done(self.listener)]
        for name in done:
            del self.recoveries[name]
        return [Recovered(name, self.clients[name].resume()) for name in done]

    def _arm(self, now: int) -> None:
        """The listener looks again while it waits for something, the clients while anything
        waits for its acknowledgement (an idle listener needs no timer)."""
        if self._listen_at is None and self.listener.waiting:
            self._listen_at = now + self.listen_tick_ns
        if self._resend_at is None and any(core.unacked for core in self.clients.values()):
            self._resend_at = now + self.resend_tick_ns
