"""replicas/_audit.c against the pure audit: the compiled books behave as the pure ones, and a
machine fed packets through the compiled common cases ends every packet in the very state the
pure rules reach on the same messages (books, orphans, expiry queues, dirty ids, effects, alerts,
digest); and where a C compiler exists it was built."""

import gc
import random
import resource
from collections import deque

import pytest
from compilers import where_built
from hypothesis import example, given, settings
from hypothesis import strategies as st
from strategies import packet_of as packet

from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import messages as M
from tape.protocol.errors import InvariantViolation
from tape.protocol.limits import MAX_BOOKS_EXPECTED
from tape.protocol.receiver import Deliver
from tape.replicas import audit_core
from tape.replicas.audit_core import DIGEST_BLOCK, Alert, AuditMachine, Books

compiled = pytest.mark.skipif(audit_core.apply_fast is None, reason="built without a C compiler")
ORIGIN = b"client1   "


@where_built
def test_the_compiled_audit_was_built_where_a_compiler_exists():
    assert audit_core.apply_fast is not None and AuditMachine().compiled


def seqd(raw: bytes, stamp: int, cseq: int) -> tuple:
    return M.decode(M.stamp(raw, stamp, ORIGIN, cseq))


@st.composite
def streams(draw):
    """Every rule's case: fills, alerts, rejects, held purchases, expiries, control messages (the
    session's end, a fold point, among them), ids at both ends of u64 (few orders, so that they collide)."""
    orders = draw(st.lists(st.sampled_from([1, 2, 3, 2**63, 2**64 - 1, 77]), min_size=1, max_size=5, unique=True))
    stamp, out = 0, []
    for i in range(draw(st.integers(1, 150))):
        stamp += draw(st.sampled_from([0, 0, 1, 5, 30, 200]))
        kind = draw(st.sampled_from("RPPPPPKE" if i % 3 == 0 else "RPPPPPK"))
        order, shares = draw(st.sampled_from(orders)), draw(st.sampled_from([-1, 0, 1, 10, 40, 100]))
        client, stock = draw(st.sampled_from("AAAB")), draw(st.sampled_from("XXXY"))
        if kind == "K":
            out.append(M.decode(M.time_tick(stamp, ORIGIN)))
        elif kind == "E":
            out.append(M.decode(M.session_end(stamp, ORIGIN)))
        elif kind == "R":
            out.append(seqd(M.purchase_request(order, shares, client, stock), stamp, i + 1))
        else:
            out.append(seqd(M.purchase(1000 + i, order, shares, client, stock), stamp, i + 1))
    return out


def state(m: AuditMachine) -> tuple:
    """What must be equal, the dirty ids as a snapshot takes them (keys and packed books); and the ids
    the rules marked, the only ones a snapshot looks up for orphans."""
    marked, keys, books = m.take_dirty_packed()
    return (dict(m.books.items()), m.orphans, list(m._book_expiry), list(m._orphan_expiry), keys, books,
            m.pending_effects, m.chain, m.rejects, m.alerts_raised, m.applied, m.last_seq, m.now_ns), marked


@compiled
@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.tuples(st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=12),
       st.sampled_from([30, 200, 10**9]), st.sampled_from([5, 30, 200, 10**9]))
@pytest.mark.slow
def test_packets_through_the_compiled_cases_end_as_the_pure_rules_do(stream, cuts, book_ttl, orphan_ttl):
    pure = AuditMachine(book_ttl, orphan_ttl, compiled=False)
    fast = AuditMachine(book_ttl, orphan_ttl, compiled=True)
    pos, k = 0, 0
    while pos < len(stream):
        size, back = cuts[k % len(cuts)]
        back = min(back, pos)  # the packet begins with messages already applied: delivered from `skip`
        msgs = stream[pos - back:pos + size]
        held = set(pure.orphans)
        assert fast.apply_packet(pos + 1, packet(pos - back + 1, msgs), back) == pure.apply_run(pos + 1, msgs[back:])
        (fast_state, fast_marked), (pure_state, every_id) = state(fast), state(pure)  # (the pure rules mark all)
        assert fast_state == pure_state and fast.digest() == pure.digest()
        assert {i for i in every_id if i in held or i in pure.orphans} <= fast_marked  # orphans: by the rules only
        assert [int.from_bytes(pure_state[4][i:i + 8], "big") for i in range(0, len(pure_state[4]), 8)] == \
            sorted(every_id)
        pos, k = pos - back + len(msgs), k + 1


