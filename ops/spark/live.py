"""Continuous queries over the stream (`tape watch`, `tape audit --follow`): what the batch
analytics and audit compute, as the log is written.

Time is the sequencer's stamp (event time): a replay of the journal gives the windows the live run
gave. Windows are tumbling, closed once a later stamp has been read (a watermark with no delay: the
stamps never decrease along the log), and each closed window is written once.

- `volume_windows`: requests, requested shares, purchases and purchased shares per window, stock
  and client. The batch analytics compute their windows with this same function.
- `OrderStates`: the alerts and rejects of the audit, each micro-batch's trades folded into each
  order's state (ops/spark/order_audit_core.py), kept exactly once with the query's progress.
"""

from __future__ import annotations

import heapq
from pathlib import Path

from tape.ops.spark.order_audit_core import OrderState, Trade, expire, fold

TRADE_TYPES = ("purchase_request", "purchase")
DEFAULT_WINDOW = "10 seconds"
TRADE_COLUMNS = ("order_id", "seq", "stamp_ns", "type", "shares", "client", "stock", "purchase_id")
STATE_MAP_BYTES = 1 << 36  # LMDB's map: virtual, sized for the open orders of a long day (~200 bytes each)
VOLUME_COLUMNS = ("requests", "requested_shares", "purchases", "purchased_shares")


def stream_df(spark, journal: str | None = None, config: str | None = None, rewinder: str | None = None,
              from_seq: int = 1, max_records: int | None = None):
    """The `tape` streaming source over a journal directory, or over `rewinder`'s replay port."""
    reader = spark.readStream.format("tape").option("fromSeq", from_seq)
    if max_records:
        reader = reader.option("maxRecordsPerTrigger", max_records)
    if rewinder:
        return reader.option("config", config).option("rewinder", rewinder).load()
    return reader.load(journal)


def volume_windows(df, window: str = DEFAULT_WINDOW):
    """Per window of stamps, stock and client: requests, requested shares, purchases, purchased
    shares. Streaming (closed windows, once each) or batch (every window) alike."""
    from pyspark.sql import functions as F

    trades = df.where(F.col("type").isin(*TRADE_TYPES))
    if df.isStreaming:
        trades = trades.withWatermark("stamp", "0 seconds")
    return (trades.groupBy(F.window("stamp", window), "stock", "client").agg(*volumes())
            .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                    "stock", "client", *VOLUME_COLUMNS))


def volumes() -> list:
    """The aggregates of VOLUME_COLUMNS over trades (the analytics' totals use them too)."""
    from pyspark.sql import functions as F

    is_req, is_pur = F.col("type") == "purchase_request", F.col("type") == "purchase"
    return [F.sum(is_req.cast("long")).alias("requests"),
            F.sum(F.when(is_req, F.col("shares")).otherwise(0)).alias("requested_shares"),
            F.sum(is_pur.cast("long")).alias("purchases"),
            F.sum(F.when(is_pur, F.col("shares")).otherwise(0)).alias("purchased_shares")]


class OrderStates:
    """The live audit's state: each open order's (ops/spark/order_audit_core.py), folded in the driver
    a micro-batch at a time, in seq order, and kept in LMDB at `path` with the last micro-batch folded,
    in one transaction a batch. A batch Spark runs again after a crash (its id not above the one kept)
    is not folded twice; one folded but not written is folded again from the state before it. An
    order is forgotten once the stream's time is past its book and its held orphans (those expired).

    (Spark's own per-key state, applyInPandasWithState, was measured at about 2,000 trades a second
    on this machine, a pandas frame per order per batch; this fold 144,000: docs/decisions.md.)"""

    def __init__(self, path: Path, book_ttl_ns: int, orphan_ttl_ns: int):
        import lmdb

        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=STATE_MAP_BYTES, max_dbs=2)
        self.orders_db, self.meta_db = self.env.open_db(b"orders"), self.env.open_db(b"meta")
        self.ttl = (book_ttl_ns, orphan_ttl_ns)
        with self.env.begin() as txn:
            self.batch = int(txn.get(b"batch", b"-1", db=self.meta_db))
            self.orders = {int(k): OrderState.loads(v.decode()) for k, v in txn.cursor(db=self.orders_db)}
        self.due: dict[int, int] = {}  # order -> its deadline, as in the heap (older entries there are stale)
        self.deadlines: list[tuple[int, int]] = []
        for order_id in self.orders:
            self._schedule(order_id)

    def apply(self, batch_id: int, columns: dict, write) -> None:
        """Fold one micro-batch's trades (columns as lists, in seq order) and `write` its findings,
        [(order_id, Finding)], before the state is kept: a batch folded before is skipped whole."""
        if batch_id <= self.batch:
            return
        book_ttl, orphan_ttl = self.ttl
        found, touched = [], set()
        for order_id, trade in zip(columns["order_id"], _trades(columns)):
            order = self.orders.get(order_id)
            if order is None:
                order = self.orders[order_id] = OrderState()
            found += [(order_id, f) for f in fold(order, [trade], book_ttl, orphan_ttl)]
            touched.add(order_id)
        for order_id in touched:
            self._schedule(order_id)
        now = max(columns["stamp_ns"], default=0)
        gone = self._expire(now, found)
        write(found)
        with self.env.begin(write=True) as txn:
            for order_id in touched - gone:
                txn.put(b"%d" % order_id, self.orders[order_id].dumps().encode(), db=self.orders_db)
            for order_id in gone:
                txn.delete(b"%d" % order_id, db=self.orders_db)
            txn.put(b"batch", b"%d" % batch_id, db=self.meta_db)
        self.batch = batch_id

    def _schedule(self, order_id: int) -> None:
        deadline = self.orders[order_id].deadline_ns(*self.ttl)
        if self.due.get(order_id) != deadline:
            self.due[order_id] = deadline
            heapq.heappush(self.deadlines, (deadline, order_id))

    def _expire(self, now: int, found: list) -> set:
        """Orders whose every deadline is at or before `now`: their orphans expired; forgotten."""
        gone = set()
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, order_id = heapq.heappop(self.deadlines)
            if self.due.get(order_id) != deadline:
                continue  # (stale: the order moved its deadline, or is gone)
            found += [(order_id, f) for f in expire(self.orders.pop(order_id), self.ttl[1])]
            del self.due[order_id]
            gone.add(order_id)
        return gone

    def close(self) -> None:
        self.env.close()


def trades_of(df):
    """The columns the audit folds, of the trades of a DataFrame."""
    return df.where(df.type.isin(*TRADE_TYPES)).select(*TRADE_COLUMNS)


def _trades(columns: dict) -> list[Trade]:
    return [Trade(seq, ns, kind, shares, client, stock, pid) for seq, ns, kind, shares, client, stock, pid in zip(
        columns["seq"], columns["stamp_ns"], columns["type"], columns["shares"], columns["client"], columns["stock"],
        columns["purchase_id"])]
