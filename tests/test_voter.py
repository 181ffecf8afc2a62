"""The voter shell (tape/voter.py) with real journals and real TCP: a
sequencer whose log is behind a rewinder's takes the missing entries, so it
can be elected when the leader died after replicating only to rewinders."""

import asyncio
import time
import tomllib
from pathlib import Path

import pytest

from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol.limits import STALL_SHARE
from tape.runtime import links
from tape.runtime.config import default_toml, parse
from tape.runtime.tuning import BEHIND_RECV
from tape.runtime.voter_shell import VoterShell, VoteStore


def records(first: int, last: int, term: int = 1) -> list:
    return [(s, term, M.stamp(M.purchase_request(s, 100, "c0", "ACME"), s, b"c0".ljust(10), s))
            for s in range(first, last + 1)]


async def fetch(voter: VoterShell, peer) -> int:
    """What the voter takes from `peer` with one fetch (a real connection), as it would after a
    vote refused for its being behind."""
    before = voter.journal.last_seq
    voter.act(voter.node_core.fetch_from(peer.wire_name))
    async with asyncio.timeout(10):
        while voter.node_core.dialed:
            await asyncio.sleep(0.01)
    return voter.journal.last_seq - before


async def test_a_sequencer_behind_a_rewinder_fetches_what_it_lacks(tmp_path):
    cfg = parse(tomllib.loads(default_toml(tmp_path, sequencers=2, free=True)))
    seq_b, rw_1 = cfg.node("seq-b"), cfg.node("rw-1")
    behind, ahead = cfg.open_journal(seq_b), cfg.open_journal(rw_1)
    behind.append(records(1, 60))
    ahead.append(records(1, 100))
    for node in (seq_b, rw_1, cfg.node("seq-a")):  # election state on disk: none would mean recovering first
        Path(node.data).mkdir(parents=True, exist_ok=True)
        VoteStore(Path(node.data) / "election.json").save(1, None)
    rewinder = VoterShell(cfg, rw_1, ahead, can_lead=False)
    sequencer = VoterShell(cfg, seq_b, behind, can_lead=True)
    server = await links.start_server(rewinder.serve, rw_1.host, rw_1.replication_port)
    try:
        taken = await fetch(sequencer, rw_1)
    finally:
        server.close()
    assert taken == 40 and behind.last_seq == 100
    assert list(behind.read()) == list(ahead.read())
    assert sequencer.term_at(100) == 1 and sequencer.log.client_last[b"c0".ljust(10)] == 100
    # Nothing is taken when the logs do not line up (our entry before the fetch point is of another term).
    other = cfg.open_journal(cfg.node("seq-a"))
    other.append(records(1, 50, term=1) + records(51, 55, term=2))
    stranger = VoterShell(cfg, cfg.node("seq-a"), other, can_lead=True)
    stranger.election.term = 2
    server = await links.start_server(rewinder.serve, rw_1.host, rw_1.replication_port)
    try:
        assert await fetch(stranger, rw_1) == 0 and other.last_seq == 55
    finally:
        server.close()


class DurableSeqs:
    """The journal as the voter uses it, noting the last seq on disk at each sync."""

    def __init__(self, journal):
        self.journal, self.durable, self.syncs = journal, 0, 0

    def maybe_sync(self):
        self.journal.maybe_sync()
        self.durable, self.syncs = self.journal.last_seq, self.syncs + 1

    def __getattr__(self, name):
        return getattr(self.journal, name)


class AcksAfterSync:
    """The voter's side of the link: every ack it writes must acknowledge only synced seqs."""

    def __init__(self, writer, journal: DurableSeqs):
        self.writer, self.journal, self.frames, self.acked = writer, journal, rep.FrameReader(), []

    def write(self, data: bytes) -> None:
        for fr in self.frames.feed(data):
            if isinstance(fr, rep.Ack):
                assert fr.success and fr.last_seq <= self.journal.durable, (fr, self.journal.durable)
                self.acked.append(fr.last_seq)
        self.writer.write(data)

    def __getattr__(self, name):
        return getattr(self.writer, name)


