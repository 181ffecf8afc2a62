"""`tape replica`: a replica auditor process; the asyncio shell around ReplicaNode
(replicas/replica_node_core.py), which decides.

Loads its LMDB snapshot (or starts at seq 1), joins the public stream from
the next seq, catches up over SoupBinTCP replay from a rewinder when far
behind, applies strictly in seq order, snapshots every N messages or T ms,
and sends its alerts in emit-seq order to the emitter, resending from the
emitter's mark on every (re)connection, and its digest at each fold point;
told by the emitter that a quorum of replicas agree on another digest, it
moves its snapshot aside and applies again from seq 1, without a restart.
With `--exit-on-end` it stops once
it has applied everything up to the stream's end of session, and writes
`status.json` (last seq, digest, counts) either way when it stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Hashable

import lmdb

from tape.protocol import messages
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.linkauth import ANY_LISTENER
from tape.protocol.moldudp64 import HEADER_SIZE
from tape.protocol.streamauth import SEAL_FAILURES
from tape.replicas.audit_core import ALERT_SIZE, AuditMachine
from tape.replicas.replica_node_core import (
    Applied,
    AskRewinder,
    Close,
    Dial,
    Dropped,
    Exit,
    Rebuild,
    ReplicaNode,
    Send,
    TakeSnapshot,
)
from tape.replicas.snapshot import SaveJob, move_aside, open_verified
from tape.runtime import links
from tape.runtime.latency import LATENCY_SAMPLE_PACKETS, EveryNth, LatencyHistogram, LatencySamples
from tape.runtime.process import NodeProcess
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.settings import Config, NodeSettings
from tape.runtime.stream_sockets import GapTimer, StreamSockets
from tape.runtime.tuning import GIL_SWITCH_S

log = logging.getLogger("tape.replica")
TRADE_TYPES = bytes((messages.REQUEST, messages.PURCHASE))
BLOCK_STAMP = struct.Struct(f">{2 + messages.STAMP_AT}xQ")  # a block's stamp, alone


class Replica(NodeProcess):
    METRICS_PREFIX = "tape_replica"

    def __init__(self, cfg: Config, node: NodeSettings, drop: float = 0.0, seed: int = 0, exit_on_end: bool = False):
        super().__init__(cfg, node, log)
        self.exit_on_end = exit_on_end
        self.data = Path(node.data)
        self.drop, self.seed = drop, seed
        self.discarded = False
        self.rebuilds = 0
        self.snapshot_failures = 0
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._saving: asyncio.Task | None = None  # the save under way
        self.snapshot_histogram = LatencyHistogram()
        self.emitters = cfg.by_role("emitter")
        self.peers = {n.wire_name: n for n in (*cfg.by_role("rewinder"), *self.emitters)}
        self._writers: dict[Hashable, asyncio.StreamWriter] = {}
        self._timer: asyncio.TimerHandle | None = None  # at the node core's next deadline
        self._timer_due = 0
        self.badlog = RateLimitedLog(log)
        self.gaps = GapTimer()
        self.node_core = self._node(self._load())
        # Sequencer stamp -> applied here (wall clock, same host or PTP-synced hosts):
        # for the report only, never for state.
        self.latency = LatencySamples()
        self.latency_histogram = LatencyHistogram()
        self._sampled = EveryNth(LATENCY_SAMPLE_PACKETS)  # the packets whose latency is measured

    def _load(self) -> list[bytes]:
        """The state from the snapshot (a fresh one if there is none, or after a rebuild moved it
        aside); its outbox."""
        cfg = self.cfg
        self.store, self.machine, raw, discarded = open_verified(
            self.data / "lmdb", lambda: AuditMachine(int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9),
                                 books_expected=cfg.books_expected), log)
        self.discarded = self.discarded or discarded
        self.resumed_from = self.machine.last_seq
        return [raw[i:i + ALERT_SIZE] for i in range(0, len(raw), ALERT_SIZE)]

    def _node(self, outbox: list[bytes]) -> ReplicaNode:
        cfg = self.cfg
        replicas = [n.name for n in cfg.by_role("replica")]
        phase = replicas.index(self.node.name) / len(replicas) if self.node.name in replicas else 0.0
        return ReplicaNode(self.node.wire_name, self.machine, outbox, cfg.session_bytes,
                           [n.wire_name for n in cfg.by_role("rewinder")],
                           self.emitters[0].wire_name if self.emitters else None, cfg.gap_request_ms * 1_000_000,
                           cfg.stream_auth, cfg.max_packet, cfg.snapshot_every, cfg.snapshot_ms * 1_000_000,
                           self.exit_on_end, phase, time.monotonic_ns())

    @property
    def core(self):
        return self.node_core.core

    def report(self):
        m, n = self.machine, self.node_core
        yield "applied_seq", "gauge", "last seq applied", m.last_seq
        yield "messages_applied", "counter", "messages applied since start", m.applied
        yield "alerts_raised", "counter", "alerts raised", m.alerts_raised
        yield "alerts_unacked", "gauge", "alerts not yet acknowledged by the emitter", len(n.core.outbox)
        yield "rejects", "counter", "messages rejected, by reason", dict(m.rejects)
        yield "open_books", "gauge", "open books", len(m.books)
        yield "held_orphans", "gauge", "purchases held for their request", sum(len(h) for h in m.orphans.values())
        yield "lag", "gauge", "messages known to exist but not applied", n.receiver.lag()
        yield "stream_gap_seconds", "histogram", "time something was missing from the stream, from the drain that " \
            "saw it missing to the one that saw it filled (gaps that overlap count once)", self.gaps.histogram
        yield "gap_requests", "counter", "gap-fill requests sent to the rewinders", n.listener.requests_sent
        yield "gap_answer_timeout_seconds", "gauge", "how long a gap request waits for its answer before it is " \
            "asked again (follows measured answers, never under gap_request_ms)", \
            n.listener.answers.timeout_ns / 1e9
        yield "bad_datagrams", "counter", "stream datagrams dropped, by reason (unsealed, bad_tag, ...)", \
            dict.fromkeys(SEAL_FAILURES, 0) | n.listener.bad  # at 0 from the start: Prometheus sees the first
        yield "replayed_messages", "counter", "messages caught up over TCP replay", n.replayed
        yield "snapshots", "counter", "LMDB snapshots written", self.store.saves
        yield "snapshot_seconds", "histogram", "time to write a snapshot (its disk work, off the thread that " \
            "applies)", self.snapshot_histogram
        yield "snapshot_failures", "counter", "snapshots the disk refused (the last one written stands)", \
            self.snapshot_failures
        yield "resumed_from_seq", "gauge", "seq of the snapshot this process started from", self.resumed_from
        yield "snapshots_discarded", "counter", "snapshots found corrupt at start-up, moved aside, never used", \
            1 if self.discarded else 0
        yield "rebuilds", "counter", "times outvoted on its digest and applied again from seq 1", \
            self.rebuilds
        # The digest chain at the last fold point (a multiple of 4096 seqs, or the session's end), as
        # a 48-bit number labelled with that seq: replicas at the same fold_seq must show the same value.
        digest = {str(m.fold_seq): int.from_bytes(m.chain[:6], "big")}
        yield "digest", "gauge", "digest chain at fold_seq (48 bits)", digest, "fold_seq"
        yield "latency_seconds", "histogram", "sequencer stamp to applied here, one packet in 8 sampled (wall " \
            "clocks: same host or synced)", self.latency_histogram

    async def main(self) -> None:
        log.info(
            "%s resuming after seq %d (snapshot), %d alerts to resend",
            self.node.name,
            self.resumed_from,
            len(self.core.outbox),
        )
        sys.setswitchinterval(GIL_SWITCH_S)  # the snapshot thread holds up applying 1 ms at most
        self.sockets = StreamSockets(self.cfg, self.cfg.interface_of(self.node), self._on_datagrams, self.drop,
                                     self.seed)
        self.node_core.reply_at(*self.sockets.start(), time.time_ns())  # (nonces above any before a restart)
        self._rearm()
        await self.stop.wait()
        if self._timer is not None:
            self._timer.cancel()
        self.sockets.stop()
        for writer in self._writers.values():
            writer.close()
        await self._saved()
        self._snapshot()
        await self._saved()
        self._saver.shutdown()
        status = {"name": self.node.name, "last_seq": self.machine.last_seq, "digest": self.machine.digest(),
                  "alerts_raised": self.machine.alerts_raised, "rejects": self.machine.rejects,
                  "resumed_from": self.resumed_from, "failed": self.failed,
                  "latency_ms": self.latency.summary_ms()}
        (self.data / "status.json").write_text(json.dumps(status, indent=1))
        self.store.close()
        log.info("%s stopped at seq %d, digest %s", self.node.name, self.machine.last_seq, status["digest"])

    # --- events and actions --------------------------------------------------------------

    def event(self, handler, *args) -> None:
        """One event of the node core, its actions carried out; what cannot be applied stops the
        node (skipping it would diverge this replica from the others)."""
        if self.failed:
            return
        try:
            actions = handler(*args, time.monotonic_ns())
        except InvariantViolation as e:
            self.fail(str(e))
            return
        for a in actions:
            self._carry_out(a)
        self._rearm()

    def _rearm(self) -> None:
        """The timer at the node core's next deadline, sooner if an event brought it forward."""
        due = self.node_core.next_deadline(time.monotonic_ns())
        if self.stop.is_set() or (self._timer is not None and self._timer_due <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = asyncio.get_running_loop().call_later(max(due - time.monotonic_ns(), 0) / 1e9, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.event(self.node_core.on_timer)

    def _on_datagrams(self, datagrams: list[bytes]) -> None:
        self.event(self.node_core.on_datagrams, datagrams)
        self.gaps.note(self.node_core.receiver.missing() is not None, time.monotonic_ns())

    def _carry_out(self, a) -> None:
        kind = type(a)
        if kind is Applied:
            for run in self._sampled.pick(a.runs):
                self._note_latency(run.packet, run.skip)
        elif kind is Send:
            if (writer := self._writers.get(a.conn)) is not None:
                writer.write(a.data)
        elif kind is AskRewinder:
            self.sockets.ask(a.index, a.request)
        elif kind is Close:
            if a.reason is not None:
                log.warning("%s link closed: %s (%s)", a.conn[0], a.reason.value, a.detail)
            if (writer := self._writers.pop(a.conn, None)) is not None:
                writer.close()
        elif kind is Dial:
            self.spawn(self._dialled(a.conn, self.peers[a.peer]))
        elif kind is TakeSnapshot:
            self._snapshot()
        elif kind is Rebuild:
            self.spawn(self._rebuild(a.fold_seq))
        elif kind is Dropped:
            self.badlog.warn(a.reason, "dropped datagram: %s", a.detail)
        elif kind is Exit:
            self.stop.set()

    async def _dialled(self, conn: Hashable, peer: NodeSettings) -> None:
        """The alert link to the emitter, or a replay from a rewinder, as the node asked."""
        alert = conn[0] == "alert"
        port, keys = (peer.alert_port, self.cfg.links_of(self.node)) if alert else (peer.replay_port,
                                                                                     self.cfg.replay_link)
        try:
            reader, writer = await self.open_link(peer.host, port, keys, peer=peer.wire_name if alert else ANY_LISTENER)
        except (OSError, asyncio.TimeoutError) as e:
            log.warning("%s link to %s not opened: %s", conn[0], peer.name, e)
            self.event(self.node_core.on_closed, conn)
            return
        self._writers[conn] = writer
        if not alert:
            log.info("%s catching up over TCP from %s at seq %d (%d behind)", self.node.name, peer.name,
                     self.node_core.replay.start, self.node_core.receiver.lag())
        self.event(self.node_core.on_connected, conn)
        try:
            await links.read_each(reader, lambda data: self.event(self.node_core.on_data, conn, data))
        except (OSError, ProtocolError) as e:
            log.warning("%s link to %s lost: %s", conn[0], peer.name, e)
        finally:
            if self._writers.pop(conn, None) is not None:
                writer.close()
                self.event(self.node_core.on_closed, conn)
            elif not alert:
                log.info("%s replay from %s ended at seq %d", self.node.name, peer.name,
                         self.node_core.receiver.next_seq - 1)

    def _note_latency(self, pkt: bytes, skip: int) -> None:
        """Stamp to applied, of one packet in LATENCY_SAMPLE_PACKETS (measuring every one was a
        tenth of a replica's CPU): its messages were stamped together (one drain of the leader's
        inbound socket), so the first trade's lag stands for every trade in it."""
        start = HEADER_SIZE + skip * messages.SEQUENCED_BLOCK_SIZE
        kinds = pkt[start + 2::messages.SEQUENCED_BLOCK_SIZE]
        trades = len(kinds) - len(kinds.translate(None, TRADE_TYPES))
        if trades:
            first = 0 if kinds[0] in TRADE_TYPES else next(i for i, kind in enumerate(kinds) if kind in TRADE_TYPES)
            lag = time.time_ns() - BLOCK_STAMP.unpack_from(pkt, start + first * messages.SEQUENCED_BLOCK_SIZE)[0]
            self.latency.add(lag, trades)
            self.latency_histogram.observe(lag)

    # --- snapshots and rebuilds ----------------------------------------------------------

    async def _rebuild(self, fold_seq: int) -> None:
        """The emitter's order: a quorum of replicas agree on another digest at fold_seq. Discard
        this state (kept aside) and apply again from seq 1."""
        await self._saved()
        self.store.close()
        aside = move_aside(self.data / "lmdb")
        log.error("DIVERGED: the other replicas agree on another digest at fold seq %d: this state (moved to %s) "
                  "is discarded; applying again from seq 1", fold_seq, aside)
        self.rebuilds += 1
        outbox = self._load()
        self.event(self.node_core.on_rebuilt, self.machine, outbox)

    def _snapshot(self) -> None:
        """Take the state at this seq and write it on the snapshot thread, so that the disk's
        fsync does not stall applying. One save at a time (the node core asks for one then)."""
        if self._saving is not None:
            return
        job = self.store.prepare(self.machine, {"node": self.node.name}, outbox=b"".join(self.core.outbox))
        self._saving = self.spawn(self._save(job))

    async def _save(self, job: SaveJob) -> None:
        """A save the disk refuses (full or failing) is not fatal: the last snapshot stays as it
        was, the state stays in memory, and the next one writes its books too."""
        started = time.monotonic_ns()
        try:
            written = await asyncio.get_running_loop().run_in_executor(self._saver, self.store.write, job)
        except lmdb.Error as e:
            self.store.abandon(self.machine, job)
            self.snapshot_failures += 1
            log.error("snapshot not written (%s; a full or failing disk?): the last one on disk stands and the "
                      "state stays in memory; trying again after the next %d messages or %d ms", e,
                      self.cfg.snapshot_every, self.cfg.snapshot_ms)
        else:
            self.store.finish(job, written)
            self.snapshot_histogram.observe(time.monotonic_ns() - started)
        finally:
            self._saving = None
            self.event(self.node_core.on_saved)

    async def _saved(self) -> None:
        """Once the save under way (if any) has ended."""
        if self._saving is not None:
            await asyncio.shield(self._saving)
