"""Deterministic simulation of the whole protocol (DESIGN.md section 10).

The node cores the processes run -- SequencerNode and RewinderNode (each
around a VoterNode, every voter's replication endpoint), ReplicaNode,
EmitterNode and ClientNode (the client library's) -- in one process on a
seeded virtual network and clock, with the processes' election timeouts.
Replication, alert and replay links are connections carrying the real
frames' bytes inside link records with keys: ordered and never lost, held
across a partition until it heals, closed when a process dies; datagrams
(the stream, gap fills, inbound trades, back-offs) are delayed, dropped,
duplicated and reordered. Voters crash (keeping their log and vote), some in
the middle of a journal write (torn), lose their disks or a bit of one, or
(durability "replicated", half the seeds) lose power with what their journal
had not yet flushed in the background, find
them full, pause, run slow and are cut off by partitions (both ways or one);
three replicas crash and resume from their snapshots, lose their disks, or
have their state corrupted (outvoted on their digest, they rebuild); the
emitter crashes at its crash points; a leader is overloaded (its inbound
socket never emptied), so that it tells clients to back off and they pause;
all at times chosen by the seed. After the faults the network heals and the
run goes on until every trade is acknowledged, every replica has applied the
log and every alert is delivered; DESIGN.md section 9 is checked as it runs
and at the end.

    tape sim --seeds 1000            # seeds 1..1000
    tape sim --first 4711 --seeds 1 -v
"""

from __future__ import annotations

import functools
import heapq
import logging
import os
import random
import shutil
import tempfile
from collections import Counter, deque
from pathlib import Path

from tape.ops.verification.reference import expected_alerts
from tape.ops.verification.tradegen import TradeGenerator
from tape.ops.verification.verdict import RunFiles, judge
from tape.protocol import backoff, moldudp64
from tape.protocol import journal as fmt
from tape.protocol import messages as M
from tape.protocol import soupbintcp as soup
from tape.protocol.actions import Close, Send
from tape.protocol.election import Persist, Refused
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import REPLAY_BEHIND
from tape.protocol.linkauth import ANY_LISTENER, NONCE_SIZE, LinkEnd, LinkKeys, pair_key
from tape.protocol.listener import Deliver, Undecodable
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import ListenerKeys, StreamKeys
from tape.protocol.voter_node import (
    AppendRecords,
    Dial,
    MarkCommitted,
    ReadJournal,
    Reload,
    Resume,
    SpaceBack,
    SpaceLow,
    Truncate,
    VoterNode,
)
from tape.replicas.audit_core import ALERT_SIZE, Alert, AuditMachine
from tape.replicas.emitter_core import CRASH_POINTS, emit_seq_of
from tape.replicas.emitter_node_core import (
    Crash,
    DeliverAlerts,
    Divergence,
    EmitterNode,
    LookUp,
    RecordDone,
    RecordIntent,
    Redeliver,
    Why,
)
from tape.replicas.replica_node_core import Applied, AskRewinder, Rebuild, ReplicaNode, TakeSnapshot
from tape.replicas.snapshot import open_verified
from tape.rewinder.rewinder_node_core import ReadGap, ReplayRecords, RewinderNode, SendDatagram
from tape.runtime.config import role_of_name
from tape.runtime.settings import Config, default_of, may_link
from tape.runtime.storage import journal_store
from tape.runtime.storage.journal_repair import open_checked
from tape.runtime.tuning import DISK_CHECK_EVERY_S, FREE_SPACE
from tape.runtime.voter_shell import VoteStore
from tape.sequencer.client_node_core import ClientNode, Delivered, Recovered, SendInbound
from tape.sequencer.sequencer_node_core import (
    Advise,
    Drain,
    EndOfSession,
    Journal,
    LeaderSettings,
    Led,
    Publish,
    Replicate,
    SequencerNode,
    Stamp,
    StampNow,
)

MS = 1_000_000
SIM_LOG = logging.getLogger("tape.sim")
# Odd seeds' leaders pace their batches (sequencer/leader_core.py batch_due_ns) after one of this many
# messages (a client's batch here holds a few; the processes' threshold is 256).
PACE_FROM = 3
PACED_INTERVAL_NS = 10 * MS
SESSION = moldudp64.session_bytes("SIM")
STREAM_KEY = b"sim stream key, 32 bytes long..."
LISTENER_KEY = b"sim listener key, 32 bytes long."
STREAM_KEYS = StreamKeys([STREAM_KEY])  # a replica's: it checks the seals' tags
VOTER_STREAM_KEYS = StreamKeys([STREAM_KEY], listeners=[LISTENER_KEY])  # a leader tags for clients too
CLIENT_KEYS = ListenerKeys([LISTENER_KEY])  # a client's: it checks the listener tags, and can seal nothing
# Every connection runs the link records with keys (protocol/linkauth.py), as a cluster with keys
# does: replication and alert links each pair's key (derived from this), replay connections the stream key's.
CLUSTER_KEY = b"sim cluster key, 32 bytes long.."
REPLAY_LINK_KEYS = LinkKeys([STREAM_KEY])
SEQUENCERS = ("seq-a", "seq-b")
REWINDERS = ("rw-1", "rw-2")
VOTERS = SEQUENCERS + REWINDERS
CLIENTS = ("c0", "c1")
REPLICAS = ("replica-A", "replica-B", "replica-C")  # as a cluster runs them: two outvote a third
EMITTER = "emitter"
LAN = (*VOTERS, *CLIENTS, *REPLICAS, EMITTER)  # every node, in the order of its address
# With the processes' election timeouts (300-600 ms), faults over 3 s: as many terms a seed as
# 1.5 s gave with timeouts of half that.
FAULTS_UNTIL = 3000 * MS
FAULTS_PER_RUN = (2, 8)
FAULT_KINDS = ("crash", "pause", "partition", "isolate", "garbage", "crash-emitter", "crash-client", "wipe", "full",
               "overload", "slow", "crash-replica", "wipe-replica", "one-way", "corrupt-replica", "corrupt-journal")
# A connection's bytes as TCP hands them to the reader: a write joins the one before it if that
# one is not read yet, or comes in two pieces.
COALESCE, SPLIT = 0.5, 0.2
DISK_CHECK_NS = int(DISK_CHECK_EVERY_S * 1e9)
FREE_DISK = 1 << 30  # a voter's disk has this much free but while a disk-full fault lasts (none)
SLOW_NS = (10 * MS, 150 * MS)  # what a slow host (starved, its disk or link congested) adds to a connection's bytes
GIVE_UP = 60_000 * MS
TWO_DISKS_LOST = 0.5  # the chance that a disk loss takes two voters' disks at once
# Durability "replicated" (half the seeds, by seed: not drawn): a voter's journal flushes in the
# background at the default interval or ten times as often, and the first crash of a voter is a
# power loss of its host a millisecond after its next append (acknowledged, not yet flushed), which
# takes what was not flushed: a loss of durable state, as many a run as disks lost (one host at a
# time is what the mode survives: docs/failover.md).
FLUSH_INTERVALS_NS = (default_of(Config, "flush_ms") * MS, 5 * MS)
SIM_SEGMENT_BYTES = 4096  # a voter's journal segments (the processes' 64 MiB): a run here rolls through several
# A third of the seeds' replicas catch up over a replay once this many are missing (the processes'
# REPLAY_BEHIND, 2,000, is more than a run here sequences).
SIM_REPLAY_BEHIND = 12
# A fifth of the seeds' rewinders answer this few gap requests (the processes' budgets, 2,000 a
# second a host and 3,000 in all, are more than a run here asks): refused, a listener asks again.
SIM_GAPFILL_BUDGETS = {"rate_per_s": 40.0, "burst": 8.0, "total_rate_per_s": 60.0, "total_burst": 12.0}
# The replicas' digests fold every this many seqs (the processes' 4,096, more than a run here sequences).
SIM_FOLD_EVERY = 32
# A client submits 1-8 trades a tick (5 ms) with this chance: its 60 trades span most of the faults' time.
SUBMIT_CHANCE = 0.03
# The processes' defaults (runtime/settings.py): the simulator runs the policies as configured.
GAP_REQUEST_NS = default_of(Config, "gap_request_ms") * MS
RESEND_NS = default_of(Config, "client_resend_ms") * MS
LEADER_BEAT_NS = default_of(Config, "leader_heartbeat_ms") * MS
ELECTION_NS = default_of(Config, "election_ms") * MS
TICK_NS = default_of(Config, "tick_ms") * MS
HEARTBEAT_NS = default_of(Config, "heartbeat_ms") * MS
# Two seeds in three tick every 100 ms (as `stream.tick_ms = 100` would): an idle leader then
# stamps while the faults run, so a leader cut off holds entries no one else does more often.
EXPLORED_TICK_NS = 100 * MS
# A quarter of the seeds' leaders stamp a batch as soon as this many messages are pending (the
# processes' cap, 65,536, is more than a run here sequences): a drain's batches then come mid-drain.
SIM_MAX_BATCH = 4


