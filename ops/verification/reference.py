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

# The reference finds expiry lazily, when a book or orphan is touched again; what is never touched
# again is swept out once this many messages (or as many as it holds, if more) have passed, so that
# it holds the books and orphans open at once, not every one of a run (a sweep changes no outcome:
# what it drops had expired, and would have been found so when next touched).
SWEEP_FROM = 65_536
REJECT_REASONS = ("duplicate_order", "bad_shares", "client_mismatch", "stock_mismatch", "orphan_expired")

def expected_alerts(stream, book_ttl_ns: int, orphan_ttl_ns: int, end_ns: int | None = None,
                    books_out: list | None = None, sweep_from: int = SWEEP_FROM) -> tuple[list[dict], dict[str, int]]:
    """stream: iterable of (seq, decoded message). Returns (alerts, rejects): `alerts_in`, whole."""
    rejects = dict.fromkeys(REJECT_REASONS, 0)
    alerts = list(alerts_in(stream, book_ttl_ns, orphan_ttl_ns, rejects, end_ns, books_out, sweep_from))
    return alerts, rejects


def alerts_in(stream, book_ttl_ns: int, orphan_ttl_ns: int, rejects: dict[str, int], end_ns: int | None = None,
              books_out: list | None = None, sweep_from: int = SWEEP_FROM):
    """The alerts of `stream` (iterable of (seq, decoded message)), yielded in emit order as it
    goes by; `rejects` (reason -> 0) counts the rejects, whole once it has ended. `end_ns`: the
    time at its end (default: its last stamp), which decides which orphans still held then have
    expired. Every book opened is appended to `books_out` if given (a dict)."""
    books: dict[int, dict] = {}
    orphans: dict[int, list] = {}
    now, since_sweep = 0, 0

    def open_book(order_id):
        book = books.get(order_id)
        if book is not None and now >= book["opened"] + book_ttl_ns:
            del books[order_id]  # closed
            return None
        return book

    def expired_orphans(held):  # (counted once, whether found at its request, by a sweep or at the end)
        late = sum(1 for _, pstamp, _ in held if now >= pstamp + orphan_ttl_ns)
        rejects["orphan_expired"] += late
        return late

    for seq, m in stream:
        now = max(now, m[M.STAMP])
        since_sweep += 1
        if since_sweep >= max(sweep_from, len(books) + len(orphans)):
            since_sweep = 0
            _sweep(books, orphans, lambda book: now >= book["opened"] + book_ttl_ns,
                   lambda held: [h for h in held if now < h[1] + orphan_ttl_ns] if expired_orphans(held) else held)
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
                elif (alert := _fill_book(book, pseq, pm, seq, rejects)) is not None:
                    yield alert
        elif m[M.TYPE] == M.PURCHASE:
            book = open_book(m[M.ORDER_ID])
            if book is not None:
                if (alert := _fill_book(book, seq, m, seq, rejects)) is not None:
                    yield alert
            elif m[M.SHARES] <= 0:
                rejects["bad_shares"] += 1
            else:
                orphans.setdefault(m[M.ORDER_ID], []).append((seq, m[M.STAMP], m))
    now = max(now, end_ns or 0)
    for held in orphans.values():  # what has expired by the end of the stream
        expired_orphans(held)


def _fill_book(book: dict, seq: int, m: tuple, emit_seq: int, rejects: dict) -> dict | None:
    """A purchase on an open book: the alert it raises, if it is the one that overfills it."""
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
            return {"emit_seq": emit_seq, "purchase_seq": seq, "purchase_id": m[M.PURCHASE_ID],
                    "order_id": m[M.ORDER_ID], "requested": book["requested"], "cumulative": book["total"]}
    return None


def _sweep(books: dict, orphans: dict, closed, still_held) -> None:
    """Drop the books `closed` says are, and the orphans `still_held` leaves none of."""
    for order_id in [k for k, book in books.items() if closed(book)]:
        del books[order_id]
    for order_id in list(orphans):
        kept = still_held(orphans[order_id])
        if kept:
            orphans[order_id] = kept
        else:
            del orphans[order_id]


# --- the replicas' digest, from its definition in docs/replicas.md --------------------------

FOLD_EVERY = 4096  # the chain folds at every seq that is a multiple of this, and at each session end
_ALERT = struct.Struct(">QQQQq16s8sqqQ")
_SEQ_ID_REASON = struct.Struct(">QQB")
_BOOK_EXPIRY, _ORPHAN_EXPIRY, _OWN = 0, 1, 2  # the order of the effects at one seq