@compiled
@settings(max_examples=200, deadline=None)
@given(streams(), st.lists(st.tuples(st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(0, 60), st.integers(1, 6))
@pytest.mark.slow
def test_a_drain_applied_in_one_call_ends_as_its_packets_applied_one_by_one(stream, cuts, before_fold, per_drain):
    """apply_runs (a replica's drain) against apply_packet of each run on the pure rules: the same
    alerts, the same fold points (with the alerts raised before each and the chain folded there),
    the same state; fold points (multiples of the block and the session's end, the pure machine fed
    one message at a time to find them: where its chain changes) fall inside and at the ends of runs."""
    start = 2 * DIGEST_BLOCK - before_fold
    pure, fast = AuditMachine(compiled=False), AuditMachine(compiled=True)
    pure.last_seq = fast.last_seq = start
    runs, pos, k = [], 0, 0
    while pos < len(stream):
        size, back = cuts[k % len(cuts)]
        back = min(back, pos)
        msgs = stream[pos - back:pos + size]
        runs.append(Deliver(start + pos + 1, packet(start + pos - back + 1, msgs), back))
        pos, k = pos - back + len(msgs), k + 1
    for d in range(0, len(runs), per_drain):
        alerts, folds = [], []
        for run in runs[d:d + per_drain]:  # as a replica applied a drain before
            folded = []
            for seq, msg in enumerate(M.decode_delivered(run.packet, run.skip), run.first_seq):
                chain = pure.chain
                alerts += pure.apply(seq, msg)
                if pure.chain != chain:
                    folded.append((seq, pure.chain))
            folds += [(len(alerts), seq, chain) for seq, chain in folded]
        assert fast.apply_runs(runs[d:d + per_drain]) == (alerts, folds)
        assert state(fast)[0] == state(pure)[0] and fast.digest() == pure.digest()


@compiled
@pytest.mark.parametrize("seed", range(2))
def test_generated_trades_never_reach_the_python_rules(seed):
    """The point of it: on the load generator's stream (which never breaks a rule) the Python rules
    see nothing, alerts included."""
    gen = TradeGenerator(seed, overfill_share=0.2)
    msgs = [seqd(raw, 10**18 + i // 100, i + 1) for i, raw in enumerate(gen.take(20_000))]
    pure, fast = AuditMachine(compiled=False), AuditMachine(compiled=True)
    ruled = []
    rules = fast._apply
    fast._apply = lambda seq, ms, out: (ruled.append(seq), rules(seq, ms, out))
    for first in range(0, len(msgs), 17):  # a 1,400-byte packet's worth each, folds crossed
        chunk = msgs[first:first + 17]
        alerts = fast.apply_packet(first + 1, packet(first + 1, chunk))
        assert alerts == pure.apply_run(first + 1, chunk)
        assert all(Alert.decode(a).encode() == a for a in alerts)  # made by the C: whole records
    assert state(fast)[0] == state(pure)[0] and fast.digest() == pure.digest()
    assert fast.alerts_raised > 100 and ruled == []


@compiled
def test_the_books_expiry_entries_are_no_python_objects():
    """They live as long as their books (an hour by default): nothing for the collector to walk."""
    msgs = [seqd(raw, 10**18 + i, i + 1) for i, raw in enumerate(TradeGenerator(1).take(2000))]
    machine = AuditMachine(compiled=True)
    machine.apply_packet(1, packet(1, msgs))
    assert len(machine._book_expiry) > 100 and not gc.is_tracked(machine._book_expiry)
    assert gc.get_referents(machine._book_expiry) == []


@compiled
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9000)), max_size=12))
@example([(True, 8 * 4096), (False, 4096 + 5), (True, 3 * 4096), (False, 20000), (True, 9 * 4096)])
def test_the_expiry_queue_behaves_as_a_deque(ops):
    """Appends and pops in runs that fill, spend and cross its blocks (4,096 entries each), and its
    list of blocks (8, then doubled; slid to the front when the first are spent)."""
    queue, ref, n = audit_core.ExpiryQueue(), deque(), 0
    for append, k in ops:
        for _ in range(k if append else min(k, len(ref))):
            if append:
                n += 1
                queue.append((n * 3, n, 2**64 - n))
                ref.append((n * 3, n, 2**64 - n))
            else:
                assert queue.popleft() == ref.popleft()
        assert len(queue) == len(ref) and (not ref or (queue[0], queue[-1]) == (ref[0], ref[-1]))
    assert list(queue) == list(ref) and list(audit_core.ExpiryQueue(ref)) == list(ref)
    for _ in ref:
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IndexError):
        queue[0]


