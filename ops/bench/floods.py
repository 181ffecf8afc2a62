"""What floods cost the stream: `tape bench metrics-flood` (a stranger at the leader's metrics
endpoint) and `tape bench replays` (many readers replaying the log from seq 1 at a rewinder).

metrics-flood: two `tape up` runs at one rate, in one sitting. In both, a flooder process scrapes as fast as
FLOOD_THREADS threads can and holds up to IDLE_CONNECTIONS silent connections open (reopened as they
are dropped), for the whole load: in the control run against a stand-in metrics server outside
the cluster (the same bounded server, a process of its own), in the attack run against the
leader's metrics port. The attacker's CPU on these cores counts in both, so what differs is what
the leader's endpoint costs the leader. Figures, never pass/fail: commit latency p99 of each run,
their ratio, the terms (an election is a failure of the endpoint's bounds) and what the leader's
endpoint refused (runtime/metrics_server.py).

replays: a quiet `tape up` run, then one in which REPLAY_SESSIONS readers log in to rw-1's replay
port from seq 1 (with the listener key, as clients and readers outside the cluster do) for the
whole load, read everything they are sent and heartbeat, at the lowest CPU priority (nice 19: on
a LAN they are other hosts): commit latency p99 of each, and what the replay budget held back
(rewinder/rewinder_node_core.py).
"""

from __future__ import annotations

import multiprocessing
import os
import selectors
import socket
import statistics
import threading
import time
import urllib.request

from rich.console import Console
from rich.table import Table

from tape.ops.verification.drill import Drill
from tape.ops.verification.local import LocalCluster
from tape.protocol import messages as M
from tape.protocol import soupbintcp as soup
from tape.protocol.linkauth import LinkKeys
from tape.runtime.linkclient import LinkSocket
from tape.runtime.udp import free_port

FLOOD_THREADS = 8  # scrapers as fast as they go (issue 63's measurement)
IDLE_CONNECTIONS = 256  # silent connections it tries to hold open at once (the listen backlog lets fewer in)
SCRAPE_TIMEOUT_S = 2.0
STOP_WAIT_S = 5.0
REPLAY_SESSIONS = 64  # readers from seq 1 at once (issue 63)


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


def _read_replays(port: int, keys, sessions: int, seconds: float, counts) -> None:
    """`sessions` replay logins from seq 1 to 127.0.0.1:port, read and heartbeat for `seconds`;
    `counts[0]`: the bytes of SoupBinTCP sequenced frames read (as it goes). At the lowest priority:
    readers have hosts of their own, and here their decoding would otherwise take the cluster's
    cores, which is not what the rewinder's serving costs."""
    os.nice(19)
    deadline, sel = time.monotonic() + seconds, selectors.DefaultSelector()
    for _ in range(sessions):
        link = LinkSocket(socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S), keys)
        link.sendall(soup.login("", "", b"", 1))
        link.sock.setblocking(False)
        sel.register(link.sock, selectors.EVENT_READ, link)
    beat = time.monotonic()
    while (now := time.monotonic()) < deadline:
        for key, _ in sel.select(timeout=0.1):
            try:
                counts[0] += len(key.data.recv(1 << 16))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                sel.unregister(key.fileobj)
        if now - beat >= 1.0:  # SoupBinTCP: a client heartbeats every second, or the server drops it
            beat = now
            for key in list(sel.get_map().values()):
                key.fileobj.setblocking(True)
                key.data.sendall(soup.heartbeat(server=False))
                key.fileobj.setblocking(False)


class ReplayFlood(Drill):
    """`sessions` readers replaying rw-1's log from seq 1, from the load's first moment to its end."""

    def __init__(self, sessions: int, duration: float):
        super().__init__("replays", duration, 0)
        self.sessions = sessions
        self.procs: list[multiprocessing.Process] = []
        self.counts = multiprocessing.Array("q", 1, lock=False)
        self.held_back = 0.0

    def step(self, cluster: LocalCluster, elapsed: float) -> str | None:
        if self.injected:
            return None
        self.injected = self.healed = True
        node = cluster.cfg.node("rw-1")
        proc = multiprocessing.Process(target=_read_replays, daemon=True,
                                       args=(node.replay_port, LinkKeys(cluster.cfg.listener_keys), self.sessions,
                                             self.duration, self.counts))
        proc.start()
        self.procs.append(proc)
        return f"{self.sessions} replay sessions from seq 1 at rw-1 (:{node.replay_port})"

    def observe(self, cluster: LocalCluster) -> None:
        self.held_back = cluster.metrics("rw-1").get('tape_rewinder_replay_held_back_total{node="rw-1"}', 0.0)
        for p in self.procs:
            p.terminate()
            p.join(STOP_WAIT_S)

    def checks(self, cluster: LocalCluster, report: dict) -> dict:
        messages = self.counts[0] // (soup.FRAME_LEN.size + 1 + M.SEQUENCED_SIZE)
        report["replays"] = {"messages": messages, "held_back": self.held_back}
        return {"the replays read": (messages > 0, f"{messages:,} messages")}


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


