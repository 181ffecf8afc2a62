"""The trade-audit state machine. Pure and deterministic: a function of the
committed stream only (its stamps are the only clock), no randomness, no
iteration over unordered containers that affects output.

Rules (DESIGN.md sections 1 and 6):

- A purchase request R(order, shares, client, stock) opens a book. It is
  rejected if a book with that order id is open (`duplicate_order`) or if
  shares <= 0 (`bad_shares`).
- A purchase P(purchase, order, shares, client, stock) is rejected if
  shares <= 0 (`bad_shares`) or if its client or stock differ from its
  request's (`client_mismatch`, `stock_mismatch`). Otherwise it adds to the
  book's cumulative shares; when they first exceed the requested shares,
  exactly one alert is raised. Later purchases on the book raise nothing.
- A purchase whose request has not arrived is held (an orphan) and applied
  when the request arrives, in seq order; it expires after `orphan_ttl_ns`
  (`orphan_expired`).
- A book closes `book_ttl_ns` after its request's stamp; a purchase for a
  closed book is then an orphan like any other.

Every message advances the clock to its stamp before it is applied, so
expiries happen at the same seq on every replica. Memory is bounded by the
two windows.

An alert is identified by the seq of the purchase that triggered it; it is
*emitted* at the seq whose application raised it (the purchase's own seq, or
the request's seq for a purchase that was held). Emit seqs strictly increase,
so they order the alert channel.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from typing import NamedTuple

from tape.protocol import messages
from tape.protocol.errors import InvariantViolation
from tape.protocol.moldudp64 import HEADER_SIZE

try:
    from tape.replicas import _audit
    from tape.replicas._audit import BookTable, ExpiryQueue, apply_fast
except ImportError:  # built without a C compiler: the pure books and rules do it all
    _audit = BookTable = ExpiryQueue = apply_fast = None

DEFAULT_BOOK_TTL_NS = 3600 * 10**9
DEFAULT_ORPHAN_TTL_NS = 10 * 10**9
DIGEST_BLOCK = 4096
REJECT_REASONS = ("duplicate_order", "bad_shares", "client_mismatch", "stock_mismatch", "orphan_expired")

# Outcome codes fed to the digest, one byte per applied message.
_OPENED, _FILLED, _ALERT, _HELD, _REJECT, _CONTROL = b"O", b"F", b"A", b"H", b"X", b"C"
ALERT_RECORD = struct.Struct(">QQQQq16s8sqqQ")
ALERT_SIZE = ALERT_RECORD.size  # an alert record's bytes: its emit seq first, u64 big-endian
ALERT_STAMP = struct.Struct(">72xq8x")  # an alert record's stamp_ns alone
_REJECT_RECORD = struct.Struct(">QQB")
BOOK = struct.Struct(">qq16s8sQ?Q")  # a snapshot's book record: requested, cumulative, client, stock, opened_ns,
# alerted, request_seq (the fields of a book, in its order)
PACKED_BOOK = 8 + BOOK.size  # a book's key and record, as Books.packed gives them
_NEVER = 2**64 - 1  # no expiry due (the compiled loop's clock is u64)


class Alert(NamedTuple):
    emit_seq: int  # seq whose application raised it: orders the alert channel
    purchase_seq: int  # seq of the purchase that crossed the line: the alert id
    purchase_id: int
    order_id: int
    client: bytes
    stock: bytes
    requested: int
    cumulative: int
    stamp_ns: int  # stamp of the triggering purchase

    def encode(self) -> bytes:
        return ALERT_RECORD.pack(self.emit_seq, self.purchase_seq, self.purchase_id, self.order_id, self.requested,
                                  self.client, self.stock, self.cumulative, self.stamp_ns, 0)

    @classmethod
    def decode(cls, raw: bytes) -> "Alert":
        e, p, pid, oid, req, client, stock, cum, stamp, _ = ALERT_RECORD.unpack(raw)
        return cls(e, p, pid, oid, client, stock, req, cum, stamp)

    @staticmethod
    def joined(records: list[bytes]) -> bytes:
        """Alert records end to end, for one unpack of a field of each (ValueError if one is not a
        whole record: a shorter and a longer one would misalign all that follow)."""
        if not set(map(len, records)) <= {ALERT_SIZE}:
            raise ValueError(f"an alert record is not {ALERT_SIZE} bytes")
        return b"".join(records)

    @staticmethod
    def emit_seq_of(record: bytes) -> int:
        """An alert record's emit seq, read without decoding the rest."""
        return int.from_bytes(record[:8], "big")

    def to_dict(self, session: str) -> dict:
        return {
            "alert_id": f"{session}:{self.purchase_seq}",
            "emit_seq": self.emit_seq,
            "purchase_seq": self.purchase_seq,
            "purchase_id": self.purchase_id,
            "order_id": self.order_id,
            "client": self.client.decode("ascii", "replace").rstrip(),
            "stock": self.stock.decode("ascii", "replace").rstrip(),
            "requested": self.requested,
            "cumulative": self.cumulative,
            "stamp_ns": self.stamp_ns,
        }



