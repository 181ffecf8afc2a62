"""VoterNode (protocol/voter_node.py): every decision of a voter's replication endpoint, over
the frames' bytes, as its shell (runtime/voter_shell.py) and the simulator drive it."""

import random

import pytest

from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol import voter_node as vn
from tape.protocol.election import Persist
from tape.protocol.errors import InvariantViolation

MS = 1_000_000
ELECTION = 300 * MS
A, B, R1, R2 = (n.ljust(10).encode() for n in ("seq-a", "seq-b", "rw-1", "rw-2"))


def msg(i: int) -> bytes:
    return M.stamp(M.purchase_request(i, 10, "c", "S"), i, b"c0".ljust(10), i)


def records(first: int, last: int, term: int = 1) -> list:
    return [(s, term, msg(s)) for s in range(first, last + 1)]


SPACE = vn.FreeSpace(stop=4 << 20, resume=16 << 20)


def node(name=R1, can_lead=False, log=(), found=True, term=1, now=0) -> vn.VoterNode:
    return vn.VoterNode(name, [A, B, R1, R2], can_lead, random.Random(7), ELECTION, term, None, (0, 0), found,
                        list(log), now, free_space=SPACE)


def frames(actions, conn=None) -> list:
    """The frames the actions send (on `conn`, if named)."""
    data = b"".join(a.data for a in actions if isinstance(a, vn.Send) and conn in (None, a.conn))
    return rep.FrameReader().feed(data)


def kinds(actions) -> list:
    return [type(a).__name__ for a in actions]


def test_a_served_connection_is_greeted_and_a_reads_appends_are_acked_after_one_sync():
    v = node()
    assert frames(v.on_connected("c", 0)) == [rep.Hello(1, R1, 0, 0)]
    appends = b"".join(rep.encode_append(1, A, s - 1, 1 if s > 1 else 0, s - 1, 1, [msg(i) for i in range(s, s + 5)])
                       for s in (1, 6, 11))
    out = v.on_data("c", appends[:7], 1)  # a frame cut anywhere waits for the rest
    assert out[-1] == vn.SYNC and not frames(out)
    out = v.on_data("c", appends[7:], 2)
    assert kinds(out) == ["AppendRecords"] * 3 + ["SyncJournal", "Send", "Committed"]
    assert not any(a.sync for a in out[:3])  # one sync for the read, before the reply
    assert [f.last_seq for f in frames(out)] == [5, 10, 15] and out[-1] == vn.Committed(10)


def test_a_vote_is_persisted_before_it_is_sent():
    v = node(term=0)
    v.on_connected("c", 0)
    out = v.on_data("c", rep.encode_vote_request(3, A, 0, 0), 1)
    send = next(i for i, a in enumerate(out) if isinstance(a, vn.Send))
    assert Persist(3, A) in out[:send] and vn.Voted(A, 3) in out
    assert frames(out) == [rep.Vote(3, R1, True, False)]


def test_a_fetch_is_answered_from_the_journal_and_ends_with_an_empty_append():
    v = node(log=records(1, 10))
    v.on_connected("c", 0)
    out = v.on_data("c", rep.encode_fetch(4, 1), 1)
    read = next(a for a in out if isinstance(a, vn.ReadJournal))
    assert (read.first, read.count) == (4, vn.FETCH_MAX)
    answer = frames(v.on_read(read, records(4, 10), 2))
    assert [(a.prev_seq, a.count) for a in answer] == [(3, 7), (10, 0)]
    v.on_connected("d", 3)  # a log that does not continue ours: only the empty append
    out = v.on_data("d", rep.encode_fetch(4, 9), 4)
    read = next(a for a in out if isinstance(a, vn.ReadJournal))
    assert read.count == 0 and [a.count for a in frames(v.on_read(read, [], 5))] == [0]


def test_what_must_not_come_closes_the_connection_with_its_reason():
    v = node()
    v.on_connected("c", 0)
    bad = v.on_data("c", b"\x00\x00\x00\x01Z", 1)
    assert bad[-1].conn == "c" and bad[-1].reason is vn.Reject.BAD_FRAME
    v.on_connected("d", 2)
    odd = v.on_data("d", rep.encode_ack(1, A, True, 0), 3)
    assert odd[-1].reason is vn.Reject.UNEXPECTED_FRAME
    assert v.on_data("d", rep.encode_hello(1, A, 0, 0), 4) == []  # (closed: what was in flight is nothing)


