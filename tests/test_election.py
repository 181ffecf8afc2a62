"""ElectionCore (pure): pre-vote, one vote per term, the election
restriction, stepping down on a higher term and on a lost majority."""

import random

from tape.protocol.election import (
    CANDIDATE,
    FOLLOWER,
    LEADER,
    PRE_CANDIDATE,
    VOTE_LOST,
    Cause,
    ElectionCore,
    Lead,
    Persist,
    RequestVotes,
    StepDown,
)

A, B, R1, R2 = b"seq-a     ", b"seq-b     ", b"rw-1      ", b"rw-2      "
VOTERS = [A, B, R1, R2]
MS = 1_000_000


def core(name=A, can_lead=True, log=(0, 0), term=0, now=0):
    return ElectionCore(name, VOTERS, can_lead, lambda: log, random.Random(1), (300 * MS, 600 * MS), term, None, now)


def kinds(actions):
    return [type(a).__name__ for a in actions]


def elect(c, now):
    """Drive `c` through pre-vote and vote with every other voter granting."""
    acts = c.on_tick(now)
    assert acts[-1] == RequestVotes(True, c.term + 1, *c.log_position())
    for v in VOTERS[1:3]:
        acts = c.on_vote(c.term + 1, v, True, True, now)
    assert isinstance(acts[-1], RequestVotes) and not acts[-1].pre and acts[0] == Persist(c.term, c.name)
    for v in VOTERS[1:3]:
        acts = c.on_vote(c.term, v, True, False, now)
    return acts


def test_a_sequencer_campaigns_after_its_timeout_and_wins_with_a_majority():
    c = core()
    assert c.on_tick(299 * MS) == []  # no election before the minimum timeout
    acts = elect(c, 700 * MS)
    assert acts == [Lead(1)] and c.role == LEADER and c.term == 1 and c.leader == A


def test_rewinders_never_campaign():
    c = core(R1, can_lead=False)
    assert c.on_tick(10_000 * MS) == [] and c.role == FOLLOWER


def test_a_pre_vote_changes_no_term_and_is_refused_while_a_leader_is_heard():
    c = core(R1, can_lead=False)
    ok, _ = c.on_append(1, A, 100 * MS)
    assert ok and c.term == 1
    granted, acts = c.on_vote_request(2, B, 50, 1, True, 200 * MS)  # A was heard 100 ms ago
    assert not granted and acts == [] and c.term == 1
    granted, acts = c.on_vote_request(2, B, 50, 1, True, 500 * MS)  # silent for 400 ms
    assert granted and acts == [] and c.term == 1


def test_one_vote_per_term_and_only_for_an_up_to_date_log():
    c = core(R1, can_lead=False, log=(100, 2), term=2)
    granted, _ = c.on_vote_request(3, A, 99, 2, False, 0)  # shorter log, same last term
    assert not granted and c.term == 3
    granted, acts = c.on_vote_request(3, B, 100, 2, False, 0)
    assert granted and Persist(3, B) in acts
    granted, _ = c.on_vote_request(3, A, 200, 2, False, 0)  # already voted in term 3
    assert not granted
    granted, _ = c.on_vote_request(4, A, 50, 3, False, 0)  # a later last term wins over length
    assert granted and c.voted_for == A


def test_a_leader_steps_down_on_a_higher_term_and_without_a_majority():
    c = core()
    elect(c, 700 * MS)
    for v in (B, R1, R2):
        assert c.on_ack(v, 1, 800 * MS) == []
    assert c.on_tick(1000 * MS) == []
    acts = c.on_ack(R1, 5, 1001 * MS)
    assert kinds(acts) == ["Persist", "StepDown"] and c.role == FOLLOWER and c.term == 5
    d = core()
    elect(d, 700 * MS)
    d.on_ack(R1, 1, 800 * MS)  # only one follower answers: leader + 1 < 3
    acts = d.on_tick(1100 * MS)
    assert kinds(acts) == ["StepDown"] and "check-quorum" in acts[0].reason and d.role == FOLLOWER


