"""The replication endpoint every voter runs (sequencers and rewinders): the
asyncio shell around VoterNode (protocol/voter_node.py), which decides; this
module carries its actions out (journal, vote file, connections) and moves the
bytes.

A leader (or a candidate) connects to a voter's replication port. The voter
greets with a hello (term, log position), then answers each append with an
ack (after the records are in its journal, per the fsync policy) and each
vote request with a vote (after its term and vote are on disk). The term
and the vote live in `DATA/election.json`, written atomically and fsynced,
so that a restarted voter never votes twice in a term. A voter that starts
without that file (a new or wiped disk) recovers it first: it greets every
connection and hangs up, and asks every other voter for its hello until all
have answered (ElectionCore, docs/failover.md). A voter whose disk refuses a
write (runtime/storage/diskspace.py) does the same until there is space again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import zlib
from collections import deque
from functools import partial
from pathlib import Path
from typing import Callable, Hashable, NamedTuple

from tape.protocol import voter_node as vn
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.runtime import links
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.settings import Config, NodeSettings
from tape.runtime.storage.diskspace import DiskFull, free_bytes, no_space
from tape.runtime.tuning import DISK_CHECK_EVERY_S, FREE_SPACE, SLOW_FSYNC_S

log = logging.getLogger("tape.voter")


class ElectionState(NamedTuple):
    term: int
    voted_for: bytes | None
    log_floor: tuple[int, int]
    found: bool  # False: no election state on disk (a new or wiped disk)


def encode_election(term: int, voted_for: bytes | None, log_floor: tuple[int, int] = (0, 0)) -> bytes:
    """`election.json`'s bytes."""
    return json.dumps({"term": term, "voted_for": voted_for.decode("ascii") if voted_for else None,
                       "log_floor": list(log_floor)}).encode()


def decode_election(raw: bytes | None, where: str) -> ElectionState:
    """What `election.json` holds (None: there is none). Our own file, written atomically:
    damage is an impossible state (exit 4, an operator looks: docs/runbook.md, "A disk failed"),
    never a term guessed."""
    if raw is None:
        return ElectionState(0, None, (0, 0), False)
    try:
        doc = json.loads(raw)
        voted = doc.get("voted_for")
        floor = doc.get("log_floor", [0, 0])
        return ElectionState(int(doc["term"]), voted.encode("ascii") if voted is not None else None,
                             (int(floor[0]), int(floor[1])), True)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise InvariantViolation(f"{where}: unreadable election state ({e!r}); refusing to guess a term") from None