class Books(dict):
    """order id -> [requested, cumulative, client, stock, opened_ns, alerted, request_seq]: the pure
    books. The compiled ones (`_audit.BookTable`) read the same but hand out copies, so the rules
    write a changed book back."""

    def packed(self, order_ids) -> bytes:
        """The key (u64 big-endian) and record of each of these order ids with a book, in their order,
        one after the other (PACKED_BOOK bytes each: snapshots)."""
        pack, get = BOOK.pack, self.get
        return b"".join(order_id.to_bytes(8, "big") + pack(*book) for order_id in order_ids
                        if (book := get(order_id)) is not None)

    def put_packed(self, pairs) -> None:
        """Books from (id, record) pairs end to end (PACKED_BOOK bytes each, as `packed` gives them:
        a snapshot's bucket)."""
        if len(pairs) % PACKED_BOOK:
            raise ValueError("the books are not whole (id, record) pairs")
        for at in range(0, len(pairs), PACKED_BOOK):
            self[int.from_bytes(pairs[at:at + 8], "big")] = list(BOOK.unpack_from(pairs, at + 8))

    def take_dirty(self) -> list[int]:
        """(The compiled books' common cases note the ids they change; here the rules mark them all.)"""
        return []

    def take_packed(self, marked) -> tuple[bytes, bytes]:
        """The ids changed (here: `marked`, the rules'), sorted, as 8-byte big-endian keys end to
        end, and `packed` of them: a snapshot's part on the thread that applies."""
        ids = sorted(marked)
        return b"".join(order_id.to_bytes(8, "big") for order_id in ids), self.packed(ids)


def compiled_books_bytes(books: int) -> int | None:
    """The memory a compiled replica's audit holds for `books` open books (None without the C):
    the table sized for them below half full, as `books_expected` sizes it, and an expiry entry
    each. Books open for book_ttl_s, so this is the bound of a replica's books after that."""
    if _audit is None:
        return None
    slots = _audit.MIN_CAPACITY
    while slots < 2 * books:
        slots *= 2
    return slots * _audit.SLOT_BYTES + books * _audit.DUE_BYTES


