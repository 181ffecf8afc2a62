"""PySpark over the journal: the `tape` data source, the audit, and progress.

    spark = session()                       # local[*], quiet, source registered
    df = spark.read.format("tape").load(path)                     # whole journal
    df = spark.read.format("tape").option("fromSeq", 100).option("toSeq", 200).load(path)
    df = spark.read.format("tape").option("corrupt", "skip").load(path)

PATH is a journal directory: a local path or any URI pyarrow's file systems
open (file://, hdfs://, s3://, gs://). One partition per segment file (the
reader skips segments outside the seq range); rows come as Arrow batches.
A corrupt record fails the read with the segment, offset and expected seq;
with `corrupt = skip` each corrupt stretch becomes one row of type
"corrupt" whose `corrupt` column says where and why, and reading goes on
at the next good record.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

SCHEMA = ("seq LONG, term LONG, type STRING, stamp TIMESTAMP, stamp_ns LONG, origin STRING, client_seq LONG, "
          "order_id LONG, purchase_id LONG, shares LONG, client STRING, stock STRING, leader STRING, corrupt STRING")
LOG4J = Path(__file__).with_name("log4j2.properties")
READ_CHUNK = 8 << 20  # bytes per Arrow batch, about 85,000 records


def journal_fs(path: str):
    """(pyarrow file system, path inside it) for a local path or a URI."""
    from pyarrow import fs

    if "://" in path:
        return fs.FileSystem.from_uri(path)
    return fs.LocalFileSystem(), str(Path(path).absolute())


def list_segments(path: str) -> list[tuple[str, int]]:
    """The journal's segment files as (path in its file system, first seq), in seq order."""
    from pyarrow import fs as pafs

    filesystem, root = journal_fs(path)
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(root))
    except (FileNotFoundError, OSError) as e:
        raise FileNotFoundError(f"journal {path}: {e}") from None
    segs = sorted((i.path, int(i.base_name[:-4])) for i in infos
                  if i.type == pafs.FileType.File and i.base_name.endswith(".seg") and i.base_name[:-4].isdigit())
    if not segs:
        raise FileNotFoundError(f"no journal segments (*.seg) in {path}")
    return sorted(segs, key=lambda s: s[1])


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

    def streamReader(self, schema):
        """Over a journal directory (load(PATH)), or a rewinder's replay port (option "rewinder")."""
        if self.options.get("rewinder"):
            from tape.ops.spark.replay_stream import ReplayStreamReader

            return ReplayStreamReader(self.options)
        from tape.ops.spark.stream import JournalStreamReader

        return JournalStreamReader(self.options)


class TapeReader(DataSourceReader):
    def __init__(self, options):
        path = options.get("path")
        if not path:
            raise ValueError('spark.read.format("tape").load(PATH): PATH (a journal directory) is required')
        self.uri = path
        self.from_seq = int(options.get("fromSeq", 1))
        self.to_seq = int(options["toSeq"]) if options.get("toSeq") else None
        mode = options.get("corrupt", "fail")
        if mode not in ("fail", "skip"):
            raise ValueError(f'option corrupt = {mode!r}: use "fail" (the default) or "skip"')
        self.skip = mode == "skip"
        segs = list_segments(path)
        self.segments = [SegmentPartition(seg, first, segs[i + 1][1] - 1 if i + 1 < len(segs) else None,
                                          i + 1 < len(segs)) for i, (seg, first) in enumerate(segs)]

    def partitions(self):
        out = [
            p
            for p in self.segments
            if (p.last_seq is None or p.last_seq >= self.from_seq)
            and (self.to_seq is None or p.first_seq <= self.to_seq)
        ]
        return out or [self.segments[-1]]

    def read(self, partition: SegmentPartition):
        hi = self.to_seq if self.to_seq is not None else 2**64
        return read_segment(self.uri, partition.path, partition.first_seq, partition.sealed, self.from_seq, hi,
                            self.skip)