class _Effects:
    """The effect records of a stream, each placed at the seq where it happens, folded into the
    chain once every effect up to a seq is known (`settle`). Expiry is found lazily here (when a
    book or orphan is next touched, by a sweep, or at the end) and placed at the seq whose stamp
    first reached the deadline."""

    def __init__(self, fold_every: int):
        self.records: list[tuple[int, int, int, bytes]] = []  # (seq, phase, tie-break, bytes), not folded yet
        self.advances: list[tuple[int, int]] = []  # (clock, seq) at every seq that moved the clock forward
        self.own = 0  # tie-break of a message's own effects, in the order they happen
        self.fold_every = fold_every
        self.ends: list[int] = []  # session ends: fold points too
        self.chain, self.pending, self.folded_at = bytes(16), b"", 0  # the chain as of its last fold point

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

    def settle(self, upto: int) -> None:
        """Every effect at seqs up to `upto` is known (what is open expires later): fold them in,
        and forget the clock's advances no deadline still to come can fall in."""
        ready = sorted(r for r in self.records if r[0] <= upto)
        self.records = [r for r in self.records if r[0] > upto]
        for seq, _, _, data in ready:
            self._fold_before(seq)
            self.pending += data
        keep = bisect.bisect_left(self.advances, upto + 1, key=lambda a: a[1])
        del self.advances[:max(keep - 1, 0)]  # (the last at or before `upto` still gives its clock)

    def _fold_before(self, seq: int) -> None:
        """Fold at every point before `seq` not folded yet: multiples of fold_every, session ends."""
        while True:
            point = min([(self.folded_at // self.fold_every + 1) * self.fold_every,
                         *(e for e in self.ends if e > self.folded_at)])
            if point >= seq:
                return
            self.chain = hashlib.blake2b(self.chain + self.pending, digest_size=16).digest()
            self.pending, self.folded_at = b"", point

    def digest(self, last_seq: int) -> str:
        """The chain folded after the effects of each fold point's seq up to `last_seq`."""
        self.settle(last_seq)
        self._fold_before(last_seq + 1)
        return hashlib.blake2b(self.chain + self.pending, digest_size=16).hexdigest()


def expected_digest(stream, book_ttl_ns: int, orphan_ttl_ns: int, fold_every: int = FOLD_EVERY,
                    sweep_from: int = SWEEP_FROM) -> str:
    """The digest replicas that applied `stream` (decoded, from seq 1, stamps
    never decreasing) must report, computed from its definition alone."""
    fx = _Effects(fold_every)
    books: dict[int, dict] = {}
    orphans: dict[int, list] = {}
    seq = since_sweep = 0
    for seq, m in stream:
        fx.clock_to(seq, m[M.STAMP])
        now = fx.advances[-1][0]
        since_sweep += 1
        if since_sweep >= max(sweep_from, len(books) + len(orphans)):
            since_sweep = 0
            _sweep_effects(fx, books, orphans, now, orphan_ttl_ns)
            fx.settle(seq - 1)  # (this seq's own effects are still to come)
        order_id, shares = m[M.ORDER_ID], m[M.SHARES]
        book = books.get(order_id)
        if book is not None and now >= book["opened"] + book["ttl"]:
            fx.book_closed(order_id, books.pop(order_id))
            book = None
        if m[M.TYPE] == M.REQUEST:
            if book is not None or shares <= 0:
                fx.add(seq, _reject(seq, "duplicate_order" if book is not None else "bad_shares"))
                continue
            book = books[order_id] = {"seq": seq, "order_id": order_id, "opened": m[M.STAMP], "ttl": book_ttl_ns,
                                      "requested": shares,
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
                fx.ends.append(seq)
    for order_id, book in books.items():
        fx.book_closed(order_id, book)
    for held in orphans.values():
        for pseq, pm in held:
            fx.orphan_expired(pseq, pm[M.STAMP] + orphan_ttl_ns)
    return fx.digest(seq)


def _sweep_effects(fx: _Effects, books: dict, orphans: dict, now: int, orphan_ttl_ns: int) -> None:
    """What has expired by `now` and was not touched since, recorded where it expired and dropped."""
    def closed(book):
        if now >= book["opened"] + book["ttl"]:
            fx.book_closed(book["order_id"], book)
            return True
        return False

    def still_held(held):
        return [(pseq, pm) for pseq, pm in held if not fx.orphan_expired(pseq, pm[M.STAMP] + orphan_ttl_ns)]

    _sweep(books, orphans, closed, still_held)


def _reject(seq: int, reason: str) -> bytes:
    return b"X" + _SEQ_ID_REASON.pack(seq, 0, REJECT_REASONS.index(reason))


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
