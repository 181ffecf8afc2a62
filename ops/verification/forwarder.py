"""An impaired cable: copies Ethernet frames between two interfaces with delay, jitter (which
reorders), duplication and loss. This kernel has no netem; the LAN harness (ops/verification/lan.py) puts
this process, in a namespace of its own, between a host and the switch.

    python -m tape.ops.verification.forwarder A B --delay-ms 2 --jitter-ms 1 --dup 0.01 --loss 0 --seed 1

Runs until SIGTERM. Frames are held in a heap by due time; each direction is impaired alike.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # a frame this socket's interface sent: not ours to forward
MAX_FRAME = 65536


def open_raw(interface: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((interface, ETH_P_ALL))  # (host order here; socket() wants it swapped)
    s.setblocking(False)
    return s


class Impairment:
    def __init__(self, delay_ms: float, jitter_ms: float, dup: float, loss: float, seed: int):
        self.delay_s, self.jitter_s, self.dup, self.loss = delay_ms / 1000, jitter_ms / 1000, dup, loss
        self.rng = random.Random(seed)

    def copies(self, now: float) -> list[float]:
        """When each copy of a frame arriving now leaves (none if lost)."""
        if self.rng.random() < self.loss:
            return []
        n = 2 if self.rng.random() < self.dup else 1
        return [now + max(0.0, self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s)) for _ in range(n)]


def run(a: str, b: str, impairment: Impairment) -> None:
    socks = {a: open_raw(a), b: open_raw(b)}
    other = {socks[a]: socks[b], socks[b]: socks[a]}
    queue: list[tuple[float, int, socket.socket, bytes]] = []
    order = 0
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 0.5
        ready, _, _ = select.select(list(other), [], [], timeout)
        now = time.monotonic()
        for s in ready:
            while True:
                try:
                    frame, address = s.recvfrom(MAX_FRAME)
                except BlockingIOError:
                    break
                if address[2] == PACKET_OUTGOING:
                    continue
                for due in impairment.copies(now):
                    order += 1
                    heapq.heappush(queue, (due, order, other[s], frame))
        while queue and queue[0][0] <= time.monotonic():
            _, _, out, frame = heapq.heappop(queue)
            try:
                out.send(frame)
            except OSError:
                pass  # the link is down: the frame is lost, as on a cable


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--dup", type=float, default=0.0, help="share of frames sent twice")
    p.add_argument("--loss", type=float, default=0.0, help="share of frames dropped")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    run(args.a, args.b, Impairment(args.delay_ms, args.jitter_ms, args.dup, args.loss, args.seed))


if __name__ == "__main__":
    main()