def ticked_leader(stall_ns):
    """A leader elected on ticks 10 ms apart, every follower just heard; returns it and the time."""
    c = ElectionCore(A, VOTERS, True, lambda: (0, 0), random.Random(1), (300 * MS, 600 * MS), stall_ns=stall_ns)
    t = 0
    while c.role != LEADER:
        t += 10 * MS
        if c.on_tick(t):
            for v in (B, R1):
                c.on_vote(c.term + 1, v, True, True, t)
            for v in (B, R1):
                c.on_vote(c.term, v, True, False, t)
    assert c.stalls == 0
    return c, t


def test_a_leader_that_was_not_running_judges_its_followers_only_on_time_it_was_listening():
    (held, t), (plain, _) = ticked_leader(50 * MS), ticked_leader(None)
    # Not scheduled for 500 ms: the acks sent meanwhile are still unread at the first tick.
    assert kinds(plain.on_tick(t + 500 * MS)) == ["StepDown"]
    assert held.on_tick(t + 500 * MS) == [] and held.role == LEADER
    assert held.stalls == 1 and held.held_ns == 450 * MS
    for v in (R1, R2):
        held.on_ack(v, 1, t + 501 * MS)  # read right after
    # Cut off for real from then on: it steps down once it has listened for a whole timeout.
    quiet = [held.on_tick(t + 510 * MS + i * 10 * MS) for i in range(31)]  # the last at 309 ms
    assert quiet[:-1] == [[]] * 30 and kinds(quiet[-1]) == ["StepDown"]
    assert held.stalls == 1


def test_a_node_starved_for_good_still_times_out():
    c, t = ticked_leader(50 * MS)
    # Every tick 60 ms late: each holds the timers by 10 ms, so time still moves 50 ms a tick.
    ticks = 1
    while c.on_tick(t + ticks * 60 * MS) == []:
        ticks += 1
    assert ticks == 6 and c.role == FOLLOWER and c.stalls == 6 and c.held_ns == 60 * MS  # 6 x 50 ms listened


def test_a_follower_back_from_a_stall_reads_its_leader_before_it_campaigns():
    c = ElectionCore(B, VOTERS, True, lambda: (0, 0), random.Random(1), (300 * MS, 600 * MS), stall_ns=50 * MS)
    assert c.on_tick(10 * MS) == [] and c.on_append(1, A, 15 * MS)[0]
    assert c.on_tick(20 * MS) == []
    # Stopped from 20 ms to 2 s: past any deadline, yet no campaign, and no pre-vote granted.
    assert c.on_tick(2000 * MS) == [] and c.role == FOLLOWER and c.stalls == 1
    assert c.on_vote_request(2, R1, 0, 0, True, 2000 * MS) == (False, [])
    assert c.on_append(1, A, 2001 * MS)[0] and c.on_tick(2010 * MS) == [] and c.leader == A


def test_a_rejected_pre_vote_teaches_the_candidate_the_higher_term():
    c = core()
    c.on_tick(700 * MS)
    assert c.role == PRE_CANDIDATE
    acts = c.on_vote(6, R1, False, True, 701 * MS)
    assert c.term == 6 and c.role == FOLLOWER and acts[0] == Persist(6, None)


def test_a_candidate_yields_to_the_winner_of_its_term():
    c = core()
    c.on_tick(700 * MS)
    c.on_vote(1, R1, True, True, 700 * MS)
    c.on_vote(1, R2, True, True, 700 * MS)
    assert c.role == CANDIDATE and c.term == 1
    ok, acts = c.on_append(1, B, 710 * MS)
    assert ok and kinds(acts) == ["StepDown"] and c.role == FOLLOWER and c.leader == B


