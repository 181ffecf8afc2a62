"""The `tape` source as a Spark Structured Streaming source: offsets are sequence numbers.

    spark.readStream.format("tape").load(path)                          # a journal a voter is writing
    spark.readStream.format("tape").option("maxRecordsPerTrigger", 100_000).option("fromSeq", 1).load(path)

An offset is {"seq": N}: every record through seq N has been read (the initial offset is fromSeq - 1).
A micro-batch reads (start, end]; a query restarted from its checkpoint asks for the same ranges
again, and a seq names one record for ever, so a restarted query reads exactly what it committed
and goes on from there.

Only committed records are read: a voter's journal also holds records a majority has not taken,
which a new leader may cut. Each voter keeps its commit point beside its segments
(protocol/commit_mark.py); the source reads up to it and never past the last whole record (the
torn tail). With option("commitMark", "ignore") it reads every whole record: for a journal copied
from a stopped node that wrote no mark.

Rows, their schema and option("corrupt", "skip") are the batch source's (ops/spark/source.py).
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from tape.ops.spark.source import journal_fs, list_segments, read_segment

PARTITION_RECORDS = 250_000  # a micro-batch's records a Spark task at most (~1 s of one core): a catch-up uses them all
MARK_READS = 3  # times a reader reads a commit mark that fails its check sum before it waits for the next trigger


class SeqRange(InputPartition):
    """Seqs `lo` through `hi` of one segment file; `offset`: where `lo`'s record should start."""

    def __init__(self, path: str, first_seq: int, sealed: bool, lo: int, hi: int, offset: int):
        super().__init__((path, lo, hi))
        self.path, self.first_seq, self.sealed, self.lo, self.hi, self.offset = path, first_seq, sealed, lo, hi, offset


class SeqStreamReader(DataSourceStreamReader):
    """What both of the source's readers share: offsets {"seq": N}, fromSeq, maxRecordsPerTrigger;
    a reader says how far the log is committed (`committed`) and how to read a range."""

    def __init__(self, options):
        self.from_seq = int(options.get("fromSeq", 1))
        self.max_records = int(options["maxRecordsPerTrigger"]) if options.get("maxRecordsPerTrigger") else None
        if self.from_seq < 1 or (self.max_records is not None and self.max_records < 1):
            raise ValueError("fromSeq and maxRecordsPerTrigger must be at least 1")

    def committed(self) -> int:
        raise NotImplementedError

    def initialOffset(self) -> dict:
        return {"seq": self.from_seq - 1}

    def getDefaultReadLimit(self):
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        return ReadAllAvailable() if self.max_records is None else ReadMaxRows(self.max_records)

    def latestOffset(self, start: dict, limit) -> dict:
        """The end of the next micro-batch: what is committed after `start`, within `limit` (Spark's:
        ReadAllAvailable for a Trigger.AvailableNow query, whatever the option says)."""
        from pyspark.sql.streaming.datasource import ReadMaxRows

        end = max(start["seq"], self.committed())
        return {"seq": min(end, start["seq"] + limit.max_rows) if isinstance(limit, ReadMaxRows) else end}

    def reportLatestOffset(self) -> dict:
        return {"seq": self.committed()}

    def commit(self, end: dict) -> None:
        pass  # (nothing held: the log is the source's own, kept by the voters)


class JournalStreamReader(SeqStreamReader):
    def __init__(self, options):
        super().__init__(options)
        self.uri = options.get("path")
        if not self.uri:
            raise ValueError('spark.readStream.format("tape").load(PATH): PATH (a journal directory) is required')
        mark = options.get("commitMark", "file")
        if mark not in ("file", "ignore"):
            raise ValueError(f'option commitMark = {mark!r}: use "file" (the default) or "ignore"')
        self.use_mark = mark == "file"
        corrupt = options.get("corrupt", "fail")
        if corrupt not in ("fail", "skip"):
            raise ValueError(f'option corrupt = {corrupt!r}: use "fail" (the default) or "skip"')
        self.skip = corrupt == "skip"

    def committed(self) -> int:
        """The last seq that is committed and whole in the journal (0: none yet)."""
        return committed_seq(self.uri, self.use_mark)

    def partitions(self, start: dict, end: dict) -> list[SeqRange]:
        return seq_ranges(self.uri, start["seq"] + 1, end["seq"])

    def read(self, partition: SeqRange):
        seen = partition.lo - 1
        for batch in read_segment(self.uri, partition.path, partition.first_seq, partition.sealed, partition.lo,
                                  partition.hi, self.skip, partition.offset):
            seen = max(seen, batch.column(0)[-1].as_py())
            yield batch
        if seen < partition.hi:  # (the journal was cut or replaced under the reader: never a silent gap)
            raise ValueError(f"{partition.path} ends at seq {seen}, before seq {partition.hi}, which its node marked "
                             f"committed: its journal was cut or replaced; restart the query when it is whole")


def committed_seq(uri: str, use_mark: bool = True) -> int:
    """min(the commit mark, the last whole record) of the journal at `uri`."""
    from pyarrow import fs as pafs

    from tape.protocol import journal as fmt
    from tape.protocol.commit_mark import COMMIT_MARK_FILE, decode_mark
    from tape.protocol.journal_columns import RECORD_SIZE

    try:
        segments = list_segments(uri)
    except FileNotFoundError:
        return 0  # (a node that has not written its first segment yet)
    filesystem, root = journal_fs(uri)
    path, first = segments[-1]
    size = filesystem.get_file_info(path).size
    whole = first - 1 + max(size - fmt.SEGMENT_HEADER_SIZE, 0) // RECORD_SIZE
    if not use_mark:
        return whole
    mark = filesystem.get_file_info(f"{root}/{COMMIT_MARK_FILE}")
    if mark.type != pafs.FileType.File:
        return 0
    for _ in range(MARK_READS):  # (a mark read while its node wrote it fails its check sum: read again)
        with filesystem.open_input_stream(mark.path) as f:
            marked = decode_mark(f.read(64))
        if marked is not None:
            return min(marked, whole)
    return 0


def seq_ranges(uri: str, lo: int, hi: int) -> list[SeqRange]:
    """Seqs lo..hi as ranges of one segment and at most PARTITION_RECORDS each."""
    from tape.protocol import journal as fmt
    from tape.protocol.journal_columns import RECORD_SIZE

    if lo > hi:
        return []
    segments = list_segments(uri)
    out = []
    for i, (path, first) in enumerate(segments):
        last = segments[i + 1][1] - 1 if i + 1 < len(segments) else hi
        a, b = max(lo, first), min(hi, last)
        while a <= b:
            z = min(b, a + PARTITION_RECORDS - 1)
            out.append(SeqRange(path, first, i + 1 < len(segments), a, z,
                                fmt.SEGMENT_HEADER_SIZE + (a - first) * RECORD_SIZE))
            a = z + 1
    if not out or out[0].lo != lo:
        raise ValueError(f"journal {uri} no longer holds seq {lo} (its first segment starts at {segments[0][1]})")
    return out
