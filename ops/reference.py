"""A plain, independent recomputation of the audit's alerts and rejects from
a stream of decoded messages in seq order. It checks the replicas (tests,
`tape up`): it shares no code with the state machine and uses another
formulation of time (expiry is checked lazily, when a book or an orphan is
touched, instead of eagerly from time-ordered queues)."""

from __future__ import annotations

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
