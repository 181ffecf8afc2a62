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
from collections import Counter
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tape.node.journal_store import Journal
from tape.ops.local import LocalCluster
from tape.ops.reference import expected_alerts
from tape.protocol import messages as M

SEQUENCERS = ("seq-a", "seq-b")
VOTERS = (*SEQUENCERS, "rw-1", "rw-2")
REPLICAS = ("replica-A", "replica-B", "replica-C")


def _m(metrics: dict, name: str, node: str) -> float:
    return metrics.get(f'{name}{{node="{node}"}}', 0.0)


def run_up(rate: float, duration: float, drop: float, out: str | None, seed: int, drill=None,
           console: Console | None = None) -> dict:
    """Run the cluster under load (with `drill`'s fault, if any); returns the report."""
    console = console or Console()
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="tape-up-"))
    if out and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    total = int(rate * duration)
    cluster = LocalCluster(root, replicas=3, sequencers=len(SEQUENCERS))
    what = f"drill [bold]{drill.name}[/bold]" if drill else "[bold]tape up[/bold]"
    try:
        console.print(f"{what}: 2 sequencers, 2 rewinders, 3 replicas, emitter on "
                      f"{cluster.cfg.group}:{cluster.cfg.port}; {total:,} trades at {rate:,.0f}/s, "
                      f"{drop:.0%} loss at every receiver; data in {root}")
        cluster.start_all(drop)
        load = cluster.start("load", "load", "--rate", str(rate), "--messages", str(total), "--drop", str(drop),
                             "--seed", str(seed))
        _watch(console, cluster, load, duration, drill)
        if drill:
            drill.finish(cluster)
        _stop_in_order(cluster)
        report = _verdict(console, cluster, total, rate, drill)
    finally:
        cluster.close()
    _arrange(cluster, root)
    (root / "report.json").write_text(json.dumps(report, indent=1))
    if out:
        console.print(f"report: {root / 'report.json'}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _stop_in_order(cluster: LocalCluster) -> None:
    if cluster.alive("load"):
        cluster.procs["load"].wait(timeout=120)
    leader = cluster.leader()
    for s in SEQUENCERS:  # the standby first: the leader then ends the session with a majority still up
        if s != leader:
            cluster.stop(s)
    if leader:
        cluster.stop(leader)  # end of session: the replicas finish and exit
    deadline = time.monotonic() + 60
    for r in REPLICAS:
        proc = cluster.procs[r]
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.stop(r)
    for name in ("emitter", "rw-1", "rw-2"):
        cluster.stop(name)


def _scrape(cluster: LocalCluster) -> dict:
    out = {}
    for n in (*VOTERS, *REPLICAS, "emitter"):
        try:
            out[n] = cluster.metrics(n) if cluster.alive(n) else {}
        except OSError:
            out[n] = {}
    return out


def _watch(console, cluster: LocalCluster, load, duration: float, drill) -> None:
    progress = Progress(TextColumn("load"), BarColumn(), TimeRemainingColumn())
    task = progress.add_task("load", total=duration)
    t0 = time.monotonic()
    last = (t0, 0.0)
    rate = 0.0
    events: list[str] = []
    with Live(console=console, refresh_per_second=4) as live:
        while load.poll() is None:
            now = time.monotonic()
            if drill:
                note = drill.step(cluster, now - t0)
                if note:
                    events.append(f"{now - t0:5.1f} s  {note}")
            m = _scrape(cluster)
            seq = max(_m(m[s], "tape_sequencer_commit_seq", s) for s in SEQUENCERS)
            if now - last[0] >= 0.5:
                rate, last = (seq - last[1]) / (now - last[0]), (now, seq)
            table = Table(show_header=True, header_style="bold")
            for col in ("process", "seq", "msg/s / detail", "lag"):
                table.add_column(col, justify="left" if col == "process" else "right")
            for s in SEQUENCERS:
                if not m[s]:
                    table.add_row(f"{s} (down)", "", "", "")
                    continue
                leads = _m(m[s], "tape_sequencer_leader", s) == 1
                table.add_row(
                    f"{s} ({'leader' if leads else 'standby'}, term {_m(m[s], 'tape_sequencer_term', s):.0f})",
                    f"{_m(m[s], 'tape_sequencer_sequenced_seq', s):,.0f}",
                    f"{rate:,.0f} msg/s" if leads else "",
                    f"{_m(m[s], 'tape_sequencer_commit_lag', s):,.0f} uncommitted" if leads else "",
                )
            for r in ("rw-1", "rw-2"):
                table.add_row(r if m[r] else f"{r} (down)", f"{_m(m[r], 'tape_rewinder_last_seq', r):,.0f}",
                              f"{_m(m[r], 'tape_rewinder_gapfill_messages_sent_total', r):,.0f} gap-filled", "")
            for r in REPLICAS:
                table.add_row(r if m[r] else f"{r} (down)", f"{_m(m[r], 'tape_replica_applied_seq', r):,.0f}",
                              f"{_m(m[r], 'tape_replica_alerts_raised_total', r):,.0f} alerts",
                              f"{_m(m[r], 'tape_replica_lag', r):,.0f}")
            e = m["emitter"]
            table.add_row("emitter" if e else "emitter (down)", f"{_m(e, 'tape_emitter_mark', 'emitter'):,.0f}",
                          f"{_m(e, 'tape_emitter_alerts_delivered_total', 'emitter'):,.0f} delivered",
                          f"{_m(e, 'tape_emitter_duplicates_total', 'emitter'):,.0f} dup. copies")
            progress.update(task, completed=min(duration, now - t0))
            live.update(Group(table, *events[-6:], progress))
            time.sleep(0.25)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _verdict(console, cluster: LocalCluster, total: int, rate: float, drill) -> dict:
    cfg = cluster.cfg
    load = _read_json_text(cluster.output("load"))
    journal_records = {n: list(Journal(cluster.journal_dir(n), readonly=True).read()) for n in VOTERS}
    records = max(journal_records.values(), key=len)
    decoded = [(seq, M.SEQUENCED.unpack(raw)) for seq, _, raw in records]
    trades = [(m[M.ORIGIN], m[M.CLIENT_SEQ]) for _, m in decoded if m[M.TYPE] in (M.REQUEST, M.PURCHASE)]
    dup_trades = sum(c - 1 for c in Counter(trades).values() if c > 1)
    journals_identical = all(journal_records[n] == records for n in VOTERS)
    status = {r: _read_json(Path(cfg.node(r).data) / "status.json") for r in REPLICAS}
    applied = {r: status[r].get("last_seq", 0) for r in REPLICAS}
    digests = {r: status[r].get("digest", "") for r in REPLICAS}
    expected, rejects = expected_alerts(decoded, int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9))
    expected_by_id = {f"{cfg.session}:{a['purchase_seq']}": a for a in expected}
    delivered_rows = []
    sink = Path(cfg.node("emitter").data) / "alerts.jsonl"
    if sink.exists():
        delivered_rows = [json.loads(line) for line in sink.read_text().splitlines() if line.strip()]
    ids = Counter(r["alert_id"] for r in delivered_rows)
    duplicates = sum(c - 1 for c in ids.values() if c > 1)
    missing = sorted(set(expected_by_id) - set(ids))
    unexpected = sorted(set(ids) - set(expected_by_id))
    fields = ("emit_seq", "purchase_id", "order_id", "requested", "cumulative")
    mismatched = sorted(r["alert_id"] for r in delivered_rows if r["alert_id"] in expected_by_id
                        and any(r[f] != expected_by_id[r["alert_id"]][f] for f in fields))
    emitter = _read_json(Path(cfg.node("emitter").data) / "status.json")
    lat = load.get("latency_ms", {})
    # Inbound (the sequencer's stamp) to applied, for the slowest of the replicas.
    applied_lat = {q: max((status[r].get("latency_ms", {}).get(q) or 0.0) for r in REPLICAS)
                   for q in ("p50", "p99", "max")}
    terms = term_changes(decoded)
    published = {s: _read_json(Path(cfg.node(s).data) / "status.json").get("published_terms", {}) for s in SEQUENCERS}
    term_issues = term_problems(terms, published)
    checks = {
        "all trades acknowledged": load.get("acked") == total,
        "no loss: every trade sequenced": len(trades) == total,
        "no duplicates: no (client, client seq) twice": dup_trades == 0,
        "agreement: journals identical": journals_identical,
        "replicas applied the whole log": all(v == len(records) for v in applied.values()),
        "replica identity: digests equal": len(set(digests.values())) == 1 and "" not in digests.values(),
        "exactly-once alerts": not missing and not unexpected and not mismatched and duplicates == 0,
        "no divergence alarms": emitter.get("divergences", 0) == 0,
        "each term published only by its winner": not term_issues,
    }
    figures = {
        "all trades acknowledged": f"{load.get('acked', 0):,} / {total:,}",
        "no loss: every trade sequenced": f"{len(trades):,}",
        "no duplicates: no (client, client seq) twice": f"{dup_trades}",
        "agreement: journals identical": f"{len(records):,} records x {len(VOTERS)}",
        "replicas applied the whole log": " ".join(f"{v:,}" for v in applied.values()),
        "replica identity: digests equal": next(iter(digests.values()), "")[:16],
        "exactly-once alerts": f"{len(delivered_rows):,} delivered, {len(expected):,} expected, "
                               f"{len(missing)} missing, {len(unexpected)} unexpected, {len(mismatched)} mismatched, "
                               f"{duplicates} dup.",
        "no divergence alarms": f"{emitter.get('divergences', 0)}",
        "each term published only by its winner": term_issues[0] if term_issues else f"{len(terms)} terms",
    }
    report = {
        "submitted": load.get("submitted", 0), "acknowledged": load.get("acked", 0), "sequenced": len(trades),
        "log_length": len(records), "applied": applied, "digests": digests,
        "alerts_delivered": len(delivered_rows), "alerts_expected": len(expected), "duplicates": duplicates,
        "missing": missing[:20], "unexpected": unexpected[:20], "mismatched": mismatched[:20],
        "divergences": emitter.get("divergences", 0), "rejects": rejects,
        "rate_msgs_per_s": load.get("rate_acked", 0.0), "rate_target": rate,
        "latency_ms": {**applied_lat, "measured": "inbound (sequencer stamp) to applied, slowest replica"},
        "submit_to_sequenced_ms": {"p50": lat.get("p50"), "p99": lat.get("p99"), "max": lat.get("max"),
                                   "measured": "client submit to seen sequenced on the stream"},
        "terms": terms,
        "published_terms": published,
        "term_problems": term_issues,
    }
    if drill:
        report["drill"] = drill.name
        for name, (ok, figure) in drill.checks(cluster, report).items():
            checks[name] = ok
            figures[name] = figure
    report["checks"] = checks
    report["verdict"] = "pass" if all(checks.values()) else "fail"
    title = f"drill {drill.name}" if drill else "tape up"
    table = Table(title=f"{title}: verdict (DESIGN.md section 9)", show_header=False)
    table.add_column("check")
    table.add_column("figures", justify="right")
    table.add_column("")
    for name, ok in checks.items():
        table.add_row(name, figures[name], "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    table.add_row("rate achieved", f"{report['rate_msgs_per_s']:,.0f} msg/s", "")
    table.add_row("latency p50 / p99 / max, inbound to applied",
                  f"{applied_lat['p50']:.1f} / {applied_lat['p99']:.1f} / {applied_lat['max']:.1f} ms", "")
    table.add_row("latency p50 / p99 / max, client submit to sequenced",
                  f"{lat.get('p50', 0):.1f} / {lat.get('p99', 0):.1f} / {lat.get('max', 0):.1f} ms", "")
    if report.get("failover_ms") is not None:
        table.add_row(
            "failover (old leader's last stamp to new leader's term start)", f"{report['failover_ms']:.0f} ms", ""
        )
    table.add_row(
        "verdict", "", "[bold green]PASS[/bold green]" if report["verdict"] == "pass" else "[bold red]FAIL[/bold red]"
    )
    console.print()
    console.print(table)
    return report


def term_changes(decoded: list) -> list[dict]:
    """Each term start in the log: its seq, term, leader, and the time since
    the previous term's last stamp (the failover time, for a change of leader)."""
    out = []
    last_stamp = None
    for seq, m in decoded:
        if m[M.TYPE] == M.TERM_START:
            gap = (m[M.STAMP] - last_stamp) / 1e6 if last_stamp is not None else None
            out.append({"seq": seq, "term": m[M.TERM], "leader": m[M.LEADER].decode(errors="replace").strip(),
                        "ms_since_previous_stamp": round(gap, 1) if gap is not None else None})
        last_stamp = m[M.STAMP]
    return out


def term_problems(terms: list[dict], published: dict[str, dict]) -> list[str]:
    """Who published in which term, judged against the log: in every term at most one
    sequencer published, none published in a term it did not win, and what it published
    lies within that term's seqs. `terms` is term_changes() of the log; `published` maps
    each sequencer to {term: [first seq, last seq]} of what it published."""
    starts = {t["term"]: t for t in terms}
    ends = {t["term"]: (nxt["seq"] - 1 if nxt else None) for t, nxt in zip(terms, [*terms[1:], None])}
    problems = []
    for name, spans in sorted(published.items()):
        for term, (first, last) in sorted((int(t), s) for t, s in spans.items()):
            won = starts.get(term)
            if won is None or won["leader"] != name:
                problems.append(f"{name} published seqs {first}-{last} in term {term}, which "
                                f"{'no one' if won is None else won['leader']} won")
            elif first < won["seq"] or (ends[term] is not None and last > ends[term]):
                problems.append(f"{name} published seqs {first}-{last} outside term {term}'s "
                                f"{won['seq']}-{ends[term] or 'end'}")
    return problems


def _read_json_text(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError:
        return {}


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


def main(rate: float, duration: float, drop: float, out: str | None, seed: int) -> int:
    return 0 if run_up(rate, duration, drop, out, seed)["verdict"] == "pass" else 1
