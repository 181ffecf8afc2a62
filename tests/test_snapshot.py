"""LMDB snapshots: a replica restarted from any snapshot ends identical to
one that never stopped."""

import json
import logging
import os
import subprocess
import sys

import lmdb
import pytest
from conftest import small_disk
from strategies import packet_of

from tape.ops.verification.faults import fill
from tape.ops.verification.local import TAPE
from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.replicas import audit_core
from tape.replicas.audit_core import DIGEST_BLOCK, PACKED_BOOK, AuditMachine
from tape.replicas.replica_shell import Replica
from tape.replicas.snapshot import (
    BOOK,
    BUCKET_SHIFT,
    FORMAT,
    STATE,
    SnapshotInvalid,
    SnapshotStore,
    open_verified,
    records_sum_pure,
)
from tape.runtime.config import default, default_toml
from tape.runtime.storage.journal_store import Journal

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


def machine(compiled=None):
    return AuditMachine(book_ttl_ns=200 * 10**6, orphan_ttl_ns=3 * 10**6, compiled=compiled)


def apply(m, msgs, first):
    """In packets, as a replica applies them (through the compiled cases, where built)."""
    alerts = []
    for i in range(0, len(msgs), 17):
        alerts += m.apply_packet(first + i, packet_of(first + i, msgs[i:i + 17]))
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


def test_the_records_on_disk_are_the_machines_after_every_save_across_a_restart(tmp_path):
    """Books and orphans written, updated and deleted (orphans resolved or expired) between saves,
    with a restart between: what a fresh load reads is the machine's state, record for record."""
    msgs = stream(6000)
    m, store = machine(), SnapshotStore(tmp_path / "lmdb")
    for start in range(0, len(msgs), 500):
        if start == 3000:  # the process dies; the next one goes on from the snapshot
            store.close()
            m, store = machine(), SnapshotStore(tmp_path / "lmdb")
            store.load(m)
        apply(m, msgs[start:start + 500], start + 1)
        store.save(m)
        with store.env.begin() as txn:
            books, orphans, books_sum, orphans_sum = store._read_records(txn, m.new_books())
        assert (books, orphans, (books_sum + orphans_sum) % 2**128) == (m.books, m.orphans, store.state_sum)
    assert m.rejects["orphan_expired"] > 0


def loaded(store):
    """A fresh machine from what `store` holds; the store's sums must be those of the disk."""
    sums = (store.state_sum, store.outbox_sum, set(store.orphan_keys))
    fresh = machine()
    store.load(fresh)
    assert (store.state_sum, store.outbox_sum, store.orphan_keys) == sums
    return fresh


@pytest.mark.parametrize("compiled", [False, None])
def test_a_save_written_while_the_machine_moves_on_holds_the_state_at_its_seq(tmp_path, compiled):
    """A replica writes its snapshot on another thread while it applies on: the job holds the
    state as prepared, and the next save writes what changed since, the job's ids included when
    the disk refused the job (abandon)."""
    msgs = stream(6000)
    m, ref, store = machine(compiled), machine(compiled), SnapshotStore(tmp_path / "lmdb")
    apply(m, msgs[:2000], 1)
    apply(ref, msgs[:2000], 1)
    job = store.prepare(m, outbox=b"x" * 40)
    apply(m, msgs[2000:4000], 2001)  # changes and closes books the job holds
    store.finish(job, store.write(job))
    at_job = loaded(store)
    assert (at_job.last_seq, at_job.digest(), at_job.books, at_job.orphans) == \
        (ref.last_seq, ref.digest(), ref.books, ref.orphans)
    assert store.outbox() == b"x" * 40
    refused = store.prepare(m)
    apply(m, msgs[4000:], 4001)
    store.abandon(m, refused)
    store.save(m)
    now = loaded(store)
    assert (now.last_seq, now.digest(), now.books, now.orphans) == (m.last_seq, m.digest(), m.books, m.orphans)


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
    m = machine(compiled=False)  # (the compiled books refuse such an order id at once)
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


@pytest.mark.process
def test_a_save_the_full_disk_refuses_leaves_the_last_snapshot_and_the_next_save_catches_up(tmp_path):
    """On a real 4 MiB tmpfs: the refused save raises lmdb.Error (the replica logs it and goes on);
    the snapshot before it still verifies; with space back the next save writes all that changed."""
    with small_disk(tmp_path, "4m") as filler:
        m = machine()
        store = SnapshotStore(tmp_path / "lmdb")
        msgs = stream(30_000)
        apply(m, msgs[:1000], 1)
        store.save(m)
        fill(filler)
        apply(m, msgs[1000:], 1001)
        with pytest.raises(lmdb.Error):
            store.save(m)
        fresh = machine()
        store.load(fresh)  # what a restart would read
        assert fresh.last_seq == 1000
        filler.unlink()
        store.save(m)
        store.close()
        fresh = machine()
        reopened = SnapshotStore(tmp_path / "lmdb")
        reopened.load(fresh)
        reopened.close()
        assert fresh.last_seq == m.last_seq and fresh.digest() == m.digest() and fresh.books == m.books


