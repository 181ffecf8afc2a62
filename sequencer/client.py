"""The client library: submit trades exactly once.

`submit(messages)` numbers them with this client's own sequence numbers,
sends them as inbound batches to every sequencer, and listens to the public
stream: a message seen sequenced with this client as origin is acknowledged
(the sequencer accepts each client's messages in order, so seeing client
seq k acknowledges everything up to k). What is not acknowledged within the
resend timeout is sent again; the sequencer drops what it already has.
`submit` waits while too much is in flight (back-pressure).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
import time
from collections import deque

from tape.node.listener import StreamListener
from tape.node.settings import Config
from tape.node.transport import udp_socket
from tape.protocol import messages, moldudp64
from tape.protocol.limits import RESENDS_PER_ROUND

# Only origin and client seq of each 77-byte block: cheap to scan the whole stream.
_ORIGIN_CSEQ = struct.Struct(">59x10sQ")


class Client:
    def __init__(self, cfg: Config, name: str, drop: float = 0.0, seed: int = 0, max_in_flight: int = 100_000):
        self.cfg = cfg
        self.name = name
        self.origin = moldudp64.session_bytes(name)
        self.key = cfg.client(name).key
        self.sequencers = [(n.host, n.inbound_port) for n in cfg.by_role("sequencer")]
        self.per_batch = (
            cfg.max_packet - moldudp64.HEADER_SIZE - (32 if self.key else 0)
        ) // messages.INBOUND_BLOCK_SIZE
        self.max_in_flight = max_in_flight
        self.listener = StreamListener(cfg, self._on_stream, drop, seed)
        self.next_cseq = 1
        self.acked = 0  # highest client seq seen sequenced
        self.acked_at_seq: dict[int, int] = {}
        self._unacked: deque = deque()  # [first cseq, count, datagram, first sent, next resend due, resends]
        self._progress = asyncio.Event()
        self.resends = 0
        self.latencies_ns: list[int] = []  # submit -> seen sequenced, one sample per batch
        self._timeout = cfg.client_resend_ms * 1_000_000
        self._task = None

    async def start(self) -> None:
        self.sock, _ = udp_socket("127.0.0.1" if self.cfg.interface.startswith("127.") else "0.0.0.0")
        self.listener.start()
        self._task = asyncio.create_task(self._resend_loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.listener.stop()
        self.sock.close()

    @property
    def in_flight(self) -> int:
        return self.next_cseq - 1 - self.acked

    async def submit(self, msgs: list[bytes]) -> int:
        """Send inbound messages; returns the client seq of the last one."""
        while self.in_flight + len(msgs) > self.max_in_flight and self.in_flight > 0:
            self._progress.clear()
            await self._progress.wait()
        now = time.monotonic_ns()
        for start in range(0, len(msgs), self.per_batch):
            chunk = msgs[start:start + self.per_batch]
            data = moldudp64.encode_packet(self.origin, self.next_cseq, chunk)
            if self.key:
                data += hmac.new(self.key, data, hashlib.sha256).digest()
            self._unacked.append([self.next_cseq, len(chunk), data, now, now + self._timeout, 0])
            self.next_cseq += len(chunk)
            self._send(data)
        return self.next_cseq - 1

    def _send(self, data: bytes) -> None:
        for addr in self.sequencers:
            try:
                self.sock.sendto(data, addr)
            except OSError:
                pass  # resent after the timeout

    async def wait_acked(self, cseq: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.acked < cseq:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def _on_stream(self, first: int, pkt: bytes, skip: int) -> None:
        origin = self.origin
        top = 0
        for o, cseq in _ORIGIN_CSEQ.iter_unpack(
            memoryview(pkt)[moldudp64.HEADER_SIZE + skip * messages.SEQUENCED_BLOCK_SIZE :]
        ):
            if o == origin and cseq > top:
                top = cseq
        if top > self.acked:
            self.acked = top
            now = time.monotonic_ns()
            q = self._unacked
            while q and q[0][0] + q[0][1] - 1 <= top:
                self.latencies_ns.append(now - q.popleft()[3])
            self._progress.set()

    async def _resend_loop(self) -> None:
        """Resend the oldest unacknowledged batches that are due, a few per
        round. The oldest one blocks everything behind it (the leader holds
        what arrives ahead of it), so it is resent at the plain timeout; the
        ones behind it back off (up to 8x), so that a loaded cluster is not
        sent everything again."""
        while True:
            await asyncio.sleep(self.cfg.client_resend_ms / 4000)
            now = time.monotonic_ns()
            budget = RESENDS_PER_ROUND
            for i, entry in enumerate(self._unacked):
                if budget == 0:
                    break
                if now >= entry[4]:
                    entry[5] += 1
                    entry[4] = now + (self._timeout if i == 0 else self._timeout * min(1 << entry[5], 8))
                    self.resends += 1
                    budget -= 1
                    self._send(entry[2])
