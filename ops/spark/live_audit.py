"""`tape audit --follow`: the audit as the log is written. The stream's trades are folded into each
order's state (ops/spark/live.py OrderStates) as Spark delivers them, the alerts they imply are
reconciled with the emitter's file as it grows (ops/spark/reconcile_core.py), and the findings, with
how far the reconciliation is behind the log, are shown live and written to --report on every change.
The query's checkpoint and the orders' state live under --out: an audit started again goes on where
it stopped (its reconciliation starts again from the alerts it finds in --out/alerts).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tape.ops.spark.live import OrderStates, stream_df, trades_of
from tape.ops.spark.order_audit_core import ALERT
from tape.ops.spark.reconcile_core import FINDINGS, Reconciliation
from tape.ops.spark.watch import caught_up, position

REFRESH_S = 0.5
TRIGGER = "1 second"
TAIL_CHECKED = 4096  # bytes before the read offset compared on each read: a rewrite of the file shows there


class AlertsFile:
    """The emitter's JSON-lines file, read as it grows: whole lines only. A file replaced, cut or
    rewritten (what was read is no longer what ends there) is read again from its start."""

    def __init__(self, path: Path):
        self.path, self.offset, self.inode, self.rest, self.seen = path, 0, None, b"", b""

    def read(self) -> tuple[bool, list[dict]]:
        """(read again from the start?, the alerts of the lines new since the last read)."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return False, []
        with f:
            st = os.fstat(f.fileno())
            f.seek(max(self.offset - len(self.seen), 0))
            again = self.inode is not None and (st.st_ino != self.inode or f.read(len(self.seen)) != self.seen)
            if again:
                self.offset, self.rest, self.seen = 0, b"", b""
            self.inode = st.st_ino
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        self.seen = (self.seen + data)[-TAIL_CHECKED:]
        *lines, self.rest = (self.rest + data).split(b"\n")
        return again, [_alert(line) for line in lines if line.strip()]


def _alert(line: bytes) -> dict:
    try:
        alert = json.loads(line)
    except ValueError:
        return {"alert_id": f"unreadable line: {line[:60]!r}"}
    return alert if isinstance(alert, dict) and "alert_id" in alert else {"alert_id": f"not an alert: {line[:60]!r}"}


class LiveAudit:
    """The reconciliation fed from both sides (the query's thread and the main one), and its report."""

    def __init__(self, session: str, alerts: Path):
        self.session, self.lock = session, threading.Lock()
        self.rec, self.file = Reconciliation(), AlertsFile(alerts)
        self.stamp_ns = 0  # of the newest trade read

    def on_findings(self, found: list, columns: dict) -> None:
        alerts = [{"alert_id": f"{self.session}:{f.purchase_seq}", "emit_seq": f.seq, "purchase_id": f.purchase_id,
                   "order_id": order_id, "requested": f.requested, "cumulative": f.cumulative}
                  for order_id, f in found if f.kind == ALERT]
        with self.lock:
            self.rec.expect(alerts, max(columns["seq"], default=0))
            self.stamp_ns = max(self.stamp_ns, max(columns["stamp_ns"], default=0))

    def poll(self) -> None:
        again, delivered = self.file.read()
        with self.lock:
            if again:
                self.rec.forget_deliveries()
            self.rec.delivered(delivered)

    def report(self, read: int, committed: int) -> dict:
        """`read`, `committed`: the query's source (its trades are what the reconciliation has read)."""
        with self.lock:
            rec = self.rec
            found = rec.findings()
            read = max(read, rec.read_through)
            lag_s = max(time.time() - self.stamp_ns / 1e9, 0.0) if self.stamp_ns else None
            return {"read_through_seq": read, "committed_seq": max(committed, read),
                    "lag_messages": max(committed - read, 0),
                    "lag_seconds": None if lag_s is None else round(lag_s, 3),
                    "delivered_through_emit_seq": rec.delivered_through, "expected": len(rec.expected),
                    "delivered": sum(rec.copies.values()), **found,
                    "findings": sum(found[k]["count"] for k in FINDINGS)}


def render(report: dict, state: str) -> Group:
    head = Text(f"read through seq {report['read_through_seq']:,} of {report['committed_seq']:,} committed "
                f"({report['lag_messages']:,} behind; newest stamp {report['lag_seconds']} s ago)   {state}\n"
                f"alerts: {report['expected']:,} recomputed, {report['delivered']:,} delivered (through emit seq "
                f"{report['delivered_through_emit_seq']:,})", style="bold")
    table = Table(title="live audit", title_justify="left")
    for column in ("finding", "count", "first ids"):
        table.add_column(column)
    for name in FINDINGS:
        table.add_row(name, f"{report[name]['count']:,}", ", ".join(report[name]["first"]) or "—",
                      style="red" if report[name]["count"] else None)
    return Group(head, table)


def follow(args, session: str, book_ttl_ns: int, orphan_ttl_ns: int, master: str, conf: dict) -> int:
    from tape.ops.spark.source import session as spark_session

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    with console.status("starting Spark…"):
        spark = spark_session(master, "tape-audit-follow", conf)
    audit, states = LiveAudit(session, Path(args.alerts)), OrderStates(out / "orders", book_ttl_ns, orphan_ttl_ns)
    _expect_kept(audit, out / "alerts")

    def fold(batch, batch_id: int) -> None:
        columns = batch.orderBy("seq").toArrow().to_pydict()

        def keep(found: list) -> None:
            _keep_alerts(out / "alerts", batch_id, [(o, f) for o, f in found if f.kind == ALERT])
            audit.on_findings(found, columns)

        states.apply(batch_id, columns, keep)

    df = stream_df(spark, args.journal, args.config, args.rewinder, 1, args.max_records)
    writer = (trades_of(df).writeStream.queryName("tape-audit").option("checkpointLocation", str(out / "checkpoint"))
              .foreachBatch(fold))
    query = writer.trigger(processingTime=TRIGGER).start() if args.follow else writer.trigger(availableNow=True).start()
    report: dict = {}
    try:
        with Live(console=console, refresh_per_second=1 / REFRESH_S) as live:
            while query.isActive and (args.follow or not caught_up(query)):
                report = _tick(audit, query, live, args.report, "following" if args.follow else "")
                time.sleep(REFRESH_S)
            report = _tick(audit, query, live, args.report, "caught up")
        if query.exception() is not None:
            console.print(f"[red]the audit's query failed: {query.exception()}")
            return 2
    except KeyboardInterrupt:
        pass
    finally:
        query.stop()
        states.close()
        spark.stop()
    return 1 if report.get("findings") else 0


def _tick(audit: LiveAudit, query, live, report_path: str | None, state: str) -> dict:
    audit.poll()
    report = audit.report(**position([query]))
    live.update(render(report, state))
    if report_path:
        tmp = Path(report_path + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(report_path)
    return report


def _keep_alerts(folder: Path, batch_id: int, found: list) -> None:
    """The alerts a micro-batch implied, kept beside the state (a batch run again replaces its file):
    what a restarted audit reconciles again."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{batch_id}.json.tmp"
    tmp.write_text(json.dumps([[o, *f] for o, f in found]))
    tmp.replace(folder / f"{batch_id}.json")


def _expect_kept(audit: LiveAudit, folder: Path) -> None:
    from tape.ops.spark.order_audit_core import Finding

    for path in sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if folder.exists() else []:
        found = [(row[0], Finding(*row[1:])) for row in json.loads(path.read_text())]
        audit.on_findings(found, {"seq": [f.seq for _, f in found], "stamp_ns": [f.stamp_ns for _, f in found]})
