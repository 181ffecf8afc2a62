"""EmitterCore (replicas/emitter_core.py): which alerts are new, the delivery steps, copies, crash points."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tape.replicas.audit_core import Alert
from tape.replicas.emitter_core import (
    Crash,
    DeliverAlerts,
    EmitterCore,
    RecordDone,
    RecordIntent,
    Redeliver,
    TooFarAhead,
)

A, B, C = b"replica-A ", b"replica-B ", b"replica-C "


def alert(seq: int, cumulative: int = 150) -> bytes:
    """An alert's record, as a replica sends it."""
    return Alert(seq, seq, seq, 1, b"c".ljust(16), b"S".ljust(8), 100, cumulative, seq).encode()


def test_only_known_replicas_are_welcomed_with_the_mark():
    core = EmitterCore({A}, mark=7)
    assert core.on_hello(A) == 7 and core.on_hello(b"mallory   ") is None


def delivered(core: EmitterCore, new: list[bytes]) -> list:
    """core.deliver(new), its record committed (as the shell tells the core)."""
    steps = core.deliver(new) + (core.done_due() if core.deliver_first else [])
    core.on_recorded(next(s for s in steps if isinstance(s, RecordIntent)))
    return steps


def test_a_replica_is_acknowledged_when_the_recorded_mark_moved_past_what_it_was_told():
    core = EmitterCore({A, B, C}, mark=2)
    core.on_hello(A), core.on_hello(B)
    assert core.acks_due([A, B]) == {}  # welcomed with the mark
    delivered(core, core.on_alerts(A, [alert(3)])[0])
    assert core.acks_due([A, B]) == {A: 3, B: 3} and core.acks_due([A, B]) == {}  # once each
    core.on_alerts(B, [alert(3)])  # B's copy, raised at the mark it was told: it keeps none, told nothing
    assert core.acks_due([A, B]) == {}
    delivered(core, core.on_alerts(A, [alert(4)])[0])
    assert core.acks_due([A]) == {A: 4} and core.acks_due([A, B]) == {B: 4}  # only linked ones are told
    core.on_hello(C)  # a replica linked later is welcomed with the mark, then told what moves
    delivered(core, core.on_alerts(B, [alert(5)])[0])
    assert core.acks_due([A, B, C]) == {A: 5, B: 5, C: 5}
    delivered(core, core.on_alerts(A, [alert(6)])[0])
    assert core.acks_due([A]) == {A: 6}
    core.on_hello(B)  # a second connection naming B: its first one was told less, and still is
    assert core.acks_due([A, B, C]) == {B: 6, C: 6}


@pytest.mark.parametrize("deliver_first", [False, True])
def test_replicas_are_told_only_a_mark_whose_record_committed(deliver_first):
    """A replica drops its alerts up to the mark it is told. With deliver_first the mark moves
    before the sinks have the batch: told then, a replica would not send it again after a crash."""
    core = EmitterCore({A, B}, mark=2, deliver_first=deliver_first)
    core.on_hello(A)
    steps = core.deliver(core.on_alerts(A, [alert(3)])[0]) + (core.done_due() if deliver_first else [])
    assert core.mark == 3 and core.recorded == 2
    assert core.on_hello(B) == 2 and core.acks_due([A, B]) == {}  # nothing committed yet
    core.on_recorded(next(s for s in steps if isinstance(s, RecordIntent)))
    assert core.on_hello(B) == 3 and core.acks_due([A, B]) == {A: 3, B: 3} and core.told == {A: 3, B: 3}


def test_new_alerts_go_through_intent_deliver_done_and_move_the_mark():
    core = EmitterCore({A})
    new, copies, _ = core.on_alerts(A, [alert(3), alert(5)])
    assert copies == [] and core.deliver(new) == [RecordIntent(new, []), DeliverAlerts(new)]
    assert core.mark == 5 and core.delivered == 2
    later, copies, _ = core.on_alerts(B, [alert(5), alert(9)])  # another replica's channel: 5 is a copy
    assert seqs(later) == [9] and seqs(copies) == [5]
    assert core.deliver(later) == [RecordIntent(later, new), DeliverAlerts(later)]  # done rides the next intent
    assert core.done_due() == [RecordDone(later)] and core.done_due() == []  # or goes alone, once