def read_segment(uri: str, path: str, first_seq: int, sealed: bool, lo: int, hi: int, skip: bool,
                 offset: int | None = None):
    """Arrow batches of the segment's records from seq `lo` through `hi` (as far as the file goes),
    reading from its start, or from `offset`, the offset of seq `lo`'s record (the streaming source's
    guess: every record has one size); a corrupt record fails the read, or with `skip` becomes a row
    of type "corrupt"."""
    import pyarrow as pa

    from tape.protocol import journal as fmt
    from tape.protocol import journal_columns as columns

    filesystem, _ = journal_fs(uri)
    arrow_schema = _arrow_schema()
    with filesystem.open_input_file(path) as f:
        header = f.read(fmt.SEGMENT_HEADER_SIZE)
        try:
            _, first = fmt.decode_segment_header(header)
        except fmt.FormatError as e:
            raise ValueError(f"{path}: not a Tape segment ({e})") from None
        if first != first_seq:
            raise ValueError(f"{path}: header says first seq {first}, the file name {first_seq}")
        expect, base, buf = first, fmt.SEGMENT_HEADER_SIZE, b""
        if offset is not None and _holds(f, offset, lo):
            expect, base = lo, offset
        f.seek(base)
        while expect <= hi:
            chunk = f.read(READ_CHUNK)
            at_eof = not chunk
            buf = buf + chunk if buf else chunk
            try:
                res = columns.decode_chunk(buf, base, expect, skip, final=at_eof and sealed)
            except columns.CorruptRecord as e:
                raise ValueError(f"corrupt journal record in {path} at offset {e.offset} (seq {e.expected_seq} "
                                 f"expected): {e.problem}; option corrupt = skip reads past it") from None
            rows = res.rows
            if rows and (rows[0][2] < lo or rows[-1][2] > hi):
                rows = [r for r in rows if lo <= r[2] <= hi]
            if rows:
                yield _batch(pa, arrow_schema, columns.to_columns(rows), path)
            if res.corrupt:
                yield _corrupt_batch(pa, arrow_schema, [c.describe(path) for c in res.corrupt],
                                     [c.expected_seq for c in res.corrupt])
            expect, base, buf = res.next_seq, base + res.consumed, buf[res.consumed:]
            if at_eof:
                return


def _holds(f, offset: int, seq: int) -> bool:
    """Whether a whole, sound record of `seq` starts at `offset` (else the segment is read from its start)."""
    from tape.protocol import journal_columns as columns

    f.seek(offset)
    try:
        return len(columns.decode_chunk(f.read(columns.RECORD_SIZE), offset, seq, False, False).rows) == 1
    except columns.CorruptRecord:
        return False


def _arrow_schema():
    import pyarrow as pa

    long, text = pa.int64(), pa.string()
    return pa.schema([("seq", long), ("term", long), ("type", text), ("stamp", pa.timestamp("us", tz="UTC")),
                      ("stamp_ns", long), ("origin", text), ("client_seq", long), ("order_id", long),
                      ("purchase_id", long), ("shares", long), ("client", text), ("stock", text), ("leader", text),
                      ("corrupt", text)])