def test_a_frame_naming_another_voter_than_the_link_proved_closes_it():
    """With keys, the handshake proves which voter is at the other end: an append or a vote
    request in another's name (a follower's key used to pose as the leader) is refused, and so is
    a dialed voter answering in another's name."""
    v = node()
    v.on_connected("c", 0, peer=R2)
    out = v.on_data("c", rep.encode_append(1, A, 0, 0, 0, 1, [msg(1)]), 1)
    assert out[-1].conn == "c" and out[-1].reason is vn.Reject.NOT_THE_PEER and not frames(out)
    v.on_connected("d", 2, peer=R2)
    out = v.on_data("d", rep.encode_vote_request(5, A, 9, 1), 3)
    assert out[-1].reason is vn.Reject.NOT_THE_PEER and v.election.term == 1  # nothing it said was taken
    v.on_connected("e", 4, peer=A)
    assert kinds(v.on_data("e", rep.encode_append(1, A, 0, 0, 0, 1, [msg(1)]), 5))[0] == "AppendRecords"
    w = node(found=False)
    ask = next(a for a in w.on_timer(0) if isinstance(a, vn.Dial))
    w.on_connected(ask.conn, 1)
    out = w.on_data(ask.conn, rep.encode_hello(1, B if ask.peer != B else A, 0, 0), 2)
    assert out[-1].reason is vn.Reject.NOT_THE_PEER


