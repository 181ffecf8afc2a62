"""`tape bench ...`: throughput figures on one core. Figures, never pass/fail."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import messages, moldudp64, replication
from tape.protocol.linkauth import LinkKeys
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import StreamKeys
from tape.runtime.memory import tune_memory
from tape.runtime.storage.journal_store import Journal

_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # what the one-core benchmarks time with (set_clock)


def set_clock(kind: str) -> None:
    """'wall' (the default) or 'cpu': this process's CPU time, for a busy host, where the wall
    clock would count the other load too (what the code costs, not what the host gives)."""
    global clock
    clock = _CLOCKS[kind]


def _timed_by() -> str:
    return ", CPU time" if clock is time.process_time else ""


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}"


HOST_SPEED_MESSAGES = 200_000


def host_speed(n: int = HOST_SPEED_MESSAGES) -> float:
    """This host's speed now, as messages a second stamped and packed (`tape bench protocol`'s
    encode figure), the fastest of three passes of `n`: this project's virtual machines ran at
    0.45-1x their usual speed from one sitting to the next, so figures from different hours
    compare only beside it."""
    session, origin = moldudp64.session_bytes("BENCH"), moldudp64.session_bytes("load0")
    inbound = TradeGenerator(seed=7).take(n)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        PacketBuilder(session, 1).add_stamped(inbound, 1_700_000_000_000_000_000, origin, 1)
        best = min(best, time.perf_counter() - t0)
    return n / best


def bench_protocol(n: int = 1_000_000, batch: int = 1000) -> dict:
    console = Console()
    session = moldudp64.session_bytes("BENCH")
    origin = moldudp64.session_bytes("load0")
    inbound = TradeGenerator(seed=7).take(n)
    tune_memory()
    results = {}

    # Encode: stamp inbound messages and pack them into full packets.
    now = 1_700_000_000_000_000_000
    t0 = clock()
    packets = PacketBuilder(session, 1).add_stamped(inbound, now, origin, 1)
    results["encode (stamp + pack)"] = (n, clock() - t0)

    # Decode: validate headers and every block, decode every message into a tuple.
    t0 = clock()
    decoded = 0
    for pkt in packets:
        _, _, count = moldudp64.decode_header(pkt)
        decoded += len(messages.decode_packet_messages(pkt, count))
    results["decode (validate + unpack)"] = (decoded, clock() - t0)
    if decoded != n:
        raise RuntimeError(f"decoded {decoded} of {n} messages")

    # Journal appends, group-committed per batch.
    sequenced = [messages.stamp(m, now, origin, i) for i, m in enumerate(inbound, 1)]
    results.update(_bench_auth(session, sequenced, batch, now))
    for policy in ("batch", "never"):
        d = tempfile.mkdtemp(prefix="tape-bench-")
        try:
            j = Journal(d, session, fsync=policy)
            t0 = clock()
            for start in range(0, n, batch):
                chunk = sequenced[start:start + batch]
                j.append([(start + k + 1, 1, m) for k, m in enumerate(chunk)])
            results[f"journal append, fsync {policy}"] = (n, clock() - t0)
            if policy == "never":
                results.update(_bench_gapfill_reads(j, n))
            j.close()
        finally:
            shutil.rmtree(d)


    table = Table(title=f"tape bench protocol: {n:,} messages, {len(packets):,} packets of <= 1400 bytes, "
                        f"journal batches of {batch}, one core (pid {os.getpid()}){_timed_by()}")
    table.add_column("measurement")
    table.add_column("messages/s", justify="right")
    table.add_column("seconds", justify="right")
    for name, (count, secs) in results.items():
        table.add_row(name, _rate(count, secs), f"{secs:.3f}")
    console.print(table)
    return {k: c / s for k, (c, s) in results.items()}


def _bench_gapfill_reads(j: Journal, n: int, reads: int = 2000, per_read: int = 18) -> dict:
    """A rewinder's gap-fill read: a packet's worth of records at a random seq (seeded)."""
    rng = random.Random(7)
    t0 = clock()
    got = sum(len(j.read_batch(rng.randrange(1, n - per_read), per_read)) for _ in range(reads))
    if got != reads * per_read:
        raise RuntimeError(f"gap-fill reads returned {got} of {reads * per_read} records")
    return {f"journal: gap-fill reads of {per_read} at random seqs": (got, clock() - t0)}


def _bench_auth(session: bytes, sequenced: list[bytes], batch: int, now: int) -> dict:
    """What keys cost per message: the stream's seals (the leader seals, listeners verify) and
    the authenticated records of a replication link (one record per append of `batch`)."""
    n = len(sequenced)
    out = {}
    key = os.urandom(32)
    for what, max_packet, seal in (("", moldudp64.DEFAULT_MAX_PACKET, "blake2b"),
                                   (" of 8,972, BLAKE3", moldudp64.JUMBO_MAX_PACKET, "blake3")):
        keys = StreamKeys([key], seal)  # the LAN's default and the loopback default
        per = PacketBuilder(session, 1, max_packet).per_packet - 1  # one block of each packet is its seal
        t0 = clock()
        sealed = keys.seal_run(session, 1, sequenced, per, now, session)[1]
        out[f"stream: seal packets{what} (leader)"] = (n, clock() - t0)
        t0 = clock()
        if any(keys.verify(pkt) is not None for pkt in sealed):
            raise RuntimeError("a sealed packet does not verify")
        out[f"stream: verify seals{what} (listener)"] = (n, clock() - t0)
    frames = [replication.encode_append(1, session, i, 1, i, 1, sequenced[i:i + batch]) for i in range(0, n, batch)]
    link = LinkKeys([os.urandom(32)])
    _, sealer, _ = link.accept(bytes(16), link.hello(bytes(16)), initiator=True)
    _, _, opener = link.accept(bytes(16), link.hello(bytes(16)), initiator=False)
    t0 = clock()
    wire = [sealer.seal(f) for f in frames]
    out[f"link: seal appends of {batch}"] = (n, clock() - t0)
    t0 = clock()
    if sum(len(opener.open(w)) for w in wire) != sum(map(len, frames)):
        raise RuntimeError("a link record did not open")
    out[f"link: open appends of {batch}"] = (n, clock() - t0)
    return out


def bench_sequencer(n: int = 1_000_000, per_drain: int = 40, fsync: str = "never", keys: bool = False) -> float:
    """The sequencer's work on one core: accept inbound batches, stamp, journal,
    publish (real multicast sends), with no followers (a majority of one). With `keys`, as
    `tape up` runs it: each client batch's HMAC checked, each packet sealed with a stream key."""
    from tape.protocol import moldudp64
    from tape.runtime.mmsg import send_datagrams
    from tape.runtime.udp import multicast_sender
    from tape.sequencer.client_core import ClientCore
    from tape.sequencer.leader_core import LeaderCore

    origin = moldudp64.session_bytes("load0")
    client_key = os.urandom(32) if keys else None
    # Batched (and signed) as a client sends them: full 1,400-byte datagrams.
    datagrams = ClientCore(origin, client_key, 1400, 10**9).submit(TradeGenerator(seed=11).take(n), 0)
    d = tempfile.mkdtemp(prefix="tape-bench-")
    sock = multicast_sender()
    dest = ("239.77.99.99", 9)  # nobody listens: measures the send path only
    try:
        journal = Journal(d, moldudp64.session_bytes("BENCH"), fsync=fsync)
        core = LeaderCore(moldudp64.session_bytes("BENCH"), moldudp64.session_bytes("seq-a"), 1, [],
                          {origin: client_key}, stream_keys=StreamKeys([os.urandom(32)]) if keys else None)
        tune_memory()
        t0 = clock()
        now = time.time_ns()
        for i in range(0, len(datagrams), per_drain):
            for data in datagrams[i:i + per_drain]:
                core.on_inbound(data, now)
            batch = core.flush(now, now)
            journal.append(batch.records())
            send_datagrams(sock, core.on_journaled(batch.last_seq), dest)  # as the leader publishes
        secs = clock() - t0
        journal.close()
    finally:
        sock.close()
        shutil.rmtree(d)
    if core.accepted != n:  # every trade offered (no term start here; with keys the log holds seals too)
        raise RuntimeError(f"sequenced {core.accepted} of {n}")
    return n / secs


