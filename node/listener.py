"""Joining the public stream: the shell every listener shares (clients,
`tape tail`, replicas). Receives multicast packets and rewinders' answers
(dropping a seeded share if asked) and carries out what ListenerCore
decides: hands each in-order run of messages to a callback as (first seq,
packet bytes, index of the first message), and sends its gap requests."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config
from tape.node.transport import LossInjector, multicast_receiver, udp_socket
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import DATAGRAM_BUFFER, DRAIN_DATAGRAMS
from tape.protocol.listener import AskRewinder, Deliver, ListenerCore

log = logging.getLogger("tape.listener")


class StreamListener:
    def __init__(self, cfg: Config, deliver: Callable[[int, bytes, int], None], drop: float = 0.0, seed: int = 0,
                 next_seq: int = 1, on_undecodable: Callable[[int, ProtocolError], None] | None = None):
        self.cfg = cfg
        self.deliver = deliver
        # Called when a rewinder's answer (the committed log itself) holds a
        # message this listener cannot decode: skipping it would diverge.
        self.on_undecodable = on_undecodable
        self.loss = LossInjector(drop, seed)
        self.rewinders = [(n.host, n.gapfill_port) for n in cfg.by_role("rewinder")]
        self.core = ListenerCore(cfg.session_bytes, len(self.rewinders), cfg.gap_request_ms * 1_000_000, next_seq)
        self.receiver = self.core.receiver
        self.badlog = RateLimitedLog(log)
        self.datagrams = 0
        self._task = None

    @property
    def bad(self) -> dict[str, int]:
        return self.core.bad

    @property
    def requests_sent(self) -> int:
        return self.core.requests_sent

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.mcast, self.rcvbuf = multicast_receiver(self.cfg.group, self.cfg.port, self.cfg.interface)
        self.req, _ = udp_socket("127.0.0.1" if self.cfg.interface.startswith("127.") else "0.0.0.0")
        loop.add_reader(self.mcast, self._drain, self.mcast)
        loop.add_reader(self.req, self._drain, self.req)
        self._task = asyncio.create_task(self._gap_timer())

    def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for s in (self.mcast, self.req):
            loop.remove_reader(s)
            s.close()
        if self._task:
            self._task.cancel()

    def _drain(self, sock) -> None:
        loss, on_datagram = self.loss, self.on_datagram
        committed = sock is self.req  # unicast answers from the rewinders
        for _ in range(DRAIN_DATAGRAMS):
            try:
                data = sock.recv(DATAGRAM_BUFFER)
            except BlockingIOError:
                break
            self.datagrams += 1
            if not loss.drop():
                on_datagram(data, committed)
        self._maybe_ask()

    def on_datagram(self, data: bytes, committed: bool = False) -> None:
        actions = self.core.on_datagram(data, committed)
        if isinstance(actions, ProtocolError):
            self.badlog.warn(actions.reason, "dropped datagram of %d bytes: %s", len(data), actions)
            return
        for a in actions:
            if isinstance(a, Deliver):
                self.deliver(a.first_seq, a.packet, a.skip)
            elif self.on_undecodable is not None:
                self.on_undecodable(a.seq, a.error)

    def _maybe_ask(self) -> None:
        ask: AskRewinder | None = self.core.on_timer(time.monotonic_ns())
        if ask is not None:
            try:
                self.req.sendto(ask.request, self.rewinders[ask.index])
            except OSError:
                pass  # asked again after the timeout

    async def _gap_timer(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.gap_request_ms / 2000)
            self._maybe_ask()
