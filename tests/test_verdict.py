"""The run verdict (ops/verification/verdict.py) fails each of its rows on a fabricated bad run."""

import copy

import pytest

from tape.ops.verification.reference import expected_alerts
from tape.ops.verification.tradegen import TradeGenerator
from tape.ops.verification.verdict import RunFiles, judge
from tape.protocol import messages as M
from tape.replicas.audit_core import AuditMachine

ORIGIN = b"load0".ljust(10)
TTL = 10**15


def good_run(n: int = 400) -> RunFiles:
    msgs = [M.term_start(1, b"seq-a".ljust(10), 1, "seq-a")]
    msgs += [M.stamp(m, 1000 + i, ORIGIN, i) for i, m in enumerate(TradeGenerator(7, 0.5).take(n), 1)]
    records = [(seq, 1, m) for seq, m in enumerate(msgs, 1)]
    alerts, _ = expected_alerts([(s, M.SEQUENCED.unpack(m)) for s, _, m in records], TTL, TTL)
    rows = [{"alert_id": f"TAPE:{a['purchase_seq']}", **a} for a in alerts]
    machine = AuditMachine(TTL, TTL)
    machine.apply_run(1, [M.SEQUENCED.unpack(m) for _, _, m in records])
    status = {"last_seq": len(records), "digest": machine.digest()}
    return RunFiles(session="TAPE", book_ttl_ns=TTL, orphan_ttl_ns=TTL, submitted=n,
                    journals={v: list(records) for v in ("seq-a", "seq-b", "rw-1", "rw-2")},
                    replicas={r: dict(status) for r in ("replica-A", "replica-B", "replica-C")}, alerts=rows,
                    emitter={"divergences": 0}, load={"acked": n, "submitted": n},
                    sequencers={"seq-a": {"published_terms": {"1": [1, len(records)]}},
                                "seq-b": {"published_terms": {}}},
                    plain=True, submitted_trades={ORIGIN: lambda: TradeGenerator(7, 0.5)},
                    log_problems={"seq-a": [], "replica-A": []})


def test_a_good_run_passes_every_row():
    checks, _, report = judge(good_run())
    assert all(checks.values()) and report["alerts_expected"] > 10


def replace_record(run, voter, seq, message):
    run.journals[voter] = [(s, t, message if s == seq else m) for s, t, m in run.journals[voter]]


def duplicate_trade(run):
    records = run.journals["seq-a"]
    m = M.SEQUENCED.unpack(records[5][2])  # sequenced again, later
    dup = [(len(records) + 1, 1, M.stamp(records[5][2][:M.INBOUND_SIZE], 10**6, m[M.ORIGIN], m[M.CLIENT_SEQ]))]
    for v in run.journals:
        run.journals[v] = records + dup
    for r in run.replicas.values():
        r["last_seq"] += 1


def stamp_backwards(run, seq=50):
    """A leader that stamped with a clock behind its log's (its host's clock was behind)."""
    raw = run.journals["seq-a"][seq - 1][2]
    m = M.SEQUENCED.unpack(raw)
    earlier = M.stamp(raw[:M.INBOUND_SIZE], 5, m[M.ORIGIN], m[M.CLIENT_SEQ])
    for v in run.journals:
        replace_record(run, v, seq, earlier)
    machine = AuditMachine(TTL, TTL)
    machine.apply_run(1, [M.SEQUENCED.unpack(m) for _, _, m in run.journals["seq-a"]])
    for r in run.replicas.values():
        r["digest"] = machine.digest()


def second_term(run):
    """seq-a led again in term 2 with no fault injected (a spurious election), correctly otherwise."""
    records = run.journals["seq-a"]
    again = M.term_start(10**6, b"seq-a".ljust(10), 2, "seq-a")
    records = records + [(len(records) + 1, 2, again)]
    run.journals = {v: list(records) for v in run.journals}
    run.sequencers["seq-a"]["published_terms"]["2"] = [len(records), len(records)]
    machine = AuditMachine(TTL, TTL)
    machine.apply_run(1, [M.SEQUENCED.unpack(m) for _, _, m in records])
    for r in run.replicas.values():
        r.update(last_seq=len(records), digest=machine.digest())


