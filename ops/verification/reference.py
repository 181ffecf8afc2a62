"""A plain, independent recomputation of the audit's alerts and rejects from
a stream of decoded messages in seq order. It checks the replicas (tests,
`tape up`): it shares no code with the state machine and uses another
formulation of time (expiry is checked lazily, when a book or an orphan is
touched, instead of eagerly from time-ordered queues)."""

from __future__ import annotations

import bisect
import hashlib
import struct

from tape.protocol import messages as M


def expected_alerts(stream, book_ttl_ns: int, orphan_ttl_ns: int, end_ns: int | None = None,
                    books_out: list | None = None) -> tuple[list[dict], dict[str, int]]:
    """stream: iterable of (seq, decoded message). Returns (alerts, rejects).
    `end_ns`: the time at the end of the stream (default: its last stamp;
    a caller running one order's messages passes the whole stream's), which
    decides which orphans still held at the end have expired. Every book
    opened is appended to `books_out` if given (a dict: order_id,
    requested, total, client, stock)."""
    books: dict[int, dict] = {}
    orphans: dict[int, list] = {}
    alerts: list[dict] = []
    rejects = {"duplicate_order": 0, "bad_shares": 0, "client_mismatch": 0, "stock_mismatch": 0, "orphan_expired": 0}
    now = 0

    def open_book(order_id):
        book = books.get(order_id)
        if book is not None and now >= book["opened"] + book_ttl_ns:
            del books[order_id]  # closed
            return None
        return book

    def fill(book, seq, m, emit_seq):
        if m[M.SHARES] <= 0:
            rejects["bad_shares"] += 1
        elif m[M.CLIENT] != book["client"]:
            rejects["client_mismatch"] += 1
        elif m[M.STOCK] != book["stock"]:
            rejects["stock_mismatch"] += 1
        else:
            book["total"] += m[M.SHARES]
            if book["total"] > book["requested"] and not book["alerted"]:
                book["alerted"] = True
                alerts.append({"emit_seq": emit_seq, "purchase_seq": seq, "purchase_id": m[M.PURCHASE_ID],
                               "order_id": m[M.ORDER_ID], "requested": book["requested"], "cumulative": book["total"]})

    for seq, m in stream:
        now = max(now, m[M.STAMP])
        if m[M.TYPE] == M.REQUEST:
            if open_book(m[M.ORDER_ID]) is not None:
                rejects["duplicate_order"] += 1
                continue
            if m[M.SHARES] <= 0:
                rejects["bad_shares"] += 1
                continue
            book = {"order_id": m[M.ORDER_ID], "requested": m[M.SHARES], "total": 0, "client": m[M.CLIENT],
                    "stock": m[M.STOCK], "opened": m[M.STAMP], "alerted": False}
            books[m[M.ORDER_ID]] = book
            if books_out is not None:
                books_out.append(book)
            for pseq, pstamp, pm in orphans.pop(m[M.ORDER_ID], []):
                if now >= pstamp + orphan_ttl_ns:
                    rejects["orphan_expired"] += 1
                else:
                    fill(book, pseq, pm, seq)
        elif m[M.TYPE] == M.PURCHASE:
            book = open_book(m[M.ORDER_ID])
            if book is not None:
                fill(book, seq, m, seq)
            elif m[M.SHARES] <= 0:
                rejects["bad_shares"] += 1
            else:
                orphans.setdefault(m[M.ORDER_ID], []).append((seq, m[M.STAMP], m))
    now = max(now, end_ns or 0)
    for held in orphans.values():  # what has expired by the end of the stream
        rejects["orphan_expired"] += sum(1 for _, pstamp, _ in held if now >= pstamp + orphan_ttl_ns)
    return alerts, rejects


# --- the replicas' digest, from its definition in docs/replicas.md --------------------------

FOLD_EVERY = 4096  # the chain folds at every seq that is a multiple of this, and at each session end
_REASONS = ("duplicate_order", "bad_shares", "client_mismatch", "stock_mismatch", "orphan_expired")
_ALERT = struct.Struct(">QQQQq16s8sqqQ")
_SEQ_ID_REASON = struct.Struct(">QQB")
_BOOK_EXPIRY, _ORPHAN_EXPIRY, _OWN = 0, 1, 2  # the order of the effects at one seq