def bench_rewinder(n: int = 1_000_000, batch: int = 500, fsync: str = "batch") -> float:
    """A follower's work on one core, as a rewinder does it: open each authenticated record of
    the leader's appends, decode the frame, decide (VoterCore), journal the entries (fsync per
    `fsync`) and seal the acknowledgement. Messages per second."""
    from tape.protocol.voter import AppendRecords, VoterCore

    session = moldudp64.session_bytes("BENCH")
    names = [moldudp64.session_bytes(x) for x in ("seq-a", "seq-b", "rw-1", "rw-2")]
    gen = TradeGenerator(seed=12)
    sequenced = [messages.stamp(m, time.time_ns(), session, i) for i, m in enumerate(gen.take(n), 1)]
    link = LinkKeys([os.urandom(32)])
    _, sealer, _ = link.accept(bytes(16), link.hello(bytes(16)), initiator=True)
    _, _, opener = link.accept(bytes(16), link.hello(bytes(16)), initiator=False)
    _, acks, _ = link.accept(bytes(16), link.hello(bytes(16)), initiator=False)
    wire = [sealer.seal(replication.encode_append(1, names[0], i, 1 if i else 0, i, 1, sequenced[i:i + batch]))
            for i in range(0, n, batch)]
    d = tempfile.mkdtemp(prefix="tape-bench-")
    try:
        journal = Journal(d, session, fsync=fsync)
        core = VoterCore(names[2], names, False, random.Random(1), (300_000_000, 600_000_000), 1, None, 0)
        reader = replication.FrameReader()
        tune_memory()
        t0 = clock()
        for record in wire:
            for append in reader.feed(opener.open(record)):
                ack, actions = core.on_append(append, "leader", 0)
                for action in actions:
                    if isinstance(action, AppendRecords):
                        journal.append(action.records)
                acks.seal(replication.encode_ack(*ack))
        secs = clock() - t0
        journal.close()
    finally:
        shutil.rmtree(d)
    if core.last_seq != n:
        raise RuntimeError(f"journaled {core.last_seq} of {n}")
    return n / secs