class VoteStore:
    """(term, voted_for, log floor) on disk."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> ElectionState:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = None
        return decode_election(raw, str(self.path))

    def save(self, term: int, voted_for: bytes | None, log_floor: tuple[int, int] = (0, 0)) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_election(term, voted_for, log_floor))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if no_space(e):
                raise DiskFull(self.path, "saving the election state to") from None
            raise
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class VoterShell:
    def __init__(self, cfg: Config, node: NodeSettings, journal, can_lead: bool,
                 on_action: Callable[[vn.Lead | vn.StepDown | vn.RequestVotes], None] | None = None,
                 on_fatal: Callable[[str], None] = None, on_partition: Callable[[bool], None] | None = None,
                 link_refused: dict[str, int] | None = None, wrap: Callable[[vn.VoterNode], object] | None = None,
                 on_other: Callable[[object], list] | None = None):
        """`wrap`: the process's node core around this endpoint's (a rewinder's), which then gets
        every event; `on_other`: carries out that core's own actions (returning what they lead to)."""
        self.cfg = cfg
        self.link_keys = cfg.links_of(node)  # the other voters' pairs: no other node can connect
        self.link_refused = {} if link_refused is None else link_refused  # shared with the node's metrics
        self.node = node
        self.journal = journal
        self.on_action = on_action or (lambda action: None)  # Lead, StepDown, RequestVotes: the sequencer's
        self.on_partition = on_partition or (lambda cut: None)  # drills' fault injection
        self.on_fatal = on_fatal or (lambda why: None)  # the node's state is impossible: it must stop
        self.store = VoteStore(Path(node.data) / "election.json")
        state = self.store.load()
        if not state.found and len(cfg.voters) > 1:
            log.warning("no election state in %s (a new or wiped disk): recovering it from the other voters "
                        "before voting or following", self.store.path)
        # Seeded by the node's name: each voter has its own jitter, the same on every run.
        rng = random.Random(zlib.crc32(node.name.encode()))
        self.endpoint = vn.VoterNode(node.wire_name, [v.wire_name for v in cfg.voters], can_lead, rng,
                                     cfg.election_ms * 1_000_000, state.term, state.voted_for, state.log_floor,
                                     state.found, journal.read(), time.monotonic_ns(), free_space=FREE_SPACE,
                                     marked=journal.commit_mark())
        self.node_core = wrap(self.endpoint) if wrap else self.endpoint
        self.on_other = on_other or (lambda action: [])
        self.core = self.endpoint.core
        self.tick_ns = self.endpoint.tick_ns
        self._wake: asyncio.Future | None = None  # the timer's, while it waits
        self._due = 0
        self.peers = {v.wire_name: v for v in cfg.voters}
        # Fault injection for drills: while DATA/partitioned exists, this node
        # neither accepts nor makes replication connections (both directions cut).
        self.partition_flag = Path(node.data) / "partitioned"
        self.partitioned = False
        self._flag_checked = -(1 << 62)
        self._writers: dict[Hashable, asyncio.StreamWriter] = {}
        self._dialling: set[asyncio.Task] = set()
        self.closed: dict[str, int] = {}  # connections closed for what their peer sent, by reason
        self.link_errors = 0  # connections closed for a link record that did not verify
        self.refused: dict[str, int] = {}  # peers' messages contradicting this node's state, by reason
        self.refusal_log = RateLimitedLog(log)
        self.disk_full_events = 0
        self._space_checked = 0.0
        self._carriers = self._carrier_table()

    # What the sequencer and the metrics read of the core.
    election = property(lambda self: self.core.election)
    log = property(lambda self: self.core.log)
    commit_seq = property(lambda self: self.core.commit_seq)
    appended = property(lambda self: self.core.appended)
    truncations = property(lambda self: self.core.truncations)

    def term_at(self, seq: int) -> int:
        return self.core.term_at(seq)

    @property
    def bad_frames(self) -> int:
        return self.closed.get("bad_frame", 0) + self.closed.get("unexpected_frame", 0) + self.link_errors

    def event(self, conn: Hashable, handler, *args) -> None:
        """One event of the node core, its actions carried out; an impossible state stops the node."""
        try:
            self.act(handler(*args, time.monotonic_ns()), conn)
        except InvariantViolation as e:
            self.on_fatal(str(e))
            return
        self._rearm()

    def act(self, actions: list, conn: Hashable = None) -> None:
        """Carry out the node core's actions in order, what one leads to before the rest. A write
        refused for want of space drops the rest (no reply is sent) for what the node does then."""
        queue = deque(actions)
        while queue:
            try:
                queue.extendleft(reversed(self._carry_out(queue.popleft())))
            except DiskFull as e:
                self.disk_full_events += 1
                log.error("%s; taking no part (no appends, votes or leading) until %d MiB are free on %s",
                          e, FREE_SPACE.resume >> 20, self.journal.dir)
                self._space_checked = time.monotonic()
                queue = deque(self.node_core.on_disk_full(conn, time.monotonic_ns()))

    def _carry_out(self, a) -> list:
        """One action; what it leads to (the node's answer to a read), if anything. By its type:
        an action goes by a dict, not a chain of isinstance (a dozen a batch's every action)."""
        carry = self._carriers.get(type(a))
        if carry is None:
            return self.on_other(a)
        return carry(a) or []

    def _carrier_table(self) -> dict:
        now = time.monotonic_ns
        return {
            vn.Send: self._send,
            vn.AppendRecords: lambda a: self.journal.append(a.records, a.sync),  # durable before the ack
            vn.SyncJournal: lambda a: self.journal.maybe_sync(),
            vn.Persist: lambda a: self.store.save(a.term, a.voted_for, a.log_floor),
            vn.Truncate: self._truncate,
            vn.ReadJournal: lambda a: self.node_core.on_read(
                a, self.journal.read_batch(a.first, a.count) if a.count else [], now()),
            vn.Reload: lambda a: self.node_core.on_log(a, self.journal.read(), now()),
            vn.Resume: lambda a: self.node_core.on_data(a.conn, b"", now()),
            vn.Close: self._close,
            vn.Dial: self._dial,
            vn.Committed: lambda a: None,  # (what waited for it is the node core's to answer)
            vn.MarkCommitted: lambda a: self.journal.mark_committed(a.seq),
            vn.Refused: self._refused,
            vn.Lead: self.on_action, vn.StepDown: self.on_action, vn.RequestVotes: self.on_action,
            vn.Voted: lambda a: log.info("voted for %s in term %d", a.candidate.decode(errors="replace").strip(),
                                         a.term),
            vn.LeaderGone: lambda a: log.warning("the leader's connection closed in term %d: taking it for gone",
                                                 a.term),
            vn.Fetched: lambda a: log.warning("took %d entries from %s to catch up (log now ends at seq %d, term "
                                              "%d)", a.taken, a.peer.decode(errors="replace").strip(), a.last_seq,
                                              a.last_term),
            vn.SpaceLow: self._space_low,
            vn.SpaceBack: lambda a: log.warning("disk space back (%d MiB free on %s): taking part again",
                                                a.free >> 20, self.journal.dir),
            vn.Stalled: lambda a: self.refusal_log.warn(
                "stall", "this process was not running for %.0f ms (CPU starvation, a blocking disk write or a "
                "pause): the election's timers were held for %.0f ms", a.gap_ns / 1e6, a.held_ns / 1e6),
            vn.Recovered: lambda a: log.warning(
                "recovered the election state from %d voters: term %d (no vote in it), votes only for logs at "
                "least at (term %d, seq %d)", a.voters, a.term, *a.log_floor),
        }

    def _send(self, a: vn.Send) -> None:
        if (writer := self._writers.get(a.conn)) is not None:
            writer.write(a.data)

    def _truncate(self, a: vn.Truncate) -> None:
        log.warning("dropping uncommitted suffix after seq %d (conflicts with the leader's log)", a.after_seq)
        self.journal.truncate_after(a.after_seq)

    def _refused(self, a: vn.Refused) -> None:
        self.refused[a.reason] = self.refused.get(a.reason, 0) + 1
        self.refusal_log.warn(a.reason, "refused: %s", a.detail)

    def _close(self, a: vn.Close) -> None:
        if a.reason is not None:
            self.closed[a.reason.value] = self.closed.get(a.reason.value, 0) + 1
            self.refusal_log.warn(a.reason.value, "closing a connection: %s (%s)", a.reason.value, a.detail)
        writer = self._writers.pop(a.conn, None)
        if writer is not None:
            writer.close()

    def report(self, journal_repaired: bool):
        """The metrics every voter serves about its journal, election state and disk."""
        yield "journal_fsyncs", "counter", "journal fsync calls", self.journal.fsyncs
        yield "journal_fsync_seconds", "counter", "time spent in journal fsync", self.journal.fsync_seconds
        yield "term", "gauge", "current term", self.election.term
        yield "journal_repaired", "gauge", "1 if this start found the journal damaged and cut it there", \
            1 if journal_repaired else 0
        yield "recovering", "gauge", "1 while the election state (a wiped disk) is recovered from the other voters", \
            1 if self.core.recovering else 0
        yield "disk_full", "gauge", "1 while a write refused for want of space keeps this node from taking part", \
            1 if self.election.disk_full else 0
        yield "disk_full_events", "counter", "stops for want of space (a write refused, or too little free)", \
            self.disk_full_events
        yield "stalls", "counter", "gaps between election ticks long enough to hold the timers", self.election.stalls
        yield "stalled_seconds", "counter", "time the election's timers were held over stalls", \
            self.election.held_ns / 1e9
        yield "journal_fsync_slow", "counter", f"journal fsyncs longer than {SLOW_FSYNC_S * 1000:.0f} ms", \
            self.journal.slow_fsyncs
        yield "journal_fsync_max_seconds", "gauge", "the longest journal fsync", self.journal.fsync_max_seconds
        yield "journal_unflushed_bytes", "gauge", "journal bytes written but not yet flushed to disk (durability " \
            "replicated: the background flush's backlog)", self.journal.unflushed_bytes

    def _space_low(self, a: vn.SpaceLow) -> None:
        self.disk_full_events += 1
        log.error("disk nearly full: %d KiB free on %s; taking no part (no appends, votes or leading) until "
                  "%d MiB are free", a.free >> 10, self.journal.dir, a.resume_at >> 20)

    def _free_space(self) -> None:
        """The journal's free space to the node core, once a DISK_CHECK_EVERY_S: it decides."""
        now = time.monotonic()
        if now - self._space_checked < DISK_CHECK_EVERY_S:
            return
        self._space_checked = now
        self.event(None, self.node_core.on_free_space, free_bytes(self.journal.dir))

    async def ticks(self) -> None:
        """The node's timer (its next deadline, at least every `tick_ns`: a steady 10 ms tick was a
        hundred wake-ups a second of every voter, idle or not), the journal's interval sync, the
        drills' partition flag and the free space. An event that brings the deadline nearer (a
        commit beat due 5 ms after the commit point moved) wakes it early (`_rearm`)."""
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic_ns()
            self._due = self._next_due(now)
            self._wake = loop.create_future()
            handle = loop.call_later(max(self._due - now, 0) / 1e9, _resolve, self._wake)
            try:
                await self._wake
            finally:
                handle.cancel()
                self._wake = None
            if time.monotonic_ns() >= self._due:  # (else woken for a nearer deadline: wait for that)
                self.tick()

    def _next_due(self, now: int) -> int:
        due = min(self.node_core.next_deadline(now), now + self.tick_ns)
        sync = self.journal.sync_due_s()
        return due if sync is None else min(due, int(sync * 1e9))

    def _rearm(self) -> None:
        if self._wake is not None and self._next_due(time.monotonic_ns()) < self._due:
            _resolve(self._wake)

    def tick(self) -> None:
        self.journal.maybe_sync()  # the "every N ms" policy while no append comes
        self._free_space()
        now = time.monotonic_ns()
        if now - self._flag_checked >= self.tick_ns:  # (a leader's timer fires for every commit beat)
            self._flag_checked = now
            self._partition_flag()
        self.event(None, self.node_core.on_timer)

    def _partition_flag(self) -> None:
        cut = self.partition_flag.exists()
        if cut != self.partitioned:
            self.partitioned = cut
            log.warning("FAULT INJECTION: %s is %s", self.node.name,
                        "cut off from every voter" if cut else "reconnected to the voters")
            if cut:
                for conn in [c for c in self._writers if c in self.endpoint.served or c in self.endpoint.dialed]:
                    self._writers.pop(conn).close()
                    self.event(None, self.node_core.on_closed, conn, False)  # (not the peer's doing)
            self.on_partition(cut)

    # --- connections ---------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection another voter opened. Connections are independent: a stray one cannot
        displace the leader's, and every append and vote request is judged by its term."""
        if self.partitioned:
            writer.close()
            return
        conn = writer
        self._writers[conn] = writer
        self.event(conn, partial(self.node_core.on_connected, peer=links.peer_of(writer)), conn)
        if conn in self._writers:
            links.large_reads(writer)
        await self.read(conn, reader, writer)

    async def read(self, conn: Hashable, reader, writer) -> None:
        """Hand what `conn` brings to the node core until it closes (either end), then say so."""
        closed_by_peer = False
        try:
            if conn in self._writers:
                await links.read_each(reader, lambda data: self.event(conn, self.node_core.on_data, conn, data))
            closed_by_peer = True
        except ProtocolError as e:  # (the link's own records: a frame's errors are the node's)
            self.link_errors += 1
            log.warning("bad replication link record, closing: %s", e)
        except ConnectionError:
            closed_by_peer = True
        except asyncio.CancelledError:
            pass  # shutting down
        finally:
            open_here = self._writers.pop(conn, None) is not None
            writer.close()
            if open_here:
                self.event(None, self.node_core.on_closed, conn, closed_by_peer and not self.partitioned)

    def _dial(self, a: vn.Dial) -> None:
        if self.partitioned:
            asyncio.get_running_loop().call_soon(self.event, None, self.node_core.on_closed, a.conn)
            return
        within = a.within_ns / 1e9 if a.within_ns is not None else self.cfg.election_ms / 1000
        task = asyncio.ensure_future(self._dialled(a.conn, self.peers[a.peer], within))
        self._dialling.add(task)
        task.add_done_callback(self._dialling.discard)

    async def _dialled(self, conn: Hashable, peer: NodeSettings, within: float) -> None:
        """A connection the node asked for, within the time it gave (with keys the peer must
        answer the handshake, which a starved peer may not do within the 0.2 s a bare TCP connect had)."""
        try:
            reader, writer = await links.connect(peer.host, peer.replication_port, self.link_keys,
                                                 self.link_refused, within, peer.wire_name)
        except (OSError, asyncio.TimeoutError):
            self.event(None, self.node_core.on_closed, conn)
            return
        self._writers[conn] = writer
        self.event(conn, partial(self.node_core.on_connected, peer=links.peer_of(writer)), conn)
        await self.read(conn, reader, writer)

    def adopt(self, writer: asyncio.StreamWriter) -> None:
        """A connection of the process's own listener (a rewinder's replay), named by its writer."""
        self._writers[writer] = writer

    def writer(self, conn: Hashable) -> asyncio.StreamWriter | None:
        return self._writers.get(conn)

    def close(self) -> None:
        """Before the journal closes: its commit mark where the node's commit point is."""
        for task in list(self._dialling):
            task.cancel()
        self.act(self.node_core.on_stop(time.monotonic_ns()))


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
