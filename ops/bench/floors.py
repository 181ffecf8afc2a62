"""What this host charges before any code of Tape's runs, printed by `tape bench batch-cost` beside
what a batch costs each process:

- `wake_floor`: the CPU of a wake-up of a process that only receives a datagram, with a blocking
  recv() and on an asyncio loop;
- `hop_floor`: what nine asyncio processes spend to carry one batch along the cluster's path with
  none of Tape's work, the floor under batch-cost's sum.

The hops are the cluster's: the same nine processes, the same sockets, the same messages of about a
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
import socket
import time

from tape.runtime.udp import free_port, multicast_receiver, multicast_sender, udp_socket

FOLLOWERS, REPLICAS = 3, 3
MAJORITY_ACKS = 2  # with the leader's own: three of four voters hold it
DATAGRAM, APPEND, ACK, PACKET, ALERT = 450, 560, 52, 500, 120  # bytes: a batch of ~6.5 trades
BATCHES, BATCH_RATE = 600, 300.0  # ~2 s at the batches a second of 2,000 msg/s
DONE_WAIT_S = 20.0  # how long past the batches' own time a process waits for the last of them
WAKE_DATAGRAMS, WAKE_RATE, WAKE_DATAGRAM = 600, 300.0, 600  # wake_floor: 2 s a receiver, a batch's rate and size
WAKE_WAIT_S = 10.0  # wake_floor: a datagram later than this (lost) ends the measurement


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


def _send_paced(address: tuple, n: int, rate: float) -> None:
    """The other end of `wake_floor`: `n` datagrams to `address`, `rate` a second."""
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    t0 = time.monotonic()
    for k in range(n):
        out.sendto(b"x" * WAKE_DATAGRAM, address)
        time.sleep(max(0.0, t0 + (k + 1) / rate - time.monotonic()))


def wake_floor(n: int = WAKE_DATAGRAMS, rate: float = WAKE_RATE) -> dict[str, float]:
    """This host's CPU µs a wake-up of a process that only receives a datagram (paced, so each
    comes to a sleeping receiver): with a blocking recv(), and on an asyncio loop as Tape's
    processes run. What no code of a batch's path can cost less than, per wake-up batch-cost counts."""
    def receive_blocking(sock: socket.socket) -> None:
        sock.settimeout(WAKE_WAIT_S)
        for _ in range(n):
            sock.recv(WAKE_DATAGRAM)

    def receive_asyncio(sock: socket.socket) -> None:
        async def run() -> None:
            loop, done, got = asyncio.get_running_loop(), asyncio.Event(), [0]

            def readable() -> None:
                while got[0] < n:
                    try:
                        sock.recv(WAKE_DATAGRAM)
                    except BlockingIOError:
                        return
                    got[0] += 1
                done.set()
            sock.setblocking(False)
            loop.add_reader(sock.fileno(), readable)
            async with asyncio.timeout(n / rate + WAKE_WAIT_S):
                await done.wait()
        asyncio.run(run())

    floor = {}
    for name, receive in (("a blocking recv", receive_blocking), ("an asyncio loop", receive_asyncio)):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sender = multiprocessing.get_context("fork").Process(target=_send_paced,
                                                               args=(sock.getsockname(), n, rate))
            cpu = time.process_time()
            sender.start()
            try:
                receive(sock)
            finally:
                sender.join()
            floor[name] = (time.process_time() - cpu) * 1e6 / n
    return floor