class _Effects:
    """The effect records of a stream, each placed at the seq where it happens.
    Expiry is found lazily here (when a book or orphan is next touched, or at
    the end) and placed at the seq whose stamp first reached the deadline."""

    def __init__(self):
        self.records: list[tuple[int, int, int, bytes]] = []  # (seq, phase, tie-break, bytes)
        self.advances: list[tuple[int, int]] = []  # (clock, seq) at every seq that moved the clock forward
        self.own = 0  # tie-break of a message's own effects, in the order they happen

    def clock_to(self, seq: int, stamp: int) -> None:
        if not self.advances or stamp > self.advances[-1][0]:
            self.advances.append((stamp, seq))

    def expiry_seq(self, deadline: int) -> int | None:
        i = bisect.bisect_left(self.advances, (deadline, -1))
        return self.advances[i][1] if i < len(self.advances) else None

    def add(self, seq: int, data: bytes) -> None:
        self.own += 1
        self.records.append((seq, _OWN, self.own, data))

    def book_closed(self, order_id: int, book: dict) -> None:
        seq = self.expiry_seq(book["opened"] + book["ttl"])
        if seq is not None:
            self.records.append((seq, _BOOK_EXPIRY, book["seq"], b"E" + _SEQ_ID_REASON.pack(seq, order_id, 0)))

    def orphan_expired(self, pseq: int, deadline: int) -> bool:
        seq = self.expiry_seq(deadline)
        if seq is not None:
            self.records.append((seq, _ORPHAN_EXPIRY, pseq, b"X" + _SEQ_ID_REASON.pack(pseq, 0, 4)))
        return seq is not None

    def digest(self, last_seq: int, ends: list[int], fold_every: int) -> str:
        """The chain folded after the effects of each fold point's seq: every multiple of
        `fold_every` and each session end (`ends`)."""
        points = sorted(set(range(fold_every, last_seq + 1, fold_every)) | set(ends))
        chain, pending, next_point = bytes(16), b"", 0
        for seq, _, _, data in sorted(self.records) + [(last_seq + 1, 0, 0, b"")]:
            while next_point < len(points) and seq > points[next_point]:
                chain = hashlib.blake2b(chain + pending, digest_size=16).digest()
                pending, next_point = b"", next_point + 1
            pending += data
        return hashlib.blake2b(chain + pending, digest_size=16).hexdigest()


def expected_digest(stream, book_ttl_ns: int, orphan_ttl_ns: int, fold_every: int = FOLD_EVERY) -> str:
    """The digest replicas that applied `stream` (decoded, from seq 1, stamps
    never decreasing) must report, computed from its definition alone."""
    fx = _Effects()
    books: dict[int, dict] = {}
    orphans: dict[int, list] = {}
    ends: list[int] = []
    seq = 0
    for seq, m in stream:
        fx.clock_to(seq, m[M.STAMP])
        now = fx.advances[-1][0]
        order_id, shares = m[M.ORDER_ID], m[M.SHARES]
        book = books.get(order_id)
        if book is not None and now >= book["opened"] + book["ttl"]:
            fx.book_closed(order_id, books.pop(order_id))
            book = None
        if m[M.TYPE] == M.REQUEST:
            if book is not None or shares <= 0:
                fx.add(seq, _reject(seq, "duplicate_order" if book is not None else "bad_shares"))
                continue
            book = books[order_id] = {"seq": seq, "opened": m[M.STAMP], "ttl": book_ttl_ns, "requested": shares,
                                      "total": 0, "client": m[M.CLIENT], "stock": m[M.STOCK], "alerted": False}
            fx.add(seq, b"O")
            for pseq, pm in orphans.pop(order_id, []):
                if not fx.orphan_expired(pseq, pm[M.STAMP] + orphan_ttl_ns):
                    fx.add(seq, _fill(book, pseq, pm, seq))
        elif m[M.TYPE] == M.PURCHASE:
            if book is not None:
                fx.add(seq, _fill(book, seq, m, seq))
            elif shares <= 0:
                fx.add(seq, _reject(seq, "bad_shares"))
            else:
                orphans.setdefault(order_id, []).append((seq, m))
                fx.add(seq, b"H")
        else:
            fx.add(seq, b"C")
            if m[M.TYPE] == M.SESSION_END:
                ends.append(seq)
    for order_id, book in books.items():
        fx.book_closed(order_id, book)
    for held in orphans.values():
        for pseq, pm in held:
            fx.orphan_expired(pseq, pm[M.STAMP] + orphan_ttl_ns)
    return fx.digest(seq, ends, fold_every)


def _reject(seq: int, reason: str) -> bytes:
    return b"X" + _SEQ_ID_REASON.pack(seq, 0, _REASONS.index(reason))


def _fill(book: dict, pseq: int, m: tuple, emit_seq: int) -> bytes:
    """A purchase on an open book: its effect record."""
    if m[M.SHARES] <= 0 or m[M.CLIENT] != book["client"] or m[M.STOCK] != book["stock"]:
        reason = "bad_shares" if m[M.SHARES] <= 0 else "client_mismatch" if m[M.CLIENT] != book["client"] \
            else "stock_mismatch"
        return _reject(pseq, reason)
    book["total"] += m[M.SHARES]
    if book["total"] <= book["requested"] or book["alerted"]:
        return b"F"
    book["alerted"] = True
    return b"A" + _ALERT.pack(emit_seq, pseq, m[M.PURCHASE_ID], m[M.ORDER_ID], book["requested"], m[M.CLIENT],
                              m[M.STOCK], book["total"], m[M.STAMP], 0)
