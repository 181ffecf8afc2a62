"""LMDB snapshots of the audit state machine.

One write transaction holds the books and orphans that changed since the
last snapshot (dirty keys only), the last applied seq, the clock and the
digest chain, so that a snapshot is all-or-nothing: a crash leaves the
previous one. A restarted replica loads it and replays from last seq + 1.

Databases: `books` and `orphans` keyed by order id (u64 big-endian), and
`meta` with one record, `state`. The expiry queues are not stored: they are
rebuilt from the books and orphans, whose order they follow.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from pathlib import Path

import lmdb

from tape.protocol import messages as M
from tape.replicas.audit import AuditMachine

BOOK = struct.Struct(">qq16s8sQ?Q")  # requested, cumulative, client, stock, opened_ns, alerted, request_seq
ORPHAN = struct.Struct(">Q")  # seq, followed by the 75-byte message
STATE = struct.Struct(">QQQ16sI")  # last_seq, now_ns, applied, chain, len(pending)
FORMAT = 1


class SnapshotStore:
    def __init__(self, path: str | Path, map_size: int = 8 << 30):
        Path(path).mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=map_size, max_dbs=4, metasync=False)
        self.books = self.env.open_db(b"books")
        self.orphans = self.env.open_db(b"orphans")
        self.meta = self.env.open_db(b"meta")
        self.saves = 0
        self.keys_written = 0

    def close(self) -> None:
        self.env.close()

    def save(self, m: AuditMachine, extra: dict | None = None, outbox: bytes | None = None) -> int:
        """Write what changed since the last save, atomically; returns keys
        written. `outbox`: the alerts not yet acknowledged, saved with it."""
        dirty = sorted(m.dirty)
        with self.env.begin(write=True) as txn:
            for order_id in dirty:
                key = order_id.to_bytes(8, "big")
                book = m.books.get(order_id)
                if book is None:
                    txn.delete(key, db=self.books)
                else:
                    txn.put(key, BOOK.pack(*book), db=self.books)
                held = m.orphans.get(order_id)
                if not held:
                    txn.delete(key, db=self.orphans)
                else:
                    txn.put(key, b"".join(ORPHAN.pack(seq) + M.SEQUENCED.pack(*msg) for seq, _, msg in held),
                            db=self.orphans)
            pending = m.pending_effects
            meta = {"format": FORMAT, "rejects": m.rejects, "alerts_raised": m.alerts_raised,
                    "book_ttl_ns": m.book_ttl_ns, "orphan_ttl_ns": m.orphan_ttl_ns, **(extra or {})}
            if outbox is not None:
                txn.put(b"outbox", outbox, db=self.meta)
            txn.put(b"state", STATE.pack(m.last_seq, m.now_ns, m.applied, m.chain, len(pending)) + pending
                    + json.dumps(meta, sort_keys=True).encode(), db=self.meta)
        m.dirty.clear()
        self.saves += 1
        self.keys_written += len(dirty)
        return len(dirty)

    def outbox(self) -> bytes:
        with self.env.begin() as txn:
            return bytes(txn.get(b"outbox", b"", db=self.meta))

    def last_seq(self) -> int:
        with self.env.begin() as txn:
            raw = txn.get(b"state", db=self.meta)
        return STATE.unpack_from(raw)[0] if raw else 0

    def load(self, m: AuditMachine) -> dict | None:
        """Fill a fresh machine from the snapshot; returns its extra metadata,
        or None if there is no snapshot yet."""
        with self.env.begin() as txn:
            raw = txn.get(b"state", db=self.meta)
            if raw is None:
                return None
            last_seq, now_ns, applied, chain, npend = STATE.unpack_from(raw)
            pending = raw[STATE.size:STATE.size + npend]
            meta = json.loads(raw[STATE.size + npend:])
            if meta.get("format") != FORMAT:
                raise RuntimeError(f"snapshot format {meta.get('format')} is not {FORMAT}")
            if (meta["book_ttl_ns"], meta["orphan_ttl_ns"]) != (m.book_ttl_ns, m.orphan_ttl_ns):
                raise RuntimeError("snapshot was taken with other book/orphan windows: replay from the journal instead")
            books = {}
            for key, value in txn.cursor(db=self.books):
                books[int.from_bytes(key, "big")] = list(BOOK.unpack(value))
            orphans = {}
            step = ORPHAN.size + M.SEQUENCED_SIZE
            for key, value in txn.cursor(db=self.orphans):
                held = []
                for off in range(0, len(value), step):
                    seq = ORPHAN.unpack_from(value, off)[0]
                    msg = M.SEQUENCED.unpack_from(value, off + ORPHAN.size)
                    held.append((seq, msg[M.STAMP], msg))
                orphans[int.from_bytes(key, "big")] = held
        m.books, m.orphans = books, orphans
        m.last_seq, m.now_ns, m.applied = last_seq, now_ns, applied
        m.rejects, m.alerts_raised = meta["rejects"], meta["alerts_raised"]
        m.restore_digest(chain, pending)
        m._book_expiry = deque(sorted(((b[4] + m.book_ttl_ns, oid, b[6]) for oid, b in books.items()),
                                      key=lambda e: e[2]))
        m._orphan_expiry = deque(sorted(((stamp + m.orphan_ttl_ns, oid, seq) for oid, held in orphans.items()
                                         for seq, stamp, _ in held), key=lambda e: e[2]))
        m.dirty.clear()
        return {k: v for k, v in meta.items() if k not in ("format", "rejects", "alerts_raised")}
