"""`tape bench batch-cost`: what one batch costs each process of the cluster, counted.

Below saturation the cluster's CPU is spent per batch, not per message (docs/performance.md): this
counts what a batch costs each of the nine processes of `tape up` at an ordinary rate, so that
what is removed is what was counted. The cluster runs as `tape up` runs it; once the load sends,
`perf stat` watches every process in three windows of `window_s` each:

1. in-kernel counters, which cost the processes nothing measurable: CPU time (task-clock), the
   system calls by kind (tracepoints), and the wake-ups (voluntary context switches: the thread
   slept and something woke it) and preemptions (involuntary ones), from /proc;
2. user-space probes (uprobes), which cost each hit a trap, so the batches grow while they
   count: the hashes (a BLAKE3 hasher made, a BLAKE2b digest, a SHA-256 digest in OpenSSL, two
   an HMAC);
3. the allocations (PyObject_Malloc: every object and buffer not served from a free list), a
   probe hit a thousand times as often, in a window of its own.

Before the cluster starts it measures the host's own floors (`floors.py`): a wake-up, and a batch
carried along the same nine processes' hops with none of Tape's work.

Each count is divided by the batches the leader stamped in its window (its `batches` counter).
Figures, never pass/fail; needs root (perf's tracepoints and probes) and perf.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.bench.floors import hop_floor, wake_floor
from tape.ops.bench.throughput import host_speed
from tape.ops.verification.local import LocalCluster
from tape.ops.verification.tradegen import orders_in
from tape.ops.verification.up import REPLICAS, SEQUENCERS, load_sending, node_metric

PROCESSES = ("leader", "standby", "rw-1", "rw-2", *REPLICAS, "emitter", "load")
SYSCALL_KINDS = {  # what a process asks the kernel for, by purpose
    "send": ("sendto", "sendmsg", "sendmmsg", "write", "writev", "pwrite64"),
    "receive": ("recvfrom", "recvmsg", "recvmmsg", "read", "readv", "pread64"),
    "wait": ("epoll_wait", "epoll_pwait", "select", "poll", "ppoll", "futex", "clock_nanosleep", "nanosleep"),
    "flush": ("fsync", "fdatasync", "sync_file_range"),
}
KERNEL_EVENTS = ["task-clock", "raw_syscalls:sys_enter",
                 *(f"syscalls:sys_enter_{call}" for calls in SYSCALL_KINDS.values() for call in calls)]
SENDING_WAIT_S = 60.0  # for the load to build its trades and send
SETTLE_S = 1.0  # after the load begins to send, before the first window


class Probe:
    """A user-space probe: `label` counts entries to `symbol` (a regular expression over the
    library's symbol table: the blake3 package's are mangled Rust names) in `library`."""

    def __init__(self, label: str, library: str, symbol: str):
        self.label, self.library, self.symbol = label, library, symbol
        self.event: str | None = None  # perf's name for it, once added

    def add(self) -> bool:
        offset = _symbol_offset(self.library, self.symbol)
        if offset is None:
            return False
        name = f"tape_{self.label}"
        subprocess.run(["perf", "probe", "-q", "-d", f"*:{name}"], capture_output=True)  # (a run stopped early)
        done = subprocess.run(["perf", "probe", "-q", "-x", self.library, "-a", f"{name}=0x{offset:x}"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
            self.event = next((w for w in listed.split() if w.endswith(f":{name}")), None)
        return self.event is not None

    def remove(self) -> None:
        if self.event:
            subprocess.run(["perf", "probe", "-q", "-d", self.event], capture_output=True)
            self.event = None


def _symbol_offset(library: str, pattern: str) -> int | None:
    """The file offset (what perf probes at) of the first function of `library` whose symbol
    matches `pattern`: its address, through the loaded segment that holds it."""
    try:
        listing = subprocess.run(["nm", "--defined-only", library], capture_output=True, text=True).stdout
        listing += subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True).stdout
        segments = subprocess.run(["readelf", "-lW", library], capture_output=True, text=True).stdout
    except OSError:
        return None
    loads = [(int(f[2], 16), int(f[1], 16), int(f[5], 16)) for f in map(str.split, segments.splitlines())
             if len(f) > 5 and f[0] == "LOAD"]  # (vaddr, offset, memory size)
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "tT" and re.fullmatch(pattern, parts[2].partition("@")[0]):
            address = int(parts[0], 16)
            return next((address - vaddr + offset for vaddr, offset, size in loads if vaddr <= address < vaddr + size),
                        None)
    return None


def probes() -> tuple[list[Probe], list[Probe]]:
    """(the hashes, the allocations), in the libraries this interpreter loads: two windows, the
    second's probe being hit a thousand times as often."""
    import _blake2
    import _hashlib
    import sysconfig

    import blake3

    libpython = Path(sysconfig.get_config_var("LIBDIR")) / str(sysconfig.get_config_var("LDLIBRARY"))
    libcrypto = _linked(_hashlib.__file__, "libcrypto")
    blake3_so = next(Path(blake3.__file__).parent.glob("blake3*.so"), None)
    hashes = [Probe("blake2b", _blake2.__file__, r"PyBlake2_blake2b_final")]
    if blake3_so is not None:
        hashes.append(Probe("blake3", str(blake3_so), r".*11Blake3Class20___pymethod___new____"))
    if libcrypto is not None:
        hashes.append(Probe("sha256", libcrypto, "EVP_DigestFinal_ex"))
    return hashes, [Probe("alloc", str(libpython), "PyObject_Malloc")]