@compiled
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000), st.integers(-5, 5)), max_size=3000))
def test_the_compiled_books_behave_as_a_dict(ops):
    """Inserts and deletes past growth (1,024 slots at first) and clustered ids: a dict is the model."""
    table, model = audit_core.BookTable(), Books()
    for put, order_id, shares in ops:
        order_id *= 1024  # ids that share home slots
        if put:
            book = [shares, shares * 2, b"C" * 16, b"S" * 8, order_id, shares > 0, 2**64 - 1]
            table[order_id] = model[order_id] = book
        elif order_id in model:
            del table[order_id], model[order_id]
        assert (order_id in table) == (order_id in model) and table.get(order_id) == model.get(order_id)
    assert len(table) == len(model) and table == model and sorted(table) == sorted(model)
    marked = set(sorted(model)[::2]) | {2**64 - 1, 5}  # (setting a book notes nothing: only the rules' ids)
    assert table.take_packed(marked) == model.take_packed(marked)


@compiled
@settings(max_examples=200, deadline=None)
@given(st.sets(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 5000)), max_size=400))
def test_a_snapshot_takes_any_ids_sorted_and_once(ids):
    """Ids anywhere in the u64 range, or close together (bytes that every id shares are skipped by
    the compiled sort), some with a book: the same keys and records as the definition."""
    table, model = audit_core.BookTable(), Books()
    for order_id in sorted(ids)[::3]:
        table[order_id] = model[order_id] = [1, 2, b"C" * 16, b"S" * 8, order_id, True, 2**64 - 1]
    assert table.take_packed(ids) == model.take_packed(ids)


@compiled
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 50)), st.integers(-2**63, 2**63 - 1),
                          st.booleans()), max_size=300))
def test_books_put_from_a_snapshots_bucket_are_the_books_packed(books):
    """What a load puts from a bucket (past the table's growth, ids repeated) is
    what was packed, in the compiled books as in the pure ones; a bucket not whole is refused."""
    model = Books()
    for order_id, shares, alerted in books:
        model[order_id] = [shares, -shares - 1, b"C" * 16, b"S" * 8, order_id, alerted, 2**64 - 1 - order_id]
    pairs = b"".join(model.packed([order_id]) for order_id, _, _ in books)  # repeats included, in order
    table, pure = audit_core.BookTable(), Books()
    table.put_packed(pairs)
    pure.put_packed(pairs)
    assert table == pure == model and len(table) == len(model)
    for books_of in (audit_core.BookTable(), Books()):
        with pytest.raises(ValueError):
            books_of.put_packed(pairs + b"x")


@compiled
@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_books_stay_a_dict_through_many_deletes(seed):
    """A dense table (runs of neighbours in the probe sequence) where deletes must move books back."""
    rng, table, model = random.Random(seed), audit_core.BookTable(), Books()
    for step in range(40_000):
        order_id = rng.randrange(3000)
        if rng.random() < 0.55:
            table[order_id] = model[order_id] = [step, 0, b"C" * 16, b"S" * 8, 0, False, order_id]
        elif order_id in model:
            del table[order_id], model[order_id]
        if step % 1000 == 0:
            assert table == model
    assert table == model and all(table[k] == v for k, v in model.items())


@compiled
@pytest.mark.slow
@pytest.mark.parametrize("stride", [1, 1024, 0x9E3779B97F4A7C15])
def test_a_doubling_moves_the_books_a_few_at_a_time_and_they_stay_found(stride):
    """The 513th book doubles a fresh table; its books move over the next inserts (none stalls for
    all of them), while reads, overwrites and deletes find each book in whichever array holds it."""
    rng, table, model = random.Random(stride), audit_core.BookTable(), Books()
    ids = [i * stride % 2**64 for i in range(1, 3000)]
    for n, order_id in enumerate(ids, 1):
        table[order_id] = model[order_id] = [n, 0, b"C" * 16, b"S" * 8, 0, False, 0]
        if n == 513:
            assert 0 < table.moving < 1024
        if table.moving:
            old = rng.choice(sorted(model))
            if rng.random() < 0.5:
                del table[old], model[old]
            else:
                table[old] = model[old] = [n, 1, b"C" * 16, b"S" * 8, 0, True, 1]
            assert table == model
    fresh = iter(range(2**63, 2**63 + 4096))  # a doubling ends within its old capacity / 2 inserts
    while table.moving:
        order_id = next(fresh)
        table[order_id] = model[order_id] = [0, 0, b"C" * 16, b"S" * 8, 0, False, 0]
    assert table == model and len(table) == len(model)


def home(order_id: int, slots: int = 1024) -> int:
    """The first slot _audit.c probes for an order id (a fresh table has 1,024)."""
    run = (order_id >> 6) * 0x9E3779B97F4A7C15 % 2**64
    return (((run ^ (run >> 29)) << 6 | order_id % 64) % 2**64) % slots


