"""`tape bench stream --endpoint`: the sequencer as it runs, not its model.

The real `tape sequencer` process (its shell: inbound socket, client MACs, stamping, journal
with an fsync a batch, seals, multicast publishing; with keys, as `tape up` runs it) leads a
cluster of one voter on one core, so what it publishes is committed by its own fsync. On the
other core this process is its client and its one listener: it sends signed inbound batches
from a window of messages in flight, as many as the leader takes, and hears the stream for the
acknowledgement of each (the highest client seq sequenced). The rate counts from the first
batch sent to the last message published; the leader's CPU is read from /proc over the same
span (`/proc/PID/task/*/schedstat`, in nanoseconds).
"""

from __future__ import annotations

import os
import select
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from tape.ops.verification.local import LocalCluster, Stall, parse_metrics, task_cpu_seconds
from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import messages, moldudp64
from tape.runtime.mmsg import recv_datagrams, send_datagrams
from tape.runtime.udp import multicast_receiver, udp_socket
from tape.sequencer.client_core import ClientCore

WINDOW_MESSAGES = 50_000  # in flight: ~1,700 datagrams, a few MiB of the leader's socket buffer
SEND_CHUNK = 64  # datagrams a send call
STALL_S = 30.0  # no message sequenced this long: the run failed (the bench stops by itself)
LEAD_TIMEOUT_S = 20.0


class LeaderRun(NamedTuple):
    rate: float  # messages a second, first batch sent to the last message published
    cpu_us: float  # the leader process's CPU (all its threads) a message
    fsyncs: int  # the leader journal's fsyncs in the run
    backoffs: int  # times the leader told the client to back off (it was sent more than it took)


def bench_leader(n: int = 1_000_000) -> LeaderRun:
    """`n` messages through the real sequencer (module docstring); raises unless every one was
    published."""
    root = Path(tempfile.mkdtemp(prefix="tape-bench-leader-"))
    cores = os.sched_getaffinity(0)
    cluster = None
    try:
        if len(cores) > 1:
            os.sched_setaffinity(0, {min(cores)})  # the sequencer inherits this core...
        cluster = LocalCluster(root, rewinders=0, clients=1, sequencers=1)
        cluster.start_node("seq-a")
        if len(cores) > 1:
            os.sched_setaffinity(0, cores - {min(cores)})  # ...and this process takes the others
        _wait_leading(cluster)
        return _run(cluster, n)
    finally:
        if cluster is not None:
            cluster.close()
        os.sched_setaffinity(0, cores)
        shutil.rmtree(root, ignore_errors=True)


def _wait_leading(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + LEAD_TIMEOUT_S
    while cluster.leader() != "seq-a":
        cluster.check_running()
        if time.monotonic() > deadline:
            raise RuntimeError(f"seq-a did not lead within {LEAD_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _run(cluster: LocalCluster, n: int) -> LeaderRun:
    cfg, node, client = cluster.cfg, cluster.cfg.node("seq-a"), cluster.cfg.clients[0]
    origin = moldudp64.session_bytes(client.name)
    batches = _batches(origin, client.key, cfg.max_packet, n)
    ends = []  # the last client seq of each batch
    for data in batches:
        ends.append((ends[-1] if ends else 0) + moldudp64.decode_header(data)[2])
    stream, _ = multicast_receiver(cfg.group, cfg.port, "127.0.0.1")
    out, _ = udp_socket()
    inbound = (node.host, node.inbound_port)
    pid = cluster.procs["seq-a"].pid
    before = _counters(cluster)
    try:
        cpu0, t0 = task_cpu_seconds(pid), time.perf_counter()
        sent, acked = 0, Stall(cluster, STALL_S, "sequenced", "client seq")
        while acked.value < n:
            while sent < len(batches) and ends[sent] - acked.value <= WINDOW_MESSAGES:
                chunk = batches[sent:sent + SEND_CHUNK]
                send_datagrams(out, chunk, inbound)
                sent += len(chunk)
            select.select([stream], [], [], 0.1)
            acked.saw(max((messages.client_seq_maxima(memoryview(packet)[moldudp64.HEADER_SIZE:], 2).get(origin, 0)
                           for packet in recv_datagrams(stream, 256)), default=0), n)
        seconds, cpu = time.perf_counter() - t0, task_cpu_seconds(pid) - cpu0
    finally:
        stream.close()
        out.close()
    after = _counters(cluster)
    return LeaderRun(n / seconds, cpu / n * 1e6, int(after[0] - before[0]), int(after[1] - before[1]))


def _batches(origin: bytes, key: bytes | None, max_packet: int, n: int) -> list[bytes]:
    """`n` trades as the client sends them: numbered, in full datagrams, each signed."""
    return ClientCore(origin, key, max_packet, 10**12).submit(TradeGenerator(seed=11).take(n), 0)


def _counters(cluster: LocalCluster) -> tuple[float, float]:
    """The leader's journal fsyncs and back-offs sent, from its metrics."""
    m = parse_metrics(cluster.fetch("seq-a", cluster.cfg.node("seq-a").metrics_port, 5.0).decode())
    label = '{node="seq-a"}'
    return m[f"tape_sequencer_journal_fsyncs_total{label}"], m[f"tape_sequencer_backoffs_sent_total{label}"]
