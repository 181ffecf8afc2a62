"""Joining the public stream: the shells listeners share. StreamSockets
receives multicast packets and rewinders' answers (dropping a seeded share if
asked) and sends gap requests: the I/O of every listener, the replica's node
core included. StreamListener (clients, `tape tail`) carries out what
ListenerCore decides around them: hands the in-order runs of messages a
wake-up brings to a callback at once (a list of Deliver: first seq, packet
bytes, index of the first message), and sends its gap requests.

Both sockets, the multicast stream's and the one gap requests go out on and
the rewinders' answers come back to, are non-blocking and drained up to
DRAIN_DATAGRAMS per wake-up: nothing queues in the process but what the
kernel's receive buffer holds, whatever a flood of answers sends."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from tape.node.batchio import recv_datagrams
from tape.node.latency import LatencyHistogram
from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config
from tape.node.transport import LossInjector, multicast_receiver, udp_socket
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import DRAIN_DATAGRAMS, GAP_TICK_MS
from tape.protocol.listener import Ahead, Deliver, ListenerCore, Undecodable

log = logging.getLogger("tape.listener")


class StreamSockets:
    """The stream's multicast socket and the one gap requests go out on and answers come back to;
    each drain's datagrams go to `on_datagrams`."""

    def __init__(self, cfg: Config, interface: str, on_datagrams: Callable[[list[bytes]], None], drop: float = 0.0,
                 seed: int = 0):
        self.cfg, self.interface, self.on_datagrams = cfg, interface, on_datagrams
        self.loss = LossInjector(drop, seed)
        self.rewinders = [(n.host, n.gapfill_port) for n in cfg.by_role("rewinder")]
        self.badlog = RateLimitedLog(log)
        self.datagrams = 0

    def start(self) -> tuple[str, int]:
        """Open both and read them; the address answers come back to (which a signed request names)."""
        loop = asyncio.get_running_loop()
        self.mcast, self.rcvbuf = multicast_receiver(self.cfg.group, self.cfg.port, self.interface)
        # Bound to the multicast interface's address: the source address rewinders see.
        self.req, _ = udp_socket(self.interface)
        loop.add_reader(self.mcast, self._drain, self.mcast)
        loop.add_reader(self.req, self._drain, self.req)
        return self.req.getsockname()

    def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in (self.mcast, self.req):
            loop.remove_reader(sock)
            sock.close()

    def _drain(self, sock) -> None:
        try:
            datagrams = recv_datagrams(sock, DRAIN_DATAGRAMS)
        except OSError as e:  # an ICMP error reported for a request: asked again after the timeout
            self.badlog.warn("recv_error", "receive failed: %s", e)
            datagrams = []
        self.datagrams += len(datagrams)
        if self.loss.fraction:
            datagrams = [data for data in datagrams if not self.loss.drop()]
        self.on_datagrams(datagrams)

    def ask(self, index: int, request: bytes) -> None:
        try:
            self.req.sendto(request, self.rewinders[index])
        except OSError as e:  # asked again after the timeout
            self.badlog.warn("send_error", "gap request failed: %s", e)


class GapTimer:
    """How long something stayed missing from the stream, a gap at a time: from the drain that
    first sees something missing to the one that sees nothing missing (gaps that overlap count
    as one)."""

    def __init__(self):
        self.histogram = LatencyHistogram()
        self._since: int | None = None

    def note(self, missing: bool) -> None:
        if missing == (self._since is not None):
            return
        now = time.monotonic_ns()
        if missing:
            self._since = now
        else:
            self.histogram.observe(now - self._since)
            self._since = None


class StreamListener:
    def __init__(self, cfg: Config, interface: str, deliver: Callable[[list[Deliver]], None], drop: float = 0.0,
                 seed: int = 0, next_seq: int = 1, on_undecodable: Callable[[int, ProtocolError], None] | None = None,
                 on_ahead: Callable[[bytes], None] | None = None):
        """`interface`: the local address multicast arrives on (netif.resolve'd). `deliver`: gets
        the runs of a drain in order, in one call (a call a packet cost its Python again for each).
        `on_ahead`: gets each sealed packet held ahead of a gap (clients stop resending what it
        shows)."""
        self.cfg = cfg
        self.deliver = deliver
        self.on_ahead = on_ahead
        # Called when a verified (sealed) packet, the committed log itself, holds a
        # message this listener cannot decode: skipping it would diverge.
        self.on_undecodable = on_undecodable
        self.sockets = StreamSockets(cfg, interface, self._drained, drop, seed)
        self.loss, self.badlog = self.sockets.loss, self.sockets.badlog
        self.core = ListenerCore(cfg.session_bytes, len(self.sockets.rewinders), cfg.gap_request_ms * 1_000_000,
                                 next_seq, cfg.stream_auth, cfg.max_packet)
        self.receiver = self.core.receiver
        self.gaps = GapTimer()
        self.gap_histogram = self.gaps.histogram
        self._task = None
        self._waiting = asyncio.Event()  # set while the core has something for its timer

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
        self.core.reply_at(*self.sockets.start())
        self._task = asyncio.create_task(self._tick())

    def stop(self) -> None:
        """Stop receiving and asking."""
        self.sockets.stop()
        if self._task:
            self._task.cancel()

    async def close(self) -> None:
        """Stop, and return once every socket is closed: a listener started next may reuse their
        file descriptors, which asyncio must no longer watch."""
        self.stop()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)

    def _drained(self, datagrams: list[bytes]) -> None:
        """The multicast stream, or the rewinders' answers (the committed log again, checked as any
        stream packet): then ask at once for what is still missing, not at the next tick."""
        self._carry_out(self.core.on_datagrams(datagrams))
        missing = self.receiver.missing() is not None
        self.gaps.note(missing)
        if missing or self.core.asking:  # (asking: time the answers that filled a gap now)
            self._ask()
        if self.core.waiting:
            self._waiting.set()

    def on_datagram(self, data: bytes) -> None:
        """One datagram, delivered at once (tests)."""
        self._carry_out(self.core.on_datagrams([data]))
        if self.core.waiting:
            self._waiting.set()

    def _carry_out(self, actions: list) -> None:
        """The runs delivered together; anything else carried out after the runs before it."""
        runs: list[Deliver] = []
        for a in actions:
            kind = type(a)
            if kind is Deliver:
                runs.append(a)
                continue
            if runs:
                self.deliver(runs)
                runs = []
            if kind is Ahead:
                if self.on_ahead is not None:
                    self.on_ahead(a.packet)
            elif kind is Undecodable:
                if self.on_undecodable is not None:
                    self.on_undecodable(a.seq, a.error)
            else:
                self.badlog.warn(a.reason, "dropped datagram: %s", a)
        if runs:
            self.deliver(runs)

    async def _tick(self) -> None:
        """Ask again what stays unanswered, and for what a hint says is missing, at a steady tick
        while anything is (a tick a listener with nothing missing was a hundred idle wake-ups
        a second)."""
        while True:
            if not self.core.waiting:
                self._waiting.clear()
                await self._waiting.wait()
            await asyncio.sleep(max(self.cfg.gap_request_ms, GAP_TICK_MS) / 2000)
            self._ask()

    def _ask(self) -> None:
        for ask in self.core.on_timer(time.monotonic_ns()):
            self.sockets.ask(ask.index, ask.request)
