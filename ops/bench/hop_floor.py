"""The hops of a batch with none of Tape's work: what nine asyncio processes on this host spend
to carry one batch along the cluster's path, before any code of Tape's runs.

`tape bench batch-cost` divides what each process spends by the batches it carried; this is the
floor under that sum. The same nine processes, the same sockets, the same messages of about a
batch's size at 2,000 msg/s, and nothing else: a client sends a datagram; the leader writes it to
three followers over TCP; each follower writes back an acknowledgement; on the second, the leader
sends one multicast packet, which three replicas and the client's listener receive; each replica
writes an alert to the emitter over TCP. Every process runs an asyncio loop, as Tape's do, with
the leanest reads asyncio has (a protocol's `data_received`, a reader callback that drains its
datagram socket): no decoding, no hash, no journal, no node core.

Each process counts its own CPU from its first message to its last (start-up excluded) and
reports it; the sum over the batches sent is the floor a batch. Figures, never pass/fail.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import resource

from tape.runtime.udp import free_port, multicast_receiver, multicast_sender, udp_socket

FOLLOWERS, REPLICAS = 3, 3
MAJORITY_ACKS = 2  # with the leader's own: three of four voters hold it
DATAGRAM, APPEND, ACK, PACKET, ALERT = 450, 560, 52, 500, 120  # bytes: a batch of ~6.5 trades
BATCHES, BATCH_RATE = 600, 300.0  # ~2 s at the batches a second of 2,000 msg/s
DONE_WAIT_S = 20.0  # every process gives up this long after the client's last batch


def _cpu_s() -> tuple[float, float]:
    """This process's CPU seconds so far: in its own code, and in the kernel's on its behalf."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


class _Counted:
    """A process's CPU from its first message on, and whether it has seen all it waits for."""

    def __init__(self, wanted: int):
        self.wanted, self.seen, self.started = wanted, 0, None
        self.done = asyncio.Event()

    def note(self, n: int = 1) -> None:
        if self.started is None:
            self.started = _cpu_s()
        self.seen += n
        if self.seen >= self.wanted:
            self.done.set()

    def spent(self) -> tuple[float, float]:
        if self.started is None:
            return 0.0, 0.0
        now = _cpu_s()
        return now[0] - self.started[0], now[1] - self.started[1]


class _Fixed(asyncio.Protocol):
    """Counts fixed-size messages on a TCP connection and answers each with `answer` bytes."""

    def __init__(self, size: int, on_messages, answer: int = 0):
        self.size, self.on_messages, self.answer, self.pending = size, on_messages, answer, 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.pending += len(data)
        n, self.pending = divmod(self.pending, self.size)
        if n:
            if self.answer:
                self.transport.write(b"a" * self.answer * n)
            self.on_messages(self, n)


async def _until(counted: _Counted, seconds: float) -> None:
    async with asyncio.timeout(seconds):  # (the house's way: docs/decisions.md, "never wait_for")
        await counted.done.wait()


def _run(role, *args) -> None:
    """One process: its loop, then its CPU on `args[-1]` (a pipe's end); None if it did not see
    all it waited for in time (a datagram lost) or a socket failed."""
    out = args[-1]
    try:
        spent = asyncio.run(role(*args[:-1]))
    except (TimeoutError, OSError):
        spent = None
    out.send(spent)


def _result(pipe, wait_s: float):
    try:
        return pipe.recv() if pipe.poll(wait_s) else None
    except EOFError:  # (the process died)
        return None


async def _serve_until_done(port: int, factory, counted: _Counted, ready) -> tuple[float, float]:
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", port)
    ready.send(True)
    await _until(counted, BATCHES / BATCH_RATE + DONE_WAIT_S)
    spent = counted.spent()
    server.close()
    return spent


async def _follower(port: int, ready) -> tuple[float, float]:
    counted = _Counted(BATCHES)
    return await _serve_until_done(port, lambda: _Fixed(APPEND, lambda _, n: counted.note(n), ACK), counted, ready)


async def _emitter(port: int, ready) -> tuple[float, float]:
    counted = _Counted(BATCHES * REPLICAS)
    return await _serve_until_done(port, lambda: _Fixed(ALERT, lambda _, n: counted.note(n)), counted, ready)


