"""`tape bench metrics-flood`: what a stranger flooding a leader's metrics endpoint costs the stream.

Two `tape up` runs at one rate, in one sitting. In both, a flooder process scrapes as fast as
FLOOD_THREADS threads can and holds IDLE_CONNECTIONS silent connections open (reopened as they
are dropped), for the whole load: in the control run against a stand-in metrics server outside
the cluster (the same bounded server, a process of its own), in the attack run against the
leader's metrics port. The attacker's CPU on these cores counts in both, so what differs is what
the leader's endpoint costs the leader. Figures, never pass/fail: commit latency p99 of each run,
their ratio, the terms (an election is a failure of the endpoint's bounds) and what the leader's
endpoint refused (runtime/metrics_server.py).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
import urllib.request

from rich.console import Console
from rich.table import Table

from tape.ops.verification.drill import Drill
from tape.ops.verification.local import LocalCluster
from tape.runtime.udp import free_port

FLOOD_THREADS = 8  # scrapers as fast as they go (issue 63's measurement)
IDLE_CONNECTIONS = 256  # silent connections held open at once
SCRAPE_TIMEOUT_S = 2.0
STOP_WAIT_S = 5.0


def _flood(port: int, seconds: float, counts) -> None:
    """Scrape http://127.0.0.1:port/metrics from FLOOD_THREADS threads and hold IDLE_CONNECTIONS
    silent connections, for `seconds`; `counts` (shared, as it goes): silent connections opened, then
    each thread's scrapes sent (a slot each: no two writers)."""
    deadline = time.monotonic() + seconds

    def scrape(i: int) -> None:
        while time.monotonic() < deadline:
            counts[1 + i] += 1
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S).read()
            except OSError:
                time.sleep(0.001)  # refused or dropped: at once again

    threads = [threading.Thread(target=scrape, args=(i,), daemon=True) for i in range(FLOOD_THREADS)]
    for t in threads:
        t.start()
    idle: list[socket.socket] = []
    while time.monotonic() < deadline:
        idle = [s for s in idle if not _closed(s)]
        while len(idle) < IDLE_CONNECTIONS and time.monotonic() < deadline:
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S))
                counts[0] += 1
            except OSError:
                break
        time.sleep(0.2)
    for s in idle:
        s.close()


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _stand_in(port: int) -> None:
    """A metrics endpoint outside the cluster: the nodes' bounded server, serving this process's registry."""
    from tape.runtime import metrics_server

    metrics_server.start("127.0.0.1", port)
    time.sleep(3600)  # until terminated


class MetricsFlood(Drill):
    """The flood from the load's first moment to its end, at the leader's metrics port or (control)
    at a stand-in outside the cluster."""

    def __init__(self, at_leader: bool, duration: float, trades: int):
        super().__init__("metrics-flood" if at_leader else "metrics-flood-control", duration, trades)
        self.at_leader = at_leader
        self.procs: list[multiprocessing.Process] = []
        self.refused: dict[str, float] = {}
        self.counts = multiprocessing.Array("q", 1 + FLOOD_THREADS, lock=False)  # silent connections, scrapes

    def step(self, cluster: LocalCluster, elapsed: float) -> str | None:
        if self.injected:
            return None
        self.injected = self.healed = True  # nothing to heal: it lasts the run
        return self.inject(cluster)

    def inject(self, cluster: LocalCluster) -> str:
        self.target = cluster.leader()
        port = cluster.cfg.node(self.target).metrics_port if self.at_leader and self.target else free_port()
        if not self.at_leader:
            self.procs.append(multiprocessing.Process(target=_stand_in, args=(port,), daemon=True))
        self.procs.append(multiprocessing.Process(target=_flood, args=(port, self.duration, self.counts), daemon=True))
        for p in self.procs:
            p.start()
        where = f"{self.target}'s metrics port" if self.at_leader else "a stand-in endpoint outside the cluster"
        return f"flooding {where} (:{port}): {FLOOD_THREADS} scrapers, {IDLE_CONNECTIONS} silent connections"

    def observe(self, cluster: LocalCluster) -> None:
        if self.at_leader and self.target:
            prefix = f'tape_sequencer_metrics_refused_total{{node="{self.target}",reason="'
            self.refused = {k[len(prefix):-2]: v for k, v in cluster.metrics(self.target).items()
                            if k.startswith(prefix)}
        for p in self.procs:
            p.terminate()
            p.join(STOP_WAIT_S)

    def checks(self, cluster: LocalCluster, report: dict) -> dict:
        report["metrics_refused"] = self.refused
        scrapes = sum(self.counts[1:])
        report["flood"] = {"scrapes": scrapes, "silent_connections": self.counts[0]}
        return {"the flood ran": (scrapes > 0, f"{scrapes:,} scrapes")}


def bench_metrics_flood(rate: float, duration: float, seed: int = 1) -> dict:
    from tape.ops.verification.up import run_up

    console = Console()
    quiet = Console(file=open(os.devnull, "w"))
    runs = {}
    for at_leader in (False, True):
        drill = MetricsFlood(at_leader, duration, int(rate * duration))
        runs[drill.name] = run_up(rate, duration, 0.0, None, seed, drill=drill, console=quiet)
    control, attack = runs["metrics-flood-control"], runs["metrics-flood"]
    table = Table(title=f"a metrics flood at {rate:,.0f} msg/s for {duration:g} s")
    for column in ("run", "verdict", "terms", "scrapes / silent connections sent", "inbound→applied p50 / p99 ms",
                   "leader's endpoint refused"):
        table.add_column(column)
    for name, r in runs.items():
        lat, flood = r["latency_ms"], r.get("flood", {})
        table.add_row(name, r["verdict"], str(len(r.get("terms", []))),
                      f"{flood.get('scrapes', 0):,} / {flood.get('silent_connections', 0):,}",
                      f"{lat.get('p50') or 0:.1f} / {lat.get('p99') or 0:.1f}",
                      ", ".join(f"{k} {v:,.0f}" for k, v in r.get("metrics_refused", {}).items()) or "—")
    console.print(table)
    ratio = (attack["latency_ms"].get("p99") or 0) / max(control["latency_ms"].get("p99") or 0, 1e-9)
    console.print(f"p99 at the leader / p99 at the stand-in: {ratio:.2f}")
    return {"runs": runs, "p99_ratio": ratio}