def bench_stream(rates: list[float], seconds: float, sequencer_only: bool = False, standby: bool = False,
                 n: int = 1_000_000, endpoint: bool = False) -> None:
    import json as _json

    from tape.ops.verification.local import LocalCluster

    console = Console()
    table = Table(title=f"tape bench stream: sequencer alone, one core, {n:,} messages{_timed_by()}")
    table.add_column("journal fsync")
    table.add_column("msg/s stamped, journaled, published", justify="right")
    for policy in ("never", "batch"):
        table.add_row(policy, f"{bench_sequencer(n, fsync=policy):,.0f}")
    table.add_row("batch, with keys (as tape up runs)", f"{bench_sequencer(n, fsync='batch', keys=True):,.0f}")
    if endpoint:
        from tape.ops.bench.sequencer_endpoint import bench_leader

        run = bench_leader(n)
        table.add_row("batch, with keys: the process as it runs", f"{run.rate:,.0f}")
    console.print(table)
    if endpoint:
        console.print(f"the sequencer process: {run.cpu_us:.2f} us of CPU a message, {run.fsyncs:,} fsyncs, "
                      f"told its client to back off {run.backoffs:,} times")
    if sequencer_only:
        return
    who = "leader + standby" if standby else "sequencer"
    table = Table(title=f"tape bench stream: {who} + 2 rewinders + load client, loopback, {seconds:.0f} s per rate")
    for col in ("target msg/s", "acked msg/s", "p50 ms", "p99 ms", "max ms", "resends", "all acked"):
        table.add_column(col, justify="right")
    for rate in rates:
        root = Path(tempfile.mkdtemp(prefix="tape-bench-stream-"))
        cluster = LocalCluster(root, clients=2, sequencers=2 if standby else 1)
        try:
            cluster.start_all()
            load = cluster.start("load", "load", "--rate", str(rate), "--messages", str(int(rate * seconds)))
            load.wait(timeout=seconds * 10 + 60)
            r = _json.loads(cluster.output("load") or "{}")
        finally:
            cluster.close()
            shutil.rmtree(root, ignore_errors=True)
        lat = r.get("latency_ms", {})
        table.add_row(f"{rate:,.0f}", f"{r.get('rate_acked', 0):,.0f}", f"{lat.get('p50', 0):.2f}",
                      f"{lat.get('p99', 0):.2f}", f"{lat.get('max', 0):.2f}", f"{r.get('resends', 0):,}",
                      "yes" if r.get("all_acked") else "NO")
    console.print(table)