def _linked(module_file: str, name: str) -> str | None:
    out = subprocess.run(["ldd", module_file], capture_output=True, text=True).stdout
    return next((line.split("=>")[1].split()[0] for line in out.splitlines() if name in line and "=>" in line), None)


def perf_counts(pids: dict[str, int], events: list[str], seconds: float) -> dict[str, dict[str, float]]:
    """Each process's count of each event over `seconds` (its threads summed)."""
    thread_of = {int(t): name for name, pid in pids.items() for t in _threads(pid)}
    done = subprocess.run(["perf", "stat", "-x", ",", "--per-thread", "-e", ",".join(events),
                           "-p", ",".join(map(str, pids.values())), "--", "sleep", str(seconds)],
                          capture_output=True, text=True)
    for name, pid in pids.items():  # (threads started meanwhile)
        thread_of.update({int(t): name for t in _threads(pid)})
    out: dict[str, dict[str, float]] = {name: {} for name in pids}
    for line in done.stderr.splitlines():
        fields = line.split(",")
        if len(fields) < 4 or "-" not in fields[0]:
            continue
        name = thread_of.get(int(fields[0].rpartition("-")[2] or 0))
        try:
            value = float(fields[1])
        except ValueError:
            continue  # <not counted>
        if name is not None:
            out[name][fields[3]] = out[name].get(fields[3], 0.0) + value
    return out