def test_an_append_from_another_leader_of_this_leaders_term_is_refused_and_said_so():
    c = core()
    elect(c, 700 * MS)
    ok, actions = c.on_append(1, B, 800 * MS)  # forged, or a broken peer: input, not a reason to stop
    assert not ok and [a.reason for a in actions] == ["two_leaders"] and c.role == LEADER


def test_a_closed_leader_connection_brings_the_campaign_forward_and_frees_pre_votes():
    standby, rewinder = core(B), core(R1, can_lead=False)
    for c in (standby, rewinder):
        assert c.on_append(1, A, 100 * MS)[0]
    # Stale news (another term, another node) changes nothing.
    assert standby.on_leader_lost(A, 0, 101 * MS) == [] and standby.on_leader_lost(R2, 1, 101 * MS) == []
    assert standby.deadline >= 400 * MS
    granted, _ = rewinder.on_vote_request(2, B, 50, 1, True, 110 * MS)
    assert not granted  # the leader was heard 10 ms ago
    for c in (standby, rewinder):
        c.on_leader_lost(A, 1, 110 * MS)
    assert 140 * MS <= standby.deadline <= 170 * MS  # a tenth to a fifth of the 300 ms timeout
    assert standby.on_tick(standby.deadline)[-1].pre is True
    granted, _ = rewinder.on_vote_request(2, B, 50, 1, True, 111 * MS)
    assert granted and rewinder.term == 1  # a pre-vote still changes no term
    assert rewinder.on_tick(10_000 * MS) == []  # a rewinder still never campaigns
    # The leader speaks again (the connection was a blip): it counts as alive again.
    rewinder.on_append(1, A, 120 * MS)
    assert not rewinder.on_vote_request(2, B, 50, 1, True, 121 * MS)[0]


def test_after_a_closed_leader_connection_only_pre_vote_rounds_are_short():
    c = core(B)
    c.on_append(1, A, 100 * MS)
    c.on_leader_lost(A, 1, 110 * MS)
    now = c.deadline
    c.on_tick(now)  # a pre-vote nobody answers (the others have not seen the close yet)
    assert c.role == PRE_CANDIDATE and c.deadline - now <= 60 * MS
    now = c.deadline
    c.on_tick(now)
    c.on_vote(2, R1, True, True, now + MS)
    acts = c.on_vote(2, R2, True, True, now + MS)
    assert c.role == CANDIDATE and isinstance(acts[-1], RequestVotes) and not acts[-1].pre
    assert c.deadline - (now + MS) >= 300 * MS  # a real election waits out its votes' fsyncs
    c.on_vote(2, R1, True, False, now + 2 * MS)
    assert c.on_vote(2, R2, True, False, now + 2 * MS) == [Lead(2)] and not c.leader_gone


# --- a voter that lost its election state (issue 15) ----------------------------------------


def recovering(name=R1, log=(0, 0)):
    return ElectionCore(name, VOTERS, False, lambda: log, random.Random(1), (300 * MS, 600 * MS), 0, None, 0,
                        recovering=True)


def test_a_recovering_voter_does_nothing_until_every_other_voter_greeted_it():
    c = recovering()
    far = 10_000 * MS  # long after any timeout: no leader heard
    assert c.on_vote_request(1, B, 5, 1, True, far) == (False, [])
    assert c.on_vote_request(1, B, 5, 1, False, far) == (False, [])
    assert c.on_append(1, A, far) == (False, [])
    assert c.on_higher_term(9, A, far) == [] and c.on_tick(far) == []
    assert c.term == 0 and c.voted_for is None  # nothing adopted, nothing to persist
    assert c.on_peer_hello(A, 3, 40, 3, far) == [] and c.on_peer_hello(B, 1, 20, 1, far) == []
    assert c.on_peer_hello(A, 3, 40, 3, far) == []  # the same voter twice still counts once
    acts = c.on_peer_hello(R2, 2, 50, 2, far)
    assert acts == [Persist(3, VOTE_LOST, (3, 40))] and not c.recovering