class AuditMachine:
    def __init__(self, book_ttl_ns: int = DEFAULT_BOOK_TTL_NS, orphan_ttl_ns: int = DEFAULT_ORPHAN_TTL_NS,
                 compiled: bool | None = None, books_expected: int = 0, fold_every: int = DIGEST_BLOCK):
        """`fold_every`: the digest chain folds at every multiple of it (and at the session's end);
        replicas compare digests at those seqs, so every replica of a cluster folds at the same.
        `compiled`: books in C and the common cases applied from packets' bytes (the default
        where Tape was built with a compiler); False: all in Python, the definition.
        `books_expected`: the compiled books' table is sized for that many and its memory written
        now, so that it neither doubles nor faults in fresh pages while the stream runs (each first
        write of a page costs 2-7 us on this project's virtual machines); more still fit."""
        if compiled and apply_fast is None:
            raise RuntimeError("the compiled audit (replicas/_audit.c) was not built")
        self.compiled = apply_fast is not None if compiled is None else compiled
        self.book_ttl_ns = book_ttl_ns
        self.books_expected = books_expected
        self.orphan_ttl_ns = orphan_ttl_ns
        self.last_seq = 0  # last applied
        self.now_ns = 0
        self.books = self.new_books()
        self._book_expiry = self.new_book_expiry()  # (expires_ns, order id, request seq), in stamp order
        # order id -> [(seq, stamp, purchase tuple), ...] in seq order
        self.orphans: dict[int, list] = {}
        self._orphan_expiry: deque = deque()  # (expires_ns, order id, seq)
        self.rejects = dict.fromkeys(REJECT_REASONS, 0)
        self.alerts_raised = 0
        self.applied = 0
        # The digest: a hash chain folded at every seq multiple of fold_every and at the session's end,
        # over the effect bytes since the last fold (snapshot-able, unlike a
        # hashlib object, and independent of how the stream was cut).
        self.chain = bytes(16)
        self._codes = bytearray()  # effect bytes since the last fold
        self.fold_every = fold_every
        self.fold_seq = 0  # where the chain last folded
        self._folds_made: list | None = None  # (seq, chain) of each fold, while apply_runs collects them
        self.dirty: set[int] = set()  # order ids whose book or orphans changed since the last snapshot

    def new_books(self):
        return BookTable(self.books_expected) if self.compiled else Books()

    def take_dirty(self) -> set[int]:
        """The order ids whose book or orphans changed since the last take (a snapshot's), and
        start afresh: those the rules marked, and those the compiled common cases noted."""
        dirty, self.dirty = self.dirty, set()
        dirty.update(self.books.take_dirty())
        return dirty

    def take_dirty_packed(self) -> tuple[set[int], bytes, bytes]:
        """`take_dirty` as a snapshot takes it: (the ids the rules marked, the only ones whose
        orphans can have changed; every id taken, sorted, as 8-byte big-endian keys end to end;
        the packed books of those with one). The compiled books do it in one call."""
        marked, self.dirty = self.dirty, set()
        return marked, *self.books.take_packed(marked)

    def new_book_expiry(self, entries=()):
        """A deque of (expires_ns, order id, request seq); compiled, the same in C (an entry lives as
        long as its book: 24 bytes, not a tuple of three ints)."""
        return ExpiryQueue(entries) if self.compiled else deque(entries)

    # --- the digest ----------------------------------------------------------------

    def digest(self) -> str:
        """Digest of every applied effect through last_seq: equal streams
        give equal digests, whenever and however they were applied."""
        return hashlib.blake2b(self.chain + self._codes, digest_size=16).hexdigest()

    @property
    def pending_effects(self) -> bytes:
        return bytes(self._codes)

    def restore_digest(self, chain: bytes, pending: bytes) -> None:
        """From a snapshot, after last_seq: where the chain last folded is the last multiple (or,
        past a session's end, that end: a label of the metrics only, which the next fold puts right)."""
        self.chain = chain
        self._codes = bytearray(pending)
        self.fold_seq = self.last_seq - self.last_seq % self.fold_every

    def _fold(self, seq: int) -> None:
        self.chain = hashlib.blake2b(self.chain + self._codes, digest_size=16).digest()
        self._codes.clear()
        self.fold_seq = seq
        if self._folds_made is not None:
            self._folds_made.append((seq, self.chain))

    def _fold_point(self) -> None:
        """At a multiple of fold_every, unless the session's end folded there already."""
        if self.last_seq % self.fold_every == 0 and self.fold_seq != self.last_seq:
            self._fold(self.last_seq)

    def _effect(self, record: bytes) -> None:
        self._codes += record

    # --- applying ---------------------------------------------------------------------

    def apply(self, seq: int, msg: tuple) -> list[bytes]:
        """Apply one decoded sequenced message; returns the records of the alerts it raised
        (`Alert.encode`: what the alert link carries, the outbox holds and a snapshot keeps)."""
        if seq != self.last_seq + 1:
            raise InvariantViolation(f"applying seq {seq} after {self.last_seq}")
        return self.apply_run(seq, [msg])

    def apply_run(self, first_seq: int, msgs: list) -> list[bytes]:
        """Apply consecutive decoded messages from first_seq."""
        if first_seq != self.last_seq + 1:
            raise InvariantViolation(f"applying seq {first_seq} after {self.last_seq}")
        out: list[bytes] = []
        start = 0
        while start < len(msgs):
            # Runs end at fold points (seq multiples of fold_every), where the digest chain folds.
            seq = first_seq + start
            end = min(len(msgs), start + self.fold_every - (seq - 1) % self.fold_every)
            self._apply(seq, msgs[start:end] if start or end < len(msgs) else msgs, out)
            self._fold_point()
            start = end
        return out

    def apply_runs(self, runs: list) -> tuple[list[bytes], list[tuple[int, int, bytes]]]:
        """apply_packet of each run (`first_seq`, `packet`, `skip`: a listener's Deliver) in turn: (the
        alerts raised; for each fold point a run crossed, (how many of those alerts the runs through
        it raised, the fold's seq, the chain folded there)). Compiled, a run the C applies whole short
        of a fold point is one call here (a drain's packets through apply_packet one by one cost a
        replica ~1.5 us of Python a packet, more than the C's own work)."""
        alerts: list[bytes] = []
        folds: list[tuple[int, int, bytes]] = []
        compiled, every = self.compiled, self.fold_every
        made = self._folds_made = []
        for run in runs:
            first_seq, packet, skip = run.first_seq, run.packet, run.skip
            if compiled and first_seq == self.last_seq + 1:
                total = (len(packet) - HEADER_SIZE) // messages.SEQUENCED_BLOCK_SIZE
                last = first_seq + total - skip - 1
                if (first_seq - 1) // every == last // every:  # no fold point in the run (the C stops at an end)
                    done = self._apply_common(packet, skip, total, first_seq, alerts)
                    if self.last_seq == last:
                        continue
                    first_seq, skip = self.last_seq + 1, skip + done  # the rest the general way
            alerts += self.apply_packet(first_seq, packet, skip)
            if made:
                folds += [(len(alerts), seq, chain) for seq, chain in made]
                made.clear()
        self._folds_made = None
        return alerts, folds

    def apply_packet(self, first_seq: int, packet: bytes, skip: int = 0) -> list[bytes]:
        """Apply a delivered packet's messages from number `skip` (at first_seq) on (a replica's
        drain goes through `apply_runs`, which calls this for what the C cannot apply whole).
        Compiled, most of them never become Python objects: the C applies the common cases and
        hands each other message to the rules here (`_apply`), then goes on."""
        if not self.compiled:
            return self.apply_run(first_seq, messages.decode_delivered(packet, skip))
        if first_seq != self.last_seq + 1:
            raise InvariantViolation(f"applying seq {first_seq} after {self.last_seq}")
        out: list[bytes] = []
        index, total = skip, (len(packet) - HEADER_SIZE) // messages.SEQUENCED_BLOCK_SIZE
        while index < total:
            seq = self.last_seq + 1  # runs end at fold points, where the digest chain folds
            end = min(total, index + self.fold_every - (seq - 1) % self.fold_every)
            while index < end:
                done = self._apply_common(packet, index, end, seq, out)
                index, seq = index + done, seq + done
                if index < end:  # not a common case: the rules
                    self._apply(seq, [messages.decode_delivered_one(packet, index)], out)
                    index, seq = index + 1, seq + 1
            self._fold_point()
        return out

    def _apply_common(self, packet: bytes, index: int, end: int, seq: int, out: list) -> int:
        """The C applies messages index..end of `packet` (the first at `seq`) while they are common
        cases, their alerts to `out`: how many it applied."""
        raised, orphan_expiry = len(out), self._orphan_expiry  # (the C reads the first orphan's expiry)
        try:
            done, self.now_ns = apply_fast(self.books, self._codes, self._book_expiry, self.orphans,
                                           self.book_ttl_ns, self.now_ns,
                                           orphan_expiry[0][0] if orphan_expiry else _NEVER,
                                           packet, index, end, seq, out)
        except Exception as e:  # (out of memory): what it applied of the run is not known
            raise InvariantViolation(f"the compiled audit failed at seq {seq}: {e!r}") from e
        self.last_seq, self.applied = seq + done - 1, self.applied + done
        self.alerts_raised += len(out) - raised
        return done

    def _apply(self, first_seq: int, msgs: list, out: list) -> None:
        """The hot path: the common purchase and request cases are inlined."""
        books = self.books
        get_book = books.get
        code = self._codes.append
        mark = self.dirty.add
        book_expiry = self._book_expiry
        book_ttl = self.book_ttl_ns
        orphans = self.orphans
        now = self.now_ns
        seq = first_seq - 1
        for m in msgs:
            seq += 1
            stamp = m[6]
            if stamp > now:
                now = self.now_ns = stamp
                if (book_expiry and book_expiry[0][0] <= stamp) or \
                        (self._orphan_expiry and self._orphan_expiry[0][0] <= stamp):
                    self._expire(seq)
            kind = m[0]
            if kind == 80:  # 'P'
                order_id = m[1]
                book = get_book(order_id)
                if book is not None and m[2] > 0 and m[3] == book[2] and m[4] == book[3]:
                    total = book[1] = book[1] + m[2]
                    mark(order_id)
                    if total > book[0] and not book[5]:
                        self._alert(seq, m, book, seq, out)
                    else:
                        books[order_id] = book  # (the compiled books hand out copies)
                        code(70)  # 'F'
                elif book is not None:
                    self._purchase(seq, m, book, seq, out)  # a reject
                elif m[2] <= 0:
                    self._reject(seq, "bad_shares")
                else:
                    self._hold(seq, m)
                    code(72)  # 'H'
            elif kind == 82:  # 'R'
                order_id = m[1]
                if order_id in books or m[2] <= 0 or order_id in orphans:
                    self._request(seq, m, out)
                else:
                    books[order_id] = [m[2], 0, m[3], m[4], stamp, False, seq]
                    mark(order_id)
                    book_expiry.append((stamp + book_ttl, order_id, seq))
                    code(79)  # 'O'
            else:  # control: term start, time tick, seal, the session's end
                code(67)  # 'C'
                if kind == 69:  # 'E': a fold point too, so that the day's last digests are compared
                    self._fold(seq)
        self.last_seq = seq
        self.applied += len(msgs)

    def _purchase(self, seq: int, m: tuple, book: list, emit_seq: int, out: list) -> None:
        shares = m[2]
        if shares <= 0:
            self._reject(seq, "bad_shares")
            return
        if m[3] != book[2]:
            self._reject(seq, "client_mismatch")
            return
        if m[4] != book[3]:
            self._reject(seq, "stock_mismatch")
            return
        book[1] += shares
        self.dirty.add(m[1])
        if not book[5] and book[1] > book[0]:
            self._alert(seq, m, book, emit_seq, out)
        else:
            self.books[m[1]] = book
            self._codes += _FILLED

    def _alert(self, seq: int, m: tuple, book: list, emit_seq: int, out: list) -> None:
        book[5] = True
        self.books[m[1]] = book
        record = Alert(emit_seq, seq, m[5], m[1], m[3], m[4], book[0], book[1], m[6]).encode()
        self.alerts_raised += 1
        self._effect(_ALERT + record)
        out.append(record)

    def _request(self, seq: int, m: tuple, out: list) -> None:
        order_id, shares = m[1], m[2]
        if order_id in self.books:
            self._reject(seq, "duplicate_order")
            return
        if shares <= 0:
            self._reject(seq, "bad_shares")
            return
        book = [shares, 0, m[3], m[4], m[6], False, seq]
        self.books[order_id] = book
        self.dirty.add(order_id)
        self._book_expiry.append((m[6] + self.book_ttl_ns, order_id, seq))
        self._codes += _OPENED
        held = self.orphans.pop(order_id, None)
        if held:
            for pseq, _stamp, pm in held:  # in their own seq order
                self._purchase(pseq, pm, book, seq, out)

    def _hold(self, seq: int, m: tuple) -> None:
        self.orphans.setdefault(m[1], []).append((seq, m[6], m))
        self.dirty.add(m[1])
        self._orphan_expiry.append((m[6] + self.orphan_ttl_ns, m[1], seq))

    def _reject(self, seq: int, reason: str) -> None:
        self.rejects[reason] += 1
        self._effect(_REJECT + _REJECT_RECORD.pack(seq, 0, REJECT_REASONS.index(reason)))

    def _expire(self, seq: int) -> None:
        now = self.now_ns
        q = self._book_expiry
        while q and q[0][0] <= now:
            _, order_id, request_seq = q.popleft()
            book = self.books.get(order_id)
            if book is not None and book[6] == request_seq:
                del self.books[order_id]
                self.dirty.add(order_id)
                self._effect(b"E" + _REJECT_RECORD.pack(seq, order_id, 0))
        q = self._orphan_expiry
        while q and q[0][0] <= now:
            _, order_id, pseq = q.popleft()
            held = self.orphans.get(order_id)
            if not held:
                continue
            keep = [h for h in held if h[0] != pseq]
            if len(keep) != len(held):
                self._reject(pseq, "orphan_expired")
                self.dirty.add(order_id)
                if keep:
                    self.orphans[order_id] = keep
                else:
                    del self.orphans[order_id]