def test_other_windows_refuse_the_snapshot(tmp_path):
    m = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    apply(m, stream(100), 1)
    store.save(m)
    with pytest.raises(RuntimeError, match="windows"):
        store.load(AuditMachine())


# --- snapshots that do not verify are never used (issue 15) ------------------------------------


def saved(tmp_path, n: int = 3000):
    """A snapshot (with an outbox) of a machine that applied `n` trades; returns (dir, digest, last_seq)."""
    m = machine()
    store = SnapshotStore(tmp_path / "lmdb")
    apply(m, stream(n), 1)
    store.save(m, outbox=b"alert bytes")
    store.close()
    return tmp_path / "lmdb", m.digest(), m.last_seq


@pytest.mark.parametrize("alter, why", [
    (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "do not match its checksum"),  # still decodes: only the checksum knows
    (lambda v: v[:-1], "is not whole"),  # a bucket a byte short of its books
])
def test_an_altered_bucket_of_books_in_a_valid_lmdb_is_refused(tmp_path, alter, why):
    path, _, _ = saved(tmp_path)
    env = lmdb.open(str(path), max_dbs=4)
    books = env.open_db(b"books")
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=books)))
        txn.put(key, alter(bytes(value)), db=books)
    env.close()
    with pytest.raises(SnapshotInvalid, match=why):
        SnapshotStore(path).load(machine())


def state_json(raw: bytes) -> tuple[int, dict]:
    """Where a `state` record's JSON starts, and the JSON."""
    at = STATE.size + STATE.unpack_from(raw)[4]  # after the pending effects
    return at, json.loads(raw[at:])


def as_format_2(path) -> None:
    """Rewrite a snapshot's books as format 2 had them, a record a book keyed by its id, with that
    format's checksum (its definition: the sum of each record's BLAKE2b-128)."""
    env = lmdb.open(str(path), max_dbs=4)
    books, orphans, meta = env.open_db(b"books"), env.open_db(b"orphans"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        buckets = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=books)]
        records = [(v[i:i + 8], v[i + 8:i + PACKED_BOOK]) for _, v in buckets for i in range(0, len(v), PACKED_BOOK)]
        txn.drop(books, delete=False)
        for key, record in records:
            txn.put(key, record, db=books)
        held = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=orphans)]
        raw = bytes(txn.get(b"state", db=meta))
        at, state = state_json(raw)
        total = records_sum_pure(b"books:", records) + records_sum_pure(b"orphans:", held)
        state.update(format=2, records_sum=f"{total % 2**128:032x}")
        txn.put(b"state", raw[:at] + json.dumps(state, sort_keys=True).encode(), db=meta)
    env.close()
    assert len(records) > len(buckets) > 0


def test_a_format_2_snapshot_loads_and_its_next_save_writes_every_book_in_buckets(tmp_path):
    msgs = stream(6000)
    m, store = machine(), SnapshotStore(tmp_path / "lmdb")
    apply(m, msgs[:3000], 1)
    store.save(m)
    store.close()
    as_format_2(tmp_path / "lmdb")
    old, store = machine(), SnapshotStore(tmp_path / "lmdb")
    store.load(old)
    assert (old.last_seq, old.digest(), old.books, old.orphans) == (m.last_seq, m.digest(), m.books, m.orphans)
    apply(old, msgs[3000:], 3001)
    apply(m, msgs[3000:], 3001)
    store.save(old)
    loaded(store)  # the sums the save kept are the disk's
    store.close()
    now, store = machine(), SnapshotStore(tmp_path / "lmdb")
    store.load(now)
    assert (now.last_seq, now.digest(), now.books, now.orphans) == (m.last_seq, m.digest(), m.books, m.orphans)
    with store.env.begin() as txn:
        assert state_json(bytes(txn.get(b"state", db=store.meta)))[1]["format"] == FORMAT
        assert all(len(v) % PACKED_BOOK == 0 for _, v in txn.cursor(db=store.books))


def test_an_altered_outbox_is_refused(tmp_path):
    path, _, _ = saved(tmp_path)
    env = lmdb.open(str(path), max_dbs=4)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"outbox", b"other bytes", db=meta)
    env.close()
    store = SnapshotStore(path)
    store.load(machine())
    with pytest.raises(SnapshotInvalid, match="outbox"):
        store.outbox()


