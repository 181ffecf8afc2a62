"""spark.readStream.format("tape") (ops/spark/stream.py, issue 64): sequence numbers as offsets,
committed records only, a per-trigger limit, and a killed query resumed from its checkpoint."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for

from tape.protocol.journal_columns import RECORD_SIZE
from tape.runtime.storage.journal_store import Journal

pytestmark = [pytest.mark.spark, pytest.mark.process]


def recut(src_dir: Path, dst_dir: Path, upto: int | None = None, segment_bytes: int = 40_000) -> Journal:
    """`src_dir`'s records (through `upto`) in small segments at `dst_dir`, its writer left open."""
    src = Journal(src_dir, readonly=True)
    dst = Journal(dst_dir, src.session, segment_bytes=segment_bytes, fsync="never")
    records = list(src.read(1, upto))
    for i in range(0, len(records), 300):
        dst.append(records[i:i + 300])
    return dst


def seqs_of(spark, table: str) -> list[int]:
    return sorted(r[0] for r in spark.sql(f"SELECT seq FROM {table}").collect())


def test_a_stream_reads_up_to_the_commit_mark_within_the_trigger_limit_and_on_as_it_rises(spark, run_dir,
                                                                                         tmp_path):
    journal = recut(run_dir / "journal" / "seq-a", tmp_path / "j")
    n = journal.last_seq
    assert len(journal.segments) > 5 and n > 3000
    journal.mark_committed(n // 3)
    query = (spark.readStream.format("tape").option("maxRecordsPerTrigger", 700).load(str(tmp_path / "j"))
             .writeStream.format("memory").queryName("marked").start())
    try:
        query.processAllAvailable()
        assert seqs_of(spark, "marked") == list(range(1, n // 3 + 1))  # nothing past the mark
        journal.mark_committed(n)
        query.processAllAvailable()
        assert seqs_of(spark, "marked") == list(range(1, n + 1))  # each record once, in order of seq
        rows = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        assert max(rows) == 700 and sum(rows) == n
    finally:
        query.stop()


def test_the_torn_tail_is_never_read_even_under_a_mark_past_it(spark, run_dir, tmp_path):
    journal = recut(run_dir / "journal" / "seq-a", tmp_path / "j", upto=2000)
    journal.close()
    tail = journal.segments[-1].path
    with open(tail, "ab") as f:
        f.write(b"\x01" * (RECORD_SIZE - 1))  # a record half written
    journal.mark_committed(2005)  # (a mark ahead of the journal: a disk replaced under it)
    from tape.ops.spark.stream import committed_seq

    assert committed_seq(str(tmp_path / "j")) == 2000
    df = spark.readStream.format("tape").load(str(tmp_path / "j"))
    query = df.writeStream.format("memory").queryName("torn").start()
    try:
        query.processAllAvailable()
        assert seqs_of(spark, "torn") == list(range(1, 2001))
    finally:
        query.stop()


def test_no_mark_no_rows_unless_told_to_ignore_marks(spark, run_dir, tmp_path):
    recut(run_dir / "journal" / "seq-a", tmp_path / "j", upto=1500).close()
    for table, mark, expected in (("nomark", "file", 0), ("ignored", "ignore", 1500)):
        query = (spark.readStream.format("tape").option("commitMark", mark).load(str(tmp_path / "j"))
                 .writeStream.format("memory").queryName(table).start())
        try:
            query.processAllAvailable()
            assert len(seqs_of(spark, table)) == expected
        finally:
            query.stop()


FOLLOWER = """
import sys, time
from tape.ops.spark.source import session
journal, out, checkpoint = sys.argv[1:4]
spark = session("local[2]", "follow")
query = (spark.readStream.format("tape").option("maxRecordsPerTrigger", 2000).load(journal)
         .writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
         .trigger(processingTime="200 milliseconds").start())
query.awaitTermination()
"""


def test_a_killed_query_resumes_from_its_checkpoint_every_record_once(spark, tmp_path):
    """A live cluster writes the journal; the query is killed (SIGKILL) mid-run and started again
    on its checkpoint: the Parquet sink holds every committed record once, as the batch read does."""
    from conftest import TAPE

    script = tmp_path / "follow.py"
    script.write_text(FOLLOWER)
    run, out, checkpoint = tmp_path / "run", tmp_path / "out", tmp_path / "checkpoint"
    journal = run / "data" / "rw-1" / "journal"  # (where the node writes it; run/journal/ links it at the end)
    cluster = subprocess.Popen(TAPE + ["up", "--rate", "3000", "--duration", "15", "--out", str(run)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    follow = [sys.executable, str(script), str(journal), str(out), str(checkpoint)]
    try:
        first = subprocess.Popen(follow, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        commits = checkpoint / "commits"
        wait_for(lambda: commits.exists() and len(list(commits.iterdir())) >= 3, timeout=120,
                 what="three micro-batches committed")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        second = subprocess.Popen(follow, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        assert cluster.wait(timeout=180) == 0
        from tape.ops.spark.stream import committed_seq

        final = committed_seq(str(journal))
        assert final > 30_000
        wait_for(lambda: _committed_through(checkpoint) == final, timeout=180, what=f"the query through seq {final}")
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=30)
    finally:
        for proc in (cluster, locals().get("first"), locals().get("second")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    import pyarrow.parquet as pq

    sink = sorted(r[0] for r in spark.read.parquet(str(out)).select("seq").collect())
    batch = sorted(r[0] for r in spark.read.format("tape").option("toSeq", final).load(str(journal))
                   .select("seq").collect())
    assert sink == batch == list(range(1, final + 1))  # no gap, no duplicate
    assert pq.read_schema(next(out.glob("*.parquet"))).names[:3] == ["seq", "term", "type"]


def _committed_through(checkpoint: Path) -> int:
    """The seq the query's last committed micro-batch ends at (its checkpoint's offset log)."""
    done = [int(p.name) for p in (checkpoint / "commits").glob("[0-9]*")]
    if not done:
        return 0
    return json.loads((checkpoint / "offsets" / str(max(done))).read_text().splitlines()[-1])["seq"]


def test_a_stream_over_a_rewinders_replay_port_holds_the_journals_rows(spark, tmp_path):
    """With the cluster's keys (the listener key, as any listener): the committed log, each record
    once, as a journal stream reads it, but for the term a replayed message does not carry."""
    from tape.ops.verification.local import LocalCluster

    cluster = LocalCluster(tmp_path)
    assert cluster.cfg.listener_keys  # (keys by default)
    committed = 'tape_rewinder_commit_seq{node="rw-1"}'
    query = None
    try:
        cluster.start_all()
        first_client, second_client = (c.name for c in cluster.cfg.clients)  # (a client's seqs are sequenced once)
        cluster.start("load", "load", "--rate", "2000", "--messages", "3000", "--client", first_client).wait(timeout=60)
        wait_for(lambda: cluster.metrics("rw-1").get(committed, 0) >= 3000, "rw-1 to hold the load committed")
        query = (spark.readStream.format("tape").option("config", str(cluster.config_path))
                 .option("rewinder", "rw-1").option("maxRecordsPerTrigger", 1000).load()
                 .writeStream.format("memory").queryName("replayed").start())
        query.processAllAvailable()
        first = len(seqs_of(spark, "replayed"))
        more = cluster.start("load", "load", "--rate", "2000", "--messages", "2000", "--client", second_client)
        more.wait(timeout=60)
        wait_for(lambda: cluster.metrics("rw-1").get(committed, 0) >= first + 2000, "the second load committed")
        query.processAllAvailable()
        query.stop()  # (the log goes on growing: time ticks)
        rows = {r["seq"]: r.asDict() for r in spark.sql("SELECT * FROM replayed").collect()}
        n = len(rows)
        assert first >= 3000 and n >= first + 2000 and sorted(rows) == list(range(1, n + 1))
        assert cluster.stop("rw-1") == 0  # (its journal closed, and marked)
    finally:
        if query is not None:
            query.stop()
        cluster.close()
    journal = {r["seq"]: r.asDict() for r in spark.read.format("tape").option("toSeq", n)
               .load(str(cluster.journal_dir("rw-1"))).collect()}
    assert sorted(journal) == list(range(1, n + 1))
    for seq, row in rows.items():
        expected = journal[seq]
        assert row["term"] == (expected["term"] if row["type"] == "term_start" else None)
        assert {k: v for k, v in row.items() if k != "term"} == {k: v for k, v in expected.items() if k != "term"}
