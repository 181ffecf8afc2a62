"""`tape replica`: a replica auditor process.

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

import lmdb

from tape.node.latency import LATENCY_SAMPLE_PACKETS, EveryNth, LatencyHistogram, LatencySamples
from tape.node.listener import StreamListener
from tape.node.process import NodeProcess, within
from tape.node.settings import Config, Node
from tape.protocol import alertlink, messages
from tape.protocol import soupbintcp as soup
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import (
    CONTROL_READ,
    GIL_SWITCH_S,
    REPLAY_CLIENT_HEARTBEAT_S,
    REPLAY_POLL_FAST_FOR_S,
    REPLAY_POLL_IDLE_S,
    REPLAY_POLL_S,
    STREAM_READ,
)
from tape.protocol.moldudp64 import HEADER_SIZE, MAX_BLOCKS
from tape.protocol.packets import PacketBuilder
from tape.protocol.receiver import Deliver
from tape.protocol.streamauth import sealed_ranges
from tape.replicas.audit import ALERT_SIZE, DIGEST_BLOCK, AuditMachine
from tape.replicas.replica_core import Exit, ReplicaCore, SendAlerts, SendDigest, Snapshot
from tape.replicas.snapshot import SaveJob, move_aside, open_verified

log = logging.getLogger("tape.replica")
TRADE_TYPES = bytes((messages.REQUEST, messages.PURCHASE))
BLOCK_STAMP = struct.Struct(f">{2 + messages.STAMP_AT}xQ")  # a block's stamp, alone


class Replica(NodeProcess):
    METRICS_PREFIX = "tape_replica"

    def __init__(self, cfg: Config, node: Node, drop: float = 0.0, seed: int = 0, exit_on_end: bool = False):
        super().__init__(cfg, node, log)
        self.exit_on_end = exit_on_end
        self.data = Path(node.data)
        self.drop, self.seed = drop, seed
        self.discarded = False
        self.rebuilds = 0
        self.snapshot_failures = 0
        self.rebuilt_for = 0  # the fold seq of the last rebuild order carried out
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._saving: asyncio.Task | None = None  # the save under way
        self.snapshot_histogram = LatencyHistogram()
        self._open()
        self.emitters = cfg.by_role("emitter")
        self._writer: asyncio.StreamWriter | None = None
        self._unsent: list[bytes] = []  # alert-channel frames for the next write (_send)
        self.replayed = 0
        # Sequencer stamp -> applied here (wall clock, same host or PTP-synced hosts):
        # for the report only, never for state.
        self.latency = LatencySamples()
        self.latency_histogram = LatencyHistogram()
        self._sampled = EveryNth(LATENCY_SAMPLE_PACKETS)  # the packets whose latency is measured

    def _open(self) -> None:
        """The state from the snapshot (a fresh one if there is none), and a listener from the seq after it."""
        cfg = self.cfg
        self.store, self.machine, raw, discarded = open_verified(
            self.data / "lmdb", lambda: AuditMachine(int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9),
                                 books_expected=cfg.books_expected), log)
        self.discarded = self.discarded or discarded
        self.resumed_from = self.machine.last_seq
        outbox = [raw[i:i + ALERT_SIZE] for i in range(0, len(raw), ALERT_SIZE)]
        replicas = [n.name for n in cfg.by_role("replica")]
        phase = replicas.index(self.node.name) / len(replicas) if self.node.name in replicas else 0.0
        self.core = ReplicaCore(self.machine, outbox, cfg.snapshot_every, cfg.snapshot_ms * 1_000_000,
                                self.exit_on_end, time.monotonic_ns(), phase)
        self.listener = StreamListener(cfg, cfg.interface_of(self.node), self._deliver, self.drop, self.seed,
                                       next_seq=self.machine.last_seq + 1, on_undecodable=self._undecodable)

    async def _rebuild(self, fold_seq: int) -> bool:
        """The emitter's order: a quorum of replicas agree on another digest at fold_seq. Discard
        this state (kept aside) and apply again from seq 1. False if already done for that fold."""
        if fold_seq <= self.rebuilt_for:
            return False
        self.rebuilt_for = fold_seq
        await self.listener.close()
        await self._saved()
        self.store.close()
        aside = move_aside(self.data / "lmdb")
        log.error("DIVERGED: the other replicas agree on another digest at fold seq %d: this state (moved to %s) "
                  "is discarded; applying again from seq 1", fold_seq, aside)
        self.rebuilds += 1
        self._open()
        self.listener.start()
        self._catching_up.cancel()  # its replay fed the old listener
        self._catching_up = self.spawn(self._catch_up())
        return True

    def report(self):
        m = self.machine
        yield "applied_seq", "gauge", "last seq applied", m.last_seq
        yield "messages_applied", "counter", "messages applied since start", m.applied
        yield "alerts_raised", "counter", "alerts raised", m.alerts_raised
        yield "alerts_unacked", "gauge", "alerts not yet acknowledged by the emitter", len(self.core.outbox)
        yield "rejects", "counter", "messages rejected, by reason", dict(m.rejects)
        yield "open_books", "gauge", "open books", len(m.books)
        yield "held_orphans", "gauge", "purchases held for their request", sum(len(h) for h in m.orphans.values())
        yield "lag", "gauge", "messages known to exist but not applied", self.listener.receiver.lag()
        yield "stream_gap_seconds", "histogram", "time something was missing from the stream, from the drain that " \
            "saw it missing to the one that saw it filled (gaps that overlap count once)", self.listener.gap_histogram
        yield "gap_requests", "counter", "gap-fill requests sent to the rewinders", self.listener.requests_sent
        yield "gap_answer_timeout_seconds", "gauge", "how long a gap request waits for its answer before it is " \
            "asked again (follows measured answers, never under gap_request_ms)", \
            self.listener.core.answers.timeout_ns / 1e9
        yield "bad_datagrams", "counter", "stream datagrams dropped, by reason (unsealed, bad_tag, ...)", \
            dict(self.listener.bad)
        yield "replayed_messages", "counter", "messages caught up over TCP replay", self.replayed
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
        # The digest chain at the last fold point (a multiple of 4096 seqs), as a 48-bit number
        # labelled with that seq: replicas at the same fold_seq must show the same value.
        fold = m.last_seq - m.last_seq % DIGEST_BLOCK
        digest = {str(fold): int.from_bytes(m.chain[:6], "big")}
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
        self.listener.start()
        self._catching_up = self.spawn(self._catch_up())
        tasks = [self.spawn(self._emitter_link()), self.spawn(self._housekeeping())]
        await self.stop.wait()
        for t in [*tasks, self._catching_up]:
            t.cancel()
        self.listener.stop()
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

    # --- applying ------------------------------------------------------------------------

    def _deliver(self, runs: list[Deliver]) -> None:
        if self.failed:
            return
        try:
            actions = self.core.on_packets(runs)
        except (ProtocolError, InvariantViolation) as e:
            # Skipping would diverge this replica from the others: stop applying, loudly.
            self.fail(f"cannot apply from seq {runs[0].first_seq}: {e}")
            return
        for run in self._sampled.pick(runs):
            self._note_latency(run.packet, run.skip)
        self._carry_out(actions)

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

    def _carry_out(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, SendAlerts):
                if self._writer is not None and a.alerts:
                    self._send(alertlink.alerts(a.alerts))
            elif isinstance(a, SendDigest):
                if self._writer is not None:
                    self._send(alertlink.digest(a.fold_seq, a.chain))
            elif isinstance(a, Snapshot):
                self._snapshot()
            elif isinstance(a, Exit):
                self.stop.set()

    def _send(self, frames: bytes) -> None:
        """To the alert channel, in one write per turn of the event loop: a drain of the stream
        raises alerts in many packets, and each write is a sealed record and a system call."""
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._flush)
        self._unsent.append(frames)

    def _flush(self) -> None:
        frames, self._unsent = b"".join(self._unsent), []
        if frames and self._writer is not None:  # (a link lost since: its welcome sends the outbox again)
            self._writer.write(frames)

    def _undecodable(self, seq: int, error: ProtocolError) -> None:
        self.fail(f"the committed message at seq {seq} cannot be decoded ({error}); skipping it would diverge")

    def _snapshot(self) -> None:
        """Take the state at this seq and write it on the snapshot thread, so that the disk's
        fsync does not stall applying. One save at a time: one due meanwhile waits for it."""
        if self._saving is not None:
            return
        job = self.store.prepare(self.machine, {"node": self.node.name},
                                 outbox=b"".join(self.core.outbox))
        self.core.snapshot_taken(time.monotonic_ns())
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

    async def _saved(self) -> None:
        """Once the save under way (if any) has ended."""
        if self._saving is not None:
            await asyncio.shield(self._saving)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            self._carry_out(self.core.on_timer(time.monotonic_ns(), self.listener.receiver))

    # --- catching up over TCP ------------------------------------------------------------

    async def _catch_up(self) -> None:
        """Replay over TCP whenever far behind. Looked at often while something is missing and
        just after a (re)start (gap fills race the replay for a missing run, and win a short
        one: a rebuild's 8,000 messages were filled before a first look at 0.3 s), rarely else
        (an idle replica wakes for nothing)."""
        rewinders = self.cfg.by_role("rewinder")
        which = 0
        fast_until = time.monotonic() + REPLAY_POLL_FAST_FOR_S
        while True:
            rx = self.listener.receiver
            if not self.core.far_behind(rx) or not rewinders:
                missing = rx.lag() > rx.held
                await asyncio.sleep(REPLAY_POLL_S if missing or time.monotonic() < fast_until else REPLAY_POLL_IDLE_S)
                continue
            rw = rewinders[which % len(rewinders)]
            which += 1
            try:
                await self._replay_from(rw)
            except (OSError, ProtocolError, asyncio.TimeoutError) as e:
                log.warning("replay from %s failed: %s", rw.name, e)
                await asyncio.sleep(0.2)

    async def _replay_from(self, rw: Node) -> None:
        rx = self.listener.receiver
        start = rx.next_seq
        reader, writer = await self.open_link(rw.host, rw.replay_port, self.cfg.replay_link)
        log.info("%s catching up over TCP from %s at seq %d (%d behind)", self.node.name, rw.name, start, rx.lag())
        try:
            writer.write(soup.login(self.node.name[:6], "", "", start))
            dec = soup.FrameDecoder()
            seq = None
            batch: list[bytes] = []
            beat = time.monotonic()
            while not self.core.caught_up(rx):
                data = await within(reader.read(STREAM_READ), 5.0)
                if not data:
                    return
                if time.monotonic() - beat >= REPLAY_CLIENT_HEARTBEAT_S:  # the server drops a silent client
                    writer.write(soup.heartbeat(server=False))
                    beat = time.monotonic()
                for kind, payload in dec.feed(data):
                    if kind == soup.LOGIN_ACCEPTED:
                        seq = soup.parse_login_accepted(payload)[1]
                    elif kind == soup.LOGIN_REJECTED:
                        raise ProtocolError("rejected", f"replay login rejected ({payload!r})", 0)
                    elif kind == soup.SEQUENCED and seq is not None:
                        batch.append(payload)
                if batch:  # replayed messages go through the same receiver as the live stream
                    used = self._replayed(seq, batch)
                    if not used and len(batch) > MAX_BLOCKS:  # no range ends: not the sealed log
                        raise ProtocolError("unsealed", f"{len(batch):,} replayed entries and no seal", 0)
                    seq += used
                    self.replayed += used
                    batch = batch[used:]
        finally:
            writer.write(soup.logout())
            writer.close()
        log.info("%s caught up at seq %d", self.node.name, rx.next_seq - 1)

    def _replayed(self, seq: int, batch: list[bytes]) -> int:
        """Hand replayed entries from `seq` to the listener as packets; returns how many were used.
        With stream keys, as the sealed ranges the leader published (a packet that is not one whole
        range does not verify), and a range cut by the end of a read waits for the next one."""
        if self.cfg.stream_keys:
            ranges, used = sealed_ranges(batch, seq)
        else:
            ranges, used = [(seq, batch)], len(batch)
        for first, entries in ranges:
            for pkt in PacketBuilder(self.cfg.session_bytes, first, self.cfg.max_packet).add_sequenced(entries):
                self.listener.on_datagram(pkt)
        return used

    # --- the alert channel ---------------------------------------------------------------

    async def _emitter_link(self) -> None:
        if not self.emitters:
            return
        em = self.emitters[0]
        while True:
            try:
                reader, writer = await self.open_link(em.host, em.alert_port, self.cfg.cluster_link)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            frames = alertlink.Reader()
            try:
                writer.write(alertlink.hello(self.node.wire_name))
                while True:
                    data = await reader.read(CONTROL_READ)
                    if not data:
                        break
                    for kind, payload in frames.feed(data):
                        mark = alertlink.MARK.unpack(payload)[0] if len(payload) == 8 else 0
                        if kind == alertlink.WELCOME:  # resend everything after the emitter's mark
                            self._writer, self._unsent = writer, []  # the outbox holds what was unsent
                            self._carry_out(self.core.on_welcome(mark))
                        elif kind == alertlink.REBUILD:
                            if await self._rebuild(mark):
                                raise ConnectionResetError("rebuilding: the new state links anew")
                        else:
                            self.core.on_ack(mark)
            except (OSError, ProtocolError) as e:
                log.warning("alert link to %s lost: %s", em.name, e)
            finally:
                self._writer, self._unsent = None, []
                self.core.on_link_lost()
                writer.close()
            await asyncio.sleep(0.2)

