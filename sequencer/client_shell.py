"""The client library's shell: submit trades exactly once, around the clients'
node core (sequencer/client_node_core.py ClientNode), which decides.

A process's clients read the stream once per interface: a StreamListener (the
stream's sockets, runtime/stream_sockets.py, and the node's one timer) holds the
ClientNode, and each Client joins it with its ClientCore, the socket it sends
from (where the leader's advice comes back) and its waiters. `submit(messages)`
hands them to the node, which numbers and batches them and says where each batch
goes (the leader the stream names; every sequencer while none is known, and for
resends); the stream's drains acknowledge them, which releases `submit`'s
back-pressure and `wait_acked`; the node's timer resends what is due
(sequencer/client_core.py has the policy). `tape tail` is a StreamListener with
no clients.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable

import asyncio_dgram

from tape.protocol.errors import ProtocolError
from tape.protocol.listener import Deliver
from tape.runtime import interfaces
from tape.runtime.latency import LatencySamples
from tape.runtime.mmsg import send_datagrams
from tape.runtime.process import within
from tape.runtime.settings import Config
from tape.runtime.stream_sockets import GapTimer, StreamSockets
from tape.runtime.udp import udp_socket
from tape.sequencer.client_node_core import (
    Acked,
    AskRewinder,
    ClientNode,
    Delivered,
    Recovered,
    SendInbound,
    Undecodable,
)

log = logging.getLogger("tape.client")


class StreamListener:
    """The shell of ClientNode (sequencer/client_node_core.py): the stream's sockets, the node's one
    timer, and what its actions say to carry out. Clients of the process (sequencer/client_shell.py)
    join it with their cores, a sender of their inbound datagrams and their waiters."""

    def __init__(self, cfg: Config, interface: str, deliver: Callable[[list[Deliver]], None] | None = None,
                 drop: float = 0.0, seed: int = 0, next_seq: int = 1,
                 on_undecodable: Callable[[int, ProtocolError], None] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns):
        """`interface`: the local address multicast arrives on (interfaces.resolve'd). `deliver`: gets
        the runs of a drain in order, in one call (a call a packet cost its Python again for each).
        `clock`: monotonic ns (a test's own, to time answers and gaps exactly)."""
        self.cfg = cfg
        self.clock = clock
        self.deliver = deliver
        # Called when a verified (sealed) packet, the committed log itself, holds a
        # message this listener cannot decode: skipping it would diverge.
        self.on_undecodable = on_undecodable
        self.sockets = StreamSockets(cfg, interface, self._drained, drop, seed)
        self.loss, self.badlog = self.sockets.loss, self.sockets.badlog
        self.node = ClientNode(cfg.session_bytes, len(self.sockets.rewinders), cfg.gap_request_ms * 1_000_000,
                               cfg.client_resend_ms * 1_000_000, next_seq, cfg.listener_auth, cfg.max_packet)
        self.core = self.node.listener
        self.receiver = self.core.receiver
        self.gaps = GapTimer()
        self.gap_histogram = self.gaps.histogram
        self.senders: dict[str, Callable[[list[bytes], bytes | None], None]] = {}  # client -> its socket's send
        self.on_acked: dict[str, Callable[[], None]] = {}
        self.on_recovered: dict[str, Callable[[int], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due: int | None = None

    @property
    def bad(self) -> dict[str, int]:
        return self.core.bad

    @property
    def requests_sent(self) -> int:
        return self.core.requests_sent

    @property
    def datagrams(self) -> int:
        return self.sockets.datagrams

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.reply_at(*self.sockets.start(), time.time_ns())  # (nonces above any before a restart)
        self._rearm()

    def stop(self) -> None:
        """Stop receiving and asking."""
        self.sockets.stop()
        if self._timer is not None:
            self._timer.cancel()
        self._loop = None

    async def close(self) -> None:
        """Stop, and return once every socket is closed: a listener started next may reuse their
        file descriptors, which asyncio must no longer watch."""
        self.stop()
        await asyncio.sleep(0)

    def event(self, handler, *args) -> None:
        """One event of the node core (its time appended), its actions carried out."""
        self.act(handler(*args, self.clock()))

    def on_datagram(self, data: bytes) -> None:
        """One datagram, delivered at once (tests)."""
        self.event(self.node.on_datagrams, [data])

    def _drained(self, datagrams: list[bytes]) -> None:
        self.event(self.node.on_datagrams, datagrams)
        self.gaps.note(self.node.missing, self.clock())

    def act(self, actions: list) -> None:
        for a in actions:
            kind = type(a)
            if kind is Delivered:
                if self.deliver is not None:
                    self.deliver(a.runs)
            elif kind is AskRewinder:
                self.sockets.ask(a.index, a.request)
            elif kind is SendInbound:
                self.senders[a.client](a.datagrams, a.to)
            elif kind is Acked:
                self.on_acked[a.client]()
            elif kind is Recovered:
                self.on_recovered.pop(a.client)(a.acked)
            elif kind is Undecodable:
                if self.on_undecodable is not None:
                    self.on_undecodable(a.seq, a.error)
            else:
                self.badlog.warn(a.reason, "dropped datagram: %s", a.detail)
        self._rearm()

    def _rearm(self) -> None:
        """The node's one timer, at its next deadline (none while nothing waits)."""
        if self._loop is None:
            return
        now = self.clock()
        due = self.node.next_deadline(now)
        if due == self._due:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._due, self._timer = due, None
        if due is not None:
            self._timer = self._loop.call_later(max(due - now, 0) / 1e9, self._fire)

    def _fire(self) -> None:
        self._due = self._timer = None
        self.event(self.node.on_timer)


class Client:
    def __init__(self, cfg: Config, name: str, drop: float = 0.0, seed: int = 0, max_in_flight: int = 100_000,
                 listener: StreamListener | None = None):
        """`listener`: the stream as other clients of this process read it (`sharing_listeners`);
        by default the client reads it itself."""
        self.cfg = cfg
        self.name = name
        self.sequencers = [(n.host, n.inbound_port) for n in cfg.by_role("sequencer")]
        self._by_name = {n.wire_name: (n.host, n.inbound_port) for n in cfg.by_role("sequencer")}
        self._leaders = {(socket.gethostbyname(h), p) for h, p in self.sequencers}  # where back-offs come from
        self.max_in_flight = max_in_flight
        self.interface = interfaces.resolve(cfg.interface_of(cfg.client(name)))
        self._own_listener = listener is None
        self.listener = listener or StreamListener(cfg, self.interface, None, drop, seed)
        self._progress = asyncio.Event()
        self.core = self.listener.node.add(name, cfg.client(name).key)
        self.listener.senders[name] = self._send
        self.listener.on_acked[name] = self._acked
        self.latency = LatencySamples()  # submit -> seen sequenced, a sample a batch, taken from the core

    def _acked(self) -> None:
        self.take_latencies()
        self._progress.set()

    def take_latencies(self) -> LatencySamples:
        """The core's samples moved here (the core would hold one a batch for the whole run)."""
        self.latency.extend(self.core.latencies_ns)
        self.core.latencies_ns.clear()
        return self.latency

    # What the tools read.
    next_cseq = property(lambda self: self.core.next_cseq)
    acked = property(lambda self: self.core.acked)
    in_flight = property(lambda self: self.core.in_flight)
    per_batch = property(lambda self: self.core.per_batch)  # messages one datagram holds
    resends = property(lambda self: self.core.resends)
    rejected = property(lambda self: self.core.rejected)  # [(client seq, reason)] sequenced as rejects
    backoffs = property(lambda self: self.core.backoffs)  # back-offs honoured

    async def start(self) -> None:
        # On its own interface's address only: the advice (back-offs, resend requests) comes from
        # the sequencers, and nothing on another network of this host can reach it.
        self.sock, _ = udp_socket(self.interface)
        if self._own_listener:
            self.listener.start()
        self.advice = await asyncio_dgram.from_socket(self.sock)
        self._reading_advice = asyncio.create_task(self._read_advice())

    async def close(self) -> None:
        self.advice.close()
        await self._reading_advice
        if self._own_listener:
            self.listener.stop()
        self.sock.close()

    async def submit(self, msgs: list[bytes]) -> int:
        """Send inbound messages; returns the client seq of the last one."""
        while self.in_flight + len(msgs) > self.max_in_flight and self.in_flight > 0:
            self._progress.clear()
            await self._progress.wait()
        while pause := self.core.pause_left_ns(time.monotonic_ns()):
            await asyncio.sleep(pause / 1e9)
        self.listener.event(self.listener.node.submit, self.name, msgs)
        return self.core.next_cseq - 1

    async def _read_advice(self) -> None:
        """The leader's back-offs and resend requests, a few a second at most and each under this
        client's MAC (ClientCore judges them; anything else is counted and dropped). Each is
        handed on before the next is awaited, and asyncio's selector loop reads one datagram a
        readiness event, so the stream's queue holds what one turn of the loop brought: this
        consumer bounds it, whatever a flood sends (the kernel's receive buffer drops the rest)."""
        while True:
            try:
                data, source = await self.advice.recv()
            except asyncio_dgram.TransportClosed:
                return
            except OSError:  # an ICMP error the socket reported: nothing to hand on
                continue
            self.listener.event(self.listener.node.on_advice, self.name, data, source in self._leaders)

    def _send(self, datagrams: list[bytes], to: bytes | None = None) -> None:
        """To the sequencer named `to` (the leader the stream names), else to every one. What the
        kernel refuses is resent after the timeout."""
        leader = self._by_name.get(to)
        for addr in self.sequencers if leader is None else (leader,):
            send_datagrams(self.sock, datagrams, addr)

    async def recover(self, timeout: float) -> int:
        """After a restart: read the stream up to the head it announces (the
        listener starts at seq 1), then number on from the last client seq of
        ours sequenced, which it returns. Raises TimeoutError."""
        recovered = asyncio.get_running_loop().create_future()
        self.listener.on_recovered[self.name] = recovered.set_result
        self.listener.event(self.listener.node.recover, self.name)
        try:
            return await within(recovered, timeout)
        except asyncio.TimeoutError:
            head = self.listener.node.recoveries[self.name].head
            what = f"read up to seq {head - 1:,}" if head else "heard (no packet or heartbeat)"
            raise TimeoutError(f"recovering: the stream was not {what} within {timeout:.0f} s") from None

    async def wait_acked(self, cseq: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.acked < cseq:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._progress.clear()
            try:
                await within(self._progress.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True


def sharing_listeners(cfg: Config, names: list[str], drop: float = 0.0, seed: int = 0) -> tuple[list, list]:
    """Clients of one process that read the stream once per interface, not once each: one
    listener's node hands each drain to every client on its interface (each finds its own
    acknowledgements in it). Returns (listeners, clients); the caller starts and stops the
    listeners."""
    listeners: dict[str, StreamListener] = {}
    clients = []
    for name in names:
        interface = interfaces.resolve(cfg.interface_of(cfg.client(name)))
        if interface not in listeners:
            listeners[interface] = StreamListener(cfg, interface, None, drop, seed + len(listeners))
        clients.append(Client(cfg, name, listener=listeners[interface]))
    return list(listeners.values()), clients
