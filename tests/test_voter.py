"""The voter shell (tape/voter.py) with real journals and real TCP: a
sequencer whose log is behind a rewinder's takes the missing entries, so it
can be elected when the leader died after replicating only to rewinders."""

import asyncio
import tomllib
from pathlib import Path

from tape.node.voter import Voter, VoteStore
from tape.ops.config import default_toml, parse
from tape.protocol import messages as M


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
