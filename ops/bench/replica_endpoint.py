"""`tape bench replica --endpoint`: a replica as it runs, not its audit alone.

The real `tape replica` process (its listener: seal checks, ordering, gap detection; the
audit; the alert link to the emitter; snapshots to LMDB) on one core; on the other core a real
emitter, and this process as the leader: it publishes a stream the real LeaderCore sequenced
and sealed with the stream key, as fast as the replica reads it. It keeps at most
QUEUED_BYTES waiting in the replica's socket (its receive queue, from /proc/net/udp), so
nothing is dropped and no gap fill is needed. The rate counts from the first packet sent to
the replica's metrics showing the last message applied; the replica's CPU is read over the
same span (every thread, /proc/PID/task/*/schedstat).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from tape.ops.verification.local import LocalCluster, Stall, parse_metrics, task_cpu_seconds
from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import moldudp64
from tape.protocol.streamauth import StreamKeys
from tape.runtime.mmsg import send_datagrams
from tape.runtime.udp import multicast_sender
from tape.sequencer.client_core import ClientCore
from tape.sequencer.leader_core import LeaderCore

QUEUED_BYTES = 16 << 20  # at most this much waiting in the replica's socket (it is granted 64 MiB)
SEND_CHUNK = 64  # packets a send call
STALL_S = 30.0  # nothing more applied this long: the run failed (the bench stops by itself)
JOIN_TIMEOUT_S = 30.0
POLL_S = 0.02  # the replica's metrics, read only once every packet was sent (its endpoint answers 50 a second)
STREAM_MS_PER_BATCH = 1  # the stamps' clock: a batch of ~1,000 messages a millisecond


class ReplicaRun(NamedTuple):
    rate: float  # messages a second, first packet sent to the last message applied
    cpu_us: float  # the replica process's CPU (all its threads) a message
    alerts: int  # alerts the replica raised (each sent to the emitter)


def bench_replica_endpoint(n: int = 1_000_000) -> ReplicaRun:
    """`n` messages through the real replica (module docstring); raises unless it applied them all."""
    root = Path(tempfile.mkdtemp(prefix="tape-bench-replica-"))
    cores = os.sched_getaffinity(0)
    mine, theirs = (cores - {min(cores)}, {min(cores)}) if len(cores) > 1 else (cores, cores)
    cluster = None
    try:
        os.sched_setaffinity(0, mine)
        cluster = LocalCluster(root, rewinders=0, clients=1, replicas=1)
        packets, last_seq = _stream(cluster, n)
        cluster.start_node("emitter", 0.0, 0)  # on this process's core
        os.sched_setaffinity(0, theirs)  # the replica inherits the other
        cluster.start_node("replica-A")
        os.sched_setaffinity(0, mine)
        _wait_joined(cluster.cfg.group)
        return _run(cluster, packets, last_seq, n)
    finally:
        if cluster is not None:
            cluster.close()
        os.sched_setaffinity(0, cores)
        shutil.rmtree(root, ignore_errors=True)


def _wait_joined(group: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Until the replica has joined the stream's group (/proc/net/igmp lists it): it serves its
    metrics, which start_node waits for, before it joins, and with no rewinder here a packet sent
    before the join is never filled in (the replica would apply nothing)."""
    wanted = socket.inet_aton(group)[::-1].hex().upper()  # (the file's byte order)
    deadline = time.monotonic() + timeout_s
    while wanted not in Path("/proc/net/igmp").read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replica did not join {group} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _stream(cluster: LocalCluster, n: int) -> tuple[list[bytes], int]:
    """`n` trades as seq-a would publish them: one client's signed batches, forty a batch of
    the leader (~1,000 messages), stamped, sealed with the stream key. The packets and the
    last seq."""
    cfg, client = cluster.cfg, cluster.cfg.clients[0]
    origin = moldudp64.session_bytes(client.name)
    batches = ClientCore(origin, client.key, cfg.max_packet, 10**12).submit(TradeGenerator(seed=5).take(n), 0)
    core = LeaderCore(cfg.session_bytes, cfg.node("seq-a").wire_name, 1, [], {origin: client.key},
                      max_packet=cfg.max_packet, stream_keys=StreamKeys(cfg.stream_keys, cfg.seal))
    packets, stamp = [], time.time_ns()
    for i in range(0, len(batches), 40):
        for data in batches[i:i + 40]:
            core.on_inbound(data, stamp)
        packets += core.on_journaled(core.flush(stamp, stamp).last_seq)
        stamp += STREAM_MS_PER_BATCH * 1_000_000
    if core.accepted != n:
        raise RuntimeError(f"sequenced {core.accepted} of {n}")
    return packets, core.last_seq


def _run(cluster: LocalCluster, packets: list[bytes], last_seq: int, n: int) -> ReplicaRun:
    cfg = cluster.cfg
    pid = cluster.procs["replica-A"].pid
    sock = multicast_sender(cfg.interface or "127.0.0.1")
    try:
        cpu0, t0 = task_cpu_seconds(pid), time.perf_counter()
        sent = 0
        while sent < len(packets):
            if _queued(cfg.port) < QUEUED_BYTES:
                send_datagrams(sock, packets[sent:sent + SEND_CHUNK], (cfg.group, cfg.port))
                sent += SEND_CHUNK
            else:
                time.sleep(0.0005)
        applied = Stall(cluster, STALL_S, "applied", "seq")
        while applied.value < last_seq:
            time.sleep(POLL_S)
            applied.saw(int(_applied(cluster)), last_seq)
        seconds, cpu = time.perf_counter() - t0, task_cpu_seconds(pid) - cpu0
    finally:
        sock.close()
    alerts = parse_metrics(cluster.fetch("replica-A", cfg.node("replica-A").metrics_port, 5.0).decode())
    return ReplicaRun(n / seconds, cpu / n * 1e6, int(alerts['tape_replica_alerts_raised_total{node="replica-A"}']))


def _applied(cluster: LocalCluster) -> float:
    m = parse_metrics(cluster.fetch("replica-A", cluster.cfg.node("replica-A").metrics_port, 5.0).decode())
    return m['tape_replica_applied_seq{node="replica-A"}']


def _queued(port: int) -> int:
    """Bytes waiting in the sockets bound to UDP `port` (/proc/net/udp's rx_queue, summed)."""
    total = 0
    want = f":{port:04X}"
    with open("/proc/net/udp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1].endswith(want):
                total += int(fields[4].split(":")[1], 16)
    return total