def seqs(alerts):
    return [Alert.emit_seq_of(a) for a in alerts]


@given(st.lists(st.integers(1, 40), max_size=24), st.integers(0, 40))
def test_first_delivery_splits_any_batch_as_its_alerts_one_by_one(emit_seqs, mark):
    """Under `first` a batch's alert is new if its emit seq is above the mark and every new one before
    it, else a copy, in whatever order a (faulty) replica sends them: the fast paths agree."""
    alerts = [alert(seq, cumulative=i) for i, seq in enumerate(emit_seqs)]
    new, copies, last = [], [], mark
    for a, seq in zip(alerts, emit_seqs):
        (copies if seq <= last else new).append(a)
        last = max(last, seq)
    assert EmitterCore({A}, mark=mark).on_alerts(A, alerts) == (new, copies, [])


def test_a_record_of_another_size_is_refused_not_misread():
    """Records are read end to end: a shorter one next to a longer one would shift every field after it."""
    with pytest.raises(ValueError):
        EmitterCore({A}).on_alerts(A, [alert(1)[:-1], alert(2) + b"\0"])


def test_first_delivery_takes_a_forged_alert_quorum_does_not():
    forged = alert(4, cumulative=10**9)  # a compromised replica's alert, sent first
    first = EmitterCore({A, B, C})
    assert first.on_alerts(A, [forged])[0] == [forged]
    quorum = EmitterCore({A, B, C}, delivery="quorum")
    assert quorum.on_alerts(A, [forged]) == ([], [], [])  # B and C may still send emit seq 4
    assert quorum.on_alerts(B, [alert(7)]) == ([], [], [])  # B went past 4 without it; C may still send it
    new, _, alarms = quorum.on_alerts(C, [alert(7)])  # so did C: 4 can reach no quorum
    assert alarms == [forged] and new == [alert(7)] and quorum.divergences == 1


def test_quorum_delivers_identical_copies_in_order_and_outvotes_a_changed_one():
    core = EmitterCore({A, B, C}, delivery="quorum")
    changed = alert(3, cumulative=999)
    assert core.on_alerts(A, [changed, alert(5)]) == ([], [], [])
    new, _, alarms = core.on_alerts(B, [alert(3)])  # 3 has one vote each way, and C may still send it
    assert (new, alarms) == ([], [])
    new, _, alarms = core.on_alerts(C, [alert(3), alert(5)])
    assert new == [alert(3), alert(5)] and alarms == [changed]
    core.deliver(new)
    new, copies, alarms = core.on_alerts(B, [alert(5)])  # a third copy, below the mark: judged as a copy
    assert (new, seqs(copies), alarms) == ([], [5], [])


def test_quorum_waits_for_a_replica_that_may_still_send():
    core = EmitterCore({A, B, C}, delivery="quorum")
    core.on_alerts(A, [alert(2)])
    assert core.on_alerts(A, [alert(3)]) == ([], [], [])  # nothing from B or C yet: 2 may reach a quorum
    assert seqs(core.on_alerts(B, [alert(2), alert(3)])[0]) == [2, 3]
    assert core.pending == {}


def test_quorum_bounds_what_awaits_it_per_replica():
    core = EmitterCore({A, B, C}, delivery="quorum", max_pending=9)  # a share of 3 each
    core.on_alerts(A, [alert(100), alert(101), alert(102)])  # far ahead: A has used its share
    with pytest.raises(TooFarAhead):
        core.on_alerts(A, [alert(103)])
    assert sorted(core.pending) == [100, 101, 102]  # nothing of the refused batch taken
    assert seqs(core.on_alerts(B, [alert(1), alert(2), alert(3)])[0]) == []  # others' shares are theirs
    assert seqs(core.on_alerts(C, [alert(1), alert(2), alert(3)])[0]) == [1, 2, 3]
    assert core.held == {A: 3, B: 0, C: 0}