@pytest.mark.process
def test_a_truncated_or_zeroed_file_is_refused_not_a_sigbus(tmp_path):
    path, _, _ = saved(tmp_path, 20_000)
    data = path / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    # In a child: were the check missing, reading a page past the end would kill it with SIGBUS.
    child = subprocess.run([sys.executable, "-c", "import sys; from tape.replicas.snapshot import *\n"
                            f"try: SnapshotStore({str(path)!r}).load(__import__('tape.replicas.audit_core').replicas."
                            "audit_core.AuditMachine(200 * 10**6, 3 * 10**6))\n"
                            "except SnapshotInvalid as e: sys.exit(f'invalid: {e}')"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 1 and "is truncated" in child.stderr, child
    with open(data, "r+b") as f:  # the two meta pages zeroed
        f.write(bytes(2 * 4096))
    with pytest.raises(SnapshotInvalid, match="LMDB will not open it"):
        SnapshotStore(path)


def test_a_replica_moves_a_bad_snapshot_aside_and_starts_from_seq_1(tmp_path, caplog):
    path, _, _ = saved(tmp_path)
    env = lmdb.open(str(path), max_dbs=4)
    orphans_or_books = env.open_db(b"books")
    with env.begin(write=True) as txn:
        txn.put((2**40 >> BUCKET_SHIFT).to_bytes(8, "big"), (2**40).to_bytes(8, "big") + bytes(BOOK.size),
                db=orphans_or_books)  # a bucket with a book that never was
    env.close()
    store, m, outbox, why = open_verified(path, machine, logging.getLogger("test"))
    assert m.last_seq == 0 and outbox == b"" and "checksum" in why
    assert "snapshot discarded, never used" in caplog.text
    assert [p.name.split("-")[0] for p in tmp_path.glob("lmdb.bad-*")] == ["lmdb.bad"]  # kept for a post-mortem
    assert store.last_seq() == 0
    apply(m, stream(100), 1)
    store.save(m)  # the fresh store takes snapshots again


@pytest.mark.skipif(audit_core.apply_fast is None, reason="built without a C compiler")
def test_a_replica_sizes_its_books_for_the_books_expected_fresh_or_loaded(tmp_path):
    path, digest, _ = saved(tmp_path)
    tables = []  # each fresh machine's table, as made

    def fresh_machine():
        m = AuditMachine(200 * 10**6, 3 * 10**6, books_expected=50_000)
        tables.append(m.books)
        return m
    store, loaded = open_verified(path, fresh_machine, logging.getLogger("test"))[:2]
    store.close()
    assert loaded.digest() == digest and len(tables) == 1 and loaded.books is tables[0]  # filled in place
    assert loaded.books.capacity >= 100_000 > machine().books.capacity
    cfg = default(tmp_path / "data")
    cfg.books_expected = 50_000
    cfg.nodes.append(type(cfg.nodes[0])("replica-A", "replica", data=str(tmp_path / "replica-A")))
    replica = Replica(cfg, cfg.node("replica-A"))
    replica.store.close()
    assert replica.machine.books.capacity >= 100_000


def write_journal(path, msgs) -> None:
    j = Journal(path, moldudp64.session_bytes("TEST"))
    j.append([(seq, 1, M.SEQUENCED.pack(*msg)) for seq, msg in enumerate(msgs, 1)])
    j.close()


def replay_cli(tmp_path, *extra):
    cfg = tmp_path / "cluster.toml"
    if not cfg.exists():
        cfg.write_text(default_toml(tmp_path / "data").replace(  # the windows of machine() above
            "[journal]", "[audit]\nbook_ttl_s = 0.2\norphan_ttl_s = 0.003\n\n[journal]"))
    out = subprocess.run([*TAPE, "replay", "--config", str(cfg), "--journal", str(tmp_path / "journal"),
                          "--to-lmdb", str(tmp_path / "lmdb"), *extra], capture_output=True, text=True, timeout=120)
    return out.returncode, json.loads(out.stdout) if out.returncode == 0 else out.stderr


@pytest.mark.process
def test_replay_rebuilds_from_scratch_unless_told_to_resume(tmp_path):
    msgs = stream(6000)
    whole = machine()
    apply(whole, msgs, 1)
    write_journal(tmp_path / "journal", msgs)
    # The snapshot of a replica gone wrong: valid LMDB, one book altered.
    m = machine()
    apply(m, msgs[:4000], 1)
    order_id = next(iter(m.books))
    book = m.books[order_id]
    book[1] += 1
    m.books[order_id] = book  # (the compiled books hand out copies)
    m.dirty.update(m.books)
    store = SnapshotStore(tmp_path / "lmdb")
    store.save(m)
    store.close()
    rc, result = replay_cli(tmp_path)
    assert rc == 0 and result["resumed_after"] == 0 and "lmdb.bad-" in result["moved_aside"]
    assert (result["last_seq"], result["digest"]) == (whole.last_seq, whole.digest())
    rc, result = replay_cli(tmp_path, "--resume")  # a good snapshot: nothing left to apply
    assert rc == 0 and result["resumed_after"] == whole.last_seq and result["digest"] == whole.digest()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4)
    with env.begin(write=True) as txn:  # now spoil it
        books = env.open_db(b"books", txn=txn)
        key, value = next(iter(txn.cursor(db=books)))
        txn.put(key, bytes(len(value)), db=books)
    env.close()
    rc, err = replay_cli(tmp_path, "--resume")
    assert rc == 1 and "refusing to resume" in err and "checksum" in err
