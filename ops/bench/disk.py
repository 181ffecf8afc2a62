"""`tape bench disk`: how long a journal append waits for the disk, with as many journals
flushing at once as share it.

A batch commits once the leader and two followers hold it, each after its own append and
fdatasync: on one host the four voters' journals flush the same batch at the same moment on one
disk, and the commit waits for the slowest of the leader's and the second follower's. So this
flush's tail is a floor under the stream's latency tail that no CPU saved lowers
(docs/performance.md). Each writer is a process with the real
`Journal` (fsync per append), started together and paced like a leader's batches.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.verification.load import percentile
from tape.protocol import moldudp64
from tape.protocol.journal import RecordRun
from tape.protocol.messages import SEQUENCED_SIZE
from tape.runtime.storage.journal_store import Journal

SESSION = moldudp64.session_bytes("BENCH")
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # an fdatasync there waits for no disk


def _writer(directory: str, appends: int, per_append: int, every_s: float, start_at: float, out) -> None:
    """One voter's journal: `appends` appends of `per_append` messages, one every `every_s` from
    `start_at` (a shared monotonic instant); puts each append's seconds (write and fdatasync)
    and the journal's count of fsyncs."""
    journal = Journal(directory, SESSION, fsync="batch")
    blob = os.urandom(per_append * SEQUENCED_SIZE)
    seconds = []
    time.sleep(max(0.0, start_at - time.monotonic()))
    for k in range(appends):
        t0 = time.monotonic()
        journal.append(RecordRun(k * per_append + 1, 1, blob, SEQUENCED_SIZE))
        seconds.append(time.monotonic() - t0)
        time.sleep(max(0.0, start_at + (k + 1) * every_s - time.monotonic()))
    journal.close()
    out.put((seconds, journal.fsyncs))


def _results(procs: list, out, deadline: float) -> list:
    """Each writer's (seconds, fsyncs) once all are done; raises as soon as one died without them."""
    got = []
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=0.5))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"writers failed (exit codes {failed}) or did not finish in time") from None
    for p in procs:
        p.join()
    return got


def _records(directory: Path) -> int:
    """The records the journal holds, as opening it finds them (each checked: seqs from 1, no gap)."""
    journal = Journal(directory, readonly=True)
    try:
        return journal.last_seq
    finally:
        journal.close()


def bench_disk(writers: int, appends: int, per_append: int, every_ms: float, where: str | None = None) -> dict:
    """Run the writers in a temporary directory under `where` (the journals' disk; default the
    system's temporary directory); print and return the append latencies in ms."""
    root = Path(tempfile.mkdtemp(prefix="tape-bench-disk-", dir=where))
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs: list = []
    try:
        start_at = time.monotonic() + 0.5  # all of them started by then
        procs = [ctx.Process(target=_writer, args=(str(root / f"voter-{i}"), appends, per_append, every_ms / 1e3,
                                                   start_at, out)) for i in range(writers)]
        for p in procs:
            p.start()
        got = _results(procs, out, deadline=start_at + 60 + appends * (every_ms / 1e3 + 1.0))
        samples, fsyncs = [seconds for seconds, _ in got], [n for _, n in got]
        held = [_records(root / f"voter-{i}") for i in range(writers)]
        if held != [appends * per_append] * writers or fsyncs != [appends] * writers:
            raise RuntimeError(f"the journals hold {held} records after {fsyncs} fsyncs, not {appends * per_append} "
                               f"after {appends} each")
    finally:
        for p in procs:
            if p.is_alive():  # (a writer stuck past the deadline)
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    every = [s * 1e3 for w in samples for s in w]
    result = {"writers": writers, "appends": appends, "messages_an_append": per_append,
              "bytes_an_append": per_append * SEQUENCED_SIZE, "every_ms": every_ms, "fsyncs": sum(fsyncs),
              **{k: percentile(every, q) for k, q in (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))},
              "max_ms": max(every), "writer_p99_ms": [percentile([s * 1e3 for s in w], 0.99) for w in samples]}
    _print(result, str(root.parent))
    return result


def filesystem(path: str) -> str:
    """The type of the file system `path` is on, from the longest mount point above it
    (/proc/self/mounts; "unknown" where there is none)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for fields in map(str.split, mounts):
                point = fields[1].replace("\\040", " ") if len(fields) > 2 else ""
                inside = point and (path == point or path.startswith(point.rstrip("/") + "/"))
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def _print(r: dict, where: str) -> None:
    kind = filesystem(os.path.realpath(where))
    table = Table(title=f"tape bench disk: a journal append (write + fdatasync) in {where} ({kind}), "
                        f"{r['writers']} journals flushing at once")
    for column in ("appends", "messages (bytes) an append", "p50 ms", "p90 ms", "p99 ms", "max ms",
                   "p99 ms of each writer"):
        table.add_column(column, justify="right")
    table.add_row(f"{r['writers']} x {r['appends']:,}, one each {r['every_ms']:g} ms",
                  f"{r['messages_an_append']:,} ({r['bytes_an_append']:,})",
                  *(f"{r[k]:.2f}" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
                  " / ".join(f"{v:.2f}" for v in r["writer_p99_ms"]))
    console = Console()
    console.print(table)
    if kind in MEMORY_FILE_SYSTEMS:
        console.print(f"[bold red]{where} is {kind}: memory, not a disk; give --dir on the journals' disk")
    console.print("A batch commits once the leader and two of its three followers hold it: on one disk their "
                  "flushes wait together, and this tail is a floor under the stream's.")