def bench_replica(n: int = 1_000_000, open_orders: int = 1_000_000) -> dict:
    """One replica's hot path on one core: decode packets of a pre-built
    committed stream and apply them to the audit state machine."""
    from tape.protocol import moldudp64
    from tape.protocol.stamping import PacketBuilder
    from tape.replicas import audit_core
    from tape.replicas.audit_core import AuditMachine

    console = Console()
    inbound = TradeGenerator(seed=5).take(n)
    builder = PacketBuilder(moldudp64.session_bytes("BENCH"), 1)
    packets = []
    stamp = 1_700_000_000_000_000_000
    for i in range(0, n, 1000):  # one stamp per 1,000-message batch, 1 ms apart
        packets += builder.add_stamped(inbound[i:i + 1000], stamp + i * 1000, moldudp64.session_bytes("load0"), i + 1)
    tune_memory()
    rates, digests = {}, set()
    for compiled in [True, False] if audit_core.apply_fast else [False]:  # the replicas' path, then the definition
        machine = AuditMachine(compiled=compiled)
        t0 = clock()
        seq = 1
        for pkt in packets:  # as delivered: the compiled cases read the packet's bytes
            machine.apply_packet(seq, pkt)
            seq += moldudp64.HEADER.unpack_from(pkt)[2]
        rates["compiled" if compiled else "Python"] = n / (clock() - t0)
        digests.add(machine.digest())
    if len(digests) != 1:
        raise RuntimeError(f"the compiled and the Python audit disagree: digests {sorted(digests)}")
    digest = machine.digest()
    snap = _bench_snapshot(open_orders)
    table = Table(title=f"tape bench replica: {n:,} messages from memory, one core{_timed_by()}")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    for kind, rate in rates.items():
        table.add_row(f"decode + apply, {kind}", f"{rate:,.0f} msg/s")
    table.add_row("alerts raised", f"{machine.alerts_raised:,}")
    table.add_row("open books at the end", f"{len(machine.books):,}")
    table.add_row("digest", digest)
    table.add_row(
        f"full snapshot of {open_orders:,} open orders", f"{snap['save_s']:.2f} s, {snap['mib']:,.0f} MiB on disk"
    )
    table.add_row("load of that snapshot", f"{snap['load_s']:.2f} s")
    table.add_row("incremental snapshot after 10,000 more", f"{snap['incremental_s'] * 1000:.0f} ms")
    console.print(table)
    return {"rate": next(iter(rates.values())), "rates": rates, "alerts": machine.alerts_raised, "snapshot": snap}


def _bench_snapshot(open_orders: int) -> dict:
    """Snapshot time and size with `open_orders` open books, all dirty (the
    worst case: the first snapshot), its load time, and an incremental one."""
    from tape.protocol import moldudp64
    from tape.protocol.stamping import PacketBuilder
    from tape.replicas.audit_core import AuditMachine
    from tape.replicas.snapshot import SnapshotStore

    session, origin = moldudp64.session_bytes("BENCH"), moldudp64.session_bytes("load0")
    builder = PacketBuilder(session, 1)
    machine = AuditMachine()
    seq = 1
    stamp = 1_700_000_000_000_000_000
    for start in range(1, open_orders + 10_001, 10_000):
        batch = [messages.purchase_request(oid, 100, "load0", "ACME") for oid in range(start, start + 10_000)]
        for pkt in builder.add_stamped(batch, stamp + start, origin, start):
            machine.apply_packet(seq, pkt)
            seq += moldudp64.HEADER.unpack_from(pkt)[2]
        if start + 10_000 > open_orders and start <= open_orders:
            snap_dir = tempfile.mkdtemp(prefix="tape-bench-lmdb-")
            store = SnapshotStore(snap_dir)
            t0 = clock()
            store.save(machine)
            save_s = clock() - t0
    t0 = clock()
    store.save(machine)  # the 10,000 books opened since
    incremental_s = clock() - t0
    store.close()
    try:
        mib = sum(f.stat().st_size for f in Path(snap_dir).iterdir()) / 2**20
        t0 = clock()
        store = SnapshotStore(snap_dir)
        store.load(AuditMachine())
        load_s = clock() - t0
        store.close()
    finally:
        shutil.rmtree(snap_dir)
    return {"open_orders": open_orders, "save_s": save_s, "mib": mib, "load_s": load_s,
            "incremental_s": incremental_s}


