"""The replication endpoint every voter runs (sequencers and rewinders): the
asyncio shell around VoterCore (protocol/voter.py), which decides; this
module carries its actions out (journal, vote file) and moves the frames.

A leader (or a candidate) connects to a voter's replication port. The voter
greets with a hello (term, log position), then answers each append with an
ack (after the records are in its journal, per the fsync policy) and each
vote request with a vote (after its term and vote are on disk). The term
and the vote live in `DATA/election.json`, written atomically and fsynced,
so that a restarted voter never votes twice in a term. A voter that starts
without that file (a new or wiped disk) recovers it first: it greets every
connection and hangs up, and asks every other voter for its hello until all
have answered (ElectionCore, docs/failover.md). A voter whose disk refuses a
write (node/diskspace.py) does the same until there is space again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import zlib
from pathlib import Path
from typing import Callable, NamedTuple

from tape.node import authlink
from tape.node.diskspace import CHECK_EVERY_S, RESUME_FREE_BYTES, DiskFull, free_bytes, no_space
from tape.node.journal_store import SLOW_FSYNC_S
from tape.node.process import within
from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config, Node
from tape.protocol import replication as rep
from tape.protocol.election import ElectionAction, Persist, Refused, RequestVotes, StepDown
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import CONTROL_READ, FETCH_MAX, STALL_SHARE, STREAM_READ
from tape.protocol.voter import AppendRecords, Truncate, VoterCore

log = logging.getLogger("tape.voter")
# The longest wait between election ticks, a share of the stall threshold (election_ms x
# STALL_SHARE: 50 ms by default, so 20 ms): only a process that did not run for the rest counts a stall.
TICK_SHARE_OF_STALL = 0.4


class ElectionState(NamedTuple):
    term: int
    voted_for: bytes | None
    log_floor: tuple[int, int]
    found: bool  # False: no election state on disk (a new or wiped disk)


class VoteStore:
    """(term, voted_for, log floor) on disk."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> ElectionState:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return ElectionState(0, None, (0, 0), False)
        try:
            doc = json.loads(raw)
            voted = doc.get("voted_for")
            floor = doc.get("log_floor", [0, 0])
            return ElectionState(int(doc["term"]), voted.encode("ascii") if voted is not None else None,
                                 (int(floor[0]), int(floor[1])), True)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            # Our own file, written atomically: damage is an impossible state (exit 4, an operator
            # looks: docs/runbook.md, "A disk failed"), never a term guessed.
            raise InvariantViolation(f"{self.path}: unreadable election state ({e!r}); refusing to guess "
                                     "a term") from None

    def save(self, term: int, voted_for: bytes | None, log_floor: tuple[int, int] = (0, 0)) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"term": term, "voted_for": voted_for.decode("ascii") if voted_for else None,
                           "log_floor": list(log_floor)}, f)
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


