"""LMDB snapshots: a replica restarted from any snapshot ends identical to
one that never stopped."""

import pytest

from tape.ops.tradegen import TradeGenerator
from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.replicas.audit import DIGEST_BLOCK, AuditMachine
from tape.replicas.snapshot import SnapshotStore

ORIGIN = moldudp64.session_bytes("load0")


def stream(n: int, seed: int = 3) -> list:
    """Trades with stamps 1 ms apart per 50 messages, and a tick now and then;
    small windows so that books close and orphans expire along the way."""
    out = []
    for i, raw in enumerate(TradeGenerator(seed, overfill_share=0.3).take(n)):
        stamp = 10**9 + (i // 50) * 10**6
        out.append(M.decode(M.stamp(raw, stamp, ORIGIN, i + 1)))
        if i % 997 == 0:
            out.append(M.decode(M.time_tick(stamp, ORIGIN)))
        if i % 211 == 0:  # a purchase whose request never comes: it expires
            out.append(M.decode(M.stamp(M.purchase(10**15 + i, 10**15 + i, 5, "Acme", "IBM"), stamp, ORIGIN, i + 1)))
    # Purchases before their requests: swap some neighbours.
    for i in range(5, len(out) - 1, 37):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def machine():
    return AuditMachine(book_ttl_ns=200 * 10**6, orphan_ttl_ns=3 * 10**6)


def apply(m, msgs, first):
    alerts = []
    for i in range(0, len(msgs), 17):
        alerts += m.apply_run(first + i, msgs[i:i + 17])
    return alerts


@pytest.mark.parametrize("restart_at", [1, 4095, 4096, 4097, 9000])
def test_restart_from_a_snapshot_ends_identical(tmp_path, restart_at):
    msgs = stream(12_000)
    assert len(msgs) > 2 * DIGEST_BLOCK
    whole = machine()
    alerts_whole = apply(whole, msgs, 1)

    a = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    alerts = []
    # Incremental snapshots every 1,000 messages up to the restart point.
    for start in range(0, restart_at, 1000):
        alerts += apply(a, msgs[start:min(start + 1000, restart_at)], start + 1)
        store.save(a)
    store.close()
    del a  # the process dies

    b = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    assert store.load(b) == {"book_ttl_ns": 200 * 10**6, "orphan_ttl_ns": 3 * 10**6}
    assert b.last_seq == restart_at
    alerts += apply(b, msgs[restart_at:], restart_at + 1)
    assert b.digest() == whole.digest()
    assert alerts == alerts_whole
    assert (b.books, b.orphans, b.rejects, b.alerts_raised) == (
        whole.books,
        whole.orphans,
        whole.rejects,
        whole.alerts_raised,
    )
    assert whole.rejects["orphan_expired"] > 0 and len(alerts_whole) > 100


def test_snapshots_write_only_what_changed(tmp_path):
    m = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    msgs = stream(3000)
    apply(m, msgs[:2000], 1)
    first = store.save(m)
    apply(m, msgs[2000:2100], 2001)
    second = store.save(m)
    assert 0 < second < first / 5
    assert store.save(m) == 0  # nothing changed
    assert store.last_seq() == 2100


def test_a_snapshot_is_all_or_nothing(tmp_path):
    m = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    msgs = stream(2000)
    apply(m, msgs[:1000], 1)
    store.save(m)
    apply(m, msgs[1000:2000], 1001)
    m.books[2**70] = [1, 0, b"x", b"y", 0, False, 0]  # unpackable: the transaction fails
    m.dirty.add(2**70)
    with pytest.raises(OverflowError):  # the order id does not fit its u64 key
        store.save(m)
    assert store.last_seq() == 1000  # the previous snapshot, whole
    fresh = machine()
    store.load(fresh)
    assert fresh.last_seq == 1000


def test_other_windows_refuse_the_snapshot(tmp_path):
    m = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    apply(m, stream(100), 1)
    store.save(m)
    with pytest.raises(RuntimeError, match="windows"):
        store.load(AuditMachine())