async def _replica(group: str, port: int, emitter: int, ready) -> tuple[float, float]:
    loop, counted = asyncio.get_running_loop(), _Counted(BATCHES)
    sock, _ = multicast_receiver(group, port)
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", emitter)

    def readable() -> None:
        while True:
            try:
                sock.recv(65536)
            except BlockingIOError:
                return
            transport.write(b"r" * ALERT)
            counted.note()
    loop.add_reader(sock.fileno(), readable)
    ready.send(True)
    await _until(counted, BATCHES / BATCH_RATE + DONE_WAIT_S)
    return counted.spent()


async def _leader(inbound: int, followers: list[int], group: str, port: int, ready) -> tuple[float, float]:
    loop, counted = asyncio.get_running_loop(), _Counted(BATCHES)
    sock, _ = udp_socket(port=inbound)
    publisher, acked, published = multicast_sender(), {}, [0]

    def on_acks(link, n: int) -> None:
        acked[link] = acked.get(link, 0) + n
        committed = sorted(acked.values(), reverse=True)[MAJORITY_ACKS - 1] if len(acked) >= MAJORITY_ACKS else 0
        while published[0] < committed:
            publisher.sendto(b"p" * PACKET, (group, port))
            published[0] += 1
            counted.note()
    links = [(await loop.create_connection(lambda: _Fixed(ACK, on_acks), "127.0.0.1", p))[0] for p in followers]

    def readable() -> None:
        if counted.started is None:
            counted.started = _cpu_s()
        while True:
            try:
                sock.recv(65536)
            except BlockingIOError:
                return
            for link in links:
                link.write(b"b" * APPEND)
    loop.add_reader(sock.fileno(), readable)
    ready.send(True)
    await _until(counted, BATCHES / BATCH_RATE + DONE_WAIT_S)
    return counted.spent()


async def _client(inbound: int, group: str, port: int, go) -> tuple[float, float]:
    """Sends the batches, paced, and listens to the stream for them (as the load does)."""
    loop, counted = asyncio.get_running_loop(), _Counted(BATCHES)
    listener, _ = multicast_receiver(group, port)
    out, _ = udp_socket()

    def readable() -> None:
        while True:
            try:
                listener.recv(65536)
            except BlockingIOError:
                return
            counted.note()
    loop.add_reader(listener.fileno(), readable)
    go.recv()
    counted.started = _cpu_s()
    t0 = loop.time()
    for k in range(BATCHES):
        out.sendto(b"d" * DATAGRAM, ("127.0.0.1", inbound))
        await asyncio.sleep(max(0.0, t0 + (k + 1) / BATCH_RATE - loop.time()))
    await _until(counted, DONE_WAIT_S)
    return counted.spent()


def hop_floor() -> dict[str, float]:
    """CPU µs of all nine processes a batch carried with no work (see the module's docstring),
    in all and of which in the kernel."""
    ctx = multiprocessing.get_context("fork")
    rng = random.SystemRandom()
    group = f"239.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}"
    stream, inbound, emitter = free_port(), free_port(), free_port()
    followers = [free_port() for _ in range(FOLLOWERS)]
    plan = [(_emitter, emitter), *((_follower, p) for p in followers),
            *((_replica, group, stream, emitter) for _ in range(REPLICAS)),
            (_leader, inbound, followers, group, stream)]
    procs, results = [], []
    try:
        for role, *args in plan:  # each ready before the next connects to it
            ready_r, ready_w = ctx.Pipe(duplex=False)
            result_r, result_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_run, args=(role, *args, ready_w, result_w), daemon=True)
            proc.start()
            procs.append(proc)
            results.append(result_r)
            if not ready_r.poll(DONE_WAIT_S):
                raise RuntimeError(f"hop floor: {role.__name__} did not start")
            ready_r.recv()
        go_r, go_w = ctx.Pipe(duplex=False)
        result_r, result_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_run, args=(_client, inbound, group, stream, go_r, result_w), daemon=True)
        proc.start()
        procs.append(proc)
        results.append(result_r)
        go_w.send(True)
        wait_s = BATCHES / BATCH_RATE + 2 * DONE_WAIT_S
        spent = [_result(r, wait_s) for r in results]
        if None in spent:
            raise RuntimeError("hop floor: a process did not report (a lost datagram?)")
        user, kernel = (sum(part) * 1e6 / BATCHES for part in zip(*spent))
        return {"all": user + kernel, "kernel": kernel}
    finally:
        for proc in procs:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