def test_a_voter_without_its_election_state_greets_every_connection_and_asks_each_voter_for_its_hello():
    v = node(found=False, term=0)
    assert kinds(v.on_connected("c", 0)) == ["Send", "Close"]  # greeted, hung up
    dials = [a for a in v.on_timer(0) if isinstance(a, vn.Dial)]
    assert {d.peer for d in dials} == {A, B, R2}
    assert not any(isinstance(a, vn.Dial) for a in v.on_timer(ELECTION // 4))  # (each voter is being asked)
    out = []
    for d, term in zip(dials, (4, 2, 3)):
        assert v.on_connected(d.conn, 1) == []
        out += v.on_data(d.conn, rep.encode_hello(term, d.peer, 0, 0), 2)
    assert vn.Recovered(3, 4, (0, 0)) in out and any(isinstance(a, Persist) and a.term == 4 for a in out)
    assert not v.core.recovering and frames(v.on_connected("e", 3))[0].term == 4


def test_greetings_not_answered_are_asked_again_each_half_timeout():
    v = node(found=False, term=0)
    first = [a for a in v.on_timer(0) if isinstance(a, vn.Dial)]
    for d in first:
        v.on_closed(d.conn, 1)  # refused: the voter is down
    assert not any(isinstance(a, vn.Dial) for a in v.on_timer(ELECTION // 2 - 1))
    again = [a for a in v.on_timer(ELECTION // 2) if isinstance(a, vn.Dial)]
    assert {d.peer for d in again} == {A, B, R2}


def test_the_first_election_comes_within_a_quarter_to_a_half_of_the_timeout():
    for seed in range(20):
        v = vn.VoterNode(A, [A, B, R1, R2], True, random.Random(seed), ELECTION, 1, None, (0, 0), True, [], 0,
                         free_space=SPACE)
        assert ELECTION // 4 <= v.election.deadline <= ELECTION // 2


def campaign(v: vn.VoterNode) -> list:
    """Tick as the shell does (every tick_ns: no stall) until the pre-vote; its dials."""
    now = 0
    while not (out := v.on_timer(now)) or not isinstance(out[0], vn.RequestVotes):
        now += v.tick_ns
    assert out[0].pre
    return [a for a in out if isinstance(a, vn.Dial)]


def test_a_campaign_asks_each_voter_on_a_connection_of_its_own_and_wins_on_a_majority():
    v = node(A, can_lead=True, log=records(1, 5))
    dials = campaign(v)
    assert {d.peer for d in dials} == {B, R1, R2}
    for d in dials:
        assert frames(v.on_connected(d.conn, 1)) == [rep.VoteRequest(2, A, 5, 1, True)]
    out = v.on_data(dials[0].conn, rep.encode_hello(1, dials[0].peer, 5, 1) + rep.encode_vote(2, dials[0].peer, True,
                                                                                               True), 2)
    assert vn.Close(dials[0].conn) in out
    out = v.on_data(dials[1].conn, rep.encode_vote(2, dials[1].peer, True, True), 3)
    real = [a for a in out if isinstance(a, vn.Dial)]  # the pre-vote won: the real vote, on new connections
    assert len(real) == 3 and any(isinstance(a, Persist) and a.voted_for == A for a in out)
    for d in real[:2]:
        v.on_connected(d.conn, 4)
        out = v.on_data(d.conn, rep.encode_vote(2, d.peer, True, False), 5)
    assert vn.Lead(2) in out


def test_a_vote_refused_by_a_voter_ahead_of_us_fetches_what_it_holds():
    v = node(A, can_lead=True, log=records(1, 5))
    d = campaign(v)[0]
    v.on_connected(d.conn, 1)
    out = v.on_data(d.conn, rep.encode_hello(1, d.peer, 9, 1) + rep.encode_vote(1, d.peer, False, True), 2)
    fetch = out[-1]
    assert vn.Close(d.conn) in out and isinstance(fetch, vn.Dial) and fetch.peer == d.peer
    assert frames(v.on_connected(fetch.conn, 3)) == [rep.Fetch(1, 0)]  # from our commit point
    answer = rep.encode_runs(1, d.peer, 0, 0, 9, records(1, 9)) + rep.encode_append(1, d.peer, 9, 1, 9, 1, [])
    out = v.on_data(fetch.conn, answer[:100], 4) + v.on_data(fetch.conn, answer[100:], 5)
    assert [r[0] for r in out[0].records] == [6, 7, 8, 9]  # (what we hold is not taken again)
    assert out[0].sync and vn.Fetched(d.peer, 4, 9, 1) in out and out[-1] == vn.Close(fetch.conn)
    assert v.core.position() == (9, 1)


def test_a_fetched_entry_of_a_later_term_cuts_our_uncommitted_suffix_first():
    v = node(A, can_lead=True, log=records(1, 8, term=1), term=2)
    fetch = v.fetch_from(R1)[0]
    v.on_connected(fetch.conn, 1)
    answer = rep.encode_runs(2, R1, 0, 0, 0, records(1, 5) + records(6, 7, term=2))
    out = v.on_data(fetch.conn, answer, 2)
    assert out[-2:] == [vn.Truncate(5), vn.Reload(vn.Why.TRUNCATED)]  # the rest waits for the journal
    out = v.on_log(out[-1], records(1, 5), 3)
    assert [r[0] for r in out[0].records] == [6, 7] and v.core.position() == (7, 2)


def test_a_connection_that_keeps_us_waiting_is_closed_at_its_deadline():
    v = node(A, can_lead=True)
    d = campaign(v)[0]
    v.on_connected(d.conn, 10)
    assert v.next_deadline(11) <= 10 + ELECTION
    assert vn.Close(d.conn) in v.on_timer(10 + ELECTION)
    assert d.conn not in v.dialed


def test_a_refused_write_steps_down_reloads_the_log_and_hangs_up():
    v = node(log=records(1, 5))
    v.on_connected("c", 0)
    v.on_data("c", rep.encode_append(1, A, 5, 1, 0, 1, [msg(6)]), 1)
    out = v.on_disk_full("c", 2)
    assert out == [vn.StepDown("disk full", vn.Cause.DISK_FULL), vn.Reload(vn.Why.DISK_FULL)]
    out = v.on_log(out[1], records(1, 5), 3)  # the refused append undone
    assert out[-1] == vn.Close("c") and v.core.position() == (5, 1) and v.core.absent
    assert kinds(v.on_connected("d", 4)) == ["Send", "Close"]
    assert v.on_free_space(SPACE.resume - 1, 5) == []  # not yet: it would flap on the last few blocks
    assert v.on_free_space(SPACE.resume, 5) == [vn.SpaceBack(SPACE.resume)]
    assert kinds(v.on_connected("e", 6)) == ["Send"]


def test_too_little_free_space_stops_it_before_a_write_is_refused():
    v = node(log=records(1, 5))
    assert v.on_free_space(SPACE.stop, 1) == []
    out = v.on_free_space(SPACE.stop - 1, 2)
    assert out == [vn.SpaceLow(SPACE.stop - 1, SPACE.resume), vn.StepDown("disk full", vn.Cause.DISK_FULL),
                   vn.Reload(vn.Why.DISK_FULL)]
    v.on_log(out[-1], records(1, 5), 3)
    assert v.election.disk_full and kinds(v.on_connected("d", 4)) == ["Send", "Close"]
    assert v.on_free_space(0, 5) == []  # stopped: told again, nothing more to do
    assert v.on_free_space(SPACE.resume, 6) == [vn.SpaceBack(SPACE.resume)] and not v.election.disk_full


def test_the_leaders_connection_closed_by_its_peer_means_it_is_gone():
    v = node()
    v.on_connected("c", 0)
    v.on_data("c", rep.encode_append(1, A, 0, 0, 0, 1, []), 1)
    assert v.on_closed("c", 2, by_peer=False) == []  # a drill's cut: not the leader's doing
    v.on_connected("d", 3)
    v.on_data("d", rep.encode_append(1, A, 0, 0, 0, 1, []), 4)
    assert v.on_closed("d", 5) == [vn.LeaderGone(1)]


def test_a_tick_after_a_long_gap_reports_the_stall():
    v = node(A, can_lead=True)
    v.on_timer(1)
    stalled = [a for a in v.on_timer(1 + ELECTION) if isinstance(a, vn.Stalled)]
    assert stalled and stalled[0].held_ns == ELECTION - v.election.stall_ns
    assert v.next_deadline(2 + ELECTION) <= 2 + ELECTION + v.tick_ns


def test_an_event_that_leaves_an_impossible_state_raises_invariant_violation():
    """VoterNode.check after every event: a term never goes back, one vote a term, the commit
    point within the log. Each fails on the state that breaks it."""
    v = node(term=2)
    v.on_connected("c", 0)
    v.on_data("c", rep.encode_vote_request(2, A, 0, 0), 1)  # votes for seq-a in term 2
    v.election.voted_for = B  # and then for another, in the same term
    with pytest.raises(InvariantViolation, match="term 2"):
        v.on_timer(2)
    v = node(term=3)
    v.election.term = 1
    with pytest.raises(InvariantViolation, match="became term 1"):
        v.on_closed("nothing", 1)
    v = node(log=records(1, 3))
    v.core.follower.commit_seq = 4
    with pytest.raises(InvariantViolation, match="commit point 4 beyond"):
        v.on_connected("c", 1)


def test_a_frame_that_makes_this_node_step_down_ends_the_read_until_the_shell_has():
    """A vote request of a later term, then an append, in one read: the append is judged only
    once the shell carried out the step-down (Resume), as the leader's state hands over then."""
    v = node(A, can_lead=True, log=records(1, 10))
    e = v.election
    e.role, e.leader = "leader", A  # (leading term 1)
    v.on_connected("c", 0)
    data = rep.encode_vote_request(5, B, 10, 1) + rep.encode_append(5, B, 10, 1, 10, 5, [msg(11)])
    out = v.on_data("c", data, 1)
    assert any(isinstance(a, vn.StepDown) for a in out) and out[-1] == vn.Resume("c")
    assert frames(out) == [rep.Vote(5, A, True, False)] and not any(isinstance(a, vn.AppendRecords) for a in out)
    out = v.on_data("c", b"", 2)  # (the shell stepped down: the rest of the read)
    assert [r[0] for r in next(a for a in out if isinstance(a, vn.AppendRecords)).records] == [11]
    assert [f.last_seq for f in frames(out)] == [11] and out[-1] != vn.Resume("c")
