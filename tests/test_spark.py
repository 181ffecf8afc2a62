"""Spark over real journals: the data source, the audit, and replay (issue 6)."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import TAPE

from tape.ops.spark.source import reconcile
from tape.runtime.storage.journal_store import Journal

pytestmark = [pytest.mark.spark, pytest.mark.process]


@pytest.fixture(scope="module")
def multi_segment(run_dir, tmp_path_factory):
    """The run's journal re-written into many small segments."""
    path = tmp_path_factory.mktemp("segments")
    src = Journal(run_dir / "journal" / "seq-a", readonly=True)
    dst = Journal(path, src.session, segment_bytes=50_000, fsync="never")
    records = list(src.read())
    for i in range(0, len(records), 250):
        dst.append(records[i:i + 250])
    dst.close()
    assert len(dst.segments) > 10
    return path


def dump(path: Path, *extra: str) -> list[dict]:
    out = subprocess.run(TAPE + ["journal", "dump", str(path), *extra], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_the_source_reads_what_journal_dump_prints(spark, multi_segment):
    df = spark.read.format("tape").load(str(multi_segment))
    assert df.rdd.getNumPartitions() == len(list(multi_segment.glob("*.seg")))
    rows = {r["seq"]: r for r in df.collect()}
    expected = dump(multi_segment)
    assert sorted(rows) == [e["seq"] for e in expected]
    for e in expected:  # every row, every field
        r = rows[e["seq"]]
        assert (r["type"], r["term"], r["stamp_ns"], r["origin"], r["client_seq"]) == \
               (e["type"], e["term"], e["stamp_ns"], e["origin"], e["client_seq"])
        if e["type"] in ("purchase", "purchase_request"):
            assert (r["order_id"], r["shares"], r["client"], r["stock"], r["purchase_id"]) == \
                   (e["order_id"], e["shares"], e["client"], e["stock"], e.get("purchase_id"))
        # TIMESTAMP holds microseconds (exact ns stay in stamp_ns); float rounding adds < 1 us
        assert r["stamp"].timestamp() == pytest.approx(e["stamp_ns"] / 1e9, abs=2e-6)


def test_a_seq_range_read_returns_exactly_that_range(spark, multi_segment):
    df = spark.read.format("tape").option("fromSeq", 1234).option("toSeq", 5678).load(str(multi_segment))
    seqs = sorted(r[0] for r in df.select("seq").collect())
    assert seqs == list(range(1234, 5679))
    assert df.rdd.getNumPartitions() < len(list(multi_segment.glob("*.seg")))


def test_audit_finds_nothing_then_exactly_the_three_planted_findings(spark, run_dir, tmp_path, capsys):
    from tape.ops.spark.audit_job import show

    journal, alerts = str(run_dir / "journal" / "seq-a"), run_dir / "alerts.jsonl"
    clean = reconcile(spark, journal, str(alerts), "TAPE", 3600 * 10**9, 10 * 10**9)
    assert clean["findings"] == 0 and clean["expected"] == clean["delivered"] > 10
    lines = alerts.read_text().splitlines()
    deleted, duplicated, altered = json.loads(lines[1]), lines[2], json.loads(lines[3])
    altered["cumulative"] += 1
    tampered = tmp_path / "alerts.jsonl"
    tampered.write_text("\n".join([lines[0], duplicated, duplicated, json.dumps(altered)] + lines[4:]) + "\n")
    found = reconcile(spark, journal, str(tampered), "TAPE", 3600 * 10**9, 10 * 10**9)
    assert found["findings"] == 3
    assert found["missing"] == {"count": 1, "first": [deleted["alert_id"]]}
    assert found["duplicate"]["first"] == [json.loads(duplicated)["alert_id"]]
    assert found["mismatched"]["first"] == [altered["alert_id"]]
    assert found["unexpected"]["count"] == 0
    # `tape audit` exits 0 on the clean report and 1 on the other, and prints and writes each.
    for report, status in ((clean, 0), (found, 1)):
        report["seconds"] = 1.0
        assert show(report, journal, str(alerts), str(tmp_path / "report.json")) == status
        assert json.loads((tmp_path / "report.json").read_text()) == report
        assert f"{report['findings']}findingsin1.0s" in "".join(capsys.readouterr().out.split())  # (wrapped)


def random_journal(path: Path, seed: int, n: int = 4000) -> list:
    """A journal of random trades that hits every rule: duplicate and bad
    requests, mismatched and bad purchases, orphans, books that close."""
    import random

    from tape.protocol import messages as M

    rng = random.Random(seed)
    origin = b"client1   "
    stamp, records = 0, []
    for seq in range(1, n + 1):
        stamp += rng.choice((0, 0, 0, 10))  # coarse, so that windows end exactly on some stamps
        order, shares = rng.randint(1, n // 40), rng.choice((-1, 0, 10, 40, 100))
        client, stock = rng.choice("AAAB"), rng.choice("XXXY")
        if rng.random() < 0.06:
            raw = M.time_tick(stamp, origin)
        elif rng.random() < 0.25:
            raw = M.stamp(M.purchase_request(order, shares, client, stock), stamp, origin, seq)
        else:
            raw = M.stamp(M.purchase(10_000 + seq, order, shares, client, stock), stamp, origin, seq)
        records.append((seq, 1, raw))
    j = Journal(path, b"TAPE      ", segment_bytes=60_000, fsync="never")
    for i in range(0, n, 500):
        j.append(records[i:i + 500])
    j.close()
    return [(seq, M.decode(raw)) for seq, _, raw in records]


@pytest.mark.parametrize("book_ttl, orphan_ttl", [(300, 100), (2000, 30), (10**12, 10**12)])
def test_the_spark_rules_equal_the_reference_on_random_journals(spark, tmp_path, book_ttl, orphan_ttl):
    from pyspark.sql import functions as F

    from tape.ops.spark.source import alerts_df, apply_rules, journal_df
    from tape.ops.verification.reference import expected_alerts
    from tape.protocol import messages as M

    stream = random_journal(tmp_path / "j", seed=book_ttl + orphan_ttl)
    ref_books: list = []
    want, want_rejects = expected_alerts(stream, book_ttl, orphan_ttl, books_out=ref_books)
    trades = journal_df(spark, str(tmp_path / "j")).where("type IN ('purchase_request', 'purchase')")
    end_ns = max(m[M.STAMP] for _, m in stream)
    books, outcomes = apply_rules(trades, book_ttl, orphan_ttl, end_ns)
    outcomes = outcomes.cache()
    got = alerts_df(outcomes, "TAPE").collect()
    fields = ("emit_seq", "purchase_seq", "purchase_id", "order_id", "requested", "cumulative")
    assert sorted(tuple(r[f] for f in fields) for r in got) == sorted(tuple(a[f] for f in fields) for a in want)
    assert len(want) > 20
    counts = {r["outcome"]: r["count"] for r in outcomes.groupBy("outcome").count().collect()}
    assert {k: counts.get(k, 0) for k in want_rejects} == want_rejects
    filled = outcomes.where("outcome = 'fill'").groupBy("order_id", F.col("book").alias("book_seq")).agg(
        F.sum("shares").alias("total"))
    got_books = books.join(filled, ["order_id", "book_seq"], "left").collect()
    assert sorted((b["order_id"], b["requested"], b["total"] or 0) for b in got_books) == \
        sorted((b["order_id"], b["requested"], b["total"]) for b in ref_books)
    outcomes.unpersist()


def test_replay_to_lmdb_gives_the_live_replicas_digest(run_dir, tmp_path):
    out = subprocess.run(
        TAPE + ["replay", "--journal", str(run_dir / "journal" / "seq-a"), "--to-lmdb", str(tmp_path / "l")],
        capture_output=True,
        text=True,
        check=True,
    )
    replayed = json.loads(out.stdout)
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["digests"].values()) == {replayed["digest"]}
    assert replayed["last_seq"] == report["log_length"]


def test_a_file_uri_reads_like_a_path(spark, multi_segment):
    by_path = spark.read.format("tape").load(str(multi_segment)).count()
    assert spark.read.format("tape").load(multi_segment.resolve().as_uri()).count() == by_path > 1000


@pytest.fixture
def corrupted(multi_segment, tmp_path):
    """A copy of the journal with one record's CRC-covered byte flipped and another's length field smashed."""
    import shutil

    from tape.protocol import journal as fmt
    from tape.protocol import journal_columns as columns

    path = tmp_path / "journal"
    shutil.copytree(multi_segment, path)
    segs = sorted(path.glob("*.seg"))
    for seg, at, where in ((segs[2], 10, 60), (segs[5], 3, 5)):  # record index, byte inside the record
        data = bytearray(seg.read_bytes())
        offset = fmt.SEGMENT_HEADER_SIZE + at * columns.RECORD_SIZE + where
        data[offset] ^= 0xFF
        seg.write_bytes(bytes(data))
    return path, segs


def test_a_corrupt_record_fails_the_read_naming_segment_and_offset(spark, corrupted):
    from tape.protocol import journal as fmt
    from tape.protocol import journal_columns as columns

    path, segs = corrupted
    with pytest.raises(Exception) as e:
        spark.read.format("tape").load(str(path)).count()
    assert segs[2].name in str(e.value)
    assert f"offset {fmt.SEGMENT_HEADER_SIZE + 10 * columns.RECORD_SIZE}" in str(e.value)


def test_skip_mode_counts_each_corrupt_record_and_keeps_the_rest(spark, corrupted, multi_segment):
    path, segs = corrupted
    df = spark.read.format("tape").option("corrupt", "skip").load(str(path))
    bad = df.where("type = 'corrupt'").orderBy("seq").collect()
    assert [r["corrupt"].split(" ")[0].rsplit("/", 1)[-1] for r in bad] == [segs[2].name, segs[5].name]
    assert "CRC mismatch" in bad[0]["corrupt"] and "record length" in bad[1]["corrupt"]
    good = {r[0] for r in df.where("type != 'corrupt'").select("seq").collect()}
    everything = {r[0] for r in spark.read.format("tape").load(str(multi_segment)).select("seq").collect()}
    assert everything - good == {bad[0]["seq"], bad[1]["seq"]}


def test_analytics_in_skip_mode_count_and_name_the_corrupt_records(spark, corrupted):
    from tape.ops.spark.analytics import compute

    path, segs = corrupted
    report = compute(spark, str(path), 3600 * 10**9, 10 * 10**9, skip_corrupt=True)
    assert report["corrupt_records"] == 2
    assert sorted(c.split(" ")[0].rsplit("/", 1)[-1] for c in report["corrupt_first"]) == [segs[2].name, segs[5].name]


def test_analytics_agree_with_a_plain_count_of_the_journal(spark, run_dir, tmp_path):
    from collections import Counter

    from tape.ops.spark.analytics import compute
    from tape.ops.verification.reference import expected_alerts
    from tape.protocol import messages as M

    journal = str(run_dir / "journal" / "seq-a")
    report = compute(spark, journal, 3600 * 10**9, 10 * 10**9)
    decoded = [(seq, M.SEQUENCED.unpack(raw)) for seq, _, raw in Journal(journal, readonly=True).read()]
    trades = [m for _, m in decoded if m[M.TYPE] in (M.REQUEST, M.PURCHASE)]
    assert report["messages"] == len(decoded) and report["last_seq"] == decoded[-1][0]
    purchased = Counter()
    for m in trades:
        if m[M.TYPE] == M.PURCHASE:
            purchased[m[M.STOCK].decode().strip()] += m[M.SHARES]
    assert {r["stock"]: r["purchased_shares"] for r in report["per_stock"]} == purchased
    alerts, rejects = expected_alerts(decoded, 3600 * 10**9, 10 * 10**9)
    assert report["orders"]["alerts"] == len(alerts) == report["orders"]["overfilled"] > 0
    assert report["rejects"] == {k: v for k, v in rejects.items() if v}
    assert sum(b["orders"] for b in report["orders"]["fill_ratio_buckets"]) == report["orders"]["books"]
    assert sum(c for _, c in report["rate_per_second"]["series"]) == len(decoded)
    # The Parquet export gives the same analytics.
    parquet = tmp_path / "parquet"
    spark.read.format("tape").load(journal).write.parquet(str(parquet))
    again = compute(spark, str(parquet), 3600 * 10**9, 10 * 10**9)
    assert {k: v for k, v in again.items() if k != "journal"} == {k: v for k, v in report.items() if k != "journal"}
