"""`tape bench cluster`: where the whole cluster's CPU goes, per process and per message.

For each offered rate the whole `tape up` topology runs twice, a short run and a long one. A
process's CPU time (user + system, from /proc, from when the load began to send until the
replicas applied everything) in the long run minus the short one, over the messages sequenced
in the long run minus the short one, is its marginal CPU per message: start-up, idle ticks and
the end of the session cancel out. (The window opens after the load built its trades: the
cluster idled meanwhile, for a time that grew with the run, ~0.3 µs a message at any rate.) The
achieved rate and the latencies are the long run's. The time the processes' threads were ready
to run but waited for a core (/proc/PID/task/*/schedstat) is differenced the same way: on two
cores shared by nine processes, that queueing is what the latency's tail is made of. So is how
often their threads were put on a core (each wake-up, each return after a preemption), given a
1,000 messages: each time starts with cold caches, and the same code costs 2-4x in the cluster
what it costs alone (docs/performance.md). Figures, never
pass/fail. The host's speed (`tape bench protocol`'s encode rate) is measured before and
after the ladder and printed with it: figures from hosts or hours at other speeds compare only
beside it. So is the long run's steal (the CPU a virtual machine's host took from it while the load
sent, /proc/stat): a run with a sixth of a core stolen had four times the tail of one without
(docs/performance.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tape.ops.bench.throughput import host_speed
from tape.ops.verification.up import REPLICAS, run_up

PROCESSES = ("leader", "standby", "rw-1", "rw-2", *REPLICAS, "emitter", "load")


def marginal_us(short: dict, long: dict, key: str = "cpu_s", per: float = 1e6) -> dict[str, float]:
    """Per process, CPU µs per message sequenced (`key` "wait_s": µs ready to run but waiting for
    a core; "scheduled" with `per` 1,000: times put on a core a 1,000 messages), from two runs'
    reports (the sequencers named by role: whichever led the long run is the leader)."""
    extra = long["sequenced"] - short["sequenced"]
    if extra <= 0:
        raise ValueError("the long run sequenced no more than the short one")

    def by_role(report: dict) -> dict[str, float]:
        seconds = dict(report.get(key, {}))
        leader = report["terms"][-1]["leader"]
        standby = next(s for s in ("seq-a", "seq-b") if s != leader)
        return {**seconds, "leader": seconds.pop(leader, 0.0), "standby": seconds.pop(standby, 0.0)}

    a, b = by_role(short), by_role(long)
    out = {p: (b.get(p, 0.0) - a.get(p, 0.0)) * per / extra for p in PROCESSES}
    out["whole cluster"] = sum(out.values())
    return out


def bench_cluster(rates: list[float], short_s: float, long_s: float, out: str | None,
                  max_packet: int | None = None, durability: str | None = None) -> list[dict]:
    console = Console()
    rows = []
    speed_before = host_speed()
    with Progress(console=console) as progress:
        task = progress.add_task("cluster runs", total=2 * len(rates))
        for rate in rates:
            reports = []
            for seconds in (short_s, long_s):
                reports.append(_run_keeping_failures(console, rate, seconds, max_packet, durability))
                progress.advance(task)
            short, long = reports
            if "cpu_s" not in short or "cpu_s" not in long:
                console.print(f"{rate:,.0f} msg/s: a run aborted ({short.get('aborted') or long.get('aborted')})")
                continue
            rows.append({"rate_offered": rate, "rate_achieved": long["rate_msgs_per_s"],
                         "verdict": long["verdict"], "terms": len(long["terms"]), "max_packet": long["max_packet"],
                         "durability": long.get("durability"),
                         "inbound_to_applied_ms": long["latency_ms"],
                         "stamped_to_published_ms": long.get("commit_ms", {}),
                         "submit_to_sequenced_ms": long["submit_to_sequenced_ms"],
                         "host_steal_cores": long.get("host_steal_cores"),
                         "us_per_msg": marginal_us(short, long),
                         "wait_us_per_msg": marginal_us(short, long, "wait_s"),
                         "scheduled_per_1000_msgs": marginal_us(short, long, "scheduled", per=1000)})
    speeds = (speed_before, host_speed())
    for row in rows:
        row["host_encode_msgs_per_s"] = [round(s) for s in speeds]
    console.print(_table(rows, short_s, long_s, rows[0]["max_packet"] if rows else max_packet, speeds))
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
        console.print(f"figures: {out}")
    return rows


def _run_keeping_failures(console: Console, rate: float, seconds: float, max_packet: int | None,
                          durability: str | None = None) -> dict:
    """One `tape up` run; a failed verdict keeps the run's files and names the failed checks."""
    root = Path(tempfile.mkdtemp(prefix=f"tape-bench-{rate:.0f}-{seconds:g}s-"))
    quiet = Console(file=open(os.devnull, "w"))
    report = run_up(rate, seconds, 0.0, str(root), seed=1, console=quiet, max_packet=max_packet,
                    durability=durability)
    if report["verdict"] == "pass":
        shutil.rmtree(root, ignore_errors=True)
    else:
        failed = [name for name, ok in report["checks"].items() if not ok] or [report.get("aborted")]
        console.print(f"{rate:,.0f} msg/s for {seconds:g} s: verdict fail ({'; '.join(map(str, failed))}); "
                      f"its files: {root}")
    return report


def _table(rows: list[dict], short_s: float, long_s: float, max_packet: int | None,
           speeds: tuple[float, float]) -> Table:
    packets = f", packets of {max_packet:,} bytes" if max_packet else ""
    packets += f", durability {rows[0]['durability']}" if rows else ""
    table = Table(title=f"tape bench cluster: marginal CPU µs per message ({long_s:g} s run minus {short_s:g} s run"
                        f"{packets})",
                  caption=f"host speed, before / after: {speeds[0] / 1e6:.2f} / {speeds[1] / 1e6:.2f} M msg/s "
                          "encoded (tape bench protocol's encode)")
    table.add_column("offered msg/s")
    for r in rows:
        table.add_column(f"{r['rate_offered']:,.0f}", justify="right")
    table.add_row("achieved msg/s", *(f"{r['rate_achieved']:,.0f}" for r in rows))
    table.add_row("verdict, terms", *(f"{r['verdict']}, {r['terms']}" for r in rows))
    for label, key in (("inbound to applied", "inbound_to_applied_ms"),
                       ("of which stamped to published", "stamped_to_published_ms"),
                       ("submit to sequenced", "submit_to_sequenced_ms")):
        table.add_row(f"{label} p50 / p99 ms",
                      *(f"{r.get(key, {}).get('p50') or 0:.1f} / {r.get(key, {}).get('p99') or 0:.1f}" for r in rows))
    table.add_row("the host's steal while sending, cores",
                  *("-" if r["host_steal_cores"] is None else f"{r['host_steal_cores']:.2f}" for r in rows))
    for p in (*PROCESSES, "whole cluster"):
        table.add_row(p if p != "whole cluster" else "[bold]whole cluster[/bold]",
                      *(f"{r['us_per_msg'][p]:.2f}" for r in rows))
    table.add_row("waiting for a core, all processes", *(f"{r['wait_us_per_msg']['whole cluster']:.2f}" for r in rows))
    table.add_row("put on a core a 1,000 messages, all", *(f"{r['scheduled_per_1000_msgs']['whole cluster']:.1f}"
                                                           for r in rows))
    return table
