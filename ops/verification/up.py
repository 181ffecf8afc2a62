"""`tape up`: the whole local cluster, watched live, then checked.

Starts two sequencers (a leader is elected; the other is the standby), two
rewinders, three replicas, the emitter and a load generator as separate
processes on loopback multicast; stops them in order (load, standby, leader
-> end of session, replicas once they applied everything, emitter,
rewinders) and prints a verdict against DESIGN.md section 9. With `--out
DIR` it keeps journals (`journal/<node>`), LMDB files, `alerts.jsonl` and
`report.json`. Exits 1 if the verdict is fail. Drills (`tape drill`) run
the same with a scripted fault on the way (tape/ops/drill.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tape.ops.verification.faults import FaultUnavailable
from tape.ops.verification.load import SENDING
from tape.ops.verification.local import ClusterError, LocalCluster, host_steal_seconds
from tape.ops.verification.memory_watch import MemorySamples
from tape.ops.verification.tradegen import orders_in
from tape.ops.verification.verdict import judge, read_run
from tape.protocol.journal import RECORD_HEADER_SIZE
from tape.protocol.messages import SEQUENCED_SIZE
from tape.replicas.audit_core import compiled_books_bytes
from tape.runtime.settings import Config

SEQUENCERS = ("seq-a", "seq-b")
VOTERS = (*SEQUENCERS, "rw-1", "rw-2")
REPLICAS = ("replica-A", "replica-B", "replica-C")
JOURNAL_BYTES_A_TRADE = len(VOTERS) * (RECORD_HEADER_SIZE + SEQUENCED_SIZE)  # a record in each voter's journal
PROCESSES_BYTES = 1 << 30  # every process's memory but the replicas' books (measured: ~1 GiB all told)
SLACK_S = 90.0  # a run that has not finished its load this long after its duration is stuck: fail it
LAN_HOSTS = 5  # --lan: seq-a, seq-b, rw-1, rw-2 a host each; the replicas, emitter and load on the fifth
REPLICAS_FINISH_S = 60.0  # after the end of session, for the replicas to apply everything
APPLIED_WAIT_S = 30.0  # after the load, for the replicas to apply what was committed (CPU accounting)
# The live view reads every node's metrics once a second (a read costs a node ~1.5 ms of CPU: part of
# what a run measures), and checks the processes and steps a drill four times a second.
SCRAPE_EVERY_S = 1.0
WATCH_TICK_S = 0.25
SENDING_TICK_S = 0.01  # the watch's tick until the load says it sends: when the CPU window opens


DURABILITY_SAID = {  # what a run says of its journals (docs/failover.md)
    "flush": "durability flush: a record is committed once a majority of the voters has it on disk (it survives "
             "any power loss)",
    "replicated": "durability replicated: a record is committed once a majority of the voters holds it in memory, "
                  "flushed in the background (it survives any one process or host failing, its power included, "
                  "not two voters' hosts losing power within one flush interval: on one host, one power loss "
                  "takes every voter's memory)",
}


def node_metric(metrics: dict, name: str, node: str) -> float:
    return metrics.get(f'{name}{{node="{node}"}}', 0.0)


def run_up(rate: float, duration: float, drop: float, out: str | None, seed: int, drill=None,
           console: Console | None = None, slack_s: float = SLACK_S, delivery: str = "first",
           lan: bool = False, max_packet: int | None = None, book_ttl_s: float = Config.book_ttl_s,
           durability: str | None = None) -> dict:
    """Run the cluster under load (with `drill`'s fault, if any); returns the report. A node that
    exits unbidden, or a load still running `slack_s` after `duration`, aborts the run (verdict fail).
    `lan`: over five hosts (network namespaces, ops/verification/lan.py) instead of one host's loopback.
    `max_packet`: the stream's packet size (`[stream] max_packet`; default: config.default_toml's).
    `durability`: the journals' (`[journal] durability`; default: config.default_toml's, flush on one host).
    `book_ttl_s`: how long a book stays open (`[audit] book_ttl_s`); the replicas' books are sized
    for the orders open at once (`[audit] books_expected`), those of the whole run if it is shorter.
    A run this host has not the disk or memory for is refused before it starts."""
    open_books = orders_in(int(rate * min(duration, book_ttl_s)))
    short = short_of_room(Path(out or tempfile.gettempdir()), int(rate * duration), open_books)
    if short:
        return _aborted(console or Console(), "tape up", short, drill)
    extra = f"[audit]\nbooks_expected = {open_books}\nbook_ttl_s = {book_ttl_s}"
    books_mb = round((compiled_books_bytes(open_books) or 0) / 2**20, 1)
    memory = MemorySamples(warm_up_s=book_ttl_s if book_ttl_s < duration else None,
                           bounds_mb={f"each replica's {open_books:,} books (book_ttl_s x orders a second)": books_mb})
    run = (rate, duration, drop, out, seed, drill, console, slack_s, delivery)
    if not lan:
        return _run(*run, None, extra, max_packet, memory, durability)
    from tape.ops.verification.lan import Lan, LanUnavailable

    try:
        with Lan(LAN_HOSTS + (1 if getattr(drill, "webhook", False) else 0)) as net:
            return _run(*run, net, extra, max_packet, memory, durability)
    except LanUnavailable as e:
        return _aborted(console or Console(), "the LAN", f"cannot build it here: {e}", drill)


def short_of_room(where: Path, trades: int, open_books: int) -> str | None:
    """Why this host cannot hold a run of `trades` with `open_books` books open at once, or None:
    the voters' journals on the disk of `where`, and three replicas' books in memory."""
    where = next(p for p in (where, *where.parents) if p.exists())
    disk, free = trades * JOURNAL_BYTES_A_TRADE, shutil.disk_usage(where).free
    if disk > free:
        return (f"its journals need {disk / 2**30:,.1f} GiB ({len(VOTERS)} voters, "
                f"{JOURNAL_BYTES_A_TRADE // len(VOTERS)} bytes a trade each), {where} has {free / 2**30:,.1f} GiB free")
    books = compiled_books_bytes(open_books)
    memory, available = len(REPLICAS) * (books or 0) + PROCESSES_BYTES, _memory_available()
    if books is not None and available is not None and memory > available:
        return (f"it needs {memory / 2**30:,.1f} GiB of memory ({len(REPLICAS)} replicas' {open_books:,} open books "
                f"and the rest), {available / 2**30:,.1f} GiB is available: a shorter book_ttl_s or run")
    return None


def _memory_available() -> int | None:
    try:
        line = next(li for li in Path("/proc/meminfo").read_text().splitlines() if li.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def _run(rate, duration, drop, out, seed, drill, console, slack_s, delivery, net, extra, max_packet, memory,
         durability) -> dict:
    console = console or Console()
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="tape-up-"))
    if out and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    total = int(rate * duration)
    if net is None:
        cluster = LocalCluster(root, replicas=3, sequencers=len(SEQUENCERS), delivery=delivery, extra=extra,
                               max_packet=max_packet, durability=durability)
    else:
        from tape.ops.verification.lan import LanCluster

        cluster = LanCluster(root, net, extra, delivery=delivery, webhook=getattr(drill, "webhook", False),
                             max_packet=max_packet, durability=durability)
    cluster.planted = drill.planted if drill else ()
    what = f"drill [bold]{drill.name}[/bold]" if drill else "[bold]tape up[/bold]"
    where = f"over {len(net.hosts)} hosts ({', '.join(net.addresses)})" if net else "on loopback"
    try:
        console.print(f"{what}: 2 sequencers, 2 rewinders, 3 replicas, emitter {where} on "
                      f"{cluster.cfg.group}:{cluster.cfg.port}; {total:,} trades at {rate:,.0f}/s, "
                      f"{drop:.0%} loss at every receiver; alerts delivered on the {delivery} copy; data in {root}\n"
                      f"{DURABILITY_SAID[cluster.cfg.durability]}")
        try:
            if drill:
                drill.prepare(cluster)
            cluster.start_all(drop)
            cluster.wait_leader()  # (trades sent before an election are resent: not what a run measures)
            cluster.start("load", "load", "--rate", str(rate), "--messages", str(total), "--drop", str(drop),
                          "--seed", str(seed))
            opened = _watch(console, cluster, duration, drill, slack_s, memory)
            if drill:
                drill.finish(cluster)
            timing = _voter_timing(cluster)
            cpu = _since(opened[0], _cpu_when_applied(cluster)) if drill is None and opened else {}
            steal = _steal_cores(opened[3]) if cpu else None
            waited = _since(opened[1], cluster.wait_seconds()) if cpu else {}  # ready to run, without a core
            scheduled = _since(opened[2], cluster.times_scheduled()) if cpu else {}  # put on a core
            _stop_in_order(cluster)
        except (ClusterError, FaultUnavailable) as e:  # fail now, saying why, rather than wait for a verdict
            report = _aborted(console, what, str(e), drill)
        else:
            report = _verdict(console, cluster, total, rate, drill)
            report["voters"] = timing
            report["memory"] = memory.report(root / "memory.png", f"resident memory: {total:,} trades at {rate:,.0f}/s")
            if memory.series:
                console.print(memory.table())
            if cpu:
                load = json.loads(cluster.output("load") or "{}")
                report["cpu_s"] = {**cpu, "load": load.get("cpu_s", 0.0)}
                report["wait_s"] = {**waited, "load": load.get("wait_s", 0.0)}
                report["scheduled"] = {**scheduled, "load": load.get("scheduled", 0)}
                if steal is not None:
                    report["host_steal_cores"] = steal
                    console.print(f"the host's steal while the load sent: {steal:.2f} of a core (what a virtual "
                                  "machine's host ran instead: compare latencies only with runs that had as little)")
    finally:
        cluster.close()
        if drill:
            drill.release(cluster)
    _arrange(cluster, root)
    report["hosts"] = sorted({n.host for n in cluster.cfg.nodes})
    report["max_packet"], report["durability"] = cluster.cfg.max_packet, cluster.cfg.durability
    (root / "report.json").write_text(json.dumps(report, indent=1))
    if out:
        console.print(f"report: {root / 'report.json'}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _stop_in_order(cluster: LocalCluster) -> None:
    leader = cluster.leader()
    if leader:  # it ends the session: an entry every live voter journals (the standby too, which then
        cluster.stop(leader)  # campaigns no more), and the replicas finish where they apply it
    for s in SEQUENCERS:
        if s != leader:
            cluster.stop(s)
    deadline = time.monotonic() + REPLICAS_FINISH_S
    for r in REPLICAS:
        proc = cluster.procs[r]
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.stop(r)
    for name in ("emitter", "rw-1", "rw-2"):
        cluster.stop(name)


def _cpu_when_applied(cluster: LocalCluster) -> dict[str, float]:
    """Each process's CPU seconds once every replica has applied what was committed when the
    load ended (or APPLIED_WAIT_S passed): all the work of the run's messages, none of stopping."""
    m = _scrape(cluster)
    committed = max(node_metric(m[s], "tape_sequencer_commit_seq", s) for s in SEQUENCERS)
    deadline = time.monotonic() + APPLIED_WAIT_S
    while time.monotonic() < deadline:
        m = _scrape(cluster)
        if all(node_metric(m[r], "tape_replica_applied_seq", r) >= committed for r in REPLICAS if m[r]):
            break
        time.sleep(0.05)
    return cluster.cpu_seconds()


