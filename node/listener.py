"""Joining the public stream: the shell every listener shares (clients,
`tape tail`, replicas). Receives multicast packets and rewinders' answers
(dropping a seeded share if asked) and carries out what ListenerCore
decides: hands each in-order run of messages to a callback as (first seq,
packet bytes, index of the first message), and sends its gap requests.

The multicast stream is the hot path: a non-blocking socket drained up to
DRAIN_DATAGRAMS per wake-up. Gap requests and the rewinders' answers are a
low-rate request/answer exchange (one answer per request): they use an
asyncio-dgram stream, one await per datagram."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import asyncio_dgram

from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config
from tape.node.transport import LossInjector, multicast_receiver, udp_socket
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import DATAGRAM_BUFFER, DRAIN_DATAGRAMS
from tape.protocol.listener import Ahead, Deliver, ListenerCore

log = logging.getLogger("tape.listener")


class StreamListener:
    def __init__(self, cfg: Config, interface: str, deliver: Callable[[int, bytes, int], None], drop: float = 0.0,
                 seed: int = 0, next_seq: int = 1, on_undecodable: Callable[[int, ProtocolError], None] | None = None,
                 on_ahead: Callable[[bytes], None] | None = None):
        """`interface`: the local address multicast arrives on (netif.resolve'd). `on_ahead`: gets
        each sealed packet held ahead of a gap (clients stop resending what it shows)."""
        self.cfg = cfg
        self.interface = interface
        self.deliver = deliver
        self.on_ahead = on_ahead
        # Called when a verified (sealed) packet, the committed log itself, holds a
        # message this listener cannot decode: skipping it would diverge.
        self.on_undecodable = on_undecodable
        self.loss = LossInjector(drop, seed)
        self.rewinders = [(n.host, n.gapfill_port) for n in cfg.by_role("rewinder")]
        self.core = ListenerCore(cfg.session_bytes, len(self.rewinders), cfg.gap_request_ms * 1_000_000, next_seq,
                                 cfg.stream_auth, cfg.max_packet)
        self.receiver = self.core.receiver
        self.badlog = RateLimitedLog(log)
        self.datagrams = 0
        self._task = None
        self._gap_seen = asyncio.Event()  # the multicast side found a gap: ask now, not at the next tick

    @property
    def bad(self) -> dict[str, int]:
        return self.core.bad

    @property
    def requests_sent(self) -> int:
        return self.core.requests_sent

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.mcast, self.rcvbuf = multicast_receiver(self.cfg.group, self.cfg.port, self.interface)
        # Bound to the multicast interface's address: the source address rewinders see, which a
        # signed request names as where its answer goes.
        self.req, _ = udp_socket(self.interface)
        self.core.reply_at(*self.req.getsockname())
        loop.add_reader(self.mcast, self._drain)
        self._task = asyncio.create_task(self._gap_exchange())

    def stop(self) -> None:
        """Stop receiving (the gap exchange's socket closes as its task ends)."""
        asyncio.get_running_loop().remove_reader(self.mcast)
        self.mcast.close()
        if self._task:
            self._task.cancel()

    async def close(self) -> None:
        """Stop, and return once every socket is closed: a listener started next may reuse their
        file descriptors, which asyncio must no longer watch."""
        self.stop()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)

    def _drain(self) -> None:
        loss, on_datagram, sock = self.loss, self.on_datagram, self.mcast
        for _ in range(DRAIN_DATAGRAMS):
            try:
                data = sock.recv(DATAGRAM_BUFFER)
            except BlockingIOError:
                break
            self.datagrams += 1
            if not loss.drop():
                on_datagram(data)
        if self.receiver.missing() is not None:
            self._gap_seen.set()

    def on_datagram(self, data: bytes) -> None:
        actions = self.core.on_datagram(data)
        if isinstance(actions, ProtocolError):
            self.badlog.warn(actions.reason, "dropped datagram of %d bytes: %s", len(data), actions)
            return
        for a in actions:
            if isinstance(a, Deliver):
                self.deliver(a.first_seq, a.packet, a.skip)
            elif isinstance(a, Ahead):
                if self.on_ahead is not None:
                    self.on_ahead(a.packet)
            elif self.on_undecodable is not None:
                self.on_undecodable(a.seq, a.error)

    async def _gap_exchange(self) -> None:
        """Gap requests out, the rewinders' answers (the committed log) in."""
        stream = await asyncio_dgram.from_socket(self.req)
        answer = asyncio.ensure_future(stream.recv())
        seen = asyncio.ensure_future(self._gap_seen.wait())
        try:
            while True:
                await asyncio.wait((answer, seen), timeout=self.cfg.gap_request_ms / 2000,
                                   return_when=asyncio.FIRST_COMPLETED)
                if answer.done():
                    answer = self._on_answer(answer, stream)
                if seen.done():
                    self._gap_seen.clear()
                    seen = asyncio.ensure_future(self._gap_seen.wait())
                for ask in self.core.on_timer(time.monotonic_ns()):
                    try:
                        await stream.send(ask.request, self.rewinders[ask.index])
                    except OSError as e:  # asked again after the timeout
                        self.badlog.warn("send_error", "gap request failed: %s", e)
        finally:
            answer.cancel()
            seen.cancel()
            stream.close()

    def _on_answer(self, done: asyncio.Future, stream) -> asyncio.Future:
        """Take one answer; return the wait for the next."""
        try:
            data, _ = done.result()
        except OSError as e:  # an ICMP error reported for a request: asked again after the timeout
            self.badlog.warn("send_error", "gap request failed: %s", e)
        else:
            self.datagrams += 1
            if not self.loss.drop():
                self.on_datagram(data)
        return asyncio.ensure_future(stream.recv())
