"""Joining the public stream: the shell every listener shares (clients,
`tape tail`, replicas). Receives multicast packets (dropping a seeded
share if asked), puts them in order with StreamReceiver, asks the
rewinders for what is missing, and hands each in-order run of messages to
a callback as (first seq, packet bytes, index of the first message)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config
from tape.node.transport import LossInjector, multicast_receiver, udp_socket
from tape.protocol import messages, moldudp64
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import DATAGRAM_BUFFER, DRAIN_DATAGRAMS
from tape.protocol.receiver import StreamReceiver

log = logging.getLogger("tape.listener")

Deliver = Callable[[int, bytes, int], None]


class StreamListener:
    def __init__(self, cfg: Config, deliver: Deliver, drop: float = 0.0, seed: int = 0, next_seq: int = 1,
                 on_undecodable: Callable[[int, ProtocolError], None] | None = None):
        self.cfg = cfg
        self.deliver = deliver
        # Called when a rewinder's answer (the committed log itself) holds a
        # message this listener cannot decode: skipping it would diverge.
        self.on_undecodable = on_undecodable
        self.loss = LossInjector(drop, seed)
        self.receiver = StreamReceiver(cfg.session_bytes, next_seq)
        self.rewinders = [(n.host, n.gapfill_port) for n in cfg.by_role("rewinder")]
        self.badlog = RateLimitedLog(log)
        self.bad: dict[str, int] = {}
        self.requests_sent = 0
        self.datagrams = 0
        self._ask = (0, 0.0)  # (seq asked for, when)
        self._which = 0
        self._task = None

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
        try:
            session, seq, count = moldudp64.decode_header(data)
            if 0 < count < 0xFFFF:
                try:
                    messages.check_packet_messages(data, count)
                except ProtocolError as e:
                    if committed and session == self.receiver.session and e.reason in ("unknown_type", "bad_length") \
                            and seq <= self.receiver.next_seq < seq + count and self.on_undecodable:
                        bad_seq = seq + max(0, e.offset - moldudp64.HEADER_SIZE) // messages.SEQUENCED_BLOCK_SIZE
                        self.on_undecodable(bad_seq, e)
                    raise
            runs = self.receiver.on_packet(session, seq, count, data)
        except ProtocolError as e:
            self.bad[e.reason] = self.bad.get(e.reason, 0) + 1
            self.badlog.warn(e.reason, "dropped datagram of %d bytes: %s", len(data), e)
            return
        for first, pkt, skip in runs:
            self.deliver(first, pkt, skip)

    def _maybe_ask(self) -> None:
        gap = self.receiver.missing()
        if gap is None or not self.rewinders:
            return
        now = time.monotonic()
        if gap[0] == self._ask[0] and now - self._ask[1] < self.cfg.gap_request_ms / 1000:
            return
        if gap[0] == self._ask[0]:
            self._which += 1  # no answer: try the next rewinder
        self._ask = (gap[0], now)
        target = self.rewinders[self._which % len(self.rewinders)]
        try:
            self.req.sendto(moldudp64.encode_request(self.cfg.session_bytes, gap[0], gap[1]), target)
            self.requests_sent += 1
        except OSError:
            pass

    async def _gap_timer(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.gap_request_ms / 2000)
            self._maybe_ask()