def wire(name: str) -> bytes:
    return moldudp64.session_bytes(name)


@functools.cache
def link_keys(name: str, port: str) -> LinkKeys:
    """`name`'s keys on a connection to or from `port`: a pair's for replication and alerts, as
    `Config.links_of` gives a node (only the peers its role links with), the stream key for replay."""
    if port == "replay":
        return REPLAY_LINK_KEYS
    return LinkKeys(peers={wire(p): [pair_key(CLUSTER_KEY, name, p)] for p in LAN
                           if p != name and may_link(role_of_name(name), role_of_name(p))})


def address(name: str) -> tuple[str, int]:
    """A node's (IPv4, port) on the simulated LAN: where gap-fill answers go, signed into requests."""
    return f"10.0.0.{LAN.index(name) + 1}", 7000


ADDRESSES = {address(name): name for name in LAN}  # and back


def name_of(wire_name: bytes) -> str:
    return moldudp64.session_name(wire_name)


class Violation(AssertionError):
    pass


class Crashed(Exception):
    """A node died while handling an event: the rest of the event never happens."""


class DiskIsFull(Exception):
    """A voter's write was refused for want of space: the rest of the event, its reply
    included, never happens (runtime/voter_shell.py raises DiskFull the same way)."""


class SimVoter:
    """A sequencer or rewinder: the node core the process runs (SequencerNode or RewinderNode,
    each around its VoterNode) over the replication links' bytes, its journal and its vote.
    Durable: the log and the vote; volatile everything else."""

    def __init__(self, sim: "Sim", name: str):
        self.sim, self.name, self.wire = sim, name, wire(name)
        self.can_lead = name in SEQUENCERS
        self.dir = sim.disk / name  # its disk: the journal (the store's own files) lives here
        self.journal: journal_store.Journal | None = None
        self.log: list[tuple[int, bytes]] = []  # (term, message) at seq i + 1: what its journal must hold
        self.votes = VoteStore(self.dir / "election.json")  # the processes' own file (none on a new or wiped disk)
        self.checked = 0  # seqs of the committed log already checked against what was published
        self.up = True
        self.full_until = 0  # a fault: the disk refuses writes and has no space free until then
        self.space_checked = -DISK_CHECK_NS  # when the shell last told the node its free space
        self.clock_skew = sim.rng.randrange(-200, 201) * MS  # hosts' clocks differ: stamps must not go backwards
        self.restart()

    def clock(self) -> int:
        """The host's wall clock (stamps); its monotonic clock is the simulation's."""
        return self.sim.now + self.clock_skew

    def records(self) -> list:
        return list(self.journal.read())

    def open_journal(self) -> None:
        """The journal as the process opens it (runtime/storage/journal_repair.py): the store's own recovery
        cuts a torn tail, what is left must be what the voter wrote whole; a damaged record is cut
        there with what follows, and the election state set aside (a disk lost from that point)."""
        # (no fdatasync: on this disk a write is durable once made, and a crash tears only what the fault says)
        self.journal, held, damage = open_checked(
            lambda: journal_store.Journal(self.dir / "journal", SESSION, segment_bytes=SIM_SEGMENT_BYTES,
                                          fsync="never"),
            self.dir, lambda journal: [(t, m) for _, t, m in journal.read()])
        if held != (self.log[:len(held)] if damage else self.log):
            raise Violation(f"{self.name}'s journal, reopened, is not the {len(self.log)} entries written whole")
        if damage:
            self.sim.trace.append(f"  {self.name}'s journal cut at its damage: {len(held)} of {len(self.log)} kept")
            self.log, self.checked = held, min(self.checked, len(held))

    def damage_journal(self) -> None:
        """A bit of a record on its disk flips (the process is down): found when it starts. Not
        in the journal's last record, which a flip makes look torn (docs/failover.md)."""
        segments = journal_store.Journal(self.dir / "journal", readonly=True).segments
        spans = [(seg.path, seg.size) for seg in segments if seg.size > fmt.SEGMENT_HEADER_SIZE]
        if spans and self.log:
            path, size = spans[-1]
            spans[-1] = path, size - len(fmt.encode_record(len(self.log), *self.log[-1]))
            spans = [(path, size) for path, size in spans if size > fmt.SEGMENT_HEADER_SIZE]
        if spans:
            path, size = self.sim.rng.choice(spans)
            with open(path, "r+b") as f:
                f.seek(self.sim.rng.randrange(fmt.SEGMENT_HEADER_SIZE, size))
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 1 << self.sim.rng.randrange(8)]))

    @property
    def unflushed(self) -> int:
        return len(self.log) - self.flushed

    def lose_unflushed(self) -> None:
        """Its host lost power (the process is down): what the background flush had not written is
        gone, the commit mark as it was (not synced: it may be ahead of the journal now)."""
        with journal_store.Journal(self.dir / "journal", SESSION, segment_bytes=SIM_SEGMENT_BYTES,
                                   fsync="never") as journal:
            journal.truncate_after(self.flushed)
        del self.log[self.flushed:]
        self.checked = min(self.checked, self.flushed)

    def lose_disk(self) -> None:
        """The disk is gone (the process is down): it restarts empty, with no election state."""
        self.log, self.checked = [], 0
        shutil.rmtree(self.dir, ignore_errors=True)

    def close_journal(self) -> None:
        """The process stops (or dies: with a sync per append, what it wrote is on the disk)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    def restart(self) -> None:
        """A process (re)starting on its durable state: the log and the vote."""
        self.close_journal()
        self.open_journal()
        state = self.votes.load()
        rng = random.Random(self.sim.rng.random())
        endpoint = VoterNode(self.wire, [wire(v) for v in VOTERS], self.can_lead, rng, ELECTION_NS, state.term,
                             state.voted_for, state.log_floor, state.found, self.records(), self.sim.now,
                             free_space=FREE_SPACE, marked=self.journal.commit_mark())
        if self.can_lead:
            settings = LeaderSettings(SESSION, {wire(c): None for c in CLIENTS}, default_of(Config, "max_packet"),
                                      self.sim.tick_ns, HEARTBEAT_NS, self.sim.batch_interval_ns, LEADER_BEAT_NS,
                                      VOTER_STREAM_KEYS, pace_from=PACE_FROM, max_batch=self.sim.max_batch,
                                      client_hosts=frozenset(address(c)[0] for c in CLIENTS))
            self.node = SequencerNode(endpoint, settings, [wire(v) for v in VOTERS if v != self.name])
        else:
            self.node = RewinderNode(endpoint, SESSION, default_of(Config, "max_packet"), VOTER_STREAM_KEYS,
                                     GAP_REQUEST_NS, SIM_GAPFILL_BUDGETS if self.sim.seed % 5 == 2 else None)
        self.core, self.election = self.node.core, self.node.election
        self.torn_write: int | None = None  # a fault: crash (until then) in the middle of the next journal write
        self.wake_at = self.sim.now
        self.flushed, self.flushed_at = len(self.log), self.sim.now  # entries on the disk (the rest in memory)
        self.power_loss_at_append: int | None = None  # a fault: its host's power goes after its next append

    @property
    def leader(self):
        """Its LeaderCore while it leads."""
        return self.node.leader if self.can_lead else None

    @property
    def commit_seq(self) -> int:
        return self.node.commit_seq

    def write(self) -> None:
        """Before any durable write: a full disk refuses it (runtime/voter_shell.py's DiskFull)."""
        if self.sim.now >= self.full_until:
            return
        if not self.election.disk_full:
            self.sim.trace.append(f"  {self.name} finds its disk full")
        raise DiskIsFull(self.name)

    def act(self, actions: list, conn=None) -> None:
        """Carry out the node core's actions as the voter shell does (runtime/voter_shell.py): in order,
        what one leads to before the rest; a refused write drops the rest for the node's answer."""
        queue = deque(actions)
        while queue:
            try:
                queue.extendleft(reversed(self.carry_out(queue.popleft())))
            except DiskIsFull:
                self.space_checked = self.sim.now
                queue = deque(self.node.on_disk_full(conn, self.sim.now))

    def carry_out(self, a) -> list:
        now = self.sim.now
        if isinstance(a, Send):
            self.sim.stream(self.name, a.conn, a.data)
        elif isinstance(a, AppendRecords):
            self.append(a.records)
        elif isinstance(a, Persist):
            self.write()
            self.votes.save(a.term, a.voted_for, a.log_floor)
        elif isinstance(a, Truncate):
            if a.after_seq < self.journal.commit_mark():  # (a journal cut for damage refills behind it: not this)
                raise Violation(f"{self.name} cut its journal after seq {a.after_seq}, below its commit mark "
                                f"{self.journal.commit_mark()}")
            self.journal.truncate_after(a.after_seq)
            del self.log[a.after_seq:]
            self.flushed = min(self.flushed, a.after_seq)
        elif isinstance(a, ReadJournal):
            return self.node.on_read(a, self.journal.read_batch(a.first, a.count) if a.count else [], now)
        elif isinstance(a, Reload):
            return self.node.on_log(a, self.records(), now)
        elif isinstance(a, Resume):
            return self.node.on_data(a.conn, b"", now)
        elif isinstance(a, Close):
            if a.reason is not None:  # the simulated peers are honest: a broken rule
                raise Violation(f"{self.name} closed a connection: {a.reason.value} ({a.detail})")
            self.sim.hang_up(self.name, a.conn)
        elif isinstance(a, Dial):
            self.sim.dial(self.name, a.conn, name_of(a.peer))
        elif isinstance(a, MarkCommitted):
            if a.seq > self.commit_seq:
                raise Violation(f"{self.name} marked seq {a.seq} committed, its commit point {self.commit_seq}")
            self.journal.mark_committed(a.seq)
        elif isinstance(a, Refused):  # the simulated peers are honest: this is a broken rule
            raise Violation(f"{self.name} refused: {a.detail}")
        elif isinstance(a, (SpaceLow, SpaceBack)):
            self.sim.trace.append(f"  {self.name} {'stops, disk full' if isinstance(a, SpaceLow) else 'resumes'}")
        elif self.can_lead:
            return self.carry_out_leading(a)
        else:
            return self.carry_out_rewinding(a)
        return []  # (RequestVotes: its dials follow; Committed: the node answers what waited; the rest: logs)

    def carry_out_leading(self, a) -> list:
        """The sequencer node's own actions, as sequencer/sequencer_shell.py carries them out."""
        now = self.sim.now
        if isinstance(a, Replicate):
            for conn in a.conns:
                self.sim.stream(self.name, conn, a.frame)
            return self.node.on_replicated(a, [0] * len(a.conns), now)
        if isinstance(a, Journal):
            self.append(a.batch.records())  # after replicating the batch: only followers may hold it
            return self.node.on_journaled(a.batch, now)
        if isinstance(a, StampNow):
            return self.node.on_stamp(self.clock(), now)
        if isinstance(a, Publish):
            self.sim.publish(self.name, a.packets)
        elif isinstance(a, Stamp):
            self.sim.at(max(a.due, now), self.sim.deliver, self.name, self.name, ("stamp",))
        elif isinstance(a, Drain):  # (a connection's queue here drains within a millisecond)
            self.sim.at(now + MS, self.sim.deliver, self.name, self.name, ("drained", a.conn))
        elif isinstance(a, Advise):
            self.sim.send(self.name, a.source, ("advice", a.data))
        elif isinstance(a, EndOfSession):
            for i in range(a.repeats):
                self.sim.at(now + i * a.interval_ns, self.sim.publish, self.name, [a.packet])
            self.sim.end_published = now + (a.repeats - 1) * a.interval_ns + 1
        elif isinstance(a, Led):
            known = self.sim.leaders.setdefault(a.term, self.name)
            if known != self.name:
                raise Violation(f"two leaders in term {a.term}: {known} and {self.name}")
        return []  # (Dropped: the garbage fault's; SteppedDown, FollowerJoined: logs)

    def carry_out_rewinding(self, a) -> list:
        """The rewinder node's own actions, as rewinder/rewinder_shell.py carries them out."""
        now = self.sim.now
        if isinstance(a, SendDatagram):
            self.sim.send(self.name, ADDRESSES[a.addr], ("packet", a.data))
        elif isinstance(a, ReplayRecords):  # as SoupBinTCP frames, drained at once
            records = self.journal.read_batch(a.first, a.count)
            self.sim.stream(self.name, a.conn, b"".join([soup.sequenced(m) for _, _, m in records]))
            return self.node.on_replayed(a, now)
        elif isinstance(a, ReadGap):
            return self.node.on_gap_read(a, [m for _, _, m in self.journal.read_batch(a.first, a.count)], now)
        return []

    def append(self, records) -> None:
        self.write()
        if records[0][0] != len(self.log) + 1:
            raise Violation(f"{self.name} appends seq {records[0][0]} after {len(self.log)}")
        if self.torn_write is not None:
            self.tear(records)  # no ack: the process dies mid-write
        self.journal.append(records)
        self.log.extend((term, m) for _, term, m in records)
        if not self.sim.replicated:  # (durability "flush": on the disk before any ack)
            self.flushed = len(self.log)
        elif self.power_loss_at_append is not None:
            self.sim.at(self.sim.now + MS, self.sim.power_loss, self.name, self.power_loss_at_append)
            self.power_loss_at_append = None

    def tear(self, records: list) -> None:
        """The process dies in the middle of writing `records`: a prefix of them reached the
        disk (the journal's recovery cuts the torn record), the rest did not, nothing was acked."""
        kept = self.sim.rng.randrange(len(records))
        records = list(records)
        whole = records[:kept]
        if whole:
            self.journal.append(whole)
        self.log.extend((term, m) for _, term, m in whole)
        if self.journal.segments:  # the next record, half written
            torn = fmt.encode_record(*records[kept])
            with open(self.journal.segments[-1].path, "ab") as f:
                f.write(torn[:len(torn) // 2])
        self.sim.trace.append(f"  {self.name} torn after {kept} of {len(records)} records")
        self.sim.crash(self.name, self.torn_write)
        raise Crashed(self.name)

    # --- events ----------------------------------------------------------------------------

    def tick(self) -> None:
        """The shell's timer: the node's next deadline as it stood at the last one (a leader's,
        every tick: the shell wakes early when an event brings its deadline nearer)."""
        now = self.sim.now
        if self.sim.replicated and now - self.flushed_at >= self.sim.flush_ns:  # the background flush
            self.flushed, self.flushed_at = len(self.log), now
        if now - self.space_checked >= DISK_CHECK_NS:  # the shell's look at its free space
            self.space_checked = now
            self.act(self.node.on_free_space(0 if now < self.full_until else FREE_DISK, now))
        if now >= self.wake_at or self.leader is not None:
            self.act(self.node.on_timer(now))
            self.wake_at = self.node.next_deadline(now)

    def receive(self, src: str, msg) -> None:
        now = self.sim.now
        kind, conn = msg[0], msg[1] if len(msg) > 1 else None
        if kind == "open" and msg[2] == "replay":  # a replica catching up
            self.act(self.node.on_replay_connected(conn, now), conn)
        elif kind == "open":
            self.act(self.node.on_connected(conn, now, msg[3]), conn)
        elif kind == "bytes":
            self.act(self.node.on_data(conn, msg[2], now), conn)
        elif kind == "shut":
            self.act(self.node.on_closed(conn, now))
        elif kind == "inbound" and self.can_lead:
            emptied = self.sim.now >= self.sim.busy.get(self.name, 0)  # (overloaded: never emptied)
            self.act(self.node.on_inbound([(msg[1], src)], emptied, self.clock(), now))
        elif kind == "stamp":
            self.act(self.node.on_stamp(self.clock(), now))
        elif kind == "drained":
            self.act(self.node.on_drained(conn, now), conn)
        elif kind == "gap" and not self.can_lead:
            self.act(self.node.on_datagram(address(src), msg[1], now))


def take_delivered(sim: "Sim", name: str, delivered: list[bytes], d: Deliver) -> None:
    """A listener's delivered run onto what it applied, checked: in order (prefix), and what
    every listener gets was published there."""
    n = moldudp64.HEADER.unpack_from(d.packet)[2]
    if d.first_seq != len(delivered) + 1:
        raise Violation(f"{name} delivered seq {d.first_seq} after {len(delivered)}")
    for seq, i in enumerate(range(d.skip, n), d.first_seq):
        raw = M.packet_message_bytes(d.packet, i)
        if sim.published.get(seq, raw) != raw:
            raise Violation(f"{name} delivered at seq {seq} a message other than the one published")
        delivered.append(raw)


class Replica:
    """A replica: the ReplicaNode the process runs (the stream, the alert link's bytes, catch-up
    over a rewinder's replay) and its real LMDB snapshots (replicas/snapshot.py, on this run's
    own tmpfs directory), at the processes' cadence. It crashes and resumes from its last
    snapshot, or loses its disk and starts again from seq 1. Its state may be corrupted (a bit
    flips in its memory): the emitter, comparing its digest with the others', must tell it to
    rebuild, and it applies again from seq 1."""

    def __init__(self, sim: "Sim", name: str):
        self.sim, self.name = sim, name
        self.disk = sim.disk / name / "lmdb"
        self.delivered: list[bytes] = []  # what it applied, in order: checked against what was published
        self.alerts: dict[int, bytes] = {}  # emit seq -> every alert it raised, for the final check
        self.store = None
        self.corrupt = self.saved_corrupt = False  # its state in memory, and in its last snapshot
        self.was_corrupted = False
        self.rebuilds = 0
        self.restart()

    def open_state(self) -> list[bytes]:
        """The machine and the outbox from its snapshot (fresh if there is none)."""
        self.store, self.machine, raw, _ = open_verified(
            self.disk, lambda: AuditMachine(book_ttl_ns=2000 * MS, orphan_ttl_ns=500 * MS,
                                            fold_every=SIM_FOLD_EVERY), SIM_LOG)
        self.machine.apply_runs = self._keeping_alerts(self.machine.apply_runs)
        del self.delivered[self.machine.last_seq:]  # applied again from the snapshot on
        self.corrupt = self.saved_corrupt
        return [raw[i:i + ALERT_SIZE] for i in range(0, len(raw), ALERT_SIZE)]

    def restart(self) -> None:
        """The process (re)starting on what its disk holds."""
        self.up = True
        outbox = self.open_state()
        sim = self.sim
        self.node = ReplicaNode(wire(self.name), self.machine, outbox, SESSION, [wire(r) for r in REWINDERS],
                                wire(EMITTER), GAP_REQUEST_NS, STREAM_KEYS, default_of(Config, "max_packet"),
                                default_of(Config, "snapshot_every"),
                                default_of(Config, "snapshot_ms") * MS, False, 0.0, sim.now,
                                REPLAY_BEHIND if sim.seed % 3 else SIM_REPLAY_BEHIND)
        self.node.reply_at(*address(self.name), sim.now)  # (its nonces above any before a crash)
        self.wake_at = sim.now

    def crash(self, wipe: bool) -> None:
        self.up = False
        self.store.close()
        if wipe:
            shutil.rmtree(self.disk)
            self.saved_corrupt = False

    def corrupt_state(self) -> None:
        """A bit flips in its state: from here on its digest differs from the others'."""
        chain = bytearray(self.machine.chain)
        chain[0] ^= 1
        self.machine.chain = bytes(chain)
        self.corrupt = self.was_corrupted = True

    def rebuild(self) -> None:
        """The emitter's order (replicas/replica_shell.py _rebuild): its state moved aside, applied
        again from seq 1."""
        if not self.was_corrupted:  # (once corrupted, told again after a restart until it agrees: a rebuild more)
            raise Violation(f"{self.name}, whose state was never corrupted, was told to rebuild")
        self.store.close()
        shutil.rmtree(self.disk)
        self.saved_corrupt, self.rebuilds = False, self.rebuilds + 1
        self.sim.trace.append(f"{self.sim.now / MS:.0f} ms: {self.name} rebuilds from seq 1")
        outbox = self.open_state()
        self.act(self.node.on_rebuilt(self.machine, outbox, self.sim.now))

    def _keeping_alerts(self, apply_runs):
        """The machine's apply_runs, keeping every alert it raised for the final check (the outbox
        does not keep those at or below the emitter's mark); one raised again after a restart is
        the same."""
        def apply_and_keep(runs):
            alerts, folds = apply_runs(runs)
            for a in alerts:
                if self.alerts.setdefault(emit_seq_of(a), a) != a:
                    raise Violation(f"{self.name} raised emit seq {emit_seq_of(a)} again, differently")
            return alerts, folds
        return apply_and_keep

    def receive(self, src: str, msg) -> None:
        now = self.sim.now
        if msg[0] == "packet":
            self.act(self.node.on_datagrams([msg[1]], now))
        elif msg[0] == "open":
            self.act(self.node.on_connected(msg[1], now))
        elif msg[0] == "bytes":
            self.act(self.node.on_data(msg[1], msg[2], now))
        elif msg[0] == "shut":
            self.act(self.node.on_closed(msg[1], now))

    def tick(self) -> None:
        if self.sim.now >= self.wake_at:  # the shell's timer
            self.act(self.node.on_timer(self.sim.now))
            self.wake_at = self.node.next_deadline(self.sim.now)

    def act(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Applied):
                for run in a.runs:
                    take_delivered(self.sim, self.name, self.delivered, run)
                if not self.corrupt:
                    self.sim.check_digest(self.name, self.machine.last_seq, self.machine.digest())
            elif isinstance(a, Send):
                self.sim.stream(self.name, a.conn, a.data)
            elif isinstance(a, AskRewinder):
                self.sim.send(self.name, REWINDERS[a.index], ("gap", a.request))
            elif isinstance(a, Dial):
                self.sim.dial(self.name, a.conn, name_of(a.peer), a.conn[0])
            elif isinstance(a, Close):
                if a.reason is not None:
                    raise Violation(f"{self.name} closed its {a.conn[0]} link: {a.reason.value} ({a.detail})")
                self.sim.hang_up(self.name, a.conn)
            elif isinstance(a, TakeSnapshot):  # (the shell writes it on its snapshot thread)
                job = self.store.prepare(self.machine, {"node": self.name}, outbox=b"".join(self.node.core.outbox))
                self.store.finish(job, self.store.write(job))
                self.saved_corrupt = self.corrupt
                self.act(self.node.on_saved(self.sim.now))
            elif isinstance(a, Rebuild):
                self.rebuild()


class Listener:
    """A client (submits, resends, acks): the ClientNode the client library runs, on the
    simulated network."""

    def __init__(self, sim: "Sim", name: str):
        self.sim, self.name = sim, name
        self.gen_seed = sim.rng.randrange(1 << 30)
        self.start()

    def start(self, recover: bool = False) -> None:
        """A client (re)starting: it regenerates the same trades under the same client seqs and,
        restarted, reads the stream from seq 1 up to its head before it numbers on."""
        self.up = True
        self.node = ClientNode(SESSION, len(REWINDERS), GAP_REQUEST_NS, RESEND_NS, keys=CLIENT_KEYS,
                               max_packet=default_of(Config, "max_packet"))
        self.node.listener.reply_at(*address(self.name), self.sim.now)
        self.client = self.node.add(self.name, None)
        self.gen = self.trades()
        self.delivered: list[bytes] = []
        self.recovering = recover
        if recover:
            self.act(self.node.recover(self.name, self.sim.now))

    def trades(self) -> TradeGenerator:
        """What this client submits, in client seq order from 1 (the same after a restart)."""
        return TradeGenerator(self.gen_seed, overfill_share=0.3, first_id=1 + CLIENTS.index(self.name) * 10**9)

    def restart_client(self) -> None:
        """Everything but the generator's seed was lost: read the stream from seq 1 again."""
        self.start(recover=True)

    def act(self, actions: list) -> None:
        """As sequencer/client_shell.py's StreamListener carries them out."""
        for a in actions:
            if isinstance(a, Delivered):
                for d in a.runs:
                    take_delivered(self.sim, self.name, self.delivered, d)
            elif isinstance(a, AskRewinder):
                self.sim.send(self.name, REWINDERS[a.index], ("gap", a.request))
            elif isinstance(a, SendInbound):
                self.submit(a.datagrams, a.to)
            elif isinstance(a, Recovered):
                self.gen.take(a.acked)  # what the log holds is not sent again
                self.recovering = False
            elif isinstance(a, Undecodable):
                raise Violation(f"{self.name}: the committed log holds an undecodable message at seq {a.seq}")
            # (Acked: no one waits here; Dropped: counted by the cores)

    def receive(self, src: str, msg) -> None:
        if msg[0] == "advice":
            self.act(self.node.on_advice(self.name, msg[1], src in SEQUENCERS, self.sim.now))
        elif msg[0] == "packet":
            self.act(self.node.on_datagrams([msg[1]], self.sim.now))

    def tick(self) -> None:
        now, c = self.sim.now, self.client
        due = self.node.next_deadline(now)
        if due is not None and due <= now:  # the shell's timer
            self.act(self.node.on_timer(now))
        if self.recovering:
            return
        if c.next_cseq <= self.sim.per_client and self.sim.rng.random() < SUBMIT_CHANCE and not c.pause_left_ns(now):
            count = min(self.sim.rng.randint(1, 8), self.sim.per_client - c.next_cseq + 1)
            self.act(self.node.submit(self.name, self.gen.take(count), now))

    def submit(self, datagrams: list[bytes], to: bytes | None) -> None:
        """To the sequencer `to` names (the leader the stream names, as the client shell sends),
        else to every one (resends)."""
        named = [s for s in SEQUENCERS if wire(s) == to]
        for data in datagrams:
            for s in named or SEQUENCERS:
                self.sim.send(self.name, s, ("inbound", data))


class Emitter:
    """The emitter: the EmitterNode the process runs, over the alert links' bytes; its LMDB
    (mark, outbox, delivered) and an idempotent JSON-lines sink are the durable state here. It
    crashes at the core's crash points."""

    def __init__(self, sim: "Sim"):
        self.sim, self.name, self.up = sim, EMITTER, True
        self.mark = 0
        self.outbox: dict[int, bytes] = {}  # emit seq -> alert: intent recorded, done not
        self.recorded: dict[int, bytes] = {}  # emit seq -> alert: done
        self.sink: list[dict] = []  # alerts.jsonl
        self.crash_at: tuple[str, int] | None = None  # (point, until): a fault waiting for the next batch
        self.restart()

    def restart(self) -> None:
        delivery = "quorum" if self.sim.seed % 2 else "first"  # both modes, without drawing from the seed's rng
        deliver_first = self.sim.seed % 4 >= 2  # (its sink is idempotent: both orders are the shell's)
        self.node = EmitterNode({wire(r) for r in REPLICAS}, self.mark, delivery, deliver_first)
        self.core = self.node.core
        self.carry_out(self.node.start([self.outbox[k] for k in sorted(self.outbox)], self.sim.now))

    def receive(self, src: str, msg) -> None:
        now = self.sim.now
        if msg[0] == "open":  # a replica's alert link
            self.carry_out(self.node.on_connected(msg[1], now, msg[3]))
        elif msg[0] == "bytes":
            self.carry_out(self.node.on_data(msg[1], msg[2], now))
        elif msg[0] == "shut":
            self.carry_out(self.node.on_closed(msg[1], now))

    def carry_out(self, actions: list) -> None:
        """As the emitter shell does: in order, what a step leads to after the rest of its list."""
        queue = deque(actions)
        while queue:
            a, now = queue.popleft(), self.sim.now
            if isinstance(a, Send):
                self.sim.stream(EMITTER, a.conn, a.data)
            elif isinstance(a, Close):
                raise Violation(f"the emitter refused {a.conn[0]}'s link: {a.reason} ({a.detail})")
            elif isinstance(a, RecordIntent):
                (self.recorded if a.delivered else self.outbox).update((emit_seq_of(x), x) for x in a.alerts)
                self.mark = emit_seq_of(a.alerts[-1])
                self.record_done(a.done)
                queue.extend(self.node.on_recorded(a, now))
            elif isinstance(a, (DeliverAlerts, Redeliver)):
                held = {r["alert_id"] for r in self.sink}  # the sink is idempotent by alert id
                records = (Alert.decode(x).to_dict("SIM") for x in a.alerts)
                self.sink += [r for r in records if r["alert_id"] not in held]
                if isinstance(a, DeliverAlerts):
                    queue.extend(self.node.on_delivered(a, now))
            elif isinstance(a, RecordDone):
                self.record_done(a.alerts)
            elif isinstance(a, LookUp):
                stored = [kept or self.recorded.get(emit_seq_of(x), self.outbox.get(emit_seq_of(x)))
                          for x, kept in zip(a.copies, a.recorded)]
                queue.extend(self.node.on_looked_up(a, stored, now))
            elif isinstance(a, Divergence):
                if a.why is Why.DIGEST_OUTVOTED and self.sim.replicas[name_of(a.replica)].was_corrupted:
                    self.sim.trace.append(f"{now / MS:.0f} ms: the emitter outvotes {name_of(a.replica)} "
                                          f"at fold seq {a.fold_seq}")
                    continue
                seq = emit_seq_of(a.alert) if a.alert else a.fold_seq
                raise Violation(f"divergence: {a.why.value} at emit seq {seq}")
            elif isinstance(a, Crash):
                self.sim.crash_emitter(self.crash_at[1])
                return

    def record_done(self, alerts: list) -> None:
        for x in alerts:
            self.recorded[emit_seq_of(x)] = self.outbox.pop(emit_seq_of(x), x)

    def tick(self) -> None:
        """As the shell's timer: at the node's deadline (acknowledgements, a done alone, a record)."""
        due = self.node.next_deadline()
        if due is not None and due <= self.sim.now:
            self.carry_out(self.node.on_timer(self.sim.now))


class Sim:
    def __init__(self, seed: int, per_client: int = 60):
        self.seed = seed
        # The replicas' disks (their LMDB snapshots): this run's own, in memory where there is a tmpfs.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.tmp = tempfile.TemporaryDirectory(prefix="tape-sim-", dir=shm)
        self.disk = Path(self.tmp.name)
        self.rng = random.Random(seed)
        self.now = 0
        self.per_client = per_client
        self.queue: list = []
        self.counter = 0
        self.leaders: dict[int, str] = {}
        self.published: dict[int, bytes] = {}  # seq -> the message first published there
        self.cut: dict[tuple[str, str], int] = {}  # (from, to) -> until when nothing goes that way
        self.conns: dict[tuple, dict[str, object]] = {}  # replication connections: (dialer, its name, n) -> ends
        self.lives: Counter = Counter()  # node -> processes of it that died
        self.handles: dict[tuple, tuple] = {}  # (node, its name for a connection) -> the connection
        self.links: dict[tuple, LinkEnd] = {}  # (connection, node) -> that end's link records
        self.ports: dict[tuple, str] = {}  # connection -> the port it was dialled to
        self.dialled = 0
        self.unread: dict[tuple, list] = {}  # (connection, sender) -> the bytes of its last write not yet read
        self.paused: dict[str, list] = {}  # node -> messages waiting for it
        self.slow: dict[str, int] = {}  # voter -> until when its connections are slow
        self.busy: dict[str, int] = {}  # sequencer -> until when its inbound socket is never emptied (overload)
        self.loss = self.rng.choice((0.0, 0.01, 0.05, 0.15))
        self.dup = self.rng.choice((0.0, 0.02))
        self.batch_interval_ns = PACED_INTERVAL_NS if seed % 2 else 0  # (not drawn: the other draws stay a seed's)
        self.tick_ns = EXPLORED_TICK_NS if seed % 3 else TICK_NS
        self.max_batch = SIM_MAX_BATCH if seed % 4 == 1 else default_of(LeaderSettings, "max_batch")
        self.replicated = seed // 2 % 2 == 1  # durability "replicated" (else "flush")
        self.flush_ns = FLUSH_INTERVALS_NS[seed // 4 % 2]
        self.voters = {n: SimVoter(self, n) for n in VOTERS}
        self.listeners = {n: Listener(self, n) for n in CLIENTS}
        self.replicas = {n: Replica(self, n) for n in REPLICAS}
        self.emitter = Emitter(self)
        self.nodes = {**self.voters, **self.listeners, **self.replicas, EMITTER: self.emitter}
        self.digests: dict[int, tuple[str, str]] = {}  # seq -> (the first replica there, its digest)
        self.published_terms: dict[str, dict[str, list[int]]] = {}  # sequencer -> term -> [first, last] seq
        self.channel_at: dict[tuple[str, str], int] = {}  # ordered channels: when the last message arrives
        self.trace: list[str] = []
        self.wiped = False
        self.end_published = 0  # when its last end-of-session packet goes out
        self._schedule_faults()

    def close(self) -> None:
        """The voters' and replicas' disks go."""
        for v in self.voters.values():
            v.close_journal()
        for r in self.replicas.values():
            if r.up:
                r.store.close()
        self.tmp.cleanup()

    # --- the virtual network -----------------------------------------------------------

    def at(self, when: int, fn, *args) -> None:
        self.counter += 1
        heapq.heappush(self.queue, (when, self.counter, fn, args))

    def send(self, src: str, dst: str, msg) -> None:
        if (src, dst) in self.cut or self.rng.random() < self.loss:
            return
        for _ in range(2 if self.rng.random() < self.dup else 1):
            self.at(self.now + self.rng.randint(100_000, 3 * MS), self.deliver, src, dst, msg)

    def crash_emitter(self, until: int) -> None:
        self.emitter.up = False
        self.emitter.crash_at = None
        self.drop_connections(EMITTER)  # its links close: what is in flight on them is lost
        self.at(max(until, self.now + MS), self.recover_emitter)

    def recover_emitter(self) -> None:
        self.emitter.up = True
        self.emitter.restart()

    # --- connections (TCP with link records): ordered, never lost; held across a partition --

    def dial(self, src: str, conn, dst: str, port: str = "replication") -> None:
        """`src` connects to `dst`'s `port` (`conn`: its name for it; `dst` names it (src, conn,
        n)). Refused at once if `dst` is down, timed out across a partition. Each end is open for
        its node once the link's hellos are exchanged."""
        self.dialled += 1
        key = (src, conn, self.dialled)  # (a restarted node names its connections anew: this one is new)
        cut = (src, dst) in self.cut or (dst, src) in self.cut  # (a SYN or its answer lost)
        if cut or not self.nodes[dst].up:
            wait = ELECTION_NS if cut else self.rng.randint(100_000, 3 * MS)
            self.at(self.now + wait, self.refused, src, conn, dst, self.lives[src])
            return
        self.conns[key] = {src: conn, dst: key}  # each end's name for it, while that end is open
        self.handles[(src, conn)] = self.handles[(dst, key)] = key
        self.ports[key] = port
        peer = ANY_LISTENER if port == "replay" else wire(dst)
        self.links[(key, src)] = LinkEnd(link_keys(src, port), self.rng.randbytes(NONCE_SIZE), True, peer=peer)
        self.at(self.now + self.rng.randint(100_000, 3 * MS), self.accept, key, src, dst, port)

    def refused(self, src: str, conn, dst: str, life: int) -> None:
        """A connect refused or timed out: told to the process that dialled, not to one started
        since (a restarted node names its connections from 1 again: this one may have its name)."""
        if self.lives[src] == life:
            self.deliver(dst, src, ("shut", conn))

    def accept(self, key, src: str, dst: str, port: str) -> None:
        """The connection reaches `dst`: the dialler's hello follows it."""
        if dst not in self.conns.get(key, ()) or src not in self.conns[key]:
            return  # a process died meanwhile: the other end learns it from its close
        self.links[(key, dst)] = LinkEnd(link_keys(dst, port), self.rng.randbytes(NONCE_SIZE), False)
        self.transmit(key, src, dst, self.links[(key, src)].opening())

    def stream(self, src: str, conn, data: bytes) -> None:
        """Bytes `src`'s node writes on its connection `conn`: in link records."""
        key = self.handles.get((src, conn))
        if key is None or len(ends := self.conns[key]) < 2:
            return  # closed at the other end
        dst = next(n for n in ends if n != src)
        end = self.links[(key, src)]
        if not end.established:
            raise Violation(f"{src} wrote on a connection before it was open")
        self.transmit(key, src, dst, end.seal(data))

    def transmit(self, key, src: str, dst: str, data: bytes) -> None:
        """Bytes on the wire from `src`, as TCP hands them to the reader."""
        ends = self.conns.get(key, {})
        if src not in ends or dst not in ends:
            return  # closed at either end meanwhile
        unread = self.unread.get((key, src))
        if unread is not None and self.rng.random() < COALESCE:  # written before the peer read: one read
            unread.append(data)
            return
        cut = self.rng.randrange(1, len(data)) if len(data) > 1 and self.rng.random() < SPLIT else len(data)
        for chunk in (data[:cut], data[cut:]) if cut < len(data) else (data,):  # a frame may come in pieces
            self.unread[(key, src)] = parts = [chunk]
            self.stream_to(key, src, dst, ("bytes", ends[dst], parts))

    def stream_to(self, key, src: str, dst: str, msg) -> None:
        """In order on the connection; across a partition held until it heals (TCP resends)."""
        when = self.now + self.rng.randint(100_000, 3 * MS)
        if (src, dst) in self.cut:
            when = max(when, self.cut[(src, dst)] + self.rng.randint(100_000, 3 * MS))
        if self.slow.get(src, 0) > self.now or self.slow.get(dst, 0) > self.now:
            when += self.rng.randint(*SLOW_NS)
        when = max(when, self.channel_at.get((key, src), 0) + 1)
        self.channel_at[(key, src)] = when
        self.at(when, self.arrive, key, src, dst, msg)

    def arrive(self, key, src: str, dst: str, msg) -> None:
        if msg[0] == "bytes" and self.unread.get((key, src)) is msg[2]:
            del self.unread[(key, src)]
        if dst not in self.conns.get(key, ()):
            return  # closed at that end (or that process died) meanwhile
        if msg[0] == "shut":
            opened = self.links.get((key, dst)) is not None and self.links[(key, dst)].established
            self.close_end(key, dst)
            if opened or key[0] == dst:  # (a server's node never hears of a link closed in its handshake)
                self.deliver(src, dst, msg)
        else:  # (read by the process, so not while it is paused)
            self.deliver(src, dst, ("wire", key, b"".join(msg[2])))

    def unseal(self, src: str, dst: str, key, data: bytes) -> list:
        """What the node at `dst` gets of bytes that came on connection `key`: the connection's
        opening once the hellos are through, the payloads of whole records."""
        end = self.links.get((key, dst))
        if end is None:
            return []  # closed meanwhile
        was_open = end.established
        try:
            reply, plain = end.receive(data)
        except ProtocolError as e:  # the simulated peers are honest
            raise Violation(f"{dst} refused a link from {src}: {e}") from e
        if reply:
            self.transmit(key, dst, src, reply)
        conn = self.conns[key][dst]
        return ([("open", conn, self.ports[key], end.peer)] if end.established and not was_open else []) + \
            ([("bytes", conn, plain)] if plain else [])

    def close_end(self, key, node: str) -> None:
        ends = self.conns[key]
        del self.handles[(node, ends.pop(node))]
        self.links.pop((key, node), None)
        if not ends:
            del self.conns[key]
            del self.ports[key]

    def hang_up(self, src: str, conn) -> None:
        """`src` closes its end; the other end learns it after what was sent before."""
        key = self.handles.get((src, conn))
        if key is None:
            return
        self.close_end(key, src)
        if key in self.conns:
            dst = next(iter(self.conns[key]))
            self.stream_to(key, src, dst, ("shut", self.conns[key][dst]))

    def drop_connections(self, node: str) -> None:
        """`node`'s process died: its kernel closes every connection it had (and what it dialled
        that never connected is nobody's now)."""
        self.lives[node] += 1
        for key in [k for k, ends in self.conns.items() if node in ends]:
            self.hang_up(node, self.conns[key][node])

    def deliver(self, src: str, dst: str, msg) -> None:
        node = self.nodes[dst]
        if not node.up:
            return
        if dst in self.paused:
            self.paused[dst].append((src, msg))
            return
        try:
            for m in self.unseal(src, dst, msg[1], msg[2]) if msg[0] == "wire" else [msg]:
                node.receive(src, m)
        except Crashed:
            pass
        except InvariantViolation as e:  # the process would stop with exit 4: a failed seed
            raise Violation(f"{dst} {e}") from e

    def publish(self, src: str, packets: list[bytes]) -> None:
        for pkt in packets:
            _, seq, count = moldudp64.decode_header(pkt)
            if 0 < count < 0xFFFF:
                for i in range(count):
                    msg = M.packet_message_bytes(pkt, i)
                    first = self.published.setdefault(seq + i, msg)
                    if first != msg:
                        raise Violation(f"{src} published a different message at seq {seq + i}")
                span = self.published_terms.setdefault(src, {}).setdefault(str(self.voters[src].leader.term),
                                                                           [seq, seq])
                span[1] = seq + count - 1  # who published what in which term: the verdict judges terms
            for name in (*self.listeners, *self.replicas):
                self.send(src, name, ("packet", pkt))

    # --- faults ------------------------------------------------------------------------

    def _schedule_faults(self) -> None:
        r = self.rng
        for _ in range(r.randint(*FAULTS_PER_RUN)):
            start = r.randint(100 * MS, FAULTS_UNTIL - 200 * MS)
            length = r.randint(50 * MS, 700 * MS)
            kind = r.choice(FAULT_KINDS)
            self.at(start, self.fault, kind, None, start + length)

    def fault(self, kind: str, node: str | None, until: int) -> None:
        if node is None:  # half the time the leader of the moment, else any voter
            leader = next((v.name for v in self.voters.values() if v.leader is not None and v.up), None)
            node = leader if leader and self.rng.random() < 0.5 else self.rng.choice(VOTERS)
        self.trace.append(f"{self.now / MS:.0f} ms: {kind} {node} for {(until - self.now) / MS:.0f} ms")
        if kind == "crash-client":
            client = self.listeners[self.rng.choice(CLIENTS)]
            self.trace[-1] = f"{self.now / MS:.0f} ms: crash client {client.name} for {(until - self.now) / MS:.0f} ms"
            if client.up:
                client.up = False
                self.at(max(until, self.now + MS), client.restart_client)
        elif kind.endswith("-replica"):
            self.replica_fault(kind, self.replicas[self.rng.choice(REPLICAS)], until)
        elif kind == "crash-emitter":
            e = self.emitter
            if e.up and e.crash_at is None:  # dies at a crash point of its next batch of alerts
                point = self.rng.choice(CRASH_POINTS)
                e.crash_at = (point, until)
                e.core.crash_at, e.core.crash_after = point, e.core.batches + 1
                self.trace[-1] = f"{self.now / MS:.0f} ms: crash the emitter {point} of its next batch, " \
                                 f"for {(until - self.now) / MS:.0f} ms"
        elif kind == "wipe" and not self.wiped:
            self.wiped = True  # one disk loss per run, of one voter or two at once: more is beyond the fault model
            nodes = [node] + ([self.rng.choice([v for v in VOTERS if v != node])]
                              if self.rng.random() < TWO_DISKS_LOST else [])
            self.trace[-1] = f"{self.now / MS:.0f} ms: wipe {' and '.join(nodes)} for {(until - self.now) / MS:.0f} ms"
            for name in nodes:
                v = self.voters[name]
                if v.up:
                    self.crash(name, until)
                v.lose_disk()
        elif kind == "corrupt-journal" and not self.wiped and self.voters[node].up:
            self.wiped = True  # a disk that lost data: as many a run as disks lost whole
            self.crash(node, until)
            self.voters[node].damage_journal()
        elif kind == "full":
            self.voters[node].full_until = max(self.voters[node].full_until, until)
        elif kind == "crash" and self.voters[node].up:
            self.crash_fault(node, until)
        elif kind == "slow":
            self.slow[node] = max(self.slow.get(node, 0), until)
        elif kind == "overload":
            self.busy[node] = max(self.busy.get(node, 0), until)
        elif kind == "pause" and node not in self.paused:
            self.paused[node] = []
            self.at(until, self.resume, node)
        elif kind in ("partition", "isolate", "one-way"):
            others = [n for n in self.nodes if n != node]
            side = set(self.rng.sample(others, self.rng.randint(1, len(others) - 1))) if kind != "isolate" else set()
            side.add(node)
            ways = [(a, b) for a in side for b in self.nodes if b not in side]
            if kind != "one-way":
                ways += [(b, a) for a, b in ways]
            elif self.rng.random() < 0.5:  # into the side only, else out of it only
                ways = [(b, a) for a, b in ways]
            self.cut.update((way, max(until, self.cut.get(way, 0))) for way in ways)
            self.at(until, self.heal)
        elif kind == "garbage":
            self.garbage()

    def replica_fault(self, kind: str, replica: Replica, until: int) -> None:
        if kind == "corrupt-replica":
            self.trace[-1] = f"{self.now / MS:.0f} ms: corrupt {replica.name}'s state"
            if replica.up and not any(r.was_corrupted for r in self.replicas.values()):  # one faulty replica a run
                replica.corrupt_state()
            return
        self.trace[-1] = f"{self.now / MS:.0f} ms: {kind.split('-')[0]} {replica.name} for " \
                         f"{(until - self.now) / MS:.0f} ms"
        if replica.up:
            replica.crash(wipe=kind == "wipe-replica")
            self.drop_connections(replica.name)
            self.at(max(until, self.now + MS), replica.restart)

    def garbage(self) -> None:
        """Datagrams from a stranger: junk to every socket, a back-off from elsewhere than a
        sequencer, and well-formed forgeries at the seqs each listener needs next."""
        for dst in (*SEQUENCERS, *self.listeners, *self.replicas):
            for blob in (b"", b"\x00" * 7, bytes(self.rng.randrange(256) for _ in range(60)),
                         SESSION + b"\x00" * 8 + b"\x00\x05" + b"junk"):
                self.send("mallory", dst, ("inbound", blob) if dst in SEQUENCERS else ("packet", blob))
        for name in CLIENTS:
            self.send("mallory", name, ("advice", backoff.encode(wire(name), 1 << 40, 1, 65_535, None)))
        receivers = {**{n: c.node.listener.receiver for n, c in self.listeners.items()},
                     **{n: r.node.receiver for n, r in self.replicas.items()}}
        for name, receiver in receivers.items():
            for pkt in self.forgeries(receiver.next_seq):
                self.send("mallory", name, ("packet", pkt))

    def forgeries(self, seq: int) -> list[bytes]:
        """Packets at `seq` that are valid MoldUDP64 of valid messages: unsealed, and sealed with another key."""
        fake = [M.stamp(M.purchase(7, 7, 10**6, "MALLORY", "EVIL"), self.now, wire("c0"), 1)]
        sealed = StreamKeys([b"not the cluster's key, 32 bytes!"]).seal_packet(SESSION, seq, fake, self.now,
                                                                             wire("seq-a"))[1]
        return PacketBuilder(SESSION, seq).add_sequenced(fake) + [sealed]

    def crash(self, node: str, until: int) -> None:
        v = self.voters[node]
        v.up = False
        v.close_journal()
        self.drop_connections(node)
        v.torn_write = None
        self.at(max(until, self.now + MS), self.recover, node)

    def crash_fault(self, node: str, until: int) -> None:
        """A voter's process dies: now, or in the middle of its next journal write; or its host's
        power goes (durability "replicated")."""
        if self.rng.random() < 0.5:
            self.voters[node].torn_write = until
            self.trace.append("  (in the middle of its next journal write)")
        elif self.replicated and not self.wiped:
            self.wiped = True
            self.voters[node].power_loss_at_append = until
            self.trace.append("  (its host's power, a millisecond after its next journal write)")
        else:
            self.crash(node, until)

    def power_loss(self, node: str, until: int) -> None:
        """Its host loses power: the process dies and its journal keeps what was flushed."""
        v = self.voters[node]
        if not v.up:
            return
        self.trace.append(f"{self.now / MS:.0f} ms: {node}'s host loses power: {v.unflushed} unflushed entries lost")
        self.crash(node, until)
        v.lose_unflushed()

    def recover(self, node: str) -> None:
        v = self.voters[node]
        v.up = True
        v.restart()

    def resume(self, node: str) -> None:
        waiting = self.paused.pop(node, [])
        for src, msg in waiting:
            self.deliver(src, node, msg)

    def heal(self) -> None:
        self.cut = {way: until for way, until in self.cut.items() if until > self.now}

    # --- running -------------------------------------------------------------------------

    def check_digest(self, replica: str, seq: int, digest: str) -> None:
        """Replica identity, as it goes: replicas that applied up to the same seq have equal digests."""
        known = self.digests.setdefault(seq, (replica, digest))
        if known[1] != digest:
            raise Violation(f"{replica} and {known[0]} applied up to seq {seq} with different digests")

    def check_agreement(self) -> None:
        """Agreement, as it goes: what each voter knows committed is what was published there."""
        for v in self.voters.values():
            upto = min(v.commit_seq, len(v.log))
            for seq in range(v.checked + 1, upto + 1):
                pub = self.published.get(seq)
                if pub is not None and v.log[seq - 1][1] != pub:
                    raise Violation(f"{v.name} holds at committed seq {seq} a message other than the one published")
            v.checked = max(v.checked, upto)

    def tick(self) -> None:
        self.check_agreement()
        for name, node in self.nodes.items():
            if node.up and name not in self.paused:
                try:
                    node.tick()
                except Crashed:
                    pass
        self.at(self.now + 5 * MS, self.tick)

    def settled(self) -> bool:
        """Every fault healed and every trade acknowledged, then the session ended, then every
        replica applied the whole log and every voter holds it."""
        if not self.healed() or not self.ended():
            return False
        leader = self.leader()
        c = leader.commit_seq
        return (all(len(r.delivered) >= c for r in self.replicas.values())
                and all(v.log[:c] == leader.log[:c] for v in self.voters.values()))

    def healed(self) -> bool:
        if self.now < FAULTS_UNTIL + 200 * MS:
            return False
        if self.paused or self.cut or not all(v.up for v in self.voters.values()) or not self.emitter.up:
            return False  # every fault healed
        if any(r.node.core.outbox for r in self.replicas.values()):
            return False  # alerts the emitter has not acknowledged
        if any(r.corrupt for r in self.replicas.values()):
            return False  # a corrupted replica not yet outvoted and rebuilt
        if any(c.next_cseq <= self.per_client or c.acked < c.next_cseq - 1 for c in
               (self.listeners[n].client for n in CLIENTS)):
            return False  # (not only none to resend: seen ahead of a gap is not acknowledged yet)
        leader = self.leader()
        return leader is not None and leader.commit_seq >= len(leader.log)

    def ended(self) -> bool:
        """The session ends as the processes end it: the leader is told to stop (a new leader whose
        log holds no end is told again) and stamps the end (no time tick after it); once that
        commits, it tells the followers and publishes the end-of-session packet. A leader that
        dies with its end replicated, not committed, leaves logs whose next leader ends the
        session again by itself."""
        leader = self.leader()
        node = leader.node
        try:
            if not node.ending:
                self.trace.append(f"{self.now / MS:.0f} ms: {leader.name} ends the session")
                leader.act(node.on_end(leader.clock(), self.now))
                return False
            if not node.session_ended():
                return False
            if not node.end_told:
                leader.act(node.on_session_ended(self.now))
                return False
        except Crashed:  # (its journal write of the end torn: a crash fault armed for it)
            return False
        return self.now >= self.end_published

    def unfinished(self) -> str:
        """What a stalled run still waits for, for its failure message."""
        leader = self.leader()
        waits = [f"{r.name} corrupt" for r in self.replicas.values() if r.corrupt]
        waits += [f"{n} behind" for n, r in self.replicas.items() if leader and len(r.delivered) < leader.commit_seq]
        waits += [f"{n} unacknowledged" for n in CLIENTS if self.listeners[n].client.acked < self.per_client]
        return ", ".join(waits or ["no leader" if leader is None else "the session's end"])

    def leader(self) -> SimVoter | None:
        """The leader of the highest term (a stale one may still think it leads)."""
        leading = [v for v in self.voters.values() if v.leader is not None and v.up]
        return max(leading, key=lambda v: v.leader.term, default=None)

    def run(self) -> dict:
        self.at(0, self.tick)
        while self.queue:
            when, _, fn, args = heapq.heappop(self.queue)
            self.now = when
            fn(*args)
            if self.now > FAULTS_UNTIL and self.counter % 64 == 0:
                if self.settled():
                    break
                if self.now > GIVE_UP:
                    raise Violation(f"no progress: the healed cluster did not finish within 60 s of virtual time "
                                    f"({self.unfinished()})")
        return self.check()

    def judge_as_a_run(self, c: int) -> None:
        """The verdict every real run gets (ops/verification/verdict.py), on what this run left behind."""
        clients = [self.listeners[n].client for n in CLIENTS]
        run = RunFiles(
            session="SIM", book_ttl_ns=2000 * MS, orphan_ttl_ns=500 * MS, submitted=self.per_client * len(CLIENTS),
            journals={v.name: [(s, t, m) for s, (t, m) in enumerate(v.log[:c], 1)] for v in self.voters.values()},
            replicas={n: {"last_seq": r.machine.last_seq, "digest": r.machine.digest()}
                      for n, r in self.replicas.items()},
            alerts=self.emitter.sink, emitter={"divergences": self.emitter.core.divergences},
            load={"acked": sum(cl.acked for cl in clients), "submitted": sum(cl.next_cseq - 1 for cl in clients)},
            sequencers={s: {"published_terms": self.published_terms.get(s, {})} for s in SEQUENCERS},
            fold_every=SIM_FOLD_EVERY,
            submitted_trades={moldudp64.session_bytes(n): self.listeners[n].trades for n in CLIENTS})
        checks, figures, _ = judge(run)
        failed = [f"{name} ({figures[name]})" for name, ok in checks.items() if not ok]
        if failed:
            raise Violation(f"the run's verdict fails: {'; '.join(failed)}")

    def check(self) -> dict:
        leader = self.leader()
        c = leader.commit_seq
        log = [m for _, m in leader.log[:c]]
        last = next(t for t in (M.SEQUENCED.unpack(m)[M.TYPE] for m in reversed(log)) if t != M.AUTH)
        if last != M.SESSION_END:  # (a seal follows it, as every packet's worth ends with one)
            raise Violation(f"the committed log ends with a type {chr(last)!r} entry, not the session's end")
        for v in self.voters.values():  # agreement: every journal is a prefix of the committed log
            if [m for _, m in v.log[:c]] != log[:len(v.log)]:
                raise Violation(f"{v.name}'s log disagrees with the committed log")
        for seq, msg in self.published.items():  # what was published is the committed log
            if seq <= c and log[seq - 1] != msg:
                raise Violation(f"published seq {seq} differs from the committed log")
        for name, listener in {**self.listeners, **self.replicas}.items():  # prefix: one gap-free stream for all
            if listener.delivered != log[:len(listener.delivered)]:
                raise Violation(f"{name} delivered a stream that is not the committed log")
        trades = [(m[M.ORIGIN], m[M.CLIENT_SEQ]) for m in map(M.SEQUENCED.unpack, log)
                  if m[M.TYPE] in M.CLIENT_SEQ_TYPES]
        dups = [k for k, n in Counter(trades).items() if n > 1]
        if dups:
            raise Violation(f"sequenced twice: {dups[:3]}")
        for name in CLIENTS:  # no loss: everything a client saw sequenced, and (after healing) all it sent
            mine = sorted(cseq for origin, cseq in trades if origin == wire(name))
            if mine != list(range(1, self.per_client + 1)):
                raise Violation(f"{name}: sequenced client seqs are not 1..{self.per_client}")
        replicas = list(self.replicas.values())
        if len({(len(r.delivered), r.machine.digest()) for r in replicas}) != 1:
            raise Violation("replicas that applied the same log have different digests")
        decoded = [(i + 1, M.SEQUENCED.unpack(m)) for i, m in enumerate(replicas[0].delivered)]
        want, _ = expected_alerts(decoded, 2000 * MS, 500 * MS)
        raised = [replicas[0].alerts[k] for k in sorted(replicas[0].alerts)]
        got = [(a.emit_seq, a.purchase_seq, a.cumulative) for a in map(Alert.decode, raised)]
        if got != [(a["emit_seq"], a["purchase_seq"], a["cumulative"]) for a in want]:
            raise Violation("the replicas' alerts differ from those recomputed from the log")
        delivered = [(r["emit_seq"], r["purchase_seq"], r["cumulative"]) for r in self.emitter.sink]
        if sorted(delivered) != [(a["emit_seq"], a["purchase_seq"], a["cumulative"]) for a in want]:
            missing = len(set(got) - set(delivered))
            raise Violation(f"exactly-once alerts: {len(delivered)} delivered ({len(delivered) - len(set(delivered))} "
                            f"twice, {missing} missing), {len(want)} expected")
        self.judge_as_a_run(c)
        return {"seed": self.seed, "log": c, "terms": len(self.leaders), "virtual_ms": self.now // MS,
                "faults": len(self.trace), "loss": self.loss, "alerts": len(delivered),
                "emitter_in_doubt": self.emitter.core.in_doubt,
                "backoffs": sum(self.listeners[n].client.backoffs for n in CLIENTS),
                "rebuilds": sum(r.rebuilds for r in self.replicas.values())}


def run_seed(seed: int) -> tuple[int, str | None, dict | None]:
    sim = Sim(seed)
    try:
        return seed, None, sim.run()
    except Exception as e:  # a violation, or any crash of a core on what the network sent it
        detail = f"{type(e).__name__}: {e}" + "".join(f"\n    {t}" for t in sim.trace)
        return seed, detail, None
    finally:
        sim.close()


def main(first: int, seeds: int, verbose: bool = False, jobs: int = 1) -> int:
    import multiprocessing
    import time

    from rich.progress import Progress

    # The voters' journals log the torn tails and damage the faults make, cut as designed: not news here.
    logging.getLogger("tape.journal").setLevel(logging.CRITICAL + 1)
    t0 = time.monotonic()
    failures = []
    results = []
    with Progress(transient=True) as progress:
        task = progress.add_task(f"seeds {first}..{first + seeds - 1}", total=seeds)
        pool = multiprocessing.Pool(jobs) if jobs > 1 else None
        outcomes = (pool.imap_unordered(run_seed, range(first, first + seeds), chunksize=8) if pool
                    else map(run_seed, range(first, first + seeds)))
        for seed, error, result in outcomes:
            progress.advance(task)
            if error:
                failures.append((seed, error))
            else:
                results.append(result)
                if verbose:
                    print(result)
        if pool:
            pool.close()
    secs = time.monotonic() - t0
    for seed, error in sorted(failures):
        print(f"seed {seed} FAILED: {error}")
        print(f"  reproduce: tape sim --first {seed} --seeds 1 -v")
    terms = sum(r["terms"] for r in results)
    print(f"{seeds} seeds in {secs:.1f} s: {len(failures)} failed; {sum(r['log'] for r in results):,} messages "
          f"committed, {terms} terms, {sum(r['faults'] for r in results)} faults injected, "
          f"{sum(r['backoffs'] for r in results)} back-offs honoured, "
          f"{sum(r['rebuilds'] for r in results)} replicas outvoted and rebuilt")
    return 1 if failures else 0