def _steal_cores(opened: tuple[float | None, float]) -> float | None:
    """The host's steal since `opened` (its steal seconds then, and the monotonic clock), in cores:
    what the other tenants of a virtual machine's host took while the cluster ran."""
    (before, t0), now = opened, host_steal_seconds()
    if before is None or now is None:
        return None
    return round((now - before) / max(time.monotonic() - t0, 1e-9), 3)


def _voter_timing(cluster: LocalCluster) -> dict:
    """Per voter, what an election timer would have felt: its own stalls (held timers), slow
    fsyncs and step-downs by reason. The evidence when a run elects more than one term."""
    out = {}
    for n, m in _scrape(cluster).items():
        if n not in VOTERS or not m:
            continue
        def total(suffix: str) -> float:
            return sum(v for k, v in m.items() if k.split("{")[0].endswith(suffix))
        out[n] = {"stalls": int(total("_stalls_total")), "stalled_ms": round(total("_stalled_seconds_total") * 1000),
                  "slow_fsyncs": int(total("_journal_fsync_slow_total")),
                  "fsync_max_ms": round(total("_journal_fsync_max_seconds") * 1000, 1),
                  "step_downs": {k.split('reason="')[1].rstrip('"}'): int(v) for k, v in m.items()
                                 if k.startswith("tape_sequencer_step_downs_total") and 'reason="' in k}}
    return out