def build_journal(path: Path, n: int, seed: int = 7, per_ms: int = 100) -> int:
    """A journal of `n` generated trades (plus the term start), stamped
    `per_ms` messages per millisecond; returns the record count."""
    from tape.protocol import messages as M

    session, origin = moldudp64.session_bytes("TAPE"), moldudp64.session_bytes("load0")
    journal = Journal(path, session, fsync="never")
    stamp = 1_700_000_000_000_000_000
    journal.append([(1, 1, M.term_start(stamp, moldudp64.session_bytes("seq-a"), 1, "seq-a"))])
    gen = TradeGenerator(seed)
    seq = 2
    for start in range(0, n, 100_000):
        inbound = gen.take(min(100_000, n - start))
        records = []
        for i, msg in enumerate(inbound):
            k = start + i
            records.append((seq, 1, M.stamp(msg, stamp + (k // per_ms) * 1_000_000, origin, k + 1)))
            seq += 1
        journal.append(records)
    journal.close()
    return seq - 1


def bench_spark(n: int, master: str, keep: str | None = None) -> dict:
    """Audit and analytics over an n-message journal, read by the Python
    source and from its Parquet export; rows/s for each."""
    import json

    from tape.ops.spark import analytics
    from tape.ops.spark.source import reconcile, session
    from tape.ops.verification.reference import expected_alerts

    console = Console()
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="tape-bench-spark-"))
    root.mkdir(parents=True, exist_ok=True)
    journal, parquet, alerts = root / "journal", root / "parquet", root / "alerts.jsonl"
    times: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        if not journal.exists():
            with console.status(f"writing a {n:,}-message journal…"):
                build_journal(journal, n)
        if not alerts.exists():
            with console.status("computing the delivered alerts with the reference checker…"):
                stream = (
                    (seq, messages.SEQUENCED.unpack(raw)) for seq, _, raw in Journal(journal, readonly=True).read()
                )
                found, _ = expected_alerts(stream, 3600 * 10**9, 10 * 10**9)
                with open(alerts, "w") as f:
                    for a in found:
                        f.write(json.dumps({"alert_id": f"TAPE:{a['purchase_seq']}", **a}) + "\n")
        times["prepare"] = time.perf_counter() - t0
        records = sum(1 for _ in open(alerts))
        spark = session(master, "tape-bench-spark")
        try:
            def timed(name, fn):
                with console.status(f"{name}…"):
                    t = time.perf_counter()
                    result = fn()
                    times[name] = time.perf_counter() - t
                console.print(f"{name}: {times[name]:.1f} s")
                return result

            timed("count, Python reader", lambda: spark.read.format("tape").load(str(journal)).count())
            timed("export to Parquet", lambda: spark.read.format("tape").load(str(journal))
                  .write.mode("overwrite").parquet(str(parquet)))
            timed("count, Parquet", lambda: spark.read.parquet(str(parquet)).count())
            for source, path in (("Python reader", journal), ("Parquet", parquet)):
                found = timed(f"audit, {source}", lambda: reconcile(spark, str(path), str(alerts), "TAPE",
                                                                     3600 * 10**9, 10 * 10**9))
                assert found["findings"] == 0, found
                timed(f"analytics, {source}", lambda: analytics.compute(spark, str(path), 3600 * 10**9, 10 * 10**9))
        finally:
            spark.stop()
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    table = Table(title=f"tape bench spark: {n:,} messages, {master}, {records:,} alerts")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    table.add_column("rows/s", justify="right")
    for name, secs in times.items():
        table.add_row(name, f"{secs:,.1f}", "" if name == "prepare" else f"{n / secs:,.0f}")
    console.print(table)
    return times


def bench_failover(runs: int, rate: float, duration: float) -> dict:
    """`runs` kill-leader drills: failover time (the old leader's last stamp
    to the new leader's term start), p50 and max, and every verdict."""
    from tape.ops.verification.drill import make
    from tape.ops.verification.up import run_up

    console = Console()
    quiet = Console(file=open(os.devnull, "w"))
    times, verdicts = [], []
    for i in range(runs):
        with console.status(f"kill-leader drill {i + 1}/{runs}…"):
            drill = make("kill-leader", duration, int(rate * duration))
            report = run_up(rate, duration, 0.0, None, seed=i + 1, drill=drill, console=quiet)
        verdicts.append(report["verdict"])
        if report.get("failover_ms") is not None:
            times.append(report["failover_ms"])
        failed = [name for name, ok in report["checks"].items() if not ok]
        console.print(f"run {i + 1}: {report['verdict']}, failover {report.get('failover_ms')} ms"
                      + (f"; failed: {', '.join(failed)}" if failed else ""))
    times.sort()
    p50 = times[len(times) // 2] if times else None
    table = Table(title=f"tape bench failover: {runs} kill-leader drills at {rate:,.0f} msg/s")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    table.add_row("verdicts pass", f"{verdicts.count('pass')} / {runs}")
    table.add_row("failover p50", f"{p50:.0f} ms" if p50 is not None else "-")
    table.add_row("failover max", f"{times[-1]:.0f} ms" if times else "-")
    table.add_row("failover min", f"{times[0]:.0f} ms" if times else "-")
    console.print(table)
    return {"failover_ms": times, "p50": p50, "verdicts": verdicts}
