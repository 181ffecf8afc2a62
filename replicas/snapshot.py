"""LMDB snapshots of the audit state machine.

One write transaction holds the books and orphans that changed since the
last snapshot (the buckets of the dirty books only), the last applied seq,
the clock and the digest chain, so that a snapshot is all-or-nothing: a
crash leaves the previous one. A restarted replica loads it and replays
from last seq + 1.

Databases: `books` in buckets of 64 consecutive order ids (keyed by the id
>> 6, u64 big-endian; the value the (id, record) pairs of its books, sorted),
`orphans` keyed by order id, and `meta` with `state` and `outbox`. The expiry
queues are not stored: they are rebuilt from the books and orphans, whose
order they follow. Format 2 (a record a book) is read, verified by its own
records, and rewritten in buckets by the first save after it.

Checked: `state` holds a checksum of every bucket and orphan record (the sum,
mod 2^128, of a BLAKE2b hash of each record: kept up to date from the dirty
keys alone, so a save costs no full pass) and of the outbox. `load` recomputes
it over what it reads, and the store refuses a data file shorter than its own
pages say (reading the missing pages would kill the process with SIGBUS). A
snapshot that fails either is SnapshotInvalid: never used.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import lmdb

from tape.protocol import messages as M
from tape.replicas.audit_core import BOOK, PACKED_BOOK, AuditMachine
from tape.runtime.storage.quarantine import aside_path
from tape.runtime.tuning import REPLICA_MAP_BYTES

ORPHAN = struct.Struct(">Q")  # seq, followed by the 75-byte message
STATE = struct.Struct(">QQQ16sI")  # last_seq, now_ns, applied, chain, len(pending)
FORMAT = 3  # 2: with checksums; 3: books in buckets (format 2 is read, and rewritten by the next save)
BUCKET_SHIFT = 6  # a bucket holds the books of 64 consecutive order ids: a save writes ~14x fewer records
SUM_MOD = 1 << 128
SUM_CHUNK = 4096  # records hashed per call while loading (bounds the list of them)


@dataclass(frozen=True)
class SaveJob:
    """What one save writes, taken from the machine at one seq."""
    keys: bytes  # the order ids changed since the last save, sorted, 8-byte big-endian keys end to end
    books: bytes  # key and record of those with a book, PACKED_BOOK bytes each (Books.take_packed)
    orphans: list[tuple[int, bytes | None]]  # (order id, held purchases; None: delete the record)
    state: bytes  # STATE and the pending effects
    meta: dict  # the state's JSON part but for the sums
    outbox: bytes | None


class SnapshotInvalid(Exception):
    """A snapshot that cannot be verified (corrupt, truncated, another format): never used."""


def records_sum_pure(prefix: bytes, records: list[tuple[bytes, bytes]]) -> int:
    """The checksum share of records of one database, mod 2^128: `prefix` is the database's name
    and a colon, each record a (key, value) pair (keys are 8 bytes, so this is unambiguous). The
    definition of `records_sum`, which is this in C (`replicas/_snapshot.c`) where Tape was built with a
    compiler: a save hashes the old and new value of each record it rewrites, and one hashlib call
    each was two thirds of a save's time (when a record was a book)."""
    return sum(int.from_bytes(hashlib.blake2b(prefix + k + v, digest_size=16).digest(), "big")
               for k, v in records) % SUM_MOD


def bucket_keys_pure(joined: bytes, shift: int) -> list[bytes]:
    """The keys of the buckets the ids (sorted, 8-byte big-endian keys end to end in `joined`) fall
    in: id >> shift, each once, in order. In C as `bucket_keys` where Tape was built with a compiler."""
    if len(joined) % 8 or not 0 <= shift <= 63:
        raise ValueError("ids are not whole 8-byte keys, or the shift is not in 0..63")
    buckets = sorted({int.from_bytes(joined[i:i + 8], "big") >> shift for i in range(0, len(joined), 8)})
    return [b.to_bytes(8, "big") for b in buckets]


