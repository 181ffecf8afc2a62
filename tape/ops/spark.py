"""PySpark over the journal: the `tape` data source and the audit.

    spark = session()                       # local[*], quiet, source registered
    df = spark.read.format("tape").load(path)                     # whole journal
    df = spark.read.format("tape").option("fromSeq", 100).option("toSeq", 200).load(path)

One partition per segment file (the reader skips segments outside the seq
range). A corrupt record fails the read with the segment, offset and seq.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

SCHEMA = ("seq LONG, term LONG, type STRING, stamp TIMESTAMP, stamp_ns LONG, origin STRING, client_seq LONG, "
          "order_id LONG, purchase_id LONG, shares LONG, client STRING, stock STRING, leader STRING")
LONG_MAX = 2**63 - 1
LOG4J = Path(__file__).with_name("log4j2.properties")


class SegmentPartition(InputPartition):
    def __init__(self, path: str, first_seq: int, last_seq: int | None, sealed: bool):
        super().__init__((path, first_seq, last_seq, sealed))
        self.path, self.first_seq, self.last_seq, self.sealed = path, first_seq, last_seq, sealed


class TapeDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "tape"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema):
        return TapeReader(self.options)


class TapeReader(DataSourceReader):
    def __init__(self, options):
        path = options.get("path")
        if not path:
            raise ValueError('spark.read.format("tape").load(PATH): PATH (a journal directory) is required')
        self.dir = Path(path)
        self.from_seq = int(options.get("fromSeq", 1))
        self.to_seq = int(options["toSeq"]) if options.get("toSeq") else None
        segs = sorted(self.dir.glob("*.seg"))
        if not segs:
            raise FileNotFoundError(f"no journal segments (*.seg) in {path}")
        self.segments = []
        for i, seg in enumerate(segs):
            first = int(seg.stem)
            last = int(segs[i + 1].stem) - 1 if i + 1 < len(segs) else None
            self.segments.append(SegmentPartition(str(seg), first, last, i + 1 < len(segs)))

    def partitions(self):
        out = [p for p in self.segments
               if (p.last_seq is None or p.last_seq >= self.from_seq) and (self.to_seq is None or p.first_seq <= self.to_seq)]
        return out or [self.segments[-1]]

    def read(self, partition: SegmentPartition):
        from tape.journal import format as fmt
        from tape.journal.store import iter_segment_file
        from tape.protocol import messages as M

        names = M.TYPE_NAMES
        utc = datetime.timezone.utc
        epoch = datetime.datetime(1970, 1, 1, tzinfo=utc)
        lo, hi = self.from_seq, self.to_seq
        for seq, term, raw, _ in iter_segment_file(Path(partition.path), fmt.SEGMENT_HEADER_SIZE, partition.first_seq,
                                                   sealed=partition.sealed):
            if seq < lo:
                continue
            if hi is not None and seq > hi:
                return
            m = M.SEQUENCED.unpack(raw)
            kind = m[M.TYPE]
            stamp_ns = m[M.STAMP]
            order_id, purchase_id = m[M.ORDER_ID], m[M.PURCHASE_ID]
            if order_id > LONG_MAX or purchase_id > LONG_MAX or stamp_ns > LONG_MAX:
                raise ValueError(f"seq {seq}: an id above 2^63-1 does not fit Spark's LONG; use tape journal dump")
            stamp = epoch + datetime.timedelta(microseconds=stamp_ns // 1000)
            origin = m[M.ORIGIN].decode("ascii", "replace").rstrip()
            if kind == M.TERM_START:
                yield (seq, term, names[kind], stamp, stamp_ns, origin, m[M.CLIENT_SEQ], None, None, None, None,
                       None, m[M.LEADER].decode("ascii", "replace").rstrip())
            elif kind == M.TIME_TICK:
                yield (seq, term, names[kind], stamp, stamp_ns, origin, m[M.CLIENT_SEQ], None, None, None, None,
                       None, None)
            else:
                yield (seq, term, names[kind], stamp, stamp_ns, origin, m[M.CLIENT_SEQ], order_id,
                       purchase_id if kind == M.PURCHASE else None, m[M.SHARES],
                       m[M.CLIENT].decode("ascii", "replace").rstrip(), m[M.STOCK].decode("ascii", "replace").rstrip(),
                       None)


def session(master: str = "local[*]", app: str = "tape"):
    """A quiet Spark session with the `tape` source registered. The JVM's
    own stderr (start-up chatter, Spark's errors) goes to a log file whose
    path is in SPARK_LOG, so that a command's output stays clean."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import logging

    logging.getLogger("py4j").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    import tempfile

    global SPARK_LOG
    SPARK_LOG = os.path.join(tempfile.gettempdir(), f"tape-spark-{os.getpid()}.log")
    saved = os.dup(2)
    log_fd = os.open(SPARK_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)  # the JVM started now inherits this as its stderr
    try:
        spark = _build(SparkSession, master, app)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log_fd)
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(TapeDataSource)
    return spark


