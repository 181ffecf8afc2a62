"""`tape status`: every node of a cluster, read from its metrics endpoint.

One row a node: whether it answers, its role's position in the log (a sequencer's term,
leadership, sequenced, committed and published seqs; a rewinder's journal and commit
point and the messages it gap-filled; a replica's applied seq, lag, snapshots and digest;
the emitter's mark, deliveries and divergences) and the datagrams it dropped, by reason.
The exit status is what a script needs: 1 if a node does not answer, or no sequencer (or
more than one) says it leads; `--json` prints the same as data.
"""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tape.ops.verification.local import parse_metrics

FETCH_TIMEOUT_S = 2.0

# role -> (column, metric name without the role prefix): what each role's row shows
FIELDS = {
    "sequencer": (("term", "term"), ("leader", "leader"), ("sequenced", "sequenced_seq"),
                  ("committed", "commit_seq"), ("published", "published_seq"), ("commit lag", "commit_lag")),
    "rewinder": (("term", "term"), ("journal", "last_seq"), ("committed", "commit_seq"),
                 ("gap-filled", "gapfill_messages_sent_total"), ("recovering", "recovering"),
                 ("disk full", "disk_full")),
    "replica": (("applied", "applied_seq"), ("lag", "lag"), ("snapshots", "snapshots_total"),
                ("rebuilds", "rebuilds_total")),
    "emitter": (("mark", "mark"), ("delivered", "alerts_delivered_total"), ("divergences", "divergences_total"),
                ("diverged replicas", "replicas_diverged")),
}


def client_tls(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """The context to scrape endpoints that serve TLS (`[metrics] certfile`) with: their CA, and
    a certificate of ours where they ask for one; None without a CA (plain HTTP)."""
    if not ca_file:
        return None
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


def _scrape(node, tls: ssl.SSLContext | None) -> dict[str, float] | None:
    url = f"{'https' if tls else 'http'}://{node.metrics_address}:{node.metrics_port}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S, context=tls).read().decode()
    except OSError:
        return None
    return parse_metrics(text)


def collect(cfg, tls: ssl.SSLContext | None = None) -> dict:
    """{"nodes": [one dict a node], "problems": [...]}: the cluster as its endpoints say."""
    nodes = [n for n in cfg.nodes if n.metrics_port]
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        scraped = dict(zip((n.name for n in nodes), pool.map(lambda n: _scrape(n, tls), nodes)))
    rows, problems = [], []
    for n in nodes:
        m = scraped[n.name]
        row = {"node": n.name, "role": n.role, "host": n.host, "up": m is not None}
        if m is None:
            problems.append(f"{n.name} ({n.metrics_address}:{n.metrics_port}) does not answer")
            rows.append(row)
            continue
        prefix, label = f"tape_{n.role}_", f'{{node="{n.name}"}}'
        for column, metric in FIELDS[n.role]:
            row[column] = m.get(prefix + metric + label)
        drops = {k.split('reason="')[1].rstrip('"}'): v for k, v in m.items()
                 if k.startswith(prefix + "dropped_datagrams_total{") and 'reason="' in k and v}
        row["dropped"] = drops
        if n.role == "replica":
            digest = next(((k, v) for k, v in m.items() if k.startswith(prefix + "digest{")), None)
            if digest:
                fold = re.search(r'fold_seq="(\d+)"', digest[0])
                row["digest"] = f"{int(digest[1]):012x} at {fold.group(1) if fold else '?'}"
        rows.append(row)
    leaders = [r["node"] for r in rows if r["role"] == "sequencer" and r.get("leader") == 1]
    if cfg.by_role("sequencer") and len(leaders) != 1:
        problems.append("no sequencer leads" if not leaders else f"{len(leaders)} sequencers say they lead: "
                                                                  f"{', '.join(leaders)}")
    return {"nodes": rows, "leader": leaders[0] if len(leaders) == 1 else None, "problems": problems}


def table(status: dict) -> Table:
    t = Table(title="tape status")
    for col in ("node", "role", "host", "position", "dropped"):
        t.add_column(col)
    for r in status["nodes"]:
        if not r["up"]:
            t.add_row(r["node"], r["role"], r["host"], "[red]does not answer[/red]", "")
            continue
        shown = [(c, r.get(c)) for c, _ in FIELDS[r["role"]]] + ([("digest", r["digest"])] if "digest" in r else [])
        position = ", ".join(f"{c} {v:,.0f}" if isinstance(v, float) else f"{c} {v}" for c, v in shown
                             if v is not None)
        dropped = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["dropped"].items()))
        t.add_row(r["node"], r["role"], r["host"], position, dropped)
    return t


def main(cfg, as_json: bool, watch: float | None, tls: ssl.SSLContext | None = None) -> int:
    console = Console()
    if cfg.certfile and tls is None:
        console.print("tape status: the nodes serve metrics over TLS ([metrics] certfile): name their CA (--ca-file), "
                      "and where they ask for one a certificate (--cert-file, --key-file)")
        return 2
    if as_json:
        status = collect(cfg, tls)
        print(json.dumps(status, indent=1))
        return 1 if status["problems"] else 0
    with Live(console=console, auto_refresh=False) as live:
        while True:
            status = collect(cfg, tls)
            problems = "\n".join(f"[red]problem:[/red] {p}" for p in status["problems"]) or "cluster ok"
            live.update(_grid(table(status), problems), refresh=True)
            if not watch:
                return 1 if status["problems"] else 0
            time.sleep(watch)


def _grid(*parts) -> Table:
    grid = Table.grid()
    for p in parts:
        grid.add_row(p)
    return grid
