"""The client library's shell: submit trades exactly once.

`submit(messages)` hands them to ClientCore, which numbers and batches
them, and sends each batch to the leader the stream names (every sequencer
while none is known, and for resends); the StreamListener feeds
the public stream back to the core, whose acknowledgements release
`submit`'s back-pressure and `wait_acked`; a timer sends again what the
core says is due (sequencer/client_core.py has the policy). The send
socket hears the leader's advice: back-offs (`submit` holds new batches
while the core says so) and resend requests (sent at once).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from tape.node import netif
from tape.node.batchio import send_datagrams
from tape.node.listener import StreamListener
from tape.node.process import within
from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config
from tape.node.transport import udp_socket
from tape.protocol import moldudp64
from tape.protocol.limits import DATAGRAM_BUFFER, DRAIN_DATAGRAMS
from tape.protocol.receiver import Deliver
from tape.sequencer.client_core import ClientCore, Recovery, read_drain

log = logging.getLogger("tape.client")


class Client:
    def __init__(self, cfg: Config, name: str, drop: float = 0.0, seed: int = 0, max_in_flight: int = 100_000,
                 listener: StreamListener | None = None):
        """`listener`: the stream as other clients of this process read it (`sharing_listeners`);
        by default the client reads it itself."""
        self.cfg = cfg
        self.name = name
        self.core = ClientCore(moldudp64.session_bytes(name), cfg.client(name).key, cfg.max_packet,
                               cfg.client_resend_ms * 1_000_000)
        self.sequencers = [(n.host, n.inbound_port) for n in cfg.by_role("sequencer")]
        self._by_name = {n.wire_name: (n.host, n.inbound_port) for n in cfg.by_role("sequencer")}
        self._leaders = {(socket.gethostbyname(h), p) for h, p in self.sequencers}  # where back-offs come from
        self.badlog = RateLimitedLog(log)
        self.max_in_flight = max_in_flight
        self.interface = netif.resolve(cfg.interface_of(cfg.client(name)))
        self._own_listener = listener is None
        self.listener = listener or StreamListener(cfg, self.interface, _fan_out([self]), drop, seed,
                                                   on_ahead=self.on_ahead)
        self._progress = asyncio.Event()
        self._task = None
        self._sent = asyncio.Event()  # set while something sent waits for its acknowledgement

    # What the tools read.
    next_cseq = property(lambda self: self.core.next_cseq)
    acked = property(lambda self: self.core.acked)
    in_flight = property(lambda self: self.core.in_flight)
    per_batch = property(lambda self: self.core.per_batch)  # messages one datagram holds
    resends = property(lambda self: self.core.resends)
    rejected = property(lambda self: self.core.rejected)  # [(client seq, reason)] sequenced as rejects
    latencies_ns = property(lambda self: self.core.latencies_ns)
    backoffs = property(lambda self: self.core.backoffs)  # back-offs honoured

    async def start(self) -> None:
        self.sock, _ = udp_socket("127.0.0.1" if self.interface.startswith("127.") else "0.0.0.0")
        if self._own_listener:
            self.listener.start()
        asyncio.get_running_loop().add_reader(self.sock, self._on_advice)
        self._task = asyncio.create_task(self._resend_loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        asyncio.get_running_loop().remove_reader(self.sock)
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
        self._send(self.core.submit(msgs, time.monotonic_ns()), self.core.leader)
        self._sent.set()
        return self.core.next_cseq - 1

    def _on_advice(self) -> None:
        for _ in range(DRAIN_DATAGRAMS):
            try:
                data, source = self.sock.recvfrom(DATAGRAM_BUFFER)
            except (BlockingIOError, OSError):
                return
            now = time.monotonic_ns()
            reason = self.core.on_advice(data, now, source in self._leaders)
            if reason is None:  # (a resend request made a batch due now)
                self._send(self.core.on_timer(now))
            elif reason != "sent_recently":
                self.badlog.warn(reason, "dropped a datagram of %d bytes from %s:%d: %s", len(data), *source, reason)

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
        recovery = Recovery()
        deadline = time.monotonic() + timeout
        while not recovery.done(self.listener.core):
            if time.monotonic() >= deadline:
                what = f"read up to seq {recovery.head - 1:,}" if recovery.head else "heard (no packet or heartbeat)"
                raise TimeoutError(f"recovering: the stream was not {what} within {timeout:.0f} s")
            await asyncio.sleep(0.01)
        return self.core.resume()

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

    def on_stream(self, read: tuple, now_ns: int) -> None:
        """A drain of the stream, as `read_drain` read it for every client of this process."""
        if self.core.on_read(read, now_ns):
            self._progress.set()

    def on_ahead(self, pkt: bytes) -> None:
        self.core.on_ahead(pkt, time.monotonic_ns())

    async def _resend_loop(self) -> None:
        """Resends when due, while anything waits for its acknowledgement."""
        while True:
            if not self.core.unacked:
                self._sent.clear()
                await self._sent.wait()
            await asyncio.sleep(self.cfg.client_resend_ms / 4000)
            self._send(self.core.on_timer(time.monotonic_ns()))


def sharing_listeners(cfg: Config, names: list[str], drop: float = 0.0, seed: int = 0) -> tuple[list, list]:
    """Clients of one process that read the stream once per interface, not once each: one
    listener hands each packet to every client on its interface (each finds its own
    acknowledgements in it). Returns (listeners, clients); the caller starts and stops the
    listeners."""
    groups: dict[str, tuple[StreamListener, list[Client]]] = {}
    clients = []
    for name in names:
        interface = netif.resolve(cfg.interface_of(cfg.client(name)))
        if interface not in groups:
            group: list[Client] = []
            groups[interface] = (StreamListener(cfg, interface, _fan_out(group), drop, seed + len(groups),
                                                on_ahead=_fan_out_ahead(group)), group)
        listener, group = groups[interface]
        group.append(Client(cfg, name, listener=listener))
        clients.append(group[-1])
    return [listener for listener, _ in groups.values()], clients


def _fan_out(clients: list[Client]):
    def deliver(runs: list[Deliver]) -> None:
        read, now = read_drain(runs), time.monotonic_ns()  # once for all of them
        for c in clients:
            c.on_stream(read, now)
    return deliver


def _fan_out_ahead(clients: list[Client]):
    def ahead(pkt: bytes) -> None:
        for c in clients:
            c.on_ahead(pkt)
    return ahead
