"""The voter shell (tape/voter.py) with real journals and real TCP: a
sequencer whose log is behind a rewinder's takes the missing entries, so it
can be elected when the leader died after replicating only to rewinders."""

import asyncio
import os
import socket
import threading
import time
import tomllib
from pathlib import Path

from tape.node.voter import Voter, VoteStore
from tape.ops.config import default_toml, parse
from tape.protocol import messages as M
from tape.protocol import replication as rep


def records(first: int, last: int, term: int = 1) -> list:
    return [(s, term, M.stamp(M.purchase_request(s, 100, "c0", "ACME"), s, b"c0".ljust(10), s))
            for s in range(first, last + 1)]


async def test_a_sequencer_behind_a_rewinder_fetches_what_it_lacks(tmp_path):
    cfg = parse(tomllib.loads(default_toml(tmp_path, sequencers=2, free=True)))
    seq_b, rw_1 = cfg.node("seq-b"), cfg.node("rw-1")
    behind, ahead = cfg.open_journal(seq_b), cfg.open_journal(rw_1)
    behind.append(records(1, 60))
    ahead.append(records(1, 100))
    for node in (seq_b, rw_1, cfg.node("seq-a")):  # election state on disk: none would mean recovering first
        Path(node.data).mkdir(parents=True, exist_ok=True)
        VoteStore(Path(node.data) / "election.json").save(1, None)
    rewinder = Voter(cfg, rw_1, ahead, can_lead=False)
    sequencer = Voter(cfg, seq_b, behind, can_lead=True)
    server = await asyncio.start_server(rewinder.serve, rw_1.host, rw_1.replication_port)
    try:
        taken = await sequencer.fetch_from(rw_1)
    finally:
        server.close()
    assert taken == 40 and behind.last_seq == 100
    assert list(behind.read()) == list(ahead.read())
    assert sequencer.term_at(100) == 1 and sequencer.log.client_last[b"c0".ljust(10)] == 100
    # Nothing is taken when the logs do not line up (our entry before the fetch point is of another term).
    other = cfg.open_journal(cfg.node("seq-a"))
    other.append(records(1, 50, term=1) + records(51, 55, term=2))
    stranger = Voter(cfg, cfg.node("seq-a"), other, can_lead=True)
    stranger.election.term = 2
    server = await asyncio.start_server(rewinder.serve, rw_1.host, rw_1.replication_port)
    try:
        assert await stranger.fetch_from(rw_1) == 0 and other.last_seq == 55
    finally:
        server.close()


def held_fdatasync(monkeypatch):
    """fdatasync that waits until the test lets it go: what a slow disk does, on demand."""
    release, real = threading.Event(), os.fdatasync

    def held(fd):
        assert release.wait(30), "the test never released the fsync"
        real(fd)

    monkeypatch.setattr(os, "fdatasync", held)
    return release


async def until(condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_an_ack_waits_for_the_fsync_that_makes_its_entries_durable(tmp_path, monkeypatch):
    """With the fsyncs off the event loop (node/journal_sync.py), the journal write returns
    at once, but the ack that promises the entries is sent only once they are on disk; a
    reply after it (a pre-vote answer, which promises nothing) keeps its place behind it."""
    cfg = parse(tomllib.loads(default_toml(tmp_path, sequencers=2, free=True)))
    rw_1, seq_a = cfg.node("rw-1"), cfg.node("seq-a")
    Path(rw_1.data).mkdir(parents=True, exist_ok=True)
    VoteStore(Path(rw_1.data) / "election.json").save(1, None)
    journal = cfg.open_journal(rw_1)
    release = held_fdatasync(monkeypatch)
    voter = Voter(cfg, rw_1, journal, can_lead=False)
    syncer = voter.sync_in_background()
    server = await asyncio.start_server(voter.serve, rw_1.host, rw_1.replication_port)
    sock = socket.create_connection((rw_1.host, rw_1.replication_port))
    sock.setblocking(False)
    frames, got = rep.FrameReader(), []

    def received():
        try:
            got.extend(frames.feed(sock.recv(65536)))
        except BlockingIOError:
            pass
        return got

    try:
        await until(received, "the hello")
        entries = [m for _, _, m in records(1, 50)]
        sock.sendall(rep.encode_append(1, seq_a.wire_name, 0, 0, 0, 1, entries)
                     + rep.encode_vote_request(2, cfg.node("seq-b").wire_name, 50, 1, True))
        await until(lambda: journal.last_seq == 50, "the entries written")
        await asyncio.sleep(0)  # what the voter sends with the write would be in our socket by now
        assert [type(f).__name__ for f in received()] == ["Hello"] and journal.durable_seq == 0
        release.set()
        await until(lambda: len(received()) == 3, "the ack and the vote")
        assert isinstance(got[1], rep.Ack) and got[1].success and got[1].last_seq == 50
        assert isinstance(got[2], rep.Vote) and journal.durable_seq == 50
    finally:
        release.set()
        sock.close()
        server.close()
        syncer.close()
        journal.close()