def test_the_wiped_rewinder_of_the_issue_cannot_vote_twice_in_a_term():
    """rw-1 voted for seq-a in term 1, lost its disk, restarted empty: seq-b, still asking in term 1,
    must be refused (before: granted, as the empty log counted every candidate up to date)."""
    c = recovering()
    for voter, term in ((A, 1), (B, 1), (R2, 1)):
        c.on_peer_hello(voter, term, 0, 0, 0)
    far = 10_000 * MS
    assert c.term == 1
    assert c.on_vote_request(1, B, 0, 0, False, far)[0] is False  # the term it may have voted in
    assert c.on_vote_request(1, A, 0, 0, False, far)[0] is False  # anyone, even the one it voted for
    granted, acts = c.on_vote_request(2, B, 0, 0, False, far)
    assert granted and acts[-1] == Persist(2, B, (0, 0))  # a later term is a new vote


def test_a_recovered_voter_votes_only_for_logs_as_up_to_date_as_any_it_heard():
    """Its own log is gone, so it takes the best log heard for its own: a candidate missing what
    a majority may have committed cannot win with its vote."""
    c = recovering()
    c.on_peer_hello(A, 4, 100, 4, 0)
    c.on_peer_hello(B, 4, 90, 3, 0)
    c.on_peer_hello(R2, 4, 100, 4, 0)
    far = 10_000 * MS
    assert c.on_vote_request(5, B, 90, 3, True, far)[0] is False  # behind the floor: refused
    assert c.on_vote_request(5, B, 100, 4, True, far)[0] is True  # caught up (fetched from a voter)
    assert c.on_vote_request(5, B, 100, 4, False, far)[0] is True


def test_a_voter_alone_needs_no_hello():
    c = ElectionCore(A, [A], True, lambda: (0, 0), random.Random(1), (300 * MS, 600 * MS), recovering=True)
    assert not c.recovering and c.on_tick(600 * MS)[-1] == Lead(1)


def test_a_voter_whose_disk_is_full_steps_down_and_takes_no_part_until_space_returns():
    c = core()
    elect(c, 400 * MS)
    assert c.role == LEADER
    assert c.on_disk_full() == [StepDown("disk full", Cause.DISK_FULL)] and c.role == FOLLOWER and c.leader is None
    far = 10_000 * MS
    assert c.on_tick(far) == []  # no campaign: it could not persist its own vote
    assert c.on_vote_request(c.term + 1, B, 10**6, 9, False, far) == (False, [])
    assert c.on_append(c.term + 1, B, far) == (False, []) and c.on_higher_term(c.term + 5, B, far) == []
    assert c.on_disk_full() == []  # already out: nothing to step down from
    c.on_disk_ok(far)
    assert c.on_tick(far + 299 * MS) == []  # a whole timeout to hear the leader first
    assert kinds(c.on_tick(far + 600 * MS)) == ["RequestVotes"]


def test_the_next_deadline_is_when_a_tick_first_campaigns_and_none_while_nothing_can_time_out():
    """The shell ticks at the deadline (and at least every few ms for the stall clock): a tick just
    before it decides nothing, one at it campaigns; a leader and a rewinder have no such deadline."""
    c = core()
    due = c.next_deadline_ns()
    assert c.on_tick(due - 1) == [] and c.role == FOLLOWER
    assert kinds(c.on_tick(due)) == ["RequestVotes"] and c.next_deadline_ns() > due
    c.on_append(1, B, due + MS)  # heard a leader: the deadline moves a whole timeout on
    assert c.next_deadline_ns() >= due + MS + 300 * MS
    assert core(R1, can_lead=False).next_deadline_ns() is None
    leader = core()
    elect(leader, 700 * MS)
    assert leader.role == LEADER and leader.next_deadline_ns() is None