def altered_shares(run, seq=60):
    """A sequencer that changed one trade's shares, and replicas that applied it as it did: every
    other row holds (the log agrees with itself), only the comparison with what was sent fails."""
    raw = run.journals["seq-a"][seq - 1][2]
    inbound = bytearray(raw[:M.INBOUND_SIZE])
    inbound[9:17] = (int.from_bytes(inbound[9:17], "big", signed=True) + 1).to_bytes(8, "big", signed=True)
    m = M.SEQUENCED.unpack(raw)
    for v in run.journals:
        replace_record(run, v, seq, M.stamp(bytes(inbound), m[M.STAMP], m[M.ORIGIN], m[M.CLIENT_SEQ]))
    records = run.journals["seq-a"]
    alerts, _ = expected_alerts([(s, M.SEQUENCED.unpack(m)) for s, _, m in records], TTL, TTL)
    run.alerts = [{"alert_id": f"TAPE:{a['purchase_seq']}", **a} for a in alerts]
    machine = AuditMachine(TTL, TTL)
    machine.apply_run(1, [M.SEQUENCED.unpack(m) for _, _, m in records])
    for r in run.replicas.values():
        r["digest"] = machine.digest()


BAD = {
    "content: each trade as its client submitted it": altered_shares,
    "every node wrote its status file": lambda run: run.replicas.update({"replica-B": {}}),
    "no traceback or unexpected CRITICAL in a log": lambda run: run.log_problems.update(
        {"rw-1": ["2026-12-02 12:00:00 tape.rewinder CRITICAL rw-1: journal closed; stopping (exit 4)"]}),
    "all trades acknowledged": lambda run: run.load.update(acked=run.submitted - 1),
    # The load saw one more trade acknowledged than the log holds (a forged acknowledgement).
    "no loss: every trade sequenced": lambda run: (setattr(run, "submitted", run.submitted + 1),
                                                   run.load.update(acked=run.submitted)),
    "no duplicates: no (client, client seq) twice": duplicate_trade,
    "agreement: every journal a prefix of the log": lambda run: replace_record(
        run, "rw-2", 50, M.stamp(M.purchase_request(99, 1, "X", "Y"), 5, ORIGIN, 999)),
    "replicas applied the whole log": lambda run: run.replicas["replica-C"].update(last_seq=3),
    "replica identity: digests equal": lambda run: run.replicas["replica-B"].update(digest="cd" * 16),
    # All three replicas agree, on a state the journal does not give (they applied a forged packet).
    "replicas' digest is the journal's": lambda run: [r.update(digest="cd" * 16) for r in run.replicas.values()],
    "stamps never go backwards": stamp_backwards,
    "exactly-once alerts": lambda run: run.alerts.pop(3),
    "no divergence alarms": lambda run: run.emitter.update(divergences=1),
    "each term published only by its winner": lambda run: run.sequencers["seq-b"].update(
        published_terms={"1": [10, 20]}),
    "no fault, one term: no spurious election": second_term,
}


@pytest.mark.parametrize("row", sorted(BAD))
def test_each_row_fails_on_its_own_bad_run(row):
    run = copy.deepcopy(good_run())
    BAD[row](run)
    checks, _, _ = judge(run)
    assert checks[row] is False
    also = {  # rows that a bad run of this kind fails as well, by their nature
        "no duplicates: no (client, client seq) twice": {"no loss: every trade sequenced",
                                                         "replicas' digest is the journal's"},
        "replicas applied the whole log": {"replica identity: digests equal"},
        "replica identity: digests equal": {"replicas' digest is the journal's"},
        "every node wrote its status file": {"replicas applied the whole log", "replica identity: digests equal",
                                             "replicas' digest is the journal's"},
    }.get(row, set())
    assert {name for name, ok in checks.items() if not ok} - also == {row}


@pytest.mark.parametrize("kind", ["duplicate", "unexpected", "mismatched"])
def test_exactly_once_sees_every_kind_of_wrong_alert(kind):
    run = good_run()
    if kind == "duplicate":
        run.alerts.append(dict(run.alerts[0]))
    elif kind == "unexpected":
        run.alerts.append({**run.alerts[0], "alert_id": "TAPE:999999"})
    else:
        run.alerts[2] = {**run.alerts[2], "cumulative": run.alerts[2]["cumulative"] + 1}
    checks, _, report = judge(run)
    assert not checks["exactly-once alerts"]
    assert report[{"duplicate": "duplicates", "unexpected": "unexpected", "mismatched": "mismatched"}[kind]]


