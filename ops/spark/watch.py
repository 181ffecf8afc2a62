"""`tape watch`: the day as it happens, from the stream (ops/spark/live.py's continuous queries).

Two queries over one source: the volume windows and the audit's findings (alerts, which are the
overfilled books, and rejects). Each closed window and each finding is written once, as Parquet
under OUT (`windows/`, `findings/`, a directory per micro-batch that a re-run batch overwrites),
with the queries' checkpoints under OUT/checkpoints: started again with the same OUT, it goes on
where it stopped. The terminal shows the latest closed window's most active stocks and clients,
the alerts and rejects in it, and where the stream is (seq read, seq committed, how far behind).
Without --follow it reads what is committed now and stops.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tape.ops.spark.live import VOLUME_COLUMNS, OrderStates, stream_df, trades_of, volume_windows

REFRESH_S = 0.5
TRIGGER = "1 second"  # a micro-batch a second while following


class View:
    """What the terminal shows, updated by the queries' micro-batches (Spark's callback thread)."""

    def __init__(self, top: int):
        self.top, self.lock = top, threading.Lock()
        self.window: tuple | None = None  # the latest closed window's (start, end)
        self.rows: list = []  # its rows (window_start, window_end, stock, client, counts...)
        self.findings: dict = defaultdict(Counter)  # window start -> kind -> count
        self.totals: Counter = Counter()
        self.window_s = 10.0

    def on_windows(self, rows: list) -> None:
        if not rows:
            return
        with self.lock:
            latest = max((r["window_start"], r["window_end"]) for r in rows)
            if self.window is None or latest >= self.window:
                kept = self.rows if latest == self.window else []
                self.rows = kept + [r for r in rows if (r["window_start"], r["window_end"]) == latest]
                self.window = latest

    def on_findings(self, found: list) -> None:
        with self.lock:
            for _, f in found:
                self.findings[int(f.stamp_ns / 1e9 // self.window_s * self.window_s)][f.kind] += 1
                self.totals[f.kind] += 1

    def render(self, source: str, position: dict) -> Group:
        with self.lock:
            parts = [Text(f"tape watch: {source}", style="bold"),
                     Text(f"read through seq {position.get('read', 0):,}, committed {position.get('committed', 0):,}"
                          f"   {position.get('state', '')}", style="bold")]
            if self.window is None:
                parts.append(Text("no window closed yet"))
                return Group(*parts)
            start, end = self.window
            parts += [self._table(f"most active stocks, {start:%H:%M:%S}–{end:%H:%M:%S}", "stock"),
                      self._table(f"most active clients, {start:%H:%M:%S}–{end:%H:%M:%S}", "client")]
            here = self.findings.get(int(start.timestamp() // self.window_s * self.window_s), Counter())
            said = ", ".join(f"{k} {v:,}" for k, v in sorted(here.items())) or "none"
            total = ", ".join(f"{k} {v:,}" for k, v in sorted(self.totals.items())) or "none"
            parts.append(Text(f"alerts and rejects in the window: {said}\nsince the start: {total}"))
            return Group(*parts)

    def _table(self, title: str, key: str) -> Table:
        sums: dict = defaultdict(Counter)
        for r in self.rows:
            sums[r[key]].update({c: r[c] for c in VOLUME_COLUMNS})
        table = Table(title=title, title_justify="left")
        for column in (key, *VOLUME_COLUMNS):
            table.add_column(column.replace("_", " "), justify="left" if column == key else "right")
        for name, c in sorted(sums.items(), key=lambda kv: (-kv[1]["purchased_shares"], kv[0]))[:self.top]:
            table.add_row(name, *(f"{c[column]:,}" for column in VOLUME_COLUMNS))
        return table


def start_queries(df, out: Path, view: View, window: str, states: OrderStates, follow: bool) -> list:
    """The two queries, writing under `out` and telling `view`. The windows close as later stamps
    come, so they run on a timer even when not following, until caught up (`caught_up`)."""

    def windows(batch, batch_id: int) -> None:
        batch.persist()  # (two actions: one run of the micro-batch)
        batch.write.mode("overwrite").parquet(str(out / "windows" / f"batch={batch_id}"))
        view.on_windows([r.asDict() for r in batch.collect()])
        batch.unpersist()

    def findings(batch, batch_id: int) -> None:
        def write(found: list) -> None:
            write_findings(out / "findings" / f"batch={batch_id}", found)
            view.on_findings(found)

        states.apply(batch_id, batch.orderBy("seq").toArrow().to_pydict(), write)

    queries = []
    for name, frame, sink, timed in (("windows", volume_windows(df, window), windows, True),
                                     ("findings", trades_of(df), findings, follow)):
        writer = (frame.writeStream.queryName(f"tape-watch-{name}").outputMode("append")
                  .option("checkpointLocation", str(out / "checkpoints" / name)).foreachBatch(sink))
        writer = writer.trigger(processingTime=TRIGGER) if timed else writer.trigger(availableNow=True)
        queries.append(writer.start())
    return queries


def write_findings(path: Path, found: list) -> None:
    """[(order_id, Finding)] as one Parquet file at `path` (replaced whole: a batch run again)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    long = pa.int64()
    table = pa.table({
        "kind": pa.array([f.kind for _, f in found], pa.string()),
        "seq": pa.array([f.seq for _, f in found], long),
        "stamp": pa.array([f.stamp_ns // 1000 for _, f in found], pa.timestamp("us", tz="UTC")),
        "order_id": pa.array([o for o, _ in found], long),
        **{name: pa.array([getattr(f, name) for _, f in found], long)
           for name in ("purchase_seq", "purchase_id", "requested", "cumulative")}})
    pq.write_table(table, path / "part-0.parquet.tmp")
    (path / "part-0.parquet.tmp").replace(path / "part-0.parquet")


def position(queries: list) -> dict:
    """Where the source stands, from the queries' last progress."""
    read = committed = 0
    for q in queries:
        progress = q.lastProgress
        if not progress or not progress.get("sources"):
            continue
        source = progress["sources"][0]
        read = max(read, _seq(source.get("endOffset")))
        committed = max(committed, _seq(source.get("latestOffset")))
    return {"read": read, "committed": committed}


def run(args, book_ttl_ns: int, orphan_ttl_ns: int, master: str, conf: dict) -> int:
    from tape.ops.spark.source import session

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    with console.status("starting Spark…"):
        spark = session(master, "tape-watch", conf)
    source = f"rewinder {args.rewinder}" if args.rewinder else args.journal
    view = View(args.top)
    view.window_s = _seconds(args.window)
    df = stream_df(spark, args.journal, args.config, args.rewinder, args.from_seq, args.max_records)
    states = OrderStates(out / "orders", book_ttl_ns, orphan_ttl_ns)
    queries = start_queries(df, out, view, args.window, states, args.follow)
    try:
        with Live(view.render(source, {}), console=console, refresh_per_second=1 / REFRESH_S) as live:
            while any(q.isActive for q in queries) and (args.follow or not all(map(caught_up, queries))):
                live.update(view.render(source, {**position(queries), "state": "following" if args.follow else ""}))
                time.sleep(REFRESH_S)
            live.update(view.render(source, {**position(queries), "state": "caught up"}))
        failed = [q for q in queries if q.exception() is not None]
        for q in failed:
            console.print(f"[red]{q.name} failed: {q.exception()}")
    except KeyboardInterrupt:
        failed = []
    finally:
        for q in queries:
            q.stop()
        states.close()
        spark.stop()
    if failed:
        return 1
    console.print(f"\nwindows and findings: {out}/windows, {out}/findings (Parquet)")
    return 0


def caught_up(query) -> bool:
    """Stopped, or its last micro-batch read nothing and it has read all that is committed."""
    progress = query.lastProgress
    if not query.isActive:
        return True
    if not progress or not progress.get("sources"):
        return False
    source = progress["sources"][0]
    return progress["numInputRows"] == 0 and _seq(source.get("endOffset")) == _seq(source.get("latestOffset"))


def _seq(offset) -> int:
    """An offset of the progress report (a dict, or its JSON) -> its seq."""
    import json

    if isinstance(offset, str):
        offset = json.loads(offset)
    return (offset or {}).get("seq", 0)


def _seconds(window: str) -> float:
    """'10 seconds', '1 minute' -> seconds (Spark's interval words)."""
    number, unit = window.split()
    scale = {"second": 1, "minute": 60, "hour": 3600}[unit.rstrip("s")]
    return float(number) * scale

