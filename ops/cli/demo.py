"""`tape demo` (behind `make demo`): the live stream with real processes.

Starts a sequencer and two rewinders on loopback multicast, a load generator
and a `tape tail` listener, with a seeded share of datagrams dropped at every
receiver. Shows rates, commit lag, gaps filled and drops live, then stops
everything in order and checks the run: every trade sequenced exactly once,
the three journals identical, the listener's stream gap-free and identical
to the journal.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tape.ops.cli.journal_tool import digest
from tape.ops.verification.local import LocalCluster
from tape.protocol import messages
from tape.runtime.storage.journal_store import Journal

NODES = ("seq-a", "rw-1", "rw-2")


def run_demo(total: int, rate: float, out: str | None, drop: float, seed: int) -> int:
    console = Console()
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="tape-demo-"))
    if out and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(root)
    try:
        console.print(f"[bold]tape demo[/bold]: sequencer + 2 rewinders on {cluster.cfg.group}:{cluster.cfg.port}, "
                      f"{total:,} trades at {rate:,.0f} msg/s, {drop:.0%} loss at every receiver; data in {root}")
        cluster.start_all(drop)
        tail = cluster.start(
            "tail", "tail", "--summary", "--until", str(total + 1), "--drop", str(drop), "--seed", str(seed + 7)
        )
        load = cluster.start("load", "load", "--rate", str(rate), "--messages", str(total), "--drop", str(drop),
                             "--seed", str(seed))
        _watch(console, cluster, load, total)
        tail.wait(timeout=60)
        time.sleep(0.3)  # the last commit point reaches the rewinders
        for name in NODES:
            cluster.stop(name)
        ok = _verdict(console, cluster, total)
    finally:
        cluster.close()
    if not out:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


def _metric(m: dict, name: str, node: str, default: float = 0.0) -> float:
    return m.get(f'{name}{{node="{node}"}}', default)


def _sum_prefix(m: dict, prefix: str, skip: str = "") -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix) and (not skip or skip not in k))


def _watch(console, cluster: LocalCluster, load, total: int) -> None:
    progress = Progress(TextColumn("published"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task("published", total=total + 1)
    last = (time.monotonic(), 0.0)
    rate = 0.0
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while True:
            done = load.poll() is not None
            try:
                m = {n: cluster.metrics(n) for n in NODES}
            except OSError:
                break
            s = m["seq-a"]
            published = _metric(s, "tape_sequencer_messages_published_total", "seq-a")
            now = time.monotonic()
            if now - last[0] >= 0.5:
                rate = (published - last[1]) / (now - last[0])
                last = (now, published)
            table = Table(show_header=True, header_style="bold")
            for col in ("node", "seq", "committed", "msg/s", "lag", "gap fills", "dropped"):
                table.add_column(col, justify="right" if col != "node" else "left")
            table.add_row("seq-a (leader)", f"{_metric(s, 'tape_sequencer_sequenced_seq', 'seq-a'):,.0f}",
                          f"{_metric(s, 'tape_sequencer_commit_seq', 'seq-a'):,.0f}", f"{rate:,.0f}",
                          f"{_metric(s, 'tape_sequencer_commit_lag', 'seq-a'):,.0f}", "",
                          f"{_sum_prefix(s, 'tape_sequencer_dropped_datagrams_total', skip='duplicate'):,.0f}")
            for n in ("rw-1", "rw-2"):
                r = m[n]
                table.add_row(n, f"{_metric(r, 'tape_rewinder_last_seq', n):,.0f}",
                              f"{_metric(r, 'tape_rewinder_commit_seq', n):,.0f}", "", "",
                              f"{_metric(r, 'tape_rewinder_gapfill_messages_sent_total', n):,.0f}",
                              f"{_sum_prefix(r, 'tape_rewinder_dropped_datagrams_total'):,.0f}")
            progress.update(task, completed=min(published, total + 1))
            live.update(Group(table, progress))
            if done:
                break
            time.sleep(0.25)


def _verdict(console, cluster: LocalCluster, total: int) -> bool:
    load = json.loads(cluster.output("load") or "{}")
    tail = json.loads(cluster.output("tail") or "{}")
    journals = {n: digest(cluster.journal_dir(n)) for n in NODES}
    origins = []
    for _, _, raw in Journal(cluster.journal_dir("seq-a"), readonly=True).read():
        m = messages.SEQUENCED.unpack(raw)
        if m[messages.TYPE] in (messages.REQUEST, messages.PURCHASE):
            origins.append((m[messages.ORIGIN], m[messages.CLIENT_SEQ]))
    dupes = sum(c - 1 for c in Counter(origins).values() if c > 1)
    tail_ok = bool(tail) and tail.get("first_seq") == 1 and tail["messages"] == tail["last_seq"] and \
        digest(cluster.journal_dir("seq-a"), tail["last_seq"])[1] == tail["digest"]
    checks = [
        (
            "trades submitted / acknowledged",
            f"{load.get('submitted', 0):,} / {load.get('acked', 0):,}",
            load.get("acked") == total,
        ),
        ("trades sequenced (each once)", f"{len(origins):,}, {dupes} duplicates", len(origins) == total and not dupes),
        (
            "journals identical (seq-a, rw-1, rw-2)",
            f"{journals['seq-a'][0]:,} records",
            len(set(journals.values())) == 1,
        ),
        ("listener's stream gap-free and equal to the journal", f"{tail.get('messages', 0):,} messages", tail_ok),
        (
            "gaps detected / repaired by the listener",
            f"{tail.get('gaps_detected', 0):,} / {tail.get('requests_sent', 0):,} requests",
            True,
        ),
        ("client resends after loss", f"{load.get('resends', 0):,}", True),
        ("acknowledged rate", f"{load.get('rate_acked', 0):,.0f} msg/s", True),
        (
            "submit-to-sequenced latency p50 / p99",
            f"{load.get('latency_ms', {}).get('p50', 0):.1f} / {load.get('latency_ms', {}).get('p99', 0):.1f} ms",
            True,
        ),
    ]
    console.print()
    table = Table(title="tape demo: verdict", show_header=False)
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_column("")
    for name, value, ok in checks:
        table.add_row(name, value, "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    ok = all(c[2] for c in checks)
    table.add_row("verdict", "", "[bold green]PASS[/bold green]" if ok else "[bold red]FAIL[/bold red]")
    console.print(table)
    return ok
