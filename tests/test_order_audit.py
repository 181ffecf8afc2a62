"""The live audit's per-order fold (ops/spark/order_audit_core.py) against the independent reference
(ops/verification/reference.py), on random streams cut into micro-batches anywhere: the same alerts
and the same rejects, whatever the cuts, with each order's state kept as JSON between them."""

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st
from test_audit import streams

from tape.ops.spark.order_audit_core import ALERT, Finding, OrderState, Trade, expire, fold
from tape.ops.verification.reference import REJECT_REASONS, expected_alerts
from tape.protocol import messages as M

KINDS = {M.REQUEST: "purchase_request", M.PURCHASE: "purchase"}


def trades_by_order(stream) -> dict[int, list[Trade]]:
    out = defaultdict(list)
    for seq, m in enumerate(stream, 1):
        if m[M.TYPE] in KINDS:
            text = lambda raw: raw.decode().rstrip()  # noqa: E731
            out[m[M.ORDER_ID]].append(Trade(seq, m[M.STAMP], KINDS[m[M.TYPE]], m[M.SHARES], text(m[M.CLIENT]),
                                            text(m[M.STOCK]), m[M.PURCHASE_ID] if m[M.TYPE] == M.PURCHASE else None))
    return out


@settings(max_examples=150, deadline=None)
@given(streams(), st.sampled_from([30, 200, 10**9]), st.sampled_from([5, 30, 200, 10**9]), st.data())
def test_per_order_micro_batches_give_the_references_alerts_and_rejects(stream, book_ttl, orphan_ttl, data):
    findings = []
    for order_id, trades in trades_by_order(stream).items():
        state = OrderState()
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(trades) - 1, 1)), max_size=3)))
        for lo, hi in zip([0, *cuts], [*cuts, len(trades)]):
            state = OrderState.loads(state.dumps())  # (what Spark keeps between micro-batches)
            findings += [(order_id, f) for f in fold(state, trades[lo:hi], book_ttl, orphan_ttl)]
        findings += [(order_id, f) for f in expire(state, orphan_ttl)]  # (the stream's time passed it all)
    alerts = sorted((f.seq, f.purchase_seq, f.purchase_id, order_id, f.requested, f.cumulative)
                    for order_id, f in findings if f.kind == ALERT)
    rejects = dict.fromkeys(REJECT_REASONS, 0)
    for _, f in findings:
        if f.kind != ALERT:
            rejects[f.kind] += 1
    end = max([m[M.STAMP] for m in stream] + [0]) + 2 * 10**9 + 1
    ref_alerts, ref_rejects = expected_alerts(enumerate(stream, 1), book_ttl, orphan_ttl, end_ns=end)
    assert alerts == [tuple(a.values()) for a in ref_alerts]
    assert rejects == ref_rejects


def test_a_state_says_when_all_of_it_has_expired():
    state = OrderState()
    fold(state, [Trade(1, 100, "purchase", 5, "A", "X", 9), Trade(2, 150, "purchase_request", 0, "A", "X", None)],
         book_ttl_ns=1000, orphan_ttl_ns=30)
    assert state.deadline_ns(1000, 30) == 130 and len(state.orphans) == 1  # (a request of 0 shares opens none)
    late = fold(state, [Trade(3, 150, "purchase_request", 3, "A", "X", None)], 1000, 30)
    assert late == [Finding("orphan_expired", 1, 130)]  # (its window ended at 130: it fills nothing)
    assert state.orphans == [] and state.deadline_ns(1000, 30) == 1150