def _threads(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of all of `pid`'s threads so far."""
    vol = invol = 0
    for t in _threads(pid):
        try:
            text = Path(f"/proc/{pid}/task/{t}/status").read_text()
        except OSError:
            continue
        vol += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
        invol += int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
    return vol, invol


class Window:
    """One counting window: the leader's batches and messages, each process's counts."""

    def __init__(self, cluster: LocalCluster, pids: dict[str, int], leader: str):
        self.cluster, self.pids, self.leader = cluster, pids, leader

    def count(self, events: list[str], seconds: float, labels: dict[str, str] | None = None) -> dict:
        """`labels`: a name for each event's count (else perf's)."""
        before = self._leader_counts(), {n: switches(p) for n, p in self.pids.items()}
        counts = perf_counts(self.pids, events, seconds)
        after = self._leader_counts(), {n: switches(p) for n, p in self.pids.items()}
        batches, messages = (a - b for a, b in zip(after[0], before[0]))
        for name in self.pids:
            counts[name]["wake-ups"] = after[1][name][0] - before[1][name][0]
            counts[name]["preempted"] = after[1][name][1] - before[1][name][1]
            for label, event in (labels or {}).items():
                counts[name][label] = counts[name].pop(event, 0.0)
        return {"batches": batches, "messages": messages, "seconds": seconds, "counts": counts}

    def _leader_counts(self) -> tuple[float, float]:
        m = self.cluster.metrics(self.leader)
        return (node_metric(m, "tape_sequencer_batches_total", self.leader),
                node_metric(m, "tape_sequencer_messages_published_total", self.leader))


def bench_batch_cost(rate: float, window_s: float, out: str | None, durability: str | None = None) -> dict:
    console = Console(width=max(Console().width, 150))
    if shutil.which("perf") is None:
        console.print("perf is not installed (the Makefile's set-up installs it)")
        return {}
    speed, floor, hops = host_speed(), wake_floor(), hop_floor()
    root = Path(tempfile.mkdtemp(prefix=f"tape-batch-cost-{rate:.0f}-"))
    seconds = SETTLE_S + 3 * window_s + 10
    books = orders_in(int(rate * seconds))
    cluster = LocalCluster(root, replicas=len(REPLICAS), sequencers=len(SEQUENCERS),
                           extra=f"[audit]\nbooks_expected = {books}", durability=durability)
    hashes, allocations = probes()
    windows = {}
    try:
        cluster.start_all()
        leader = cluster.wait_leader()
        cluster.start("load", "load", "--rate", str(rate), "--messages", str(int(rate * seconds)), "--seed", "1")
        _wait_sending(cluster)
        time.sleep(SETTLE_S)
        standby = next(s for s in SEQUENCERS if s != leader)
        roles = {"leader": leader, "standby": standby}
        window = Window(cluster, {p: cluster.procs[roles.get(p, p)].pid for p in PROCESSES}, leader)
        windows["kernel"] = window.count(KERNEL_EVENTS, window_s)
        for name, found in (("hashes", hashes), ("allocations", allocations)):
            events = {p.label: p.event for p in found if p.add()}
            if events:
                windows[name] = window.count(list(events.values()), window_s, labels=events)
            for p in found:
                p.remove()
    finally:
        for p in (*hashes, *allocations):
            p.remove()
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    figures = {"rate_offered": rate, "durability": cluster.cfg.durability, "host_encode_msgs_per_s": round(speed),
               "wake_floor_us": floor, "hop_floor_us": hops, "windows": windows,
               "per_batch": {name: per_batch(w) for name, w in windows.items()}}
    console.print(_table(figures))
    if out:
        Path(out).write_text(json.dumps(figures, indent=1))
        console.print(f"figures: {out}")
    return figures


def _wait_sending(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + SENDING_WAIT_S
    while not load_sending(cluster):
        cluster.check_running(ignore=("load",))
        if time.monotonic() > deadline:
            raise RuntimeError(f"the load did not begin to send within {SENDING_WAIT_S:.0f} s")
        time.sleep(0.05)


def per_batch(window: dict) -> dict[str, dict[str, float]]:
    """Each process's counts a batch of the window's: CPU µs, system calls by kind, the rest as
    counted."""
    batches = max(window["batches"], 1)
    rows = {}
    for name, c in window["counts"].items():
        row = {label: value / batches for label, value in c.items() if not label.startswith("syscalls:")}
        if "task-clock" in row:
            row["CPU µs"] = row.pop("task-clock") * 1000  # (perf counts it in ms)
            row["system calls"] = row.pop("raw_syscalls:sys_enter", 0.0)
            for kind, calls in SYSCALL_KINDS.items():
                row[kind] = sum(c.get(f"syscalls:sys_enter_{call}", 0.0) for call in calls) / batches
        rows[name] = row
    return rows


def _table(f: dict) -> Table:
    windows, rows = f["windows"], f["per_batch"]
    said = "; ".join(f"{name}: {w['batches']:,.0f} batches of {w['messages'] / max(w['batches'], 1):.1f} messages"
                     for name, w in windows.items())
    table = Table(title=f"tape bench batch-cost: a batch, counted in each process at {f['rate_offered']:,.0f} msg/s, "
                        f"durability {f['durability']} ({said}, each in {windows['kernel']['seconds']:g} s)",
                  caption=f"host speed {f['host_encode_msgs_per_s'] / 1e6:.2f} M msg/s encoded (tape bench protocol); "
                          "a wake-up to receive one datagram costs this host "
                          + ", ".join(f"{us:.0f} µs with {how}" for how, us in f["wake_floor_us"].items()) + "; "
                          f"a batch carried along the same hops by nine asyncio processes doing nothing else, "
                          f"{f['hop_floor_us']['all']:,.0f} µs ({f['hop_floor_us']['kernel']:,.0f} in the kernel). "
                          "wake-ups: voluntary context switches; send, receive, wait, flush: system calls by kind; "
                          "hashes: BLAKE3 hashers made, BLAKE2b and SHA-256 digests (an HMAC is two SHA-256); "
                          "alloc: PyObject_Malloc calls (the probes slow each process: those batches are larger)")
    columns = ["CPU µs", "wake-ups", "preempted", "system calls", *SYSCALL_KINDS]
    columns += [label for name in windows if name != "kernel" for label in next(iter(rows[name].values()))
                if label not in ("wake-ups", "preempted")]
    table.add_column("process")
    for col in columns:
        table.add_column(col, justify="right")
    for name in PROCESSES:
        table.add_row(name, *(f"{_cell(rows, name, col):,.1f}" for col in columns))
    table.add_row("[bold]all nine[/bold]", *(f"{sum(_cell(rows, n, col) for n in PROCESSES):,.1f}" for col in columns))
    return table


def _cell(rows: dict, process: str, column: str) -> float:
    """The column's figure from the window that counted it (wake-ups: the kernel's, unprobed)."""
    for window in rows.values():
        if column in window[process]:
            return window[process][column]
    return 0.0
