"""`tape bench rewinder`'s endpoint row: a rewinder's replication endpoint as it runs.

The rewinder's real shell (runtime/voter_shell.py's `VoterShell.serve`, behind the authenticated link's
handshake, over TCP on loopback, into its journal) on one core, and a leader process on the
other core that sends every append at once, as a leader does when a follower is behind: the
rate is what the follower can take. It counts from the first append sent to the
acknowledgement of the last, so every message was journaled (per the fsync policy) and
acknowledged in it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
import shutil
import tempfile
import time
import tomllib
from pathlib import Path
from typing import NamedTuple

from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import messages, replication
from tape.runtime import links
from tape.runtime.config import default_toml, new_keys, parse
from tape.runtime.memory import tune_memory
from tape.runtime.storage.journal_store import Journal
from tape.runtime.voter_shell import VoterShell, VoteStore

LEADER_TIMEOUT_S = 300  # the whole send, however slow the host: the bench stops by itself


class EndpointRun(NamedTuple):
    rate: float  # messages a second, first append sent to the last acknowledged
    cpu_us: float  # the follower's CPU (user + system) a message
    fsyncs: int  # the follower journal's fsyncs in the run


def _appends(n: int, batch: int, leader: bytes) -> list[bytes]:
    session = b"TAPE".ljust(10)
    stamped = [messages.stamp(m, time.time_ns(), session, i) for i, m in enumerate(TradeGenerator(seed=12).take(n), 1)]
    return [replication.encode_append(1, leader, i, 1 if i else 0, i, 1, stamped[i:i + batch])
            for i in range(0, n, batch)]


def _leader(cfg, node, frames: list[bytes], n: int, out) -> None:
    """The child: connect as the leader, send every append, wait for the ack of message n."""
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})

    async def run() -> float:
        keys = cfg.links_of(cfg.node("seq-a"))  # the leader's
        reader, writer = await links.connect(node.host, node.replication_port, keys, {}, 10, node.wire_name)
        acks = replication.FrameReader()
        t0 = time.perf_counter()
        for frame in frames:  # sealed as sent: drain() lets the loop send while the follower reads
            writer.write(frame)
            await writer.drain()
        while True:
            data = await reader.read(1 << 16)
            if not data:
                raise RuntimeError("the follower closed the link")
            for fr in acks.feed(data):
                if isinstance(fr, replication.Ack) and not fr.success:
                    raise RuntimeError(f"the follower refused an append: {fr}")
                if isinstance(fr, replication.Ack) and fr.last_seq == n:
                    writer.close()
                    return time.perf_counter() - t0

    async def within_limit() -> float:
        async with asyncio.timeout(LEADER_TIMEOUT_S):  # not wait_for (runtime/process.py `within`)
            return await run()

    try:
        out.send(asyncio.run(within_limit()))
    except BaseException as e:  # the parent reports it
        out.send(e)


def bench_endpoint(n: int = 1_000_000, batch: int = 500, fsync: str = "batch") -> EndpointRun:
    """`n` messages in appends of `batch` through the endpoint (module docstring); raises unless
    the follower journaled them all and acknowledged the last."""
    root = Path(tempfile.mkdtemp(prefix="tape-bench-endpoint-"))
    cores = os.sched_getaffinity(0)
    journal = None
    try:
        cfg = parse(tomllib.loads(default_toml(root, sequencers=1, rewinders=1, clients=1, free=True,
                                                keys=new_keys(1))))
        follower, leader = cfg.node("rw-1"), cfg.node("seq-a")
        Path(follower.data).mkdir(parents=True)
        VoteStore(Path(follower.data) / "election.json").save(1, None)  # state on disk: it follows at once
        journal = Journal(Path(follower.data) / "journal", cfg.session_bytes, fsync=fsync)
        voter = VoterShell(cfg, follower, journal, can_lead=False)
        frames = _appends(n, batch, leader.wire_name)
        ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=False)
        if len(cores) > 1:
            os.sched_setaffinity(0, {min(cores)})
        tune_memory()
        return asyncio.run(_serve_while(cfg, follower, voter, frames, n, ours, theirs))
    finally:
        os.sched_setaffinity(0, cores)
        if journal is not None:
            journal.close()
        shutil.rmtree(root, ignore_errors=True)


async def _serve_while(cfg, node, voter: VoterShell, frames, n, ours, theirs) -> EndpointRun:
    server = await links.start_server(links.serving(voter.serve, voter.link_keys, {}), node.host,
                                         node.replication_port)
    child = multiprocessing.get_context("fork").Process(target=_leader, args=(cfg, node, frames, n, theirs),
                                                        daemon=True)
    before, fsyncs = resource.getrusage(resource.RUSAGE_SELF), voter.journal.fsyncs
    child.start()
    theirs.close()  # the child's end is the child's alone: its death ends our recv (EOFError)
    try:
        got = await asyncio.get_running_loop().run_in_executor(None, ours.recv)
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        server.close()
        child.join(10)
        if child.is_alive():
            child.kill()
    if isinstance(got, BaseException):
        raise RuntimeError(f"the leader failed: {got!r}")
    if voter.journal.last_seq != n:
        raise RuntimeError(f"journaled {voter.journal.last_seq} of {n}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return EndpointRun(n / got, cpu / n * 1e6, voter.journal.fsyncs - fsyncs)
