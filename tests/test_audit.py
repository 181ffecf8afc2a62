"""The audit state machine against the challenge, the rules, and an
independent reference; determinism by digest."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tape.ops.verification.reference import FOLD_EVERY, expected_alerts, expected_digest
from tape.protocol import messages as M
from tape.replicas.audit_core import Alert, AuditMachine

ORIGIN = b"client1   "


def seqd(inbound: bytes, stamp: int, cseq: int = 1) -> tuple:
    return M.decode(M.stamp(inbound, stamp, ORIGIN, cseq))


def run(machine, msgs, first=1) -> list[Alert]:
    """The alerts raised, decoded from the records the machine returns."""
    return [Alert.decode(record) for record in machine.apply_run(first, msgs)]


def test_the_challenge_example_alerts_once_at_the_second_purchase():
    stream = [
        seqd(M.purchase_request(1, 100, "Sendence", "AAPL"), 10),
        seqd(M.purchase(2, 1, 90, "Sendence", "AAPL"), 11),
        seqd(M.purchase(3, 1, 30, "Sendence", "AAPL"), 12),
        seqd(M.purchase(4, 1, 50, "Sendence", "AAPL"), 13),
    ]
    alerts = run(AuditMachine(), stream)
    assert len(alerts) == 1
    a = alerts[0]
    assert (a.purchase_seq, a.purchase_id, a.order_id, a.requested, a.cumulative) == (3, 3, 1, 100, 120)
    assert a.to_dict("TAPE")["alert_id"] == "TAPE:3"


def test_exactly_equal_is_not_over():
    stream = [seqd(M.purchase_request(1, 100, "C", "S"), 1), seqd(M.purchase(2, 1, 100, "C", "S"), 2)]
    assert run(AuditMachine(), stream) == []


def test_rejects_are_counted_by_reason():
    m = AuditMachine()
    run(m, [
        seqd(M.purchase_request(1, 100, "C", "S"), 1),
        seqd(M.purchase_request(1, 50, "C", "S"), 2),       # known order id
        seqd(M.purchase_request(2, 0, "C", "S"), 3),        # shares <= 0
        seqd(M.purchase(3, 1, -5, "C", "S"), 4),            # shares <= 0
        seqd(M.purchase(4, 1, 500, "D", "S"), 5),           # client differs
        seqd(M.purchase(5, 1, 500, "C", "T"), 6),           # stock differs
    ])
    assert m.rejects == {"duplicate_order": 1, "bad_shares": 2, "client_mismatch": 1, "stock_mismatch": 1,
                         "orphan_expired": 0}
    assert m.alerts_raised == 0


def test_orphans_wait_for_their_request_and_expire():
    m = AuditMachine(orphan_ttl_ns=100)
    alerts = run(m, [
        seqd(M.purchase(10, 7, 80, "C", "S"), 1000),        # before its request
        seqd(M.purchase(11, 8, 5, "C", "S"), 1000),          # its request never comes
        seqd(M.purchase_request(7, 50, "C", "S"), 1050),
    ])
    assert [(a.emit_seq, a.purchase_seq) for a in alerts] == [(3, 1)]  # raised when the request arrived
    run(m, [M.decode(M.time_tick(1200, ORIGIN))], first=4)  # time passes
    assert m.rejects["orphan_expired"] == 1 and not m.orphans


def test_books_close_after_their_window():
    m = AuditMachine(book_ttl_ns=100, orphan_ttl_ns=1000)
    run(m, [seqd(M.purchase_request(1, 10, "C", "S"), 0), seqd(M.purchase(2, 1, 5, "C", "S"), 50)])
    alerts = run(m, [seqd(M.purchase(3, 1, 50, "C", "S"), 150)], first=3)
    assert alerts == [] and 1 not in m.books and 1 in m.orphans  # the book closed: the purchase is an orphan


# --- against the reference, on random streams ------------------------------------------------

@st.composite
def streams(draw):
    n = draw(st.integers(1, 120))
    orders = draw(st.integers(1, 8))
    stamp = 0
    out = []
    for i in range(n):
        stamp += draw(st.sampled_from([0, 0, 1, 5, 30, 200]))
        kind = draw(st.sampled_from("RPPPPK"))
        order = draw(st.integers(1, orders))
        shares = draw(st.sampled_from([-1, 0, 1, 10, 40, 100]))
        client = draw(st.sampled_from(["A", "A", "A", "B"]))
        stock = draw(st.sampled_from(["X", "X", "X", "Y"]))
        if kind == "R":
            raw = M.purchase_request(order, shares, client, stock)
        elif kind == "P":
            raw = M.purchase(1000 + i, order, shares, client, stock)
        else:
            out.append(M.decode(M.time_tick(stamp, ORIGIN)))
            continue
        out.append(seqd(raw, stamp, i + 1))
    return out


# The reference sweeps what expired untouched every `sweep` messages (at least): 1 and 3 sweep
# all the time, 10**9 never; none may change an outcome.
SWEEPS = st.sampled_from([1, 3, 10**9])


@settings(max_examples=200, deadline=None)
@given(streams(), st.sampled_from([30, 200, 10**9]), st.sampled_from([5, 30, 200, 10**9]), SWEEPS)
@pytest.mark.slow
def test_alerts_and_rejects_equal_the_reference(stream, book_ttl, orphan_ttl, sweep):
    m = AuditMachine(book_ttl_ns=book_ttl, orphan_ttl_ns=orphan_ttl)
    alerts = run(m, stream)
    ref_alerts, ref_rejects = expected_alerts(enumerate(stream, 1), book_ttl, orphan_ttl, sweep_from=sweep)
    got = [{"emit_seq": a.emit_seq, "purchase_seq": a.purchase_seq, "purchase_id": a.purchase_id,
            "order_id": a.order_id, "requested": a.requested, "cumulative": a.cumulative} for a in alerts]
    assert got == ref_alerts
    # The machine expires eagerly only as time passes; the reference counts
    # what has expired by the end, so compare after one more tick past the windows.
    last = max([x[M.STAMP] for x in stream] + [0])
    m.apply_run(len(stream) + 1, [M.decode(M.time_tick(last + 10**9 + 1, ORIGIN))])
    tick = M.decode(M.time_tick(last + 10**9 + 1, ORIGIN))
    _, ref_end = expected_alerts(list(enumerate(stream, 1)) + [(len(stream) + 1, tick)], book_ttl, orphan_ttl,
                                 sweep_from=sweep)
    assert m.rejects == ref_end
    assert [a.emit_seq for a in alerts] == sorted({a.emit_seq for a in alerts})  # emit seqs strictly increase


@settings(max_examples=300, deadline=None)
@given(streams(), st.sampled_from([30, 200, 10**9]), st.sampled_from([5, 30, 200, 10**9]), SWEEPS)
@pytest.mark.slow
def test_the_digest_equals_the_one_recomputed_from_its_definition(stream, book_ttl, orphan_ttl, sweep):
    m = AuditMachine(book_ttl_ns=book_ttl, orphan_ttl_ns=orphan_ttl)
    for end in sorted({len(stream) // 3, len(stream)}):  # mid-stream too: what has expired by then, no more
        m.apply_run(m.last_seq + 1, stream[m.last_seq:end])
        assert m.digest() == expected_digest(enumerate(stream[:end], 1), book_ttl, orphan_ttl, sweep_from=sweep)


@pytest.mark.parametrize("seed", range(3))
def test_the_digest_equals_the_recomputed_one_across_folds(seed):
    rng = random.Random(seed)
    stream, stamp = [], 0
    for i in range(3 * FOLD_EVERY + 77):  # several folds, the last block partial
        stamp += rng.choice([0, 1, 5, 30])
        order = rng.randrange(1, 300)
        raw = (M.purchase_request(order, rng.choice([-1, 10, 40]), "A", "X") if rng.random() < 0.3
               else M.purchase(i, order, rng.choice([0, 5, 20]), rng.choice("AAB"), "X"))
        stream.append(seqd(raw, stamp, i + 1))
    m = AuditMachine(book_ttl_ns=2000, orphan_ttl_ns=300)
    m.apply_run(1, stream)
    assert m.alerts_raised > 0 and m.rejects["orphan_expired"] > 0  # the records that are more than a byte
    assert m.digest() == expected_digest(enumerate(stream, 1), 2000, 300)
    assert m.digest() == expected_digest(enumerate(stream, 1), 2000, 300, sweep_from=50)  # folds settled early
    assert m.digest() != expected_digest(enumerate(stream[:-1], 1), 2000, 300)


@settings(max_examples=100, deadline=None)
@given(streams(), st.lists(st.integers(1, 20), max_size=10))
@pytest.mark.slow
def test_two_replicas_fed_the_same_stream_agree_at_every_seq(stream, cuts):
    a, b = AuditMachine(book_ttl_ns=100, orphan_ttl_ns=50), AuditMachine(book_ttl_ns=100, orphan_ttl_ns=50)
    digests_a = []
    for i, msg in enumerate(stream, 1):
        a.apply(i, msg)
        digests_a.append(a.digest())
    # b applies the same stream in runs of other sizes, reading its digest at other points.
    pos = 0
    k = 0
    while pos < len(stream):
        size = cuts[k % len(cuts)] if cuts else len(stream)
        b.apply_run(pos + 1, stream[pos:pos + size])
        pos = min(len(stream), pos + size)
        assert b.digest() == digests_a[pos - 1]
        k += 1
    assert (a.rejects, a.alerts_raised, sorted(a.books)) == (b.rejects, b.alerts_raised, sorted(b.books))


def test_out_of_order_apply_is_refused():
    import pytest

    from tape.replicas.audit_core import InvariantViolation

    m = AuditMachine()
    m.apply(1, seqd(M.purchase_request(1, 1, "C", "S"), 1))
    with pytest.raises(InvariantViolation):
        m.apply(3, seqd(M.purchase_request(2, 1, "C", "S"), 1))


@pytest.mark.parametrize("seed", range(3))
def test_the_digest_folds_at_each_session_end_as_its_definition_says(seed):
    """The session's end is a fold point besides the multiples (here of 7), at one of those too:
    the machine, fed the stream in any cut, and the reference agree on every prefix."""
    rng = random.Random(seed)
    stream, stamp = [], 0
    for i in range(120):
        stamp += rng.choice([0, 1, 5, 30])
        if i in (13, 34, 35, 70) or rng.random() < 0.03:  # ends at 14 (a multiple of 7), 35 then 36, ...
            stream.append(M.decode(M.session_end(stamp, ORIGIN)))
            continue
        order = rng.randrange(1, 30)
        raw = (M.purchase_request(order, rng.choice([-1, 10, 40]), "A", "X") if rng.random() < 0.3
               else M.purchase(i, order, rng.choice([0, 5, 20]), rng.choice("AAB"), "X"))
        stream.append(seqd(raw, stamp, i + 1))
    whole, cut = AuditMachine(2000, 300, fold_every=7), AuditMachine(2000, 300, fold_every=7, compiled=False)
    whole.apply_run(1, stream)
    for end in range(1, len(stream) + 1):
        cut.apply_run(end, stream[end - 1:end])
        for sweep in (1, 5, 10**9):  # session ends settled by sweeps too
            assert cut.digest() == expected_digest(enumerate(stream[:end], 1), 2000, 300, fold_every=7,
                                                   sweep_from=sweep), (end, sweep)
    assert whole.digest() == cut.digest() and whole.chain == cut.chain
    assert expected_digest(enumerate(stream, 1), 2000, 300, fold_every=7) != \
        expected_digest(enumerate(stream, 1), 2000, 300, fold_every=8)