def _batch(pa, schema, cols: dict, segment: str):
    n = len(cols["seq"])
    cols["stamp"] = [ns // 1000 for ns in cols["stamp_ns"]]
    cols["corrupt"] = [None] * n
    try:
        arrays = [pa.array(cols[f.name], type=f.type) for f in schema]
    except (OverflowError, pa.ArrowInvalid) as e:
        raise ValueError(f"{segment}: a value does not fit Spark's LONG (ids and stamps above 2^63-1); "
                         f"use tape journal dump ({e})") from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _corrupt_batch(pa, schema, descriptions: list[str], seqs: list[int]):
    n = len(descriptions)
    arrays = [pa.array(seqs, pa.int64()) if f.name == "seq" else
              pa.array(["corrupt"] * n) if f.name == "type" else
              pa.array(descriptions) if f.name == "corrupt" else
              pa.nulls(n, f.type) for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def session(master: str = "local[*]", app: str = "tape", conf: dict | None = None):
    """A quiet Spark session with the `tape` source registered. The JVM's
    own stderr (start-up chatter, Spark's errors) goes to a log file whose
    path is in SPARK_LOG, so that a command's output stays clean (the file
    is removed at exit unless it holds an error). On a cluster (a master
    other than local), the executors' Python is the cluster's own (its
    `spark.pyspark.python`, or PYSPARK_PYTHON on the workers) and Tape is
    shipped to it as a zip: the workers need Python and pyarrow, not Tape."""
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    else:  # the streaming source's planning runs in the cluster's Python on this host, beside the JVM
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_zip(), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import logging

    logging.getLogger("py4j").setLevel(logging.WARNING)
    import tempfile

    from pyspark.sql import SparkSession

    global SPARK_LOG
    SPARK_LOG = os.path.join(tempfile.gettempdir(), f"tape-spark-{os.getpid()}.log")
    saved = os.dup(2)
    log_fd = os.open(SPARK_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)  # the JVM started now inherits this as its stderr
    try:
        spark = _build(SparkSession, master, app, conf or {})
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log_fd)
    spark.sparkContext.setLogLevel("ERROR")
    if not master.startswith("local"):
        spark.sparkContext.addPyFile(package_zip())
    spark.dataSource.register(TapeDataSource)
    atexit.register(_drop_quiet_log, SPARK_LOG)
    return spark


PACKAGES = ("protocol", "runtime", "sequencer", "rewinder", "replicas", "ops")  # tape.<name>, as pyproject maps them


def package_zip() -> str:
    """Tape's Python modules in one zip (tape/<package>/*.py), for executors that do not have Tape
    installed (SparkContext.addPyFile puts it on their path). Made once a process."""
    import importlib
    import tempfile
    import zipfile

    path = os.path.join(tempfile.gettempdir(), f"tape-executors-{os.getpid()}.zip")
    if not os.path.exists(path):
        with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("tape/__init__.py", "")  # (installed, tape is a namespace package)
            for name in PACKAGES:
                root = Path(importlib.import_module(f"tape.{name}").__path__[0])
                for source in sorted(root.rglob("*.py")):
                    z.write(source, f"tape/{name}/{source.relative_to(root)}")
        os.replace(path + ".tmp", path)
        atexit.register(os.remove, path)
    return path


def _drop_quiet_log(path: str) -> None:
    """Keep the JVM's log only if it says more than its start-up lines."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return
    if "ERROR" not in text and "Exception" not in text:
        os.remove(path)


SPARK_LOG = ""


def _build(SparkSession, master: str, app: str, conf: dict):
    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile=file:{LOG4J}")
               .config("spark.executor.extraJavaOptions", f"-Dlog4j.configurationFile=file:{LOG4J}"))
    if master.startswith("local"):
        # Spark's default of 200 shuffle partitions is sized for clusters: on one host, each
        # stage of the audit would schedule 200 tiny tasks (a 100,000-message audit: 31 s, 20 s at 4).
        builder = builder.config("spark.sql.shuffle.partitions", str(4 * (os.cpu_count() or 1)))
    for key, value in conf.items():  # --conf KEY=VALUE: the usual Spark settings, last word
        builder = builder.config(key, value)
    return builder.getOrCreate()


def parse_conf(pairs: list[str] | None) -> dict:
    """`--conf KEY=VALUE` arguments as a dict; a pair without '=' is an error."""
    out = {}
    for pair in pairs or []:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise SystemExit(f"--conf {pair!r}: expected KEY=VALUE (e.g. spark.executor.memory=4g)")
        out[key] = value
    return out


def journal_df(spark, path: str, skip_corrupt: bool = False):
    """The journal at `path` as a DataFrame: a journal directory through the
    `tape` source, or a directory written by `tape journal export` (Parquet)."""
    if _is_parquet(path):
        return spark.read.parquet(path)
    reader = spark.read.format("tape")
    if skip_corrupt:
        reader = reader.option("corrupt", "skip")
    return reader.load(path)


def _is_parquet(path: str) -> bool:
    from pyarrow import fs as pafs

    filesystem, root = journal_fs(path)
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(root))
    except (FileNotFoundError, OSError):
        return False
    return any(i.base_name.endswith(".parquet") for i in infos)


class SparkProgress:
    """Progress bars on stderr for Spark's active stages while a command's
    jobs run (the console progress of Spark itself is off: it would mix
    with the command's output)."""

    def __init__(self, spark, console, what: str):
        self.spark, self.console, self.what = spark, console, what
        self._stop = threading.Event()

    def phase(self, what: str) -> None:
        self.what = what

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tasks"), TimeElapsedColumn(), console=self.console, transient=True)
        self.progress.start()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=2)
        self.progress.stop()

    def _poll(self) -> None:
        tracker = self.spark.sparkContext.statusTracker()
        tasks: dict[int, int] = {}
        while not self._stop.wait(0.25):
            try:
                active = tracker.getActiveStageIds()
                for sid in active:
                    info = tracker.getStageInfo(sid)
                    if info is None:
                        continue
                    if sid not in tasks:
                        tasks[sid] = self.progress.add_task(f"{self.what} (stage {sid})", total=info.numTasks)
                    self.progress.update(tasks[sid], completed=info.numCompletedTasks)
                for sid in [s for s in tasks if s not in active]:
                    self.progress.remove_task(tasks.pop(sid))
            except Exception:  # the session is stopping: nothing more to show
                return


# --- the audit ----------------------------------------------------------------------------

ALERT_FIELDS = ("emit_seq", "purchase_id", "order_id", "requested", "cumulative")


REJECT_REASONS = ("duplicate_order", "bad_shares", "client_mismatch", "stock_mismatch", "orphan_expired")


def _open_books(trades, book_ttl_ns: int):
    """2. Books: a fold (a JVM higher-order function) over each order's requests: (order_id, books)."""
    from pyspark.sql import functions as F

    book = F.struct(F.col("seq").alias("book_seq"), F.col("stamp_ns").alias("opened"),
                    F.col("now").alias("opened_now"), F.col("shares").alias("requested"), "client", "stock")
    fold = (f"aggregate(reqs, named_struct('opened', CAST(NULL AS BIGINT), 'books', slice(reqs, 1, 0)), "
            f"(acc, r) -> IF(acc.opened IS NULL OR r.opened_now >= acc.opened + {int(book_ttl_ns)}, "
            f"named_struct('opened', r.opened, 'books', concat(acc.books, array(r))), acc)).books")
    return (trades.where("type = 'purchase_request' AND shares > 0").groupBy("order_id")
            .agg(F.array_sort(F.collect_list(book)).alias("reqs"))
            .select("order_id", F.expr(fold).alias("books")))


def _around_books(trades, opened):
    """3. The books before (p) and after (n) each trade, from its order's few books. Both sides are
    already partitioned by order id (the window and the fold), so the join moves no data. Most
    orders have one book: plain element access then, the lambdas only for the rest (Spark
    inlines p and n into every use)."""
    from pyspark.sql import functions as F

    mark = "IF(size(books) = 1, books[0].book_seq = seq, exists(books, b -> b.book_seq = seq))"
    before = ("IF(size(books) = 1, IF(books[0].book_seq < seq, books[0], NULL), "
              "try_element_at(filter(books, b -> b.book_seq < seq), -1))")
    after = ("IF(size(books) = 1, IF(books[0].book_seq > seq, books[0], NULL), "
             "try_element_at(filter(books, b -> b.book_seq > seq), 1))")
    return (trades.join(opened, "order_id", "left").withColumn("mark", F.expr(mark))
            .withColumn("p", F.expr(before)).withColumn("n", F.expr(after)))


def apply_rules(trades, book_ttl_ns: int, orphan_ttl_ns: int, end_ns: int | None = None):
    """The replicas' rules (DESIGN.md sections 1 and 6) over a DataFrame of
    trades, in Spark SQL: no Python per row. Every rule is per order, so
    each step is a window partitioned by order id, in seq order:

    1. `now` at each message: the running max of the order's stamps.
    2. Books: a request with shares > 0 opens one unless the order's last
       book is still open (a fold over the order's requests, `aggregate`).
    3. A purchase fills the latest book before it if that book is still
       open; otherwise (shares > 0) it is an orphan, held for the next book,
       which takes it if it opens within `orphan_ttl` (else it expired; with
       no next book it expired if `end_ns` is past its window, or is held).
       An orphan fills at its book's seq, before later purchases.
    4. A fill counts if its client and stock are the book's.

    Returns (books, outcomes): books (order_id, book_seq, requested, client,
    stock, ...) and one row per trade with its `outcome` (opened, fill,
    held, or a reject reason) and, for fills, `book` and `emit_seq`."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    trades = trades.select("seq", "type", "order_id", "shares", "client", "stock", "purchase_id", "stamp_ns")
    by_order = Window.partitionBy("order_id").orderBy("seq")
    trades = trades.withColumn("now", F.max("stamp_ns").over(by_order.rowsBetween(Window.unboundedPreceding, 0)))

    opened = _open_books(trades, book_ttl_ns)
    books = opened.select("order_id", F.explode("books").alias("b")).select("order_id", "b.*")
    t = _around_books(trades, opened)
    book_open = F.col("p").isNotNull() & (F.col("now") < F.col("p.opened") + F.lit(book_ttl_ns))
    is_request = F.col("type") == "purchase_request"
    window_end = F.col("stamp_ns") + F.lit(orphan_ttl_ns)
    expired = F.when(F.col("n").isNotNull(), F.col("n.opened_now") >= window_end)
    expired = expired.otherwise(F.lit(end_ns is not None) & (F.lit(end_ns or 0) >= window_end))
    target = lambda c: F.when(book_open, F.col("p." + c)).otherwise(F.col("n." + c))  # noqa: E731
    outcome = (F.when(is_request, F.when(F.col("mark"), "opened")
                      .when(book_open, "duplicate_order").otherwise("bad_shares"))
               .when(F.col("shares") <= 0, "bad_shares")
               .when(~book_open & expired, "orphan_expired")
               .when(~book_open & F.col("n").isNull(), "held")
               .when(F.col("client") != target("client"), "client_mismatch")
               .when(F.col("stock") != target("stock"), "stock_mismatch")
               .otherwise("fill"))
    outcomes = t.select(
        "seq", "type", "order_id", "shares", "purchase_id", outcome.alias("outcome"),
        target("book_seq").alias("book"), target("requested").alias("requested"),
        F.when(book_open, F.col("seq")).otherwise(F.col("n.book_seq")).alias("emit_seq"))
    return books, outcomes


def alerts_df(outcomes, session_name: str):
    """4. Cumulative shares per book (fills ordered by emit seq, then seq);
    the first fill that takes it over the request is the alert."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    by_book = Window.partitionBy("order_id", "book").orderBy("emit_seq", "seq")
    over = (outcomes.where("outcome = 'fill'")
            .withColumn("cumulative", F.sum("shares").over(by_book.rowsBetween(Window.unboundedPreceding, 0)))
            .where(F.col("cumulative") > F.col("requested"))
            .withColumn("nth", F.row_number().over(by_book))
            .where("nth = 1"))
    return over.select(
        "emit_seq", F.col("seq").alias("purchase_seq"), "purchase_id", "order_id", "requested", "cumulative",
        F.concat(F.lit(f"{session_name}:"), F.col("seq").cast("string")).alias("alert_id"))


def expected_alerts_df(spark, journal: str, session_name: str, book_ttl_ns: int, orphan_ttl_ns: int,
                       skip_corrupt: bool = False):
    """The alerts the journal implies, by the replicas' rules."""
    trades = journal_df(spark, journal, skip_corrupt).where("type IN ('purchase_request', 'purchase')")
    _, outcomes = apply_rules(trades, book_ttl_ns, orphan_ttl_ns)
    return alerts_df(outcomes, session_name)


def reconcile(spark, journal: str, alerts_file: str, session_name: str, book_ttl_ns: int, orphan_ttl_ns: int,
              show: int = 5, skip_corrupt: bool = False) -> dict:
    """Missing, duplicate, unexpected and mismatched alerts: delivered vs recomputed."""
    from pyspark.sql import functions as F

    expected = expected_alerts_df(spark, journal, session_name, book_ttl_ns, orphan_ttl_ns, skip_corrupt).cache()
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

    def finding(df) -> dict:
        """Its count and first ids: the ids' sort is a second job, run only for findings that exist
        (each job costs seconds on a cluster, where an audit that finds nothing ran four for nothing)."""
        count = df.count()
        rows = df.select("alert_id").orderBy("alert_id").limit(show).collect() if count else []
        return {"count": count, "first": [r[0] for r in rows]}

    report = {
        "expected": expected.count(),
        "delivered": delivered.count(),
        "missing": finding(missing),
        "duplicate": finding(dup),
        "unexpected": finding(unexpected),
        "mismatched": finding(mismatched),
    }
    report["findings"] = sum(report[k]["count"] for k in ("missing", "duplicate", "unexpected", "mismatched"))
    if skip_corrupt:
        corrupt = journal_df(spark, journal, True).where("type = 'corrupt'").select("corrupt").collect()
        report["corrupt_records"] = {"count": len(corrupt), "first": [r[0] for r in corrupt[:show]]}
    return report