async def test_appends_read_together_share_one_fsync_and_are_acked_after_it(tmp_path):
    """A leader ahead of a voter has sent several appends by the time it reads: one fsync covers
    them all (group commit), and no ack leaves before it. The voter reads its link BEHIND_RECV a
    recv() (links.large_reads)."""
    cfg = parse(tomllib.loads(default_toml(tmp_path, free=True)))
    rw_1 = cfg.node("rw-1")
    Path(rw_1.data).mkdir(parents=True)
    VoteStore(Path(rw_1.data) / "election.json").save(1, None)
    journal = DurableSeqs(cfg.open_journal(rw_1))
    voter = VoterShell(cfg, rw_1, journal, can_lead=False)
    spies = []

    async def serve(reader, writer):
        spies.append(AcksAfterSync(writer, journal))
        await voter.serve(reader, spies[-1])

    server = await links.start_server(serve, rw_1.host, rw_1.replication_port)
    try:
        reader, writer = await asyncio.open_connection(rw_1.host, rw_1.replication_port)
        frames = rep.FrameReader()
        assert isinstance(frames.feed(await reader.read(1024))[0], rep.Hello)
        leader = cfg.node("seq-a").wire_name
        appends = [rep.encode_append(1, leader, s - 1, 1 if s > 1 else 0, 0, 1, [m for _, _, m in records(s, s + 9)])
                   for s in range(1, 51, 10)]
        writer.write(b"".join(appends))  # five appends, one write: the voter reads them at once
        acks = []
        async with asyncio.timeout(10):
            while len(acks) < 5 and (data := await reader.read(1024)):
                acks += [fr.last_seq for fr in frames.feed(data)]
        writer.close()
    finally:
        server.close()
    assert acks == [10, 20, 30, 40, 50] == spies[0].acked
    assert spies[0].transport.max_size == BEHIND_RECV
    assert journal.last_seq == 50 and journal.syncs == 1 and journal.fsyncs == 1


async def test_with_durability_replicated_appends_are_acked_before_any_flush(tmp_path):
    """Durability "replicated": a voter acknowledges what it wrote to its journal (the page cache);
    the disk is the background flusher's (held off here: no flush happens at all)."""
    cfg = parse(tomllib.loads(default_toml(tmp_path, free=True, durability="replicated")))
    rw_1 = cfg.node("rw-1")
    Path(rw_1.data).mkdir(parents=True)
    VoteStore(Path(rw_1.data) / "election.json").save(1, None)
    journal = cfg.open_journal(rw_1)
    journal._flusher.stop()
    voter = VoterShell(cfg, rw_1, journal, can_lead=False)
    server = await links.start_server(voter.serve, rw_1.host, rw_1.replication_port)
    try:
        reader, writer = await asyncio.open_connection(rw_1.host, rw_1.replication_port)
        frames = rep.FrameReader()
        assert isinstance(frames.feed(await reader.read(1024))[0], rep.Hello)
        leader = cfg.node("seq-a").wire_name
        writer.write(rep.encode_append(1, leader, 0, 0, 0, 1, [m for _, _, m in records(1, 10)]))
        acks = []
        async with asyncio.timeout(10):
            while not acks and (data := await reader.read(1024)):
                acks += [fr.last_seq for fr in frames.feed(data) if isinstance(fr, rep.Ack) and fr.success]
        writer.close()
    finally:
        server.close()
    assert acks == [10] and journal.last_seq == 10
    assert journal.fsyncs == 0 and journal.unflushed_bytes > 0


def test_a_voter_ticks_at_its_election_deadline_and_otherwise_only_as_its_stall_clock_needs(tmp_path):
    """No steady 10 ms tick: at most one a `tick_ns` (2/5 of the stall threshold), and one at the
    election's deadline when that comes sooner."""
    cfg = parse(tomllib.loads(default_toml(tmp_path, sequencers=2, free=True)))
    node = cfg.node("seq-b")
    Path(node.data).mkdir(parents=True, exist_ok=True)
    VoteStore(Path(node.data) / "election.json").save(1, None)
    voter = VoterShell(cfg, node, cfg.open_journal(node), can_lead=True)
    tick_s = voter.tick_ns / 1e9
    assert tick_s == pytest.approx(cfg.election_ms / 1000 * STALL_SHARE * 0.4)
    now = time.monotonic_ns()
    voter.election.deadline = now + 10**10
    assert voter._next_due(now) == now + voter.tick_ns  # the election far off: one tick a tick_ns
    voter.election.deadline = now + voter.tick_ns // 3
    assert voter._next_due(now) == voter.election.deadline  # nearer: at the deadline itself
    voter.journal.close()
