"""EmitterCore (replicas/emitter_core.py): which alerts are new, the delivery steps, copies, crash points."""

import pytest

from tape.replicas.audit import Alert
from tape.replicas.emitter_core import Crash, DeliverAlerts, EmitterCore, RecordDone, RecordIntent, Redeliver

A = b"replica-A "


def alert(seq: int, cumulative: int = 150) -> Alert:
    return Alert(seq, seq, seq, 1, b"c".ljust(16), b"S".ljust(8), 100, cumulative, seq)


def test_only_known_replicas_are_welcomed_with_the_mark():
    core = EmitterCore({A}, mark=7)
    assert core.on_hello(A) == 7 and core.on_hello(b"mallory   ") is None


def test_new_alerts_go_through_intent_deliver_done_and_move_the_mark():
    core = EmitterCore({A})
    new, copies = core.on_alerts([alert(3), alert(5)])
    assert copies == [] and core.deliver(new) == [RecordIntent(new), DeliverAlerts(new), RecordDone(new)]
    assert core.mark == 5 and core.delivered == 2
    new, copies = core.on_alerts([alert(5), alert(9)])  # another replica's channel: 5 is a copy
    assert [a.emit_seq for a in new] == [9] and [a.emit_seq for a in copies] == [5]


def test_a_copy_with_other_bytes_or_none_recorded_is_a_divergence():
    core = EmitterCore({A})
    assert core.judge_copy(alert(5), alert(5).encode()) and core.duplicates == 1
    assert not core.judge_copy(alert(5, cumulative=999), alert(5).encode())
    assert not core.judge_copy(alert(6), None) and core.divergences == 2


@pytest.mark.parametrize("point, index", [("before_intent", 0), ("after_intent", 1), ("after_deliver", 2),
                                          ("after_done", 3)])
def test_a_crash_point_sits_where_it_says_in_the_chosen_batch(point, index):
    core = EmitterCore({A}, crash_at=point, crash_after=2)
    assert not any(isinstance(s, Crash) for s in core.deliver([alert(1)]))
    steps = core.deliver([alert(2)])
    assert steps[index] == Crash(point, 2) and len(steps) == 4


def test_alerts_in_doubt_are_delivered_again_then_done():
    core = EmitterCore({A}, mark=4)
    doubt = [alert(3), alert(4)]
    assert core.recover(doubt) == [Redeliver(doubt), RecordDone(doubt)] and core.in_doubt == 2
    assert core.recover([]) == []