def test_a_replica_votes_once_per_emit_seq():
    core = EmitterCore({A, B, C}, delivery="quorum")
    core.on_alerts(A, [alert(3)])
    assert core.on_alerts(A, [alert(3)]) == ([], [], [])  # sent again (a reconnect): still one vote
    assert core.on_alerts(A, [alert(3, cumulative=1)]) == ([], [], [])  # another version: not counted
    assert seqs(core.on_alerts(B, [alert(3)])[0]) == [3]


def test_a_copy_with_other_bytes_or_none_recorded_is_a_divergence():
    core = EmitterCore({A})
    assert core.judge_copies([alert(5), alert(5, cumulative=999), alert(6), alert(7)],
                             [alert(5), alert(5), None, alert(7)]) == [1, 2]
    assert (core.duplicates, core.divergences) == (2, 2)


@pytest.mark.parametrize("point, index", [("before_intent", 0), ("after_intent", 1), ("after_deliver", 2)])
def test_a_crash_point_sits_where_it_says_in_the_chosen_batch(point, index):
    core = EmitterCore({A}, crash_at=point, crash_after=2)
    assert not any(isinstance(s, Crash) for s in core.deliver([alert(1)]))
    steps = core.deliver([alert(2)])
    assert steps[index] == Crash(point, 2) and len(steps) == 3


def test_the_after_done_crash_point_follows_the_chosen_batchs_done_alone_or_in_the_next_intent():
    core = EmitterCore({A}, crash_at="after_done", crash_after=2)
    core.deliver([alert(1)])
    assert not any(isinstance(s, Crash) for s in core.deliver([alert(2)]))  # batch 1's done: not the one
    assert core.done_due() == [RecordDone([alert(2)]), Crash("after_done", 2)]
    core = EmitterCore({A}, crash_at="after_done", crash_after=2)
    core.deliver([alert(1)])
    core.deliver([alert(2)])
    steps = core.deliver([alert(3)])
    assert steps[:2] == [RecordIntent([alert(3)], [alert(2)]), Crash("after_done", 2)]


def test_with_every_sink_idempotent_batches_are_delivered_then_recorded_together():
    """deliver_first: each batch to the sinks at once; the batches delivered since the last record
    recorded as delivered with the mark in one transaction when the shell's timer asks. No intent,
    nothing in doubt (what a crash leaves unrecorded comes again from the replicas, above the mark)."""
    core = EmitterCore({A}, deliver_first=True)
    assert core.deliver([alert(1)]) == [DeliverAlerts([alert(1)])]
    assert core.deliver([alert(2), alert(3)]) == [DeliverAlerts([alert(2), alert(3)])]
    assert (core.mark, core.recorded) == (3, 0)
    assert core.done_due() == [RecordIntent([alert(1), alert(2), alert(3)], delivered=True)]
    assert core.done_due() == []


@pytest.mark.parametrize("point, index", [("before_intent", 0), ("after_deliver", 1), ("after_intent", 2),
                                          ("after_done", 2)])
def test_with_every_sink_idempotent_a_crash_point_sits_where_it_says(point, index):
    core = EmitterCore({A}, crash_at=point, crash_after=2, deliver_first=True)
    assert not any(isinstance(s, Crash) for s in core.deliver([alert(1)]) + core.done_due())
    steps = core.deliver([alert(2)]) + core.done_due()
    assert steps[index] == Crash(point, 2) and len(steps) == 3
    assert [s for s in steps if not isinstance(s, Crash)] == [DeliverAlerts([alert(2)]),
                                                              RecordIntent([alert(2)], delivered=True)]


def test_a_record_the_disk_refused_puts_the_mark_back_in_either_order():
    for deliver_first in (False, True):
        core = EmitterCore({A}, mark=3, deliver_first=deliver_first)
        delivered(core, core.on_alerts(A, [alert(4)])[0])  # recorded
        steps = core.deliver(core.on_alerts(A, [alert(5), alert(6)])[0])
        record = next(s for s in steps + core.done_due() if isinstance(s, RecordIntent))
        core.on_intent_failed(record)
        assert (core.mark, core.recorded, core.delivered) == (4, 4, 1)
        assert seqs(core.on_alerts(A, [alert(5), alert(6)])[0]) == [5, 6]  # sent again from the mark: new again