SPARK_LOG = ""


def _build(SparkSession, master: str, app: str):
    return (SparkSession.builder.master(master).appName(app)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile=file:{LOG4J}")
             .config("spark.executor.extraJavaOptions", f"-Dlog4j.configurationFile=file:{LOG4J}")
             .getOrCreate())


# --- the audit ----------------------------------------------------------------------------

ALERT_FIELDS = ("emit_seq", "purchase_id", "order_id", "requested", "cumulative")


def _order_alerts(rows, book_ttl_ns: int, orphan_ttl_ns: int):
    """The alerts of one order, by the reference rules (every rule is per order)."""
    from tape.ops.reference import expected_alerts
    from tape.protocol import messages as M

    stream = []
    for r in sorted(rows, key=lambda r: r[0]):
        kind = M.REQUEST if r[1] == "purchase_request" else M.PURCHASE
        stream.append((r[0], (kind, r[2], r[3], r[4], r[5], r[6] or 0, r[7], None, 0)))
    alerts, _ = expected_alerts(stream, book_ttl_ns, orphan_ttl_ns)
    return [(a["emit_seq"], a["purchase_seq"], a["purchase_id"], a["order_id"], a["requested"], a["cumulative"])
            for a in alerts]


def expected_alerts_df(spark, journal: str, session_name: str, book_ttl_ns: int, orphan_ttl_ns: int):
    from pyspark.sql import functions as F

    trades = (spark.read.format("tape").load(journal)
              .where(F.col("type").isin("purchase_request", "purchase"))
              .select("seq", "type", "order_id", "shares", "client", "stock", "purchase_id", "stamp_ns"))
    alerts = (trades.rdd.map(lambda r: (r[2], tuple(r)))
              .groupByKey()
              .flatMap(lambda kv: _order_alerts(kv[1], book_ttl_ns, orphan_ttl_ns)))
    df = spark.createDataFrame(alerts, "emit_seq LONG, purchase_seq LONG, purchase_id LONG, order_id LONG, "
                                       "requested LONG, cumulative LONG")
    return df.withColumn("alert_id", F.concat(F.lit(f"{session_name}:"), F.col("purchase_seq").cast("string")))


def reconcile(spark, journal: str, alerts_file: str, session_name: str, book_ttl_ns: int, orphan_ttl_ns: int,
              show: int = 5) -> dict:
    """Missing, duplicate, unexpected and mismatched alerts: delivered vs recomputed."""
    from pyspark.sql import functions as F

    expected = expected_alerts_df(spark, journal, session_name, book_ttl_ns, orphan_ttl_ns).cache()
    delivered = spark.read.schema("alert_id STRING, emit_seq LONG, purchase_seq LONG, purchase_id LONG, "
                                  "order_id LONG, requested LONG, cumulative LONG").json(alerts_file).cache()
    dup = delivered.groupBy("alert_id").count().where("count > 1")
    missing = expected.join(delivered, "alert_id", "left_anti")
    unexpected = delivered.join(expected, "alert_id", "left_anti")
    e, d = expected.alias("e"), delivered.dropDuplicates(["alert_id"]).alias("d")
    differs = None
    for f in ALERT_FIELDS:
        cond = ~F.col(f"e.{f}").eqNullSafe(F.col(f"d.{f}"))
        differs = cond if differs is None else (differs | cond)
    mismatched = e.join(d, F.col("e.alert_id") == F.col("d.alert_id")).where(differs).select("e.alert_id")

    def ids(df):
        rows = df.select("alert_id").orderBy("alert_id").limit(show).collect()
        return [r[0] for r in rows]

    report = {
        "expected": expected.count(),
        "delivered": delivered.count(),
        "missing": {"count": missing.count(), "first": ids(missing)},
        "duplicate": {"count": dup.count(), "first": ids(dup)},
        "unexpected": {"count": unexpected.count(), "first": ids(unexpected)},
        "mismatched": {"count": mismatched.count(), "first": ids(mismatched)},
    }
    report["findings"] = sum(report[k]["count"] for k in ("missing", "duplicate", "unexpected", "mismatched"))
    return report
