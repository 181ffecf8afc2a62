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

from tape.protocol import messages as M

DEFAULT_BOOK_TTL_NS = 3600 * 10**9
DEFAULT_ORPHAN_TTL_NS = 10 * 10**9
REJECT_REASONS = ("duplicate_order", "bad_shares", "client_mismatch", "stock_mismatch", "orphan_expired")

# Outcome codes fed to the digest, one byte per applied message.
_OPENED, _FILLED, _ALERT, _HELD, _REJECT, _CONTROL = b"O", b"F", b"A", b"H", b"X", b"C"
_ALERT_RECORD = struct.Struct(">QQQQq16s8sqqQ")
_REJECT_RECORD = struct.Struct(">QQB")


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
        return _ALERT_RECORD.pack(self.emit_seq, self.purchase_seq, self.purchase_id, self.order_id, self.requested,
                                  self.client, self.stock, self.cumulative, self.stamp_ns, 0)

    @classmethod
    def decode(cls, raw: bytes) -> "Alert":
        e, p, pid, oid, req, client, stock, cum, stamp, _ = _ALERT_RECORD.unpack(raw)
        return cls(e, p, pid, oid, client, stock, req, cum, stamp)

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


class InvariantViolation(RuntimeError):
    """The state machine was fed something impossible (a seq out of order):
    stop rather than diverge."""


class AuditMachine:
    def __init__(self, book_ttl_ns: int = DEFAULT_BOOK_TTL_NS, orphan_ttl_ns: int = DEFAULT_ORPHAN_TTL_NS):
        self.book_ttl_ns = book_ttl_ns
        self.orphan_ttl_ns = orphan_ttl_ns
        self.last_seq = 0  # last applied
        self.now_ns = 0
        # order id -> [requested, cumulative, client, stock, opened_ns, alerted, request_seq]
        self.books: dict[int, list] = {}
        self._book_expiry: deque = deque()  # (expires_ns, order id, request seq), in stamp order
        # order id -> [(seq, stamp, purchase tuple), ...] in seq order
        self.orphans: dict[int, list] = {}
        self._orphan_expiry: deque = deque()  # (expires_ns, order id, seq)
        self.rejects = dict.fromkeys(REJECT_REASONS, 0)
        self.alerts_raised = 0
        self.applied = 0
        self._digest = hashlib.blake2b(digest_size=16)
        self._codes = bytearray()
        self.dirty: set[int] = set()  # order ids whose book or orphans changed since the last snapshot

    # --- the digest ----------------------------------------------------------------

    def digest(self) -> str:
        """Rolling digest of every applied effect through last_seq. Equal
        streams give equal digests, whenever they are read."""
        if self._codes:
            self._digest.update(self._codes)
            self._codes.clear()
        return self._digest.hexdigest()

    def _effect(self, record: bytes) -> None:
        self._digest.update(self._codes)
        self._codes.clear()
        self._digest.update(record)

    # --- applying ---------------------------------------------------------------------

    def apply(self, seq: int, msg: tuple) -> list[Alert]:
        """Apply one decoded sequenced message; returns the alerts it raised."""
        if seq != self.last_seq + 1:
            raise InvariantViolation(f"applying seq {seq} after {self.last_seq}")
        return self.apply_run(seq, [msg])

    def apply_run(self, first_seq: int, msgs: list) -> list[Alert]:
        """Apply consecutive decoded messages from first_seq (the hot path)."""
        if first_seq != self.last_seq + 1:
            raise InvariantViolation(f"applying seq {first_seq} after {self.last_seq}")
        out: list[Alert] = []
        books = self.books
        codes = self._codes
        dirty = self.dirty
        seq = first_seq - 1
        for m in msgs:
            seq += 1
            stamp = m[6]
            if stamp > self.now_ns:
                self.now_ns = stamp
                if (self._book_expiry and self._book_expiry[0][0] <= stamp) or \
                        (self._orphan_expiry and self._orphan_expiry[0][0] <= stamp):
                    self._expire(seq)
            kind = m[0]
            if kind == 80:  # 'P'
                book = books.get(m[1])
                if book is None:
                    if m[2] <= 0:
                        self._reject(seq, "bad_shares")
                        continue
                    self._hold(seq, m)
                    codes += _HELD
                    continue
                self._purchase(seq, m, book, seq, out)
            elif kind == 82:  # 'R'
                self._request(seq, m, out)
            else:  # control: term start, time tick
                codes += _CONTROL
        self.last_seq = seq
        self.applied += len(msgs)
        return out

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
            book[5] = True
            alert = Alert(emit_seq, seq, m[5], m[1], m[3], m[4], book[0], book[1], m[6])
            self.alerts_raised += 1
            self._effect(_ALERT + alert.encode())
            out.append(alert)
        else:
            self._codes += _FILLED

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
