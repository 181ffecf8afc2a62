"""`tape bench ...`: throughput figures on one core. Figures, never pass/fail."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from rich.console import Console
from rich.table import Table

from tape.gctune import tune_gc
from tape.journal.store import Journal
from tape.ops.tradegen import TradeGenerator
from tape.protocol import messages, moldudp64
from tape.protocol.packets import PacketBuilder


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}"


def bench_protocol(n: int = 1_000_000, batch: int = 1000) -> dict:
    console = Console()
    session = moldudp64.session_bytes("BENCH")
    origin = moldudp64.session_bytes("load0")
    inbound = TradeGenerator(seed=7).take(n)
    tune_gc()
    results = {}

    # Encode: stamp inbound messages and pack them into full packets.
    now = 1_700_000_000_000_000_000
    t0 = time.perf_counter()
    packets = PacketBuilder(session, 1).add_stamped(inbound, now, origin, 1)
    results["encode (stamp + pack)"] = (n, time.perf_counter() - t0)

    # Decode: validate headers and every block, decode every message into a tuple.
    t0 = time.perf_counter()
    decoded = 0
    for pkt in packets:
        _, _, count = moldudp64.decode_header(pkt)
        decoded += len(messages.decode_packet_messages(pkt, count))
    results["decode (validate + unpack)"] = (decoded, time.perf_counter() - t0)
    if decoded != n:
        raise RuntimeError(f"decoded {decoded} of {n} messages")

    # Journal appends, group-committed per batch.
    sequenced = [messages.stamp(m, now, origin, i) for i, m in enumerate(inbound, 1)]
    for policy in ("batch", "never"):
        d = tempfile.mkdtemp(prefix="tape-bench-")
        try:
            j = Journal(d, session, fsync=policy)
            t0 = time.perf_counter()
            for start in range(0, n, batch):
                chunk = sequenced[start:start + batch]
                j.append([(start + k + 1, 1, m) for k, m in enumerate(chunk)])
            j.close()
            results[f"journal append, fsync {policy}"] = (n, time.perf_counter() - t0)
        finally:
            shutil.rmtree(d)


    table = Table(title=f"tape bench protocol: {n:,} messages, {len(packets):,} packets of <= 1400 bytes, "
                        f"journal batches of {batch}, one core (pid {os.getpid()})")
    table.add_column("measurement")
    table.add_column("messages/s", justify="right")
    table.add_column("seconds", justify="right")
    for name, (count, secs) in results.items():
        table.add_row(name, _rate(count, secs), f"{secs:.3f}")
    console.print(table)
    return {k: c / s for k, (c, s) in results.items()}