def merge_buckets_pure(joined: bytes, packed: bytes, old: list[tuple[bytes, bytes]], shift: int,
                       pair_size: int) -> list[tuple[bytes, bytes]]:
    """Each dirty bucket's (key, new value), in order; an empty value where no book is left in it.
    `joined`: the dirty ids, sorted; `packed`: the (id, record) pairs of those with a book, sorted;
    `old`: the (bucket key, value) pairs on disk for them. A value is (id, record) pairs sorted by
    id. In C as `merge_buckets` where Tape was built with a compiler."""
    if len(joined) % 8 or pair_size <= 8 or len(packed) % pair_size or not 0 <= shift <= 63:
        raise ValueError("ids or pairs are not whole, or the shift is not in 0..63")
    new = {packed[i:i + 8]: packed[i:i + pair_size] for i in range(0, len(packed), pair_size)}
    on_disk = dict(old)
    if any(len(v) % pair_size for v in on_disk.values()):
        raise ValueError("a bucket on disk is not whole pairs")
    dirty: dict[bytes, list[bytes]] = {}  # bucket key -> its dirty ids (in order: the ids are sorted)
    for i in range(0, len(joined), 8):
        dirty.setdefault((int.from_bytes(joined[i:i + 8], "big") >> shift).to_bytes(8, "big"), []).append(
            joined[i:i + 8])
    out = []
    for key, ids in dirty.items():
        value = on_disk.pop(key, b"")
        books = {value[i:i + 8]: value[i:i + pair_size] for i in range(0, len(value), pair_size)}
        for order_id in ids:
            if order_id in new:
                books[order_id] = new.pop(order_id)
            else:
                books.pop(order_id, None)
        out.append((key, b"".join(books[k] for k in sorted(books))))
    if new or on_disk:
        raise ValueError("pairs or old buckets that no dirty id names")
    return out


try:
    from tape.replicas._snapshot import bucket_keys, merge_buckets, records_sum
except ImportError:  # built without a C compiler
    bucket_keys, merge_buckets, records_sum = bucket_keys_pure, merge_buckets_pure, records_sum_pure


def outbox_hash(outbox: bytes) -> str:
    return hashlib.blake2b(outbox, digest_size=16).hexdigest()


META_KEYS = {"format": int, "records_sum": str, "book_ttl_ns": int, "orphan_ttl_ns": int, "outbox_sum": str,
             "rejects": dict, "alerts_raised": int}  # what load() reads of a snapshot's metadata


def _checked_meta(meta) -> dict:
    """A snapshot's metadata with every key load() reads, of its type (SnapshotInvalid if not)."""
    if not isinstance(meta, dict):
        raise SnapshotInvalid(f"snapshot metadata is a {type(meta).__name__}, not an object")
    wrong = [k for k, kind in META_KEYS.items() if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool)]
    if wrong:
        raise SnapshotInvalid(f"snapshot metadata lacks or mistypes {', '.join(wrong)}")
    return meta