class Voter:
    def __init__(self, cfg: Config, node: Node, journal, can_lead: bool,
                 on_action: Callable[[ElectionAction], None] | None = None, on_fatal: Callable[[str], None] = None,
                 on_partition: Callable[[bool], None] | None = None, link_refused: dict[str, int] | None = None,
                 on_commit: Callable[[], None] | None = None):
        self.cfg = cfg
        self.link_keys = cfg.cluster_link
        self.link_refused = {} if link_refused is None else link_refused  # shared with the node's metrics
        self.node = node
        self.journal = journal
        self.on_action = on_action or (lambda action: None)  # what the election decided, but Persist
        self.on_partition = on_partition or (lambda cut: None)  # drills' fault injection
        self.on_fatal = on_fatal or (lambda why: None)  # the node's state is impossible: it must stop
        self.on_commit = on_commit or (lambda: None)  # the commit point moved (a rewinder answers what waited)
        self.store = VoteStore(Path(node.data) / "election.json")
        state = self.store.load()
        if not state.found and len(cfg.voters) > 1:
            log.warning("no election state in %s (a new or wiped disk): recovering it from the other voters "
                        "before voting or following", self.store.path)
        lo = cfg.election_ms * 1_000_000
        # Seeded by the node's name: each voter has its own jitter, the same on every run.
        rng = random.Random(zlib.crc32(node.name.encode()))
        now = time.monotonic_ns()
        self.core = VoterCore(node.wire_name, [v.wire_name for v in cfg.voters], can_lead, rng, (lo, 2 * lo),
                              state.term, state.voted_for, now, journal.read(), not state.found, state.log_floor,
                              int(lo * STALL_SHARE))
        self.tick_s = lo * STALL_SHARE * TICK_SHARE_OF_STALL / 1e9
        # The first election comes sooner: pre-votes keep a restarted node from disrupting a live leader.
        self.election.deadline = now + rng.randint(lo // 4, lo // 2)
        self.committed = asyncio.Event()  # set and cleared whenever the commit point moves
        # Fault injection for drills: while DATA/partitioned exists, this node
        # neither accepts nor makes replication connections (both directions cut).
        self.partition_flag = Path(node.data) / "partitioned"
        self.partitioned = False
        self._conns: set[asyncio.StreamWriter] = set()
        self.bad_frames = 0
        self.refused: dict[str, int] = {}  # peers' messages contradicting this node's state, by reason
        self.refusal_log = RateLimitedLog(log)
        self.disk_full_events = 0
        self._space_checked = 0.0

    # What the sequencer and the metrics read of the core.
    election = property(lambda self: self.core.election)
    log = property(lambda self: self.core.log)
    commit_seq = property(lambda self: self.core.commit_seq)
    appended = property(lambda self: self.core.appended)
    truncations = property(lambda self: self.core.truncations)

    def term_at(self, seq: int) -> int:
        return self.core.term_at(seq)

    def act(self, actions: list, sync: bool = True) -> None:
        """Carry out a core's actions in order: the journal and the vote are durable before any
        reply (sync=False: the caller syncs the journal before it replies). A write refused for
        want of space stops this voter taking part (DiskFull is raised on: the reply must not be
        sent)."""
        try:
            self._carry_out(actions, sync)
        except DiskFull as e:
            self.disk_full(e)
            raise

    def _carry_out(self, actions: list, sync: bool) -> None:
        truncated = False
        for action in actions:
            if isinstance(action, Persist):
                self.store.save(action.term, action.voted_for, action.log_floor)
            elif isinstance(action, Truncate):
                log.warning("dropping uncommitted suffix after seq %d (conflicts with the leader's log)",
                            action.after_seq)
                self.journal.truncate_after(action.after_seq)
                truncated = True
            elif isinstance(action, AppendRecords):
                self.journal.append(action.records, sync)  # durable before the ack, per the fsync policy
            elif isinstance(action, Refused):
                self.refused[action.reason] = self.refused.get(action.reason, 0) + 1
                self.refusal_log.warn(action.reason, "refused: %s", action.detail)
            else:
                self.on_action(action)
        if truncated:
            self.core.rebuild_log(self.journal.read())

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
        yield "disk_full_events", "counter", "writes refused for want of space", self.disk_full_events
        yield "stalls", "counter", "gaps between election ticks long enough to hold the timers", self.election.stalls
        yield "stalled_seconds", "counter", "time the election's timers were held over stalls", \
            self.election.held_ns / 1e9
        yield "journal_fsync_slow", "counter", f"journal fsyncs longer than {SLOW_FSYNC_S * 1000:.0f} ms", \
            self.journal.slow_fsyncs
        yield "journal_fsync_max_seconds", "gauge", "the longest journal fsync", self.journal.fsync_max_seconds

    def disk_full(self, e: DiskFull) -> None:
        """Stop leading (the node's shell first: it hands its client seqs to the log), then take
        no part until there is space again (tick)."""
        self.disk_full_events += 1
        log.error("%s; taking no part (no appends, votes or leading) until %d MiB are free on %s",
                  e, RESUME_FREE_BYTES >> 20, self.journal.dir)
        self.on_action(StepDown("disk full"))
        for action in self.core.on_disk_full(self.journal.read()):
            self.on_action(action)  # (Persist is never among them: nothing can be written)
        self._space_checked = time.monotonic()

    def _space_back(self) -> None:
        now = time.monotonic()
        if now - self._space_checked < CHECK_EVERY_S:
            return
        self._space_checked = now
        free = free_bytes(self.journal.dir)
        if free >= RESUME_FREE_BYTES:
            log.warning("disk space back (%d MiB free on %s): taking part again", free >> 20, self.journal.dir)
            self.core.on_disk_ok(time.monotonic_ns())

    async def ticks(self) -> None:
        """The election's clock, the drills' partition flag and the free space: at the election's
        next deadline, and at least every `tick_s` (a steady 10 ms tick was a hundred wake-ups a
        second of every voter, idle or not)."""
        while True:
            deadline = self.election.next_deadline_ns()
            wait = self.tick_s if deadline is None else (deadline - time.monotonic_ns()) / 1e9
            await asyncio.sleep(min(max(wait, 0.0), self.tick_s))
            self.tick()

    def tick(self) -> None:
        if self.core.election.disk_full:
            self._space_back()
        cut = self.partition_flag.exists()
        if cut != self.partitioned:
            self.partitioned = cut
            log.warning("FAULT INJECTION: %s is %s", self.node.name,
                        "cut off from every voter" if cut else "reconnected to the voters")
            if cut:
                for w in list(self._conns):
                    w.close()
            self.on_partition(cut)
        stalls, held = self.election.stalls, self.election.held_ns
        self.act(self.election.on_tick(time.monotonic_ns()))
        if self.election.stalls != stalls:
            self.refusal_log.warn("stall", "this process was not running for %.0f ms (CPU starvation, a blocking "
                                  "disk write or a pause): the election's timers were held for %.0f ms",
                                  (self.election.held_ns - held) / 1e6 + self.election.stall_ns / 1e6,
                                  (self.election.held_ns - held) / 1e6)

    def note_own(self, first_seq: int, last_seq: int, term: int, sealed: bool = False) -> None:
        self.core.note_own(first_seq, last_seq, term, sealed)

    def resync(self, commit_seq: int, client_last: dict[bytes, int]) -> None:
        """After leading: follow again from what the journal holds."""
        self.core.resync(commit_seq, client_last)

    # --- the replication port -------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Connections are independent: a stray one cannot displace the leader's,
        # and every append and vote request is judged by its term.
        if self.partitioned:
            writer.close()
            return
        self._conns.add(writer)
        writer.write(rep.encode_hello(*self.core.hello()))
        if self.core.absent:  # a greeting is all a recovering voter (or one whose disk is full) gives
            self._conns.discard(writer)
            writer.close()
            return
        frames = rep.FrameReader()
        closed_by_peer = False
        authlink.large_reads(writer)
        def on_read(data: bytes) -> None:
            writer.write(self._on_read(frames.feed(data), writer))

        try:
            await authlink.read_each(reader, on_read)
            closed_by_peer = True
        except ProtocolError as e:
            self.bad_frames += 1
            log.warning("bad replication frame, closing: %s", e)
        except InvariantViolation as e:
            self.on_fatal(str(e))
        except DiskFull:
            pass  # undone and logged (disk_full): no reply, the connection closes
        except ConnectionError:
            closed_by_peer = True
        except asyncio.CancelledError:
            pass  # shutting down
        finally:
            self._conns.discard(writer)
            writer.close()
            if self.core.on_closed(writer, closed_by_peer and not self.partitioned, time.monotonic_ns()):
                log.warning("the leader's connection closed in term %d: taking it for gone", self.election.term)

    def _on_read(self, frames, conn) -> bytes:
        """The replies to one read's frames, sent after one fsync covers all their appends: a
        leader ahead of this voter has sent many by the time it reads (group commit)."""
        try:
            return b"".join([self._on_frame(fr, conn) for fr in frames])
        finally:  # before the loop runs anything else: no hello or reply counts unsynced records
            self.journal.maybe_sync()

    def _on_frame(self, fr, conn) -> bytes:
        """The reply to one frame, after its actions are carried out (its appends written, not
        yet synced: _on_read)."""
        now = time.monotonic_ns()
        if isinstance(fr, rep.Append):
            before = self.core.commit_seq
            reply, actions = self.core.on_append(fr, conn, now)
            self.act(actions, sync=False)  # a leader seeing a higher term steps down here, before following
            if self.core.commit_seq != before:
                self.committed.set()
                self.committed.clear()
                self.on_commit()
            return rep.encode_ack(*reply)
        if isinstance(fr, rep.VoteRequest):
            reply, actions = self.core.on_vote_request(fr, now)
            self.act(actions)  # the vote is on disk before it is sent
            if self.election.voted_for == fr.candidate and not fr.pre and self.election.term == fr.term:
                log.info("voted for %s in term %d", fr.candidate.decode(errors="replace").strip(), fr.term)
            return rep.encode_vote(*reply)
        if isinstance(fr, rep.Fetch):
            return self.on_fetch(fr)
        raise ProtocolError("unexpected", f"{type(fr).__name__} frame on a voter's port", 0)

    def on_fetch(self, f: rep.Fetch) -> bytes:
        """Our own log from f.from_seq, if it continues the asker's; ends with an empty append."""
        start = self.core.fetch_start(f)
        e = self.election
        if start is None:
            prev = min(max(f.from_seq - 1, 0), self.core.last_seq)
            return rep.encode_append(e.term, self.node.wire_name, prev, self.term_at(prev), self.commit_seq, e.term, [])
        prev, prev_term = start
        records = self.journal.read_batch(f.from_seq, FETCH_MAX)
        out = rep.encode_runs(e.term, self.node.wire_name, prev, prev_term, self.commit_seq, records)
        if records:
            prev = records[-1][0]
        return out + rep.encode_append(e.term, self.node.wire_name, prev, self.term_at(prev), self.commit_seq,
                                       e.term, [])

    async def _connect(self, voter: Node):
        """A link for a vote or a fetch, within an election timeout: with keys the peer must answer
        the handshake, which a starved peer may not do within the 0.2 s a bare TCP connect had."""
        return await authlink.connect(voter.host, voter.replication_port, self.link_keys, self.link_refused,
                                      self.cfg.election_ms / 1000)

    async def fetch_from(self, voter: Node) -> int:
        """Extend our log with what `voter` holds beyond it (entries its
        leaders wrote: taking them is what their appends would have done).
        A sequencer behind a voter that cannot lead needs this to become
        electable when the leader died after replicating its last batch
        only to the rewinders. Returns how many entries were taken."""
        taken = 0
        try:
            reader, writer = await self._connect(voter)
        except (OSError, asyncio.TimeoutError):
            return 0
        try:
            writer.write(rep.encode_fetch(*self.core.fetch_from_seq()))
            frames = rep.FrameReader()
            while True:
                data = await within(reader.read(STREAM_READ), 2.0)
                if not data:
                    return taken
                for fr in frames.feed(data):
                    if not isinstance(fr, rep.Append):
                        continue
                    if not fr.count:
                        return taken  # the end
                    cut = self.core.fetched_conflict(fr)
                    if cut is not None:
                        self.act([Truncate(cut)])
                    records = self.core.take_fetched(fr)
                    if records is None:
                        return taken  # a leader appeared, or the logs do not line up
                    try:
                        self.journal.append(records)
                    except DiskFull as e:
                        self.disk_full(e)
                        return taken
                    taken += len(records)
        except (OSError, asyncio.TimeoutError, ProtocolError):
            return taken
        finally:
            writer.close()
            if taken:
                log.warning("took %d entries from %s to catch up (log now ends at seq %d, term %d)", taken,
                            voter.name, self.core.last_seq, self.core.last_term)

    # --- recovering the election state -----------------------------------------------

    async def recover(self) -> None:
        """Until every other voter has greeted this one: ask those not yet heard, a round per
        half election timeout. Returns at once if the election state was on disk."""
        others = [n for n in self.cfg.voters if n.name != self.node.name]
        while self.core.recovering:
            heard = self.election.heard
            await asyncio.gather(*(self._greeting(n) for n in others if n.wire_name not in heard))
            if self.core.recovering:
                await asyncio.sleep(self.cfg.election_ms / 2000)
        e = self.election
        log.warning("recovered the election state from %d voters: term %d (no vote in it), votes only for logs "
                    "at least at (term %d, seq %d)", len(others), e.term, *e.log_floor)

    async def _greeting(self, voter: Node) -> None:
        """Connect to `voter`, take its hello, hang up."""
        try:
            reader, writer = await self._connect(voter)
        except (OSError, asyncio.TimeoutError):
            return
        try:
            frames = rep.FrameReader()
            while self.core.recovering:
                data = await within(reader.read(CONTROL_READ), self.cfg.election_ms / 1000)
                if not data:
                    return
                hello = next((fr for fr in frames.feed(data) if isinstance(fr, rep.Hello)), None)
                if hello is not None:
                    self.act(self.core.on_peer_hello(hello, time.monotonic_ns()))
                    return
        except (OSError, asyncio.TimeoutError, ProtocolError, DiskFull):
            pass  # (DiskFull: undone and logged by act)
        finally:
            writer.close()

    # --- campaigning -------------------------------------------------------------------

    async def request_votes(self, r: RequestVotes) -> None:
        """Ask every other voter, each over a connection of its own; votes feed the election as they come."""
        if self.partitioned:
            return
        others = [n for n in self.cfg.voters if n.name != self.node.name]
        await asyncio.gather(*(self._ask(n, r.pre, r.term, r.last_seq, r.last_term) for n in others))

    async def _ask(self, voter: Node, pre: bool, term: int, last_seq: int, last_term: int) -> None:
        try:
            reader, writer = await self._connect(voter)
        except (OSError, asyncio.TimeoutError):
            return
        try:
            writer.write(rep.encode_vote_request(term, self.node.wire_name, last_seq, last_term, pre))
            frames = rep.FrameReader()
            hello = None
            deadline = time.monotonic() + self.cfg.election_ms / 1000
            while time.monotonic() < deadline:
                data = await within(reader.read(CONTROL_READ), deadline - time.monotonic())
                if not data:
                    return
                for fr in frames.feed(data):
                    if isinstance(fr, rep.Vote):
                        self.act(self.election.on_vote(fr.term, fr.voter, fr.granted, fr.pre, time.monotonic_ns()))
                        if not fr.granted and hello is not None and self.election.leader is None and \
                                (hello.last_term, hello.last_seq) > (self.core.last_term, self.core.last_seq):
                            await self.fetch_from(voter)  # refused for being behind: catch up for the next round
                        return
                    if isinstance(fr, rep.Hello):
                        hello = fr
                        self.act(self.election.on_higher_term(fr.term, fr.node, time.monotonic_ns()))
        except (OSError, asyncio.TimeoutError, ProtocolError, DiskFull):
            pass  # (DiskFull: undone and logged by act)
        finally:
            writer.close()
