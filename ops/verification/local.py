"""A local cluster of real `tape` processes on loopback, for the demo, drills
and tests: a config with free ports and a multicast group of its own,
processes started, watched through their metrics, and stopped or killed by
pid."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tape.runtime.config import default_toml, load, new_keys
from tape.runtime.tuning import METRICS_SCRAPES_PER_S

METRICS_RETRIES = 50  # of a scrape answered 429, each after 1 / METRICS_SCRAPES_PER_S: a second at most

TAPE = [sys.executable, "-m", "tape.ops.cli.main"]
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ClusterError(RuntimeError):
    """A node exited that no one stopped, or did not come up: the run cannot go on."""


def dies_with(parent: int):
    """A preexec function: the child is killed when `parent` dies, however it dies (a drill killed by a
    test's timeout must not leave its nodes running)."""
    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before prctl took effect
            os._exit(1)
    return preexec


class LocalCluster:
    def __init__(self, root: Path, rewinders: int = 2, clients: int = 2, extra: str = "", replicas: int = 0,
                 sequencers: int = 1, keys: bool = True, delivery: str = "first", max_packet: int | None = None,
                 durability: str | None = None):
        self.root = root
        self.config_path = root / "cluster.toml"
        text = default_toml(root / "data", rewinders, clients, free=True, replicas=replicas, sequencers=sequencers,
                            keys=new_keys(clients) if keys else None, delivery=delivery, max_packet=max_packet,
                            durability=durability)
        text = text.replace("[journal]", extra + "\n[journal]") if extra else text
        self.config_path.write_text(text)
        self.cfg = load(self.config_path)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.started: dict[str, tuple] = {}  # name -> (args, wait_metrics, env): what restart() repeats
        self.let_go: set[str] = set()  # stopped or killed here: their exits are expected
        self.metrics_client = None  # an ssl.SSLContext where the nodes serve metrics over TLS ([metrics])
        self.planted: tuple[str, ...] = ()  # patterns of the log lines a planted fault causes (verdict.log_problems)

    def start(
        self, name: str, *args: str, wait_metrics: int | None = None, env: dict | None = None, wait: bool = True
    ) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        self.started[name] = (args, wait_metrics, env)
        self.let_go.discard(name)
        proc = subprocess.Popen(self.command(name, list(args)),
                                stdout=open(log.with_suffix(".out"), "w"), stderr=open(log, "a"),
                                env={**os.environ, **(env or {})}, preexec_fn=dies_with(os.getpid()))
        self.procs[name] = proc
        if wait_metrics and wait:
            self.wait_http(wait_metrics, proc, name)
        return proc

    def start_node(
        self, name: str, drop: float = 0.0, seed: int = 0, *extra: str, env: dict | None = None, wait: bool = True
    ) -> subprocess.Popen:
        """Start a node; with `wait`, return once it serves metrics (failing if it exits first). A
        restart waits for it either way."""
        node = self.cfg.node(name)
        args = [node.role, "--node", name, *extra]
        if node.role != "emitter":
            args += ["--drop", str(drop), "--seed", str(seed)]
        return self.start(name, *args, wait_metrics=node.metrics_port, env=env, wait=wait)

    def start_all(self, drop: float = 0.0, emitter_args: tuple = ()) -> None:
        """Every node, in the order they are needed (followers, sequencers, the emitter, replicas),
        each started without waiting for the one before to serve (their start-ups overlap: one
        after another they took 4 s of every run here), then waited for in the same order."""
        nodes = [(n, drop, 10 + i) for i, n in enumerate(self.cfg.by_role("rewinder"))]
        nodes += [(n, drop, 1) for n in self.cfg.by_role("sequencer")]
        nodes += [(n, 0.0, 0, *emitter_args) for n in self.cfg.by_role("emitter")]
        nodes += [(n, drop, 20 + i, "--exit-on-end") for i, n in enumerate(self.cfg.by_role("replica"))]
        started = [(n, self.start_node(n.name, *rest, wait=False)) for n, *rest in nodes]
        for n, proc in started:
            self.wait_http(n.metrics_port, proc, n.name)

    def wait_http(self, port: int, proc: subprocess.Popen, name: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(self._exit_note(name))
            try:
                self.fetch(name, port, 1.0)
                return
            except OSError:
                time.sleep(0.05)
        raise ClusterError(f"{name} did not serve metrics on :{port} within {timeout:.0f} s")

    def check_running(self, ignore: tuple[str, ...] = ()) -> None:
        """Raise ClusterError naming the first node that exited without being stopped or killed here."""
        for name, proc in self.procs.items():
            if name not in self.let_go and name not in ignore and proc.poll() is not None:
                raise ClusterError(self._exit_note(name))

    def _exit_note(self, name: str) -> str:
        return f"{name} exited with {self.procs[name].returncode}: {self.logs[name].read_text()[-2000:]}"

    def metrics(self, name: str) -> dict[str, float]:
        """The node's metrics as {'name{labels}': value}."""
        return parse_metrics(self.fetch(name, self.cfg.node(name).metrics_port, 2.0).decode())

    # What a cluster over other hosts (ops/verification/lan.py) does otherwise: how a process starts, how its
    # metrics are read.

    def command(self, name: str, args: list[str]) -> list[str]:
        return TAPE + args + ["--config", str(self.config_path)]

    def fetch(self, name: str, port: int, timeout: float) -> bytes:
        return self.fetch_url("127.0.0.1", port, timeout, self.metrics_client)

    @staticmethod
    def fetch_url(host: str, port: int, timeout: float, tls=None) -> bytes:
        """The node's metrics (over https with `tls`, an ssl.SSLContext); a 429 (its endpoint's
        budget, runtime/metrics_server.py) waits and asks again."""
        url = f"{'https' if tls else 'http'}://{host}:{port}/metrics"
        for _ in range(METRICS_RETRIES):
            try:
                return urllib.request.urlopen(url, timeout=timeout, context=tls).read()
            except urllib.error.HTTPError as e:
                if e.code != 429:
                    raise
            time.sleep(1 / METRICS_SCRAPES_PER_S)
        return urllib.request.urlopen(url, timeout=timeout, context=tls).read()

    def journal_dir(self, node: str) -> Path:
        return Path(self.cfg.node(node).data) / "journal"

    def restart(self, name: str, env: dict | None = None) -> subprocess.Popen:
        """Start `name` again as it was first started (its log goes on in the same file)."""
        args, wait_metrics, first_env = self.started[name]
        return self.start(name, *args, wait_metrics=wait_metrics, env=env if env is not None else first_env)

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def leader(self) -> str | None:
        """The sequencer that says it leads (None during an election)."""
        for n in self.cfg.by_role("sequencer"):
            if not self.alive(n.name):
                continue
            try:
                if self.metrics(n.name).get(f'tape_sequencer_leader{{node="{n.name}"}}') == 1:
                    return n.name
            except OSError:
                continue
        return None

    def wait_leader(self, timeout: float = 10.0) -> str | None:
        """The leader, once one leads (None if none within `timeout`: the run goes on, and its
        verdict says what happened)."""
        deadline = time.monotonic() + timeout
        while (leader := self.leader()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return leader

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        self.let_go.add(name)
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            proc.wait(timeout=10)

    def stop(self, name: str) -> int:
        proc = self.procs[name]
        self.let_go.add(name)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each live process has used so far, from /proc/PID/stat."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, proc in self.procs.items():
            try:
                stat = Path(f"/proc/{proc.pid}/stat").read_text()
            except OSError:
                continue  # exited
            fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
            out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
        return out

    def wait_seconds(self) -> dict[str, float]:
        """Time each live process's threads were ready to run but waited for a core, so far."""
        return self._of_each_live(run_delay_seconds)

    def times_scheduled(self) -> dict[str, int]:
        """How often each live process's threads were put on a core so far (each wake-up, and each
        return after being preempted)."""
        return self._of_each_live(scheduled_count)

    def _of_each_live(self, read) -> dict:
        """read(pid) of each process, for those it can still read."""
        out = {}
        for name, proc in self.procs.items():
            value = read(proc.pid)
            if value is not None:
                out[name] = value
        return out

    def journal_dump(self, node: str) -> list[dict]:
        out = subprocess.run(TAPE + ["journal", "dump", str(self.journal_dir(node))],
                             capture_output=True, text=True, check=True)
        return [json.loads(line) for line in out.stdout.splitlines()]

    def output(self, name: str) -> str:
        return self.logs[name].with_suffix(".out").read_text()


class Stall:
    """A bench's guard: the highest count seen so far, and a RuntimeError once it has not risen for
    `limit` seconds (a run that cannot finish stops by itself, saying where it stood)."""

    def __init__(self, cluster: LocalCluster, limit: float, what: str, unit: str):
        self.cluster, self.limit, self.what, self.unit = cluster, limit, what, unit
        self.value, self.at = 0, time.monotonic()

    def saw(self, value: int, of: int) -> None:
        now = time.monotonic()
        if value > self.value:
            self.value, self.at = value, now
        elif now - self.at > self.limit:
            self.cluster.check_running()
            raise RuntimeError(f"nothing {self.what} for {self.limit:.0f} s at {self.unit} {self.value:,} of {of:,}")


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def host_steal_seconds(stat: str | None = None) -> float | None:
    """CPU seconds this machine's host has taken from its virtual CPUs so far, summed over them
    (steal: a virtual CPU ready to run and not run), from /proc/stat (or `stat`, its text); None
    where the kernel does not say."""
    try:
        fields = (Path("/proc/stat").read_text() if stat is None else stat).split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" else None
    except (OSError, IndexError, ValueError):
        return None


def run_delay_seconds(pid: int | str = "self") -> float | None:
    """Seconds the threads of process `pid` have waited on a run queue, ready but without a core
    (/proc/PID/task/*/schedstat, its second field); None if the process is gone or the kernel
    does not keep it."""
    return _schedstat_seconds(pid, 1)


def task_cpu_seconds(pid: int | str = "self") -> float | None:
    """Seconds the threads of process `pid` have run, in nanoseconds' precision
    (/proc/PID/task/*/schedstat, its first field); None as for run_delay_seconds."""
    return _schedstat_seconds(pid, 0)


def scheduled_count(pid: int | str = "self") -> int | None:
    """How often the threads of process `pid` were put on a core (/proc/PID/task/*/schedstat, its
    third field: each wake-up and each return after a preemption); None as for run_delay_seconds."""
    return _schedstat_sum(pid, 2)


def _schedstat_seconds(pid: int | str, field: int) -> float | None:
    total = _schedstat_sum(pid, field)
    return None if total is None else total / 1e9


def _schedstat_sum(pid: int | str, field: int) -> int | None:
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[field])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
    except OSError:
        return None
    return total
