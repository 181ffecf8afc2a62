"""VoterCore (protocol/voter.py), the decisions every voter's endpoint and the simulator run."""

import random

from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol.election import Persist, Refused
from tape.protocol.voter import AppendRecords, LogState, Truncate, VoterCore

MS = 1_000_000
A, B, R1, R2 = (n.ljust(10).encode() for n in ("seq-a", "seq-b", "rw-1", "rw-2"))


def msg(i: int) -> bytes:
    return M.stamp(M.purchase_request(i, 10, "c", "S"), i, b"c0".ljust(10), i)


def append(term, prev, prev_term, commit, entries_term, seqs, leader=A):
    body = [msg(i) for i in seqs]
    return rep.Append(term, leader, prev, prev_term, commit, entries_term, len(body), b"".join(body))


def core(records=()) -> VoterCore:
    return VoterCore(R1, [A, B, R1, R2], False, random.Random(1), (300 * MS, 600 * MS), 0, None, 0, records)


def test_appends_become_journal_actions_and_the_ack_follows_them():
    c = core()
    ack, actions = c.on_append(append(1, 0, 0, 0, 1, range(1, 6)), "conn", 0)
    assert actions[0] == Persist(1, None) and isinstance(actions[-1], AppendRecords)
    assert [r[0] for r in actions[-1].records] == [1, 2, 3, 4, 5]
    assert ack == rep.Ack(1, R1, True, 5) and c.position() == (5, 1)
    assert c.log.client_last[b"c0".ljust(10)] == 5


def test_a_conflicting_uncommitted_suffix_is_truncated_then_replaced():
    c = core([(s, 1, msg(s)) for s in range(1, 11)])
    _, actions = c.on_append(append(2, 5, 1, 5, 2, range(6, 8), leader=B), "conn", 0)
    assert Truncate(5) in actions and isinstance(actions[-1], AppendRecords)
    assert c.position() == (7, 2) and c.truncations == 1


def test_an_append_that_would_drop_committed_entries_is_refused_not_fatal():
    c = core([(s, 1, msg(s)) for s in range(1, 11)])
    c.on_append(append(1, 10, 1, 10, 1, []), "conn", 0)  # seqs 1..10 committed
    ack, actions = c.on_append(append(2, 5, 1, 10, 2, range(6, 8), leader=B), "conn", 0)  # a forged or broken peer
    assert not ack.success and [a.reason for a in actions if isinstance(a, Refused)] == ["drop_committed"]
    assert not any(isinstance(a, (Truncate, AppendRecords)) for a in actions)
    assert c.position() == (10, 1) and c.commit_seq == 10  # nothing changed
    ack, _ = c.on_append(append(2, 10, 1, 10, 2, [11]), "conn", 0)  # beyond what is committed: taken
    assert ack.success and c.position() == (11, 2)


def test_only_the_close_of_the_leaders_own_connection_by_its_peer_means_it_is_gone():
    c = core()
    c.on_append(append(1, 0, 0, 0, 1, [1]), "leader-conn", 0)
    assert not c.on_closed("other-conn", True, 1)
    assert not c.on_closed("leader-conn", False, 1) and not c.election.leader_gone  # we closed it
    c.on_append(append(1, 1, 1, 0, 1, []), "leader-conn", 2)
    assert c.on_closed("leader-conn", True, 3)


def test_fetch_answers_only_a_log_that_continues_the_askers():
    c = core([(s, 1, msg(s)) for s in range(1, 11)])
    assert c.fetch_start(rep.Fetch(6, 1)) == (5, 1)
    assert c.fetch_start(rep.Fetch(6, 2)) is None  # the asker's entry 5 is of another term
    assert c.fetch_start(rep.Fetch(50, 1)) is None  # beyond our log


ORIGINS = [n.ljust(10).encode() for n in ("c0", "c1", "seq-a")]
KINDS = [M.REQUEST, M.PURCHASE, M.REJECTED, M.AUTH, M.SESSION_END, M.TIME_TICK, M.TERM_START]


@given(st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(ORIGINS), st.integers(0, 50)), max_size=60),
       st.integers(1, 1000))
def test_noting_a_batch_at_once_equals_noting_each_record(entries, first):
    """LogState's batch path (one pass over the appended bytes) keeps what the per-record one keeps:
    each client's last seq, the last seal, the session's end, the term and the last position."""
    records = [(first + i, 3, M.SEQUENCED.pack(kind, 0, 0, b" " * 16, b" " * 8, 0, 0, origin, cseq))
               for i, (kind, origin, cseq) in enumerate(entries)]
    batch, each = LogState(), LogState()
    batch.client_last = {ORIGINS[0]: 20}
    each.client_last = {ORIGINS[0]: 20}
    batch.note(records)
    each._note_each(records)
    assert vars(batch) == vars(each)


def test_a_leaders_own_batches_move_the_log_a_later_leaders_append_is_judged_against():
    """An append of a later term reaching a leader before its step-down is carried out: judged
    against the log it journaled (note_own), not the one it had when it began to lead (an append
    from seq 1 was taken as continuing an empty log, and the journal refused it: exit 1)."""
    c = VoterCore(A, [A, B, R1, R2], True, random.Random(1), (300 * MS, 600 * MS), 1, A, 0, [])
    c.note_own(1, 10, 1)
    ack, actions = c.on_append(append(2, 0, 0, 0, 2, range(1, 3), leader=B), "conn", 1)
    assert Truncate(0) in actions and actions.index(Truncate(0)) < next(
        i for i, a in enumerate(actions) if isinstance(a, AppendRecords))
    ack, _ = c.on_append(append(2, 10, 1, 0, 2, range(11, 12), leader=B), "conn2", 2)
    assert not ack.success and ack.last_seq == 2  # (its log is now the new leader's 1..2)