class SnapshotStore:
    def __init__(self, path: str | Path, map_size: int = REPLICA_MAP_BYTES):
        Path(path).mkdir(parents=True, exist_ok=True)
        try:
            self.env = lmdb.open(str(path), map_size=map_size, max_dbs=4, metasync=False)
        except lmdb.Error as e:
            raise SnapshotInvalid(f"{path}: LMDB will not open it ({e})") from None
        self._check_size(Path(path) / "data.mdb")
        self.books = self.env.open_db(b"books")
        self.orphans = self.env.open_db(b"orphans")
        self.meta = self.env.open_db(b"meta")
        self.saves = 0
        self.keys_written = 0
        self.state_sum = 0  # of the records on disk: known for an empty store, else once loaded
        self.outbox_sum = outbox_hash(b"")
        self.orphan_keys: set[int] = set()  # order ids with an orphans record on disk (bounded by orphan_ttl_s)
        self._sums_known = self.last_seq() == 0
        self._rebucket = False  # the books on disk are one a record (format 2): the next save rewrites them all

    def _check_size(self, data: Path) -> None:
        """Refuse a file shorter than its last page: LMDB maps it, and touching a page past the
        end of the file is SIGBUS, a silent death."""
        size = data.stat().st_size
        need = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        if size < need:
            self.env.close()
            raise SnapshotInvalid(f"{data} is truncated: {size:,} bytes, its pages need {need:,}")

    def close(self) -> None:
        self.env.close()

    def save(self, m: AuditMachine, extra: dict | None = None, outbox: bytes | None = None) -> int:
        """Write what changed since the last save, atomically; returns keys
        written. `outbox`: the alerts not yet acknowledged, saved with it."""
        job = self.prepare(m, extra, outbox)
        try:
            self.finish(job, self.write(job))
        except BaseException:  # the disk refused it (lmdb.Error), or a record would not pack
            self.abandon(m, job)
            raise
        return len(job.keys) // 8

    def prepare(self, m: AuditMachine, extra: dict | None = None, outbox: bytes | None = None) -> SaveJob:
        """The first of a save's three steps, on the thread that applies: what changed since the
        last save, taken at this seq (the machine's dirty set starts afresh). `write` may then run
        on another thread while the machine moves on; `finish` (or, if the disk refused it,
        `abandon`) comes back here. One save at a time. Kept short: the stream waits meanwhile
        (the books come packed in one bytes; the orphans' ids are few, the dirty ones many)."""
        assert self._sums_known, "save() onto a snapshot that was not loaded: its checksum is unknown"
        marked, keys, books = m.take_dirty_packed()
        orphans = []
        for order_id in sorted(marked & (m.orphans.keys() | self.orphan_keys)):
            held = m.orphans.get(order_id)
            if held or order_id in self.orphan_keys:
                orphans.append((order_id, b"".join(ORPHAN.pack(seq) + M.SEQUENCED.pack(*msg)
                                                   for seq, _, msg in held) if held else None))
        pending = m.pending_effects
        meta = {"format": FORMAT, "rejects": dict(m.rejects), "alerts_raised": m.alerts_raised,
                "book_ttl_ns": m.book_ttl_ns, "orphan_ttl_ns": m.orphan_ttl_ns, **(extra or {})}
        state = STATE.pack(m.last_seq, m.now_ns, m.applied, m.chain, len(pending)) + pending
        return SaveJob(keys, books, orphans, state, meta, outbox)

    def write(self, job: SaveJob) -> tuple[int, str, set[int]]:
        """The save's disk work, in one transaction (any thread): returns the records' checksum,
        the outbox's and the ids with an orphans record, for `finish`. Raises lmdb.Error if the
        disk refuses it (nothing written)."""
        out_sum = self.outbox_sum if job.outbox is None else outbox_hash(job.outbox)
        orphan_keys = set(self.orphan_keys)
        with self.env.begin(write=True) as txn:
            if self._rebucket:
                txn.drop(self.books, delete=False)  # (every book is in this job: load marked them all)
            total = self.state_sum + self._put_books(txn, job.keys, job.books)
            for order_id, record in job.orphans:
                total += self._put(txn, self.orphans, b"orphans", order_id.to_bytes(8, "big"), record)
                if record:
                    orphan_keys.add(order_id)
                else:
                    orphan_keys.discard(order_id)
            total %= SUM_MOD
            meta = {**job.meta, "records_sum": f"{total:032x}", "outbox_sum": out_sum}
            if job.outbox is not None:
                txn.put(b"outbox", job.outbox, db=self.meta)
            txn.put(b"state", job.state + json.dumps(meta, sort_keys=True).encode(), db=self.meta)
        return total, out_sum, orphan_keys

    def finish(self, job: SaveJob, written: tuple[int, str, set[int]]) -> None:
        """The save committed: its sums are the store's now."""
        self.state_sum, self.outbox_sum, self.orphan_keys = written
        self._rebucket = False
        self.saves += 1
        self.keys_written += len(job.keys) // 8

    @staticmethod
    def abandon(m: AuditMachine, job: SaveJob) -> None:
        """The disk refused the save: its ids are dirty again, for the next one."""
        m.dirty.update(int.from_bytes(job.keys[i:i + 8], "big") for i in range(0, len(job.keys), 8))

    def _put_books(self, txn, joined: bytes, packed: bytes) -> int:
        """Write the dirty books (`joined`: their ids end to end), each bucket they fall in rewritten
        whole and deleted once empty; returns what the checksum moves by. A record a book cost a
        save ~22,000 Python objects, lookups, puts and hashes (most of its CPU): a bucket of 64 ids
        costs one of each, and the ids a client numbers in sequence fill their buckets."""
        with txn.cursor(db=self.books) as cursor:
            old = cursor.getmulti(bucket_keys(joined, BUCKET_SHIFT))  # (key, value) pairs, bytes
            new = merge_buckets(joined, packed, old, BUCKET_SHIFT, PACKED_BOOK)
            kept = [(key, value) for key, value in new if value]
            cursor.putmulti(kept)
        for key, value in new:
            if not value:  # every book in it closed: few, at their expiry
                txn.delete(key, db=self.books)
        return records_sum(b"books:", kept) - records_sum(b"books:", old)

    @staticmethod
    def _put(txn, db, name: bytes, key: bytes, value: bytes | None) -> int:
        """Write (or with None delete) one record; returns what the checksum moves by."""
        old = txn.pop(key, db=db) if value is None else txn.replace(key, value, db=db)
        change = -records_sum(name + b":", [(key, bytes(old))]) if old is not None else 0
        return change if value is None else change + records_sum(name + b":", [(key, value)])

    def outbox(self) -> bytes:
        """The alerts not yet acknowledged, as of the loaded snapshot (checked against its sum)."""
        with self.env.begin() as txn:
            raw = bytes(txn.get(b"outbox", b"", db=self.meta))
        if outbox_hash(raw) != self.outbox_sum:
            raise SnapshotInvalid("the outbox does not match its checksum")
        return raw

    def last_seq(self) -> int:
        with self.env.begin() as txn:
            raw = txn.get(b"state", db=self.meta)
        return STATE.unpack_from(raw)[0] if raw else 0

    def load(self, m: AuditMachine) -> dict | None:
        """Fill a fresh machine from the snapshot; returns its extra metadata,
        or None if there is no snapshot yet. SnapshotInvalid if it does not verify."""
        try:
            with self.env.begin() as txn:
                raw = txn.get(b"state", db=self.meta)
                if raw is None:
                    return None
                last_seq, now_ns, applied, chain, npend = STATE.unpack_from(raw)
                pending = bytes(raw[STATE.size:STATE.size + npend])
                meta = _checked_meta(json.loads(bytes(raw[STATE.size + npend:])))
                if meta.get("format") not in (2, FORMAT):
                    raise SnapshotInvalid(f"snapshot format {meta.get('format')} is neither 2 nor {FORMAT}")
                one_a_record = meta["format"] == 2
                # a fresh machine's table (sized for books_expected, its memory written) is filled in place
                into = m.books if len(m.books) == 0 else m.new_books()
                books, orphans, books_sum, orphans_sum = self._read_records(txn, into, one_a_record)
                total = (books_sum + orphans_sum) % SUM_MOD
        except (lmdb.Error, struct.error, ValueError, KeyError) as e:
            raise SnapshotInvalid(f"unreadable snapshot ({type(e).__name__}: {e})") from None
        if f"{total:032x}" != meta.get("records_sum"):
            raise SnapshotInvalid(f"the books and orphans of the snapshot at seq {last_seq:,} do not match its "
                                  f"checksum (a corrupt or altered file)")
        if (meta["book_ttl_ns"], meta["orphan_ttl_ns"]) != (m.book_ttl_ns, m.orphan_ttl_ns):
            raise RuntimeError("snapshot was taken with other book/orphan windows: replay from the journal instead")
        self.state_sum, self.outbox_sum, self._sums_known = total, meta["outbox_sum"], True
        if one_a_record:  # format 2: the next save drops those records and writes every book in buckets
            self.state_sum, self._rebucket = orphans_sum, True
        self.orphan_keys = set(orphans)
        m.books, m.orphans = books, orphans
        m.last_seq, m.now_ns, m.applied = last_seq, now_ns, applied
        m.rejects, m.alerts_raised = meta["rejects"], meta["alerts_raised"]
        m.restore_digest(chain, pending)
        m._book_expiry = m.new_book_expiry(sorted(((b[4] + m.book_ttl_ns, oid, b[6]) for oid, b in books.items()),
                                                  key=lambda e: e[2]))
        m._orphan_expiry = deque(sorted(((stamp + m.orphan_ttl_ns, oid, seq) for oid, held in orphans.items()
                                         for seq, stamp, _ in held), key=lambda e: e[2]))
        m.take_dirty()  # the state loaded is the state saved
        if one_a_record:
            m.dirty.update(books.keys())
        return {k: v for k, v in meta.items()
                if k not in ("format", "rejects", "alerts_raised", "records_sum", "outbox_sum")}

    def _read_records(self, txn, books, one_a_record: bool = False) -> tuple[dict, dict, int, int]:
        """Every book (into `books`, empty) and orphan record, decoded, and the checksum shares of the
        books and of the orphans. `one_a_record`: format 2's books, a record each, not in buckets."""
        orphans, records, books_sum, orphans_sum = {}, [], 0, 0
        for key, value in txn.cursor(db=self.books):
            records.append((bytes(key), bytes(value)))
            if one_a_record:
                books[int.from_bytes(key, "big")] = list(BOOK.unpack(value))
            elif len(value) % PACKED_BOOK:
                raise ValueError(f"the bucket of books at {bytes(key).hex()} is not whole")
            else:
                books.put_packed(value)
            if len(records) == SUM_CHUNK:
                books_sum += records_sum(b"books:", records)
                records.clear()
        books_sum += records_sum(b"books:", records)
        step = ORPHAN.size + M.SEQUENCED_SIZE
        for key, value in txn.cursor(db=self.orphans):
            orphans_sum += records_sum(b"orphans:", [(bytes(key), bytes(value))])
            held = []
            for off in range(0, len(value), step):
                seq = ORPHAN.unpack_from(value, off)[0]
                msg = M.SEQUENCED.unpack_from(value, off + ORPHAN.size)
                held.append((seq, msg[M.STAMP], msg))
            orphans[int.from_bytes(key, "big")] = held
        return books, orphans, books_sum % SUM_MOD, orphans_sum % SUM_MOD


def move_aside(path: Path) -> Path:
    """Rename a snapshot directory out of the way (kept for a post-mortem, never deleted)."""
    aside = aside_path(path, "bad")
    path.rename(aside)
    return aside


def open_verified(path: Path, new_machine, log) -> tuple["SnapshotStore", AuditMachine, bytes, str | None]:
    """The store at `path`, a machine (`new_machine()`) loaded from it, and its outbox. A snapshot
    that does not verify is moved aside with an ERROR line and a fresh store and machine are
    started (the replica then rebuilds from seq 1). The last item says why, or is None."""
    try:
        store = SnapshotStore(path)
        try:
            m = new_machine()
            store.load(m)
            return store, m, store.outbox(), None
        except SnapshotInvalid:
            store.close()
            raise
    except SnapshotInvalid as e:
        aside = move_aside(path)
        log.error("snapshot discarded, never used: %s; moved to %s; rebuilding from seq 1", e, aside)
        return SnapshotStore(path), new_machine(), b"", str(e)
