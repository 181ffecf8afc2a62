"""The live audit's reconciliation (ops/spark/reconcile_core.py): an alert is judged once both
sides are past it, and only then."""

from tape.ops.spark.reconcile_core import Reconciliation


def alert(seq: int, emit: int | None = None, cumulative: int = 120) -> dict:
    return {"alert_id": f"TAPE:{seq}", "emit_seq": emit or seq, "purchase_id": seq, "order_id": 7,
            "requested": 100, "cumulative": cumulative}


def counts(rec: Reconciliation) -> dict:
    return {k: v["count"] for k, v in rec.findings().items()}


NONE = {"missing": 0, "duplicate": 0, "unexpected": 0, "mismatched": 0}


def test_the_same_alerts_on_both_sides_in_any_order_find_nothing():
    rec = Reconciliation()
    rec.delivered([alert(10)])
    rec.expect([alert(10), alert(20)], through_seq=25)
    rec.delivered([alert(20)])
    assert counts(rec) == NONE and not rec.waiting and not rec.strays


def test_a_delivery_ahead_of_the_stream_is_pending_and_one_behind_it_unexpected():
    rec = Reconciliation()
    rec.expect([alert(10)], through_seq=15)
    rec.delivered([alert(10), alert(30)])
    assert counts(rec) == NONE  # (the stream has not been read to seq 30: pending)
    rec.expect([], through_seq=40)
    assert counts(rec)["unexpected"] == 1 and rec.findings()["unexpected"]["first"] == ["TAPE:30"]


def test_an_alert_not_delivered_is_missing_once_the_emitter_delivered_a_later_one():
    rec = Reconciliation()
    rec.expect([alert(10), alert(20)], through_seq=25)
    assert counts(rec) == NONE  # (the emitter may just be behind)
    rec.delivered([alert(20)])
    assert counts(rec) == {**NONE, "missing": 1} and rec.findings()["missing"]["first"] == ["TAPE:10"]


def test_a_second_copy_is_a_duplicate_and_other_fields_a_mismatch():
    rec = Reconciliation()
    rec.expect([alert(10), alert(20)], through_seq=25)
    rec.delivered([alert(10), alert(10), alert(20, cumulative=999)])
    assert counts(rec) == {**NONE, "duplicate": 1, "mismatched": 1}


def test_a_file_read_again_from_its_start_is_judged_again():
    rec = Reconciliation()
    rec.expect([alert(10), alert(20), alert(30)], through_seq=35)
    rec.delivered([alert(10), alert(20), alert(30)])
    rec.forget_deliveries()  # (the file was rewritten without seq 20's line)
    rec.delivered([alert(10), alert(30)])
    assert counts(rec) == {**NONE, "missing": 1} and rec.findings()["missing"]["first"] == ["TAPE:20"]


def test_the_alerts_file_is_read_as_it_grows_and_again_when_rewritten(tmp_path):
    from tape.ops.spark.live_audit import AlertsFile

    path = tmp_path / "alerts.jsonl"
    path.write_text('{"alert_id": "TAPE:1"}\n{"alert_id": "TA')
    f = AlertsFile(path)
    assert f.read() == (False, [{"alert_id": "TAPE:1"}])  # (a line half written waits)
    with open(path, "a") as out:
        out.write('PE:2"}\nnot json\n')
    again, alerts = f.read()
    assert not again and alerts[0] == {"alert_id": "TAPE:2"} and alerts[1]["alert_id"].startswith("unreadable")
    path.write_text('{"alert_id": "TAPE:2"}\n{"alert_id": "TAPE:9"}\n{"alert_id": "TAPE:10"}\n')  # (in place)
    assert f.read() == (True, [{"alert_id": f"TAPE:{n}"} for n in (2, 9, 10)])
    assert f.read() == (False, [])