def _page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@compiled
def test_a_table_sized_for_the_books_expected_neither_doubles_nor_faults_while_they_come():
    """Sized at start, every page written then: the books expected go in without a doubling or a
    page fault of the table (unsized, the same books double it nine times and fault its pages in)."""
    books = 300_000
    record = [0, 0, b"C" * 16, b"S" * 8, 0, False, 0]
    for expected, grows in ((books, False), (0, True)):
        table = audit_core.BookTable(expected=expected)
        gc.collect()
        faults, moved = _page_faults(), False
        for order_id in range(books):
            table[order_id] = record
            moved = moved or table.moving > 0
        faults = _page_faults() - faults
        table_pages = books * 2 * 72 // 4096  # slots of 72 bytes, at most half full
        assert moved == grows and (faults > table_pages if grows else faults < table_pages // 20), faults
        assert len(table) == books and table[books - 1] == record
    from tape.replicas import _audit

    assert _audit.MAX_EXPECTED == MAX_BOOKS_EXPECTED  # the config accepts what the table does
    for wrong in (-1, MAX_BOOKS_EXPECTED + 1):
        with pytest.raises(ValueError):
            audit_core.BookTable(expected=wrong)


@compiled
def test_a_run_of_books_that_wraps_round_the_table_survives_deletes():
    by_home = {slot: [i for i in range(300_000) if home(i) == slot][:2] for slot in (1022, 1023, 0)}
    for ids in ([*by_home[1022][:1], *by_home[1023][:1], *by_home[0][:1]],  # each at its home
                [*by_home[1022][:1], *by_home[1023]], [*by_home[1023], *by_home[0]],  # displaced
                [*by_home[1022], *by_home[1023], *by_home[0]]):
        for gone in ids:
            table = audit_core.BookTable()
            for order_id in ids:
                table[order_id] = [order_id, 0, b"C" * 16, b"S" * 8, 0, False, 0]
            del table[gone]
            assert sorted(table) == sorted(set(ids) - {gone})
            assert all(table.get(i) == [i, 0, b"C" * 16, b"S" * 8, 0, False, 0] for i in set(ids) - {gone})


@compiled
def test_the_compiled_books_refuse_what_a_book_cannot_hold():
    table = audit_core.BookTable()
    good = [1, 0, b"C" * 16, b"S" * 8, 0, False, 0]
    for key, book, error in [(2**64, good, OverflowError), (-1, good, OverflowError), ("1", good, TypeError),
                             (1, good[:6], ValueError), (1, [1, 0, b"C", b"S" * 8, 0, False, 0], ValueError),
                             (1, [2**63, 0, b"C" * 16, b"S" * 8, 0, False, 0], OverflowError),
                             (1, [1, 0, "C" * 16, b"S" * 8, 0, False, 0], TypeError)]:
        with pytest.raises(error):
            table[key] = book
    assert len(table) == 0 and 2**64 not in table and table.get(-1) is None
    with pytest.raises(KeyError):
        del table[7]


@compiled
def test_a_packet_cut_short_is_refused_before_anything_changes():
    m = AuditMachine(compiled=True)
    pkt = packet(1, [seqd(M.purchase_request(1, 100, "A", "X"), 5, 1)] * 3)
    with pytest.raises(ValueError):
        audit_core.apply_fast(m.books, m._codes, m._book_expiry, m.orphans, 1, 0, 2**64 - 1, pkt[:-1], 0, 3, 1, [])
    assert len(m.books) == 0 and not m.take_dirty() and not m.pending_effects


def test_both_kinds_replay_a_random_stream_to_the_same_digest():
    """Without the compiled kind (no compiler) this still checks the pure path through packets."""
    rng = random.Random(4)
    msgs = [seqd(M.purchase_request(i, 50, "A", "X") if rng.random() < 0.3 else
                 M.purchase(i, rng.randrange(1, i + 2), rng.choice([10, 30, 60]), "A", "X"), i, i + 1)
            for i in range(1, 9000)]
    machines = [AuditMachine(10**4, 10**3, compiled=False)] + \
        ([AuditMachine(10**4, 10**3, compiled=True)] if audit_core.apply_fast else [])
    for m in machines:
        for first in range(0, len(msgs), 17):
            m.apply_packet(first + 1, packet(first + 1, msgs[first:first + 17]))
    assert len({m.digest() for m in machines}) == 1 and machines[0].rejects["orphan_expired"] > 0


@compiled
def test_a_failure_inside_the_compiled_cases_stops_the_machine_as_impossible(monkeypatch):
    """It may have applied part of the run: the replica must stop (fail-stop), not go on."""
    def failing(*args):
        raise MemoryError()

    monkeypatch.setattr(audit_core, "apply_fast", failing)
    m = AuditMachine(compiled=True)
    with pytest.raises(InvariantViolation):
        m.apply_packet(1, packet(1, [seqd(M.purchase_request(1, 100, "A", "X"), 5, 1)]))
