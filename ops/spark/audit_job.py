"""`tape audit` (Spark) and `tape replay` (no Spark)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.runtime.config import Config


def audit(journal: str, alerts: str, cfg: Config, master: str, report_path: str | None, conf: dict | None = None,
          skip_corrupt: bool = False) -> int:
    from tape.ops.spark.source import SparkProgress, reconcile, session

    err = Console(stderr=True)
    for p in (journal, alerts):
        if "://" not in p and not Path(p).exists():
            print(f"tape audit: {p} does not exist", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    with err.status("starting Spark…"):
        spark = session(master, "tape-audit", conf)
    try:
        with SparkProgress(spark, err, "recomputing the alerts from the journal"):
            report = reconcile(spark, journal, alerts, cfg.session, int(cfg.book_ttl_s * 1e9),
                               int(cfg.orphan_ttl_s * 1e9), skip_corrupt=skip_corrupt)
    finally:
        spark.stop()
    report["seconds"] = round(time.monotonic() - t0, 1)
    return show(report, journal, alerts, report_path)


def show(report: dict, journal: str, alerts: str, report_path: str | None) -> int:
    """Print the audit's findings, write its report, and give its exit status: 1 on any finding."""
    table = Table(title=f"tape audit: {journal} against {alerts}")
    table.add_column("finding")
    table.add_column("count", justify="right")
    table.add_column("first alert ids")
    for kind in ("missing", "duplicate", "unexpected", "mismatched"):
        r = report[kind]
        table.add_row(kind, f"{r['count']:,}", ", ".join(r["first"]))
    table.caption = (f"{report['expected']:,} alerts recomputed, {report['delivered']:,} delivered; "
                     f"{report['findings']} findings in {report['seconds']} s")
    if report.get("corrupt_records", {}).get("count"):
        table.add_row("[red]corrupt journal records skipped[/red]", f"{report['corrupt_records']['count']:,}",
                      "; ".join(report["corrupt_records"]["first"]))
    Console(stderr=False).print(table)
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=1))
    return 1 if report["findings"] else 0


def replay(journal: str, to_lmdb: str, cfg: Config, resume: bool = False) -> int:
    """Rebuild a replica's LMDB state from a journal through the same state machine: from seq 1
    into an empty directory (a snapshot already there is moved aside), or with `resume` from the
    snapshot there, which must verify."""
    from tape.protocol.moldudp64 import encode_packet
    from tape.replicas.audit_core import AuditMachine
    from tape.replicas.snapshot import SnapshotInvalid, SnapshotStore, move_aside
    from tape.runtime.storage.journal_store import Journal, JournalCorruption

    machine = AuditMachine(int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9))
    target, aside = Path(to_lmdb), None
    if not resume and target.exists() and any(target.iterdir()):
        aside = move_aside(target)
    try:
        store = SnapshotStore(target)
        if resume:
            store.load(machine)
    except SnapshotInvalid as e:
        print(f"tape replay: refusing to resume from {target}: {e}; run without --resume to rebuild from seq 1",
              file=sys.stderr)
        return 1
    started_from = machine.last_seq
    try:
        j = Journal(journal, readonly=True)
        run, first = [], machine.last_seq + 1
        for seq, _, raw in j.read(machine.last_seq + 1):
            run.append(raw)
            if len(run) == 10_000:
                machine.apply_packet(first, encode_packet(b"replay    ", first, run))  # as a replica applies
                first += len(run)
                run = []
                if machine.last_seq % 100_000 == 0:
                    store.save(machine, {"node": "replay"})
        if run:
            machine.apply_packet(first, encode_packet(b"replay    ", first, run))
    except JournalCorruption as e:
        print(f"tape replay: {e}", file=sys.stderr)
        return 1
    store.save(machine, {"node": "replay"})
    store.close()
    print(json.dumps({"last_seq": machine.last_seq, "digest": machine.digest(), "alerts_raised": machine.alerts_raised,
                      "open_books": len(machine.books), "rejects": machine.rejects, "resumed_after": started_from,
                      "moved_aside": str(aside) if aside else None}))
    return 0