def test_content_is_judged_trade_by_trade_in_each_clients_order():
    run = good_run()
    _, figures, _ = judge(run)
    assert figures["content: each trade as its client submitted it"] == "400 judged, 0 altered"
    run.submitted_trades = {ORIGIN: lambda: TradeGenerator(8, 0.5)}  # another client's trades
    checks, _, report = judge(run)
    assert not checks["content: each trade as its client submitted it"] and len(report["altered_trades"]) == 20
    run.submitted_trades = {b"nobody".ljust(10): lambda: TradeGenerator(7, 0.5)}  # named, none sequenced
    assert not judge(run)[0]["content: each trade as its client submitted it"]


def test_a_log_line_is_a_problem_unless_the_runs_fault_planted_it():
    from tape.ops.verification.verdict import log_problems
    text = ("x tape.seq INFO leading term 2\n"
            "x tape.rw CRITICAL rw-1: disk full; stopping (exit 4)\n"
            "Traceback (most recent call last):\n")
    assert len(log_problems(text)) == 2
    assert log_problems(text, ("disk full",)) == ["Traceback (most recent call last):"]


def test_the_log_is_what_a_majority_holds():
    # The leader stopped before its last batch committed: its journal holds more, never published.
    run = good_run()
    extra = M.stamp(M.purchase_request(10**6, 1, "X", "Y"), 10**7, ORIGIN, 10**6)
    run.journals["seq-a"] = run.journals["seq-a"] + [(len(run.journals["seq-a"]) + 1, 1, extra)]
    checks, _, report = judge(run)
    assert all(checks.values()) and report["log_length"] == len(run.journals["rw-1"])
    # Two of four voters lost the last entry, which the replicas applied: it was committed, and lost.
    run = good_run()
    for v in ("seq-b", "rw-2"):
        run.journals[v] = run.journals[v][:-1]
    checks, _, _ = judge(run)
    assert not checks["replicas applied the whole log"]


@pytest.mark.parametrize("chunk", [7, 400, 65_536])
def test_agreement_reads_journals_a_chunk_at_a_time(monkeypatch, chunk):
    from tape.ops.verification import verdict

    monkeypatch.setattr(verdict, "AGREEMENT_CHUNK", chunk)
    records = good_run().journals["seq-a"]
    forged = M.stamp(M.purchase_request(99, 1, "X", "Y"), 5, ORIGIN, 999)
    prefixes = {"seq-a": records, "seq-b": records[:300], "rw-1": records[:13], "rw-2": []}
    assert verdict._agreement(prefixes) == ({v: len(j) for v, j in prefixes.items()}, True)
    for at in (0, 12, 250, len(records) - 1):  # in the first chunk, in a later one, at the end
        bad = records[:at] + [(at + 1, 1, forged)] + records[at + 1:]
        # The longest journal wrong where another holds that seq too, or a short one wrong.
        for voter, others_hold in (("seq-a", at < 300), ("rw-1", at < 13)):
            journals = {**prefixes, voter: bad[:len(prefixes[voter])]}
            assert verdict._agreement(journals)[1] is not others_hold, (at, voter)


def test_client_seq_runs_find_exactly_the_seqs_held_twice():
    import random

    from tape.ops.verification.verdict import _SeqRuns

    rng = random.Random(5)
    for _ in range(200):
        seqs = [rng.randint(1, 60) for _ in range(rng.randint(0, 80))]
        runs, held = _SeqRuns(), set()
        for seq in seqs:
            assert runs.add(seq) is (seq not in held), (seqs, seq)
            held.add(seq)
        assert sum(e - s + 1 for s, e in zip(runs.starts, runs.ends)) == len(held)
        assert all(e + 1 < s for e, s in zip(runs.ends, runs.starts[1:]))  # disjoint, apart, in order
    in_order = _SeqRuns()
    assert all(in_order.add(seq) for seq in range(1, 10_001)) and in_order.starts == [1]