def test_alerts_in_doubt_are_delivered_again_then_done():
    core = EmitterCore({A}, mark=4)
    doubt = [alert(3), alert(4)]
    assert core.recover(doubt) == [Redeliver(doubt), RecordDone(doubt)] and core.in_doubt == 2
    assert core.recover([]) == []


GOOD, BAD = b"g" * 16, b"b" * 16


@pytest.mark.parametrize("delivery", ["first", "quorum"])
def test_a_replica_outvoted_at_a_fold_point_is_told_to_rebuild_and_ignored_until_it_agrees(delivery):
    core = EmitterCore({A, B, C}, delivery=delivery)
    assert core.on_digest(C, 4096, BAD) == ([], [], [])  # alone: nothing to compare
    assert core.on_digest(A, 4096, GOOD) == ([], [], [])  # one against one: no quorum
    assert core.on_digest(B, 4096, GOOD)[0] == [C] and core.diverged == {C: 4096}
    assert core.on_alerts(C, [alert(7, cumulative=999)]) == ([], [], []) and core.ignored == 1
    assert core.on_digest(C, 2048, GOOD)[0] == [] and C in core.diverged  # rebuilding: not there yet
    # Rebuilt: it agrees where it diverged (the session's end may be the last fold) and counts again.
    assert core.on_digest(C, 4096, GOOD) == ([], [], []) and core.diverged == {}
    assert core.on_digest(C, 8192, BAD)[0] == []  # alone at a new fold: nothing to compare
    core.on_digest(A, 8192, GOOD)
    assert core.on_digest(B, 8192, GOOD)[0] == [C] and core.diverged == {C: 8192}  # diverged again
    assert core.rebuilds_ordered == 2
    assert core.on_digest(b"mallory   ", 8192, BAD) == ([], [], [])


def test_under_quorum_a_diverged_replicas_votes_are_withdrawn():
    core = EmitterCore({A, B, C}, delivery="quorum")
    assert core.on_alerts(C, [alert(3, cumulative=999)]) == ([], [], [])  # C's version awaits a quorum
    assert core.on_alerts(A, [alert(3)]) == ([], [], [])  # one each: B may still send
    core.on_digest(A, 4096, GOOD)
    core.on_digest(C, 4096, BAD)
    rebuild, ready, alarms = core.on_digest(B, 4096, GOOD)
    assert rebuild == [C] and ready == [] and alarms == []  # A's alone waits for B; C's vote is gone
    new, _, alarms = core.on_alerts(B, [alert(3)])
    assert new == [alert(3)] and alarms == []  # no alarm for the withdrawn version


@pytest.mark.parametrize("delivery", ["first", "quorum"])
def test_an_intent_the_disk_refused_moves_nothing_and_the_alerts_come_again(delivery):
    core = EmitterCore({A, B, C}, mark=2, delivery=delivery)
    for replica in (A, B):
        new, _, _ = core.on_alerts(replica, [alert(3), alert(5)])
    assert seqs(new) == [3, 5]
    intent = core.deliver(new)[0]
    core.on_intent_failed(intent)  # the shell closes every link: each sends again from the mark
    assert core.mark == 2 and core.delivered == 0 and core.pending == {}
    for replica in (B, A):
        new, copies, alarms = core.on_alerts(replica, [alert(3), alert(5)])
    assert seqs(new) == [3, 5] and alarms == []  # the same alerts, delivered this time
    assert core.deliver(new)[0] == RecordIntent(new) and core.mark == 5


def test_a_failed_intent_leaves_the_done_it_carried_still_to_record():
    core = EmitterCore({A}, crash_at="after_done", crash_after=2)
    delivered(core, [alert(1)])
    intent = core.deliver([alert(2)])[0]
    assert intent.done == [alert(1)]
    core.on_intent_failed(intent)
    assert core.mark == 1 and core.done_due() == [RecordDone([alert(1)])]  # batch 1's: not the crash's batch
