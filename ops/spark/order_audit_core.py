"""The replicas' audit rules as a fold over one order's messages, for the live audit (ops/spark/live.py,
Spark's per-key state). Pure. Every rule concerns one order (docs/spark.md), and the stamps never
decrease along the log, so an order's messages in seq order decide its alerts and rejects alone:

- a request opens a book unless the order's book is still open (`duplicate_order`), or its shares
  are not positive (`bad_shares`); a book is open until `book_ttl` after its request's stamp;
- a purchase fills the open book; with none open it is held as an orphan, and the next book to
  open takes it if that opens within `orphan_ttl` of the purchase (else `orphan_expired`); an
  orphan fills at its book's seq, in the order it came;
- a fill counts if its client and stock are the book's (else `client_mismatch`, `stock_mismatch`);
  the fill that takes the book's shares over its request is the alert, once a book.

`OrderState` is what Spark keeps between micro-batches (as JSON); `expire` is what happens when the
stream's time has passed every deadline of the order: its held orphans have expired, and nothing of
it need be kept. Written from the rules, not from replicas/audit_core.py: this is the audit of that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

ALERT = "alert"


class Trade(NamedTuple):
    seq: int
    stamp_ns: int
    type: str  # "purchase_request" or "purchase"
    shares: int
    client: str
    stock: str
    purchase_id: int | None


class Finding(NamedTuple):
    """An alert (kind "alert") or a reject (kind: its reason), at `seq` (an alert's: its emit seq)
    and `stamp_ns` (the stream's time when it happened)."""

    kind: str
    seq: int
    stamp_ns: int
    purchase_seq: int | None = None
    purchase_id: int | None = None
    requested: int | None = None
    cumulative: int | None = None


@dataclass
class OrderState:
    book: dict | None = None  # opened (stamp), requested, client, stock, total, alerted
    orphans: list = field(default_factory=list)  # held purchases, as Trade tuples

    def dumps(self) -> str:
        return json.dumps([self.book, self.orphans])

    @classmethod
    def loads(cls, text: str) -> "OrderState":
        book, orphans = json.loads(text)
        return cls(book, [Trade(*o) for o in orphans])

    def deadline_ns(self, book_ttl_ns: int, orphan_ttl_ns: int) -> int:
        """When the last of its book and orphans has expired: after it, `expire`."""
        ends = [t.stamp_ns + orphan_ttl_ns for t in self.orphans]
        if self.book is not None:
            ends.append(self.book["opened"] + book_ttl_ns)
        return max(ends, default=0)


def fold(state: OrderState, trades: list[Trade], book_ttl_ns: int, orphan_ttl_ns: int) -> list[Finding]:
    """Apply one order's `trades` (in seq order, after all it had before) to `state`: its findings."""
    out: list[Finding] = []
    for t in trades:
        book = state.book
        is_open = book is not None and t.stamp_ns < book["opened"] + book_ttl_ns
        if t.type == "purchase_request":
            if is_open:
                out.append(Finding("duplicate_order", t.seq, t.stamp_ns))
            elif t.shares <= 0:
                out.append(Finding("bad_shares", t.seq, t.stamp_ns))
            else:
                state.book = {"opened": t.stamp_ns, "requested": t.shares, "client": t.client, "stock": t.stock,
                              "total": 0, "alerted": False}
                held, state.orphans = state.orphans, []
                for o in held:
                    if t.stamp_ns >= o.stamp_ns + orphan_ttl_ns:
                        out.append(Finding("orphan_expired", o.seq, o.stamp_ns + orphan_ttl_ns))
                    else:
                        out += _fill(state.book, o, t)
        elif is_open:
            out += _fill(book, t, t)
        elif t.shares <= 0:
            out.append(Finding("bad_shares", t.seq, t.stamp_ns))
        else:
            state.orphans.append(t)
    return out


def expire(state: OrderState, orphan_ttl_ns: int) -> list[Finding]:
    """The stream's time is past every deadline of the order: its orphans expired."""
    return [Finding("orphan_expired", o.seq, o.stamp_ns + orphan_ttl_ns) for o in state.orphans]


def _fill(book: dict, p: Trade, at: Trade) -> list[Finding]:
    """Purchase `p` on `book`, when `at` (itself, or the request that opened the book for an orphan)."""
    if p.shares <= 0:
        return [Finding("bad_shares", p.seq, at.stamp_ns)]
    if p.client != book["client"]:
        return [Finding("client_mismatch", p.seq, at.stamp_ns)]
    if p.stock != book["stock"]:
        return [Finding("stock_mismatch", p.seq, at.stamp_ns)]
    book["total"] += p.shares
    if book["total"] <= book["requested"] or book["alerted"]:
        return []
    book["alerted"] = True
    return [Finding(ALERT, at.seq, at.stamp_ns, p.seq, p.purchase_id, book["requested"], book["total"])]