def _scrape(cluster: LocalCluster) -> dict:
    out = {}
    for n in (*VOTERS, *REPLICAS, "emitter"):
        try:
            out[n] = cluster.metrics(n) if cluster.alive(n) else {}
        except OSError:
            out[n] = {}
    return out


def _since(start: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    return {name: seconds - start.get(name, 0.0) for name, seconds in now.items()}


def load_sending(cluster: LocalCluster) -> bool:
    try:
        return SENDING in cluster.logs["load"].read_text()
    except OSError:
        return False


def _watch(console, cluster: LocalCluster, duration: float, drill, slack_s: float,
           memory: MemorySamples) -> tuple | None:
    """Show the cluster live until the load is done (and the drill healed); raise ClusterError
    if a node exits unbidden or the run outlives `duration` + `slack_s`. The run's clock (the
    progress bar, the drill's moment to inject, that deadline) starts when the load begins to
    send: it builds all its trades first (~1.5 µs each, seconds for a long run). Returns each
    process's CPU and waiting time then (None if it never said so)."""
    opened = None
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    task = progress.add_task("load: building its trades", total=duration)
    t0 = time.monotonic()
    deadline = t0 + duration + slack_s  # (while it builds, the build spends the slack)
    scraped = (t0 - SCRAPE_EVERY_S, 0.0)  # when the metrics were last read, and the commit point then
    rate = 0.0
    table = Table()
    events: list[str] = []
    with Live(console=console, refresh_per_second=4) as live:
        while cluster.alive("load") or (drill and drill.injected and not drill.healed):  # a drill may restart it
            now = time.monotonic()
            cluster.check_running(ignore=("load",))
            if now > deadline:
                awaited = "the load to finish" if cluster.alive("load") else f"the drill's heal ({drill.name})"
                raise ClusterError(f"still waiting for {awaited} {now - t0 - duration:.0f} s after the run's end")
            if opened is None and load_sending(cluster):
                opened = (cluster.cpu_seconds(), cluster.wait_seconds(), cluster.times_scheduled(),
                          (host_steal_seconds(), now))
                t0, deadline = now, now + duration + slack_s
                progress.update(task, description="load")
            if opened:
                memory.maybe_sample(cluster.procs, now - t0)
            if drill and opened:
                note = drill.step(cluster, now - t0)
                if note:
                    events.append(f"{now - t0:5.1f} s  {note}")
            if now - scraped[0] >= SCRAPE_EVERY_S:
                m = _scrape(cluster)
                seq = max(node_metric(m[s], "tape_sequencer_commit_seq", s) for s in SEQUENCERS)
                rate, scraped = (seq - scraped[1]) / (now - scraped[0]), (now, seq)
                table = _live_table(m, rate)
            progress.update(task, completed=min(duration, now - t0) if opened else 0)
            live.update(Group(table, *events[-6:], progress))
            time.sleep(WATCH_TICK_S if opened else SENDING_TICK_S)
    return opened


def _live_table(m: dict, rate: float) -> Table:
    """Each node's progress from its metrics (`m`: node -> metrics, {} if down)."""
    table = Table(show_header=True, header_style="bold")
    for col in ("process", "seq", "msg/s / detail", "lag"):
        table.add_column(col, justify="left" if col == "process" else "right")
    for s in SEQUENCERS:
        if not m[s]:
            table.add_row(f"{s} (down)", "", "", "")
            continue
        leads = node_metric(m[s], "tape_sequencer_leader", s) == 1
        table.add_row(
            f"{s} ({'leader' if leads else 'standby'}, term {node_metric(m[s], 'tape_sequencer_term', s):.0f})",
            f"{node_metric(m[s], 'tape_sequencer_sequenced_seq', s):,.0f}",
            f"{rate:,.0f} msg/s" if leads else "",
            f"{node_metric(m[s], 'tape_sequencer_commit_lag', s):,.0f} uncommitted" if leads else "",
        )
    for r in ("rw-1", "rw-2"):
        table.add_row(r if m[r] else f"{r} (down)", f"{node_metric(m[r], 'tape_rewinder_last_seq', r):,.0f}",
                      f"{node_metric(m[r], 'tape_rewinder_gapfill_messages_sent_total', r):,.0f} gap-filled", "")
    for r in REPLICAS:
        table.add_row(r if m[r] else f"{r} (down)", f"{node_metric(m[r], 'tape_replica_applied_seq', r):,.0f}",
                      f"{node_metric(m[r], 'tape_replica_alerts_raised_total', r):,.0f} alerts",
                      f"{node_metric(m[r], 'tape_replica_lag', r):,.0f}")
    e = m["emitter"]
    table.add_row("emitter" if e else "emitter (down)", f"{node_metric(e, 'tape_emitter_mark', 'emitter'):,.0f}",
                  f"{node_metric(e, 'tape_emitter_alerts_delivered_total', 'emitter'):,.0f} delivered",
                  f"{node_metric(e, 'tape_emitter_duplicates_total', 'emitter'):,.0f} dup. copies")
    return table


def _verdict(console, cluster: LocalCluster, total: int, rate: float, drill) -> dict:
    run = read_run(cluster.cfg, VOTERS, REPLICAS, SEQUENCERS, cluster.output("load"), total, plain=drill is None,
                   logs=cluster.logs, planted=cluster.planted)
    checks, figures, report = judge(run)
    lat = run.load.get("latency_ms", {})
    # Inbound (the sequencer's stamp) to applied, for the slowest of the replicas.
    applied_lat = {q: max((run.replicas[r].get("latency_ms", {}).get(q) or 0.0) for r in REPLICAS)
                   for q in ("p50", "p99", "max")}
    report.update({
        "rate_msgs_per_s": run.load.get("rate_acked", 0.0), "rate_target": rate,
        "latency_ms": {**applied_lat, "measured": "inbound (sequencer stamp) to applied, slowest replica"},
        "submit_to_sequenced_ms": {"p50": lat.get("p50"), "p99": lat.get("p99"), "max": lat.get("max"),
                                   "measured": "client submit to seen sequenced on the stream"},
        "backoffs": {"honoured": run.load.get("backoffs", 0), "paused_s": run.load.get("paused_s", 0.0)},
        "commit_ms": {**max((st.get("commit_ms", {}) for st in run.sequencers.values()),
                            key=lambda c: c.get("count", 0), default={}),
                      "measured": "a batch stamped to published by the leader (the sequencer that published most)"},
        "alert_ms": {**run.emitter.get("latency_ms", {}), "delivery": run.emitter.get("delivery"),
                     "measured": "purchase stamped to its alert delivered by the emitter"},
    })
    if drill:
        report["drill"] = drill.name
        for name, (ok, figure) in drill.checks(cluster, report).items():
            checks[name] = ok
            figures[name] = figure
    report["checks"] = checks
    report["verdict"] = "pass" if all(checks.values()) else "fail"
    _print_verdict(console, f"drill {drill.name}" if drill else "tape up", checks, figures, report)
    return report


def _aborted(console, what: str, reason: str, drill) -> dict:
    console.print(f"\n{what}: [bold red]FAIL[/bold red], run aborted: {reason}")
    return {"verdict": "fail", "aborted": reason, "checks": {}, "drill": drill.name if drill else None,
            "rate_msgs_per_s": 0.0, "latency_ms": {}}


def _print_verdict(console, title: str, checks: dict, figures: dict, report: dict) -> None:
    table = Table(title=f"{title}: verdict (DESIGN.md section 9)", show_header=False)
    table.add_column("check")
    table.add_column("figures", justify="right")
    table.add_column("")
    for name, ok in checks.items():
        table.add_row(name, figures[name], "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    table.add_row("rate achieved", f"{report['rate_msgs_per_s']:,.0f} msg/s", "")
    b = report.get("backoffs", {})
    table.add_row("clients told to back off (leader overloaded)",
                  f"{b.get('honoured', 0):,} times, {b.get('paused_s', 0):.2f} s paused", "")
    for label, lat in (("inbound to applied", report["latency_ms"]),
                       ("of which stamped to published (leader)", report["commit_ms"]),
                       ("client submit to sequenced", report["submit_to_sequenced_ms"]),
                       (f"purchase to alert delivered ({report['alert_ms']['delivery']})", report["alert_ms"])):
        table.add_row(f"latency p50 / p99 / max, {label}",
                      f"{lat.get('p50') or 0:.1f} / {lat.get('p99') or 0:.1f} / {lat.get('max') or 0:.1f} ms", "")
    if report.get("failover_ms") is not None:
        table.add_row("failover (old leader's last stamp to new leader's term start)",
                      f"{report['failover_ms']:.0f} ms", "")
    verdict = "[bold green]PASS[/bold green]" if report["verdict"] == "pass" else "[bold red]FAIL[/bold red]"
    table.add_row("verdict", "", verdict)
    console.print()
    console.print(table)


def _arrange(cluster: LocalCluster, root: Path) -> None:
    """journal/<node> and alerts.jsonl at the top of the output directory."""
    (root / "journal").mkdir(exist_ok=True)
    for n in VOTERS:
        link = root / "journal" / n
        if not link.exists():
            link.symlink_to(cluster.journal_dir(n).resolve())
    sink = Path(cluster.cfg.node("emitter").data) / "alerts.jsonl"
    if sink.exists():
        shutil.copyfile(sink, root / "alerts.jsonl")


def main(rate: float, duration: float, drop: float, out: str | None, seed: int, delivery: str = "first",
         lan: bool = False, runs: int = 1, max_packet: int | None = None,
         book_ttl_s: float | None = None, durability: str | None = None) -> int:
    how = {"delivery": delivery, "lan": lan, "max_packet": max_packet, "book_ttl_s": book_ttl_s or Config.book_ttl_s,
           "durability": durability}
    if runs == 1:
        return 0 if run_up(rate, duration, drop, out, seed, **how)["verdict"] == "pass" else 1
    reports = []
    for i in range(runs):
        run_out = str(Path(out) / f"run-{i + 1}") if out else None
        reports.append(run_up(rate, duration, drop, run_out, seed + i, **how))
        _print_runs(Console(), reports, runs)
    return 0 if all(r["verdict"] == "pass" for r in reports) else 1


def _print_runs(console: Console, reports: list[dict], runs: int) -> None:
    """One row per run: verdict, terms, and what the voters' timers felt: stalls (all voters), the
    longest total a voter's timers were held, slow fsyncs (all voters) and the longest fsync."""
    table = Table(title=f"{len(reports)} of {runs} runs")
    for col in ("run", "verdict", "terms", "msg/s", "p99 ms", "stalls", "held ms", "slow fsyncs", "fsync ms",
                "step-downs"):
        table.add_column(col, justify="left" if col in ("verdict", "step-downs") else "right")
    for i, r in enumerate(reports, 1):
        voters = r.get("voters", {})
        stalls = sum(v["stalls"] for v in voters.values())
        held = max((v["stalled_ms"] for v in voters.values()), default=0)
        slow = sum(v["slow_fsyncs"] for v in voters.values())
        fsync_max = max((v["fsync_max_ms"] for v in voters.values()), default=0)
        downs = ", ".join(f"{n}: {reason} x{c}" for n, v in voters.items() for reason, c in v["step_downs"].items())
        table.add_row(str(i), r["verdict"] if not r.get("aborted") else f"fail ({r['aborted'][:40]})",
                      str(len(r.get("terms", []))), f"{r['rate_msgs_per_s']:,.0f}",
                      f"{r['latency_ms'].get('p99') or 0:.1f}", str(stalls), str(held), str(slow), f"{fsync_max:.0f}",
                      downs or "-")
    console.print(table)
