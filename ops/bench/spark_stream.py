"""`tape bench spark-stream`: what the streaming source delivers to Spark, and how far behind the log.

1. Rate: a generated journal of --messages trades, committed whole, read once by the batch source
   and once by the streaming source (a query that catches up and stops: Trigger.AvailableNow), each
   into a sink that counts; rows a second for each, Spark's start-up left out. Then its trades
   folded by the live audit (ops/spark/live.py OrderStates) as one micro-batch: trades a second.
2. Lag: a live `tape up` at --rate for --duration, followed by a streaming query over rw-1's
   journal whose sink writes each micro-batch as Parquet; a row's lag is from its sequencer stamp
   (the leader's wall clock, on this host) to the moment its micro-batch's file is written: p50,
   p99 and max over every row after the first micro-batch (which catches up with what was written
   while Spark started), beside the micro-batches' count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.bench.throughput import build_journal
from tape.runtime.storage.journal_store import Journal

FOLLOW_TRIGGER = "100 milliseconds"  # how often the lag run's query looks for more
START_WITHIN_S = 60.0  # the live run's journal appears within this


def bench_spark_stream(messages: int, rate: float, duration: float, master: str) -> dict:
    from tape.ops.spark.source import session

    console = Console()
    root = Path(tempfile.mkdtemp(prefix="tape-bench-stream-"))
    with console.status(f"writing a {messages:,}-message journal…"):
        n = build_journal(root / "journal", messages)
        Journal(root / "journal").mark_committed(n)
    spark = session(master, "tape-bench-stream")
    try:
        with console.status("the batch source, then the streaming source, then the live audit's fold…"):
            rates = {"batch source": _batch_rate(spark, root / "journal", n),
                     "streaming source": _stream_rate(spark, root / "journal", n, root / "ck-rate")}
            fold = _fold_rate(spark, root)
        with console.status(f"tape up at {rate:,.0f} msg/s for {duration:g} s, followed…"):
            lag = _lag(spark, root, rate, duration)
    finally:
        spark.stop()
    table = Table(title=f"the tape source in Spark ({master}), {n:,} records")
    for column in ("measure", "value"):
        table.add_column(column)
    for name, per_s in rates.items():
        table.add_row(f"{name}, records/s", f"{per_s:,.0f}")
    table.add_row("streaming / batch", f"{rates['streaming source'] / rates['batch source']:.2f}")
    table.add_row("the live audit's fold in the driver, trades/s", f"{fold:,.0f}")
    table.add_row(f"lag, stamp → row in the sink, at {rate:,.0f} msg/s: p50 / p99 / max ms",
                  f"{lag['p50_ms']:.0f} / {lag['p99_ms']:.0f} / {lag['max_ms']:.0f}")
    table.add_row("rows followed, micro-batches (p50 ms of one), tape up's verdict",
                  f"{lag['rows']:,}, {lag['batches']:,} ({lag['batch_p50_ms']:,.0f}), {lag['verdict']}")
    console.print(table)
    return {"rates": rates, "fold_trades_per_s": fold, "lag": lag}


def _batch_rate(spark, journal: Path, n: int) -> float:
    from pyspark.sql import functions as F

    df = spark.read.format("tape").load(str(journal))
    df.agg(F.count("*")).collect()  # (warm: the Python workers started)
    t0 = time.perf_counter()
    (count,) = df.agg(F.count("*")).first()
    assert count == n, (count, n)
    return n / (time.perf_counter() - t0)


def _stream_rate(spark, journal: Path, n: int, checkpoint: Path) -> float:
    counted = [0]

    def count(batch, batch_id: int) -> None:
        counted[0] += batch.count()

    t0 = time.perf_counter()
    query = (spark.readStream.format("tape").load(str(journal)).writeStream.foreachBatch(count)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination()
    assert counted[0] == n, (counted[0], n)
    return n / (time.perf_counter() - t0)


def _fold_rate(spark, root: Path) -> float:
    """The journal's trades folded into OrderStates (ops/spark/live.py) as one micro-batch: trades/s."""
    from tape.ops.spark.live import OrderStates, trades_of

    columns = trades_of(spark.read.format("tape").load(str(root / "journal"))).orderBy("seq").toArrow().to_pydict()
    states = OrderStates(root / "orders", 3600 * 10**9, 10 * 10**9)
    try:
        t0 = time.perf_counter()
        states.apply(0, columns, lambda found: None)
        return len(columns["seq"]) / (time.perf_counter() - t0)
    finally:
        states.close()


def _lag(spark, root: Path, rate: float, duration: float) -> dict:
    """Follow a live run's rw-1 journal; every row's stamp-to-visible time."""
    lags: list[int] = []
    out = root / "sink"

    def sink(batch, batch_id: int) -> None:
        import pyarrow.parquet as pq

        path = out / f"batch={batch_id}"
        batch.write.mode("overwrite").parquet(str(path))
        now = time.time_ns()
        if batch_id > 0:  # (the first catches up with what the run wrote while Spark started)
            lags.extend(now - s for s in pq.read_table(path, columns=["stamp_ns"]).column(0).to_pylist())

    run = root / "up"
    up = subprocess.Popen([sys.executable, "-m", "tape.ops.cli.main", "up", "--rate", str(rate), "--duration",
                           str(duration), "--out", str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    journal = run / "data" / "rw-1" / "journal"  # (where the node writes it; run/journal/ links it at the end)
    deadline = time.monotonic() + START_WITHIN_S
    while not any(journal.glob("*.seg")) and up.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    query = (spark.readStream.format("tape").load(str(journal)).writeStream.foreachBatch(sink)
             .option("checkpointLocation", str(root / "ck-lag")).trigger(processingTime=FOLLOW_TRIGGER).start())
    try:
        said, _ = up.communicate()
        query.processAllAvailable()
        batches = query.lastProgress["batchId"] + 1 if query.lastProgress else 0
        took = sorted(p["durationMs"].get("triggerExecution", 0) for p in query.recentProgress if p["numInputRows"])
    finally:
        query.stop()
    lags.sort()
    pick = lambda q: lags[min(int(q * len(lags)), len(lags) - 1)] / 1e6 if lags else 0.0  # noqa: E731
    verdict = "pass" if up.returncode == 0 and "│ PASS │" in said else f"exit {up.returncode}"
    return {"rows": len(lags), "batches": batches, "batch_p50_ms": took[len(took) // 2] if took else 0,
            "p50_ms": pick(0.5), "p99_ms": pick(0.99),
            "max_ms": lags[-1] / 1e6 if lags else 0.0, "verdict": verdict, "cpus": os.cpu_count()}
