"""Spark over real journals: the data source, the audit, and replay (issue 6)."""

import json
import subprocess
from pathlib import Path

import pytest

from tape.journal.store import Journal
from tape.ops.spark import reconcile

from conftest import TAPE

pytestmark = [pytest.mark.spark, pytest.mark.process]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real `tape up` run: journals, alerts.jsonl, replicas' status."""
    out = tmp_path_factory.mktemp("up")
    done = subprocess.run(TAPE + ["up", "--rate", "5000", "--duration", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


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
    for e in expected[::97]:
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


def test_audit_finds_nothing_then_exactly_the_three_planted_findings(spark, run_dir, tmp_path):
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


def test_audit_command_exit_codes(run_dir, tmp_path):
    journal, alerts = run_dir / "journal" / "seq-a", run_dir / "alerts.jsonl"
    bad = tmp_path / "alerts.jsonl"
    bad.write_text("\n".join(alerts.read_text().splitlines()[1:]) + "\n")  # one missing
    out = subprocess.run(TAPE + ["audit", "--journal", str(journal), "--alerts", str(bad), "--master", "local[2]",
                                 "--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert json.loads((tmp_path / "r.json").read_text())["missing"]["count"] == 1
    assert "Traceback" not in out.stderr


def test_replay_to_lmdb_gives_the_live_replicas_digest(run_dir, tmp_path):
    out = subprocess.run(TAPE + ["replay", "--journal", str(run_dir / "journal" / "seq-a"), "--to-lmdb", str(tmp_path / "l")],
                         capture_output=True, text=True, check=True)
    replayed = json.loads(out.stdout)
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["digests"].values()) == {replayed["digest"]}
    assert replayed["last_seq"] == report["log_length"]
