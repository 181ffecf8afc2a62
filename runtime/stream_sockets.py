"""Joining the public stream: the I/O every listener shares. StreamSockets
receives multicast packets and rewinders' answers (dropping a seeded share if
asked) and sends gap requests, for the replica's node core and the clients'
(sequencer/client_shell.py StreamListener, which `tape tail` uses too); GapTimer
times how long something stayed missing.

Both sockets, the multicast stream's and the one gap requests go out on and
the rewinders' answers come back to, are non-blocking and drained up to
DRAIN_DATAGRAMS per wake-up: nothing queues in the process but what the
kernel's receive buffer holds, whatever a flood of answers sends."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from tape.runtime.latency import LatencyHistogram
from tape.runtime.loss import LossInjector
from tape.runtime.mmsg import recv_datagrams
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.settings import Config
from tape.runtime.tuning import DRAIN_DATAGRAMS
from tape.runtime.udp import multicast_receiver, udp_socket

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
        self.mcast, self.rcvbuf = multicast_receiver(self.cfg.group, self.cfg.port, self.interface,
                                                     sources=self.cfg.stream_sources)
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

    def note(self, missing: bool, now: int) -> None:
        """`now`: the monotonic clock's ns at the drain."""
        if missing == (self._since is not None):
            return
        if missing:
            self._since = now
        else:
            self.histogram.observe(now - self._since)
            self._since = None