def bench_metrics_flood(rate: float, duration: float, pairs: int = 1, seed: int = 1) -> dict:
    arms = {"metrics-flood-control": lambda: MetricsFlood(False, duration, int(rate * duration)),
            "metrics-flood": lambda: MetricsFlood(True, duration, int(rate * duration))}
    runs = _runs(rate, duration, seed, arms, pairs)
    refused = {name: ", ".join(f"{k} {v:,.0f}" for k, v in r.get("metrics_refused", {}).items()) or "—"
               for name, r in _each(runs)}
    flood = {name: f"{r['flood']['scrapes']:,} / {r['flood']['silent_connections']:,}" for name, r in _each(runs)}
    return _compare(f"a metrics flood at {rate:,.0f} msg/s for {duration:g} s", runs,
                    {"scrapes / silent connections sent": flood, "leader's endpoint refused": refused})


def bench_replays(rate: float, duration: float, sessions: int = REPLAY_SESSIONS, pairs: int = 1,
                  seed: int = 1) -> dict:
    runs = _runs(rate, duration, seed, {"quiet": lambda: None,
                                        f"{sessions} replays": lambda: ReplayFlood(sessions, duration)}, pairs)
    read = {name: f"{r.get('replays', {}).get('messages', 0):,}" for name, r in _each(runs)}
    held = {name: f"{r.get('replays', {}).get('held_back', 0):,.0f}" for name, r in _each(runs)}
    return _compare(f"replays from seq 1 at rw-1, {rate:,.0f} msg/s for {duration:g} s", runs,
                    {"messages replayed": read, "chunks held back": held})


def _runs(rate: float, duration: float, seed: int, arms: dict, pairs: int) -> dict:
    """`pairs` sittings of each arm (name -> a fresh drill, or None), alternated so that the host's
    slow and fast minutes fall on both: name -> [report, ...]."""
    from tape.ops.verification.up import run_up

    quiet = Console(file=open(os.devnull, "w"))
    runs: dict[str, list] = {name: [] for name in arms}
    for _ in range(pairs):
        for name, drill in arms.items():
            runs[name].append(run_up(rate, duration, 0.0, None, seed, drill=drill(), console=quiet))
    return runs


def _each(runs: dict):
    """(row name, report) for every run, a row each: `name` alone, or `name #k` after the first pair."""
    for name, reports in runs.items():
        for k, report in enumerate(reports):
            yield (name if len(reports) == 1 else f"{name} #{k + 1}"), report


def _p99(report: dict) -> float:
    return report["latency_ms"].get("p99") or 0.0


def _compare(title: str, runs: dict, columns: dict) -> dict:
    """Print each run's verdict, terms, p50/p99 and `columns` (row name -> text); the median p99 of
    the last arm over the first's (a single run's p99 varies ~25% here: docs/performance.md)."""
    table = Table(title=title)
    for column in ("run", "verdict", "terms", "inbound→applied p50 / p99 ms", *columns):
        table.add_column(column)
    for name, r in _each(runs):
        lat = r["latency_ms"]
        table.add_row(name, r["verdict"], str(len(r.get("terms", []))),
                      f"{lat.get('p50') or 0:.1f} / {_p99(r):.1f}", *(c[name] for c in columns.values()))
    console = Console()
    console.print(table)
    arms = list(runs.values())
    first, last = (statistics.median(_p99(r) for r in reports) for reports in (arms[0], arms[-1]))
    ratio = last / max(first, 1e-9)
    console.print(f"median p99 of the last arm / of the first ({len(arms[0])} runs each): "
                  f"{last:.1f} / {first:.1f} ms = {ratio:.2f}")
    return {"runs": runs, "p99_ratio": ratio}
