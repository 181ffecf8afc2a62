"""`tape watch` (ops/spark/watch.py, issue 64): continuous queries over the stream, their windows
equal to the batch analytics', their alerts the emitter's, a watch started again going on where it
stopped, and the live view as a person sees it in a terminal."""

import json
import shlex
import shutil
import subprocess
import time

import pytest
from conftest import TAPE, wait_for
from test_spark_stream import recut

pytestmark = [pytest.mark.spark, pytest.mark.process]
WINDOW = "1 second"


def test_watched_windows_are_the_batch_analytics_windows_and_its_alerts_the_emitters(spark, run_dir, tmp_path):
    """Watched in two goes (the log committed half way, then whole; watch's own queries, in this
    process): every closed window once, equal to the windows the batch analytics compute over the
    whole journal (the same function: `tape analytics` writes them); every alert the emitter delivered.
    (The command itself runs in the terminal test below.)"""
    from tape.ops.spark.live import OrderStates, stream_df, volume_windows
    from tape.ops.spark.watch import View, caught_up, start_queries

    journal = recut(run_dir / "journal" / "seq-a", tmp_path / "j", segment_bytes=400_000)
    n = journal.last_seq
    out = tmp_path / "watch"
    for mark in (n // 2, n):
        journal.mark_committed(mark)
        states = OrderStates(out / "orders", 3600 * 10**9, 10 * 10**9)
        queries = start_queries(stream_df(spark, str(tmp_path / "j")), out, View(10), WINDOW, states, follow=False)
        try:
            wait_for(lambda: all(map(caught_up, queries)), timeout=120, what=f"the watch caught up at seq {mark}")
        finally:
            for q in queries:
                q.stop()
            states.close()

    columns = ["window_start", "window_end", "stock", "client", "requests", "requested_shares", "purchases",
               "purchased_shares"]
    watched = [tuple(r) for r in spark.read.parquet(str(out / "windows")).select(*columns).collect()]
    batch = [tuple(r) for r in volume_windows(spark.read.format("tape").load(str(tmp_path / "j")), WINDOW)
             .select(*columns).collect()]
    last_stamp = max(r[1] for r in batch)
    closed = sorted(r for r in batch if r[1] < last_stamp)  # (the last window is still open to a stream)
    assert len(watched) == len(set(watched)) and sorted(watched) == closed and len(closed) > 5

    alerts = spark.read.parquet(str(out / "findings")).where("kind = 'alert'")
    found = sorted(tuple(r) for r in alerts.select("seq", "purchase_seq", "purchase_id", "order_id", "requested",
                                                   "cumulative").collect())
    delivered = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    assert found == sorted((a["emit_seq"], a["purchase_seq"], a["purchase_id"], a["order_id"], a["requested"],
                            a["cumulative"]) for a in delivered)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (make sysdeps installs it)")
def test_the_live_view_in_a_terminal_shows_the_most_active_stocks_as_the_log_grows(run_dir, tmp_path):
    """In a real terminal (tmux): a window of stocks and clients appears, and the seq read goes on
    rising as the log's commit mark does; ^C ends it."""
    journal = recut(run_dir / "journal" / "seq-a", tmp_path / "j")
    n = journal.last_seq
    journal.mark_committed(n // 2)
    session = f"tape-watch-{time.monotonic_ns()}"
    command = shlex.join(TAPE + ["watch", "--journal", str(tmp_path / "j"), "--out", str(tmp_path / "out"),
                               "--window", WINDOW, "--follow"])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "50", command], check=True)
    screen = lambda: subprocess.run(["tmux", "capture-pane", "-p", "-J", "-t", session],  # noqa: E731
                                    capture_output=True, text=True).stdout
    try:
        wait_for(lambda: "most active stocks" in screen() and f"committed {n // 2:,}" in screen(), timeout=120,
                 what="the first windows on the screen")
        assert "purchased shares" in screen() and any(s in screen() for s in ("AAPL", "GOOG", "MSFT"))
        journal.mark_committed(n)
        wait_for(lambda: f"read through seq {n:,}" in screen(), timeout=60, what="the screen at the log's end")
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        wait_for(lambda: "windows and findings:" in screen() or subprocess.run(
            ["tmux", "has-session", "-t", session], capture_output=True).returncode != 0, timeout=60,
            what="the watch to end on ^C")
    finally:
        print(screen())  # (what the terminal showed last, for a failure's report)
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_the_live_audit_follows_the_log_and_reports_a_deleted_and_a_forged_alert(run_dir, tmp_path):
    """`tape audit --follow`: alerts delivered ahead of the committed log are pending, not findings;
    once it has read the whole log nothing is found; then a delivered alert deleted from the
    emitter's file and a forged one appended are reported, each by its id."""
    journal = recut(run_dir / "journal" / "seq-a", tmp_path / "j")
    n = journal.last_seq
    journal.mark_committed(n // 2)
    alerts = tmp_path / "alerts.jsonl"
    lines = (run_dir / "alerts.jsonl").read_text().splitlines(keepends=True)
    alerts.write_text("".join(lines))
    report = tmp_path / "report.json"
    proc = subprocess.Popen(TAPE + ["audit", "--follow", "--journal", str(tmp_path / "j"), "--alerts", str(alerts),
                                    "--out", str(tmp_path / "audit"), "--report", str(report)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def said():
        return json.loads(report.read_text()) if report.exists() else {}

    def counts():
        return {k: said().get(k, {}).get("count") for k in ("missing", "duplicate", "unexpected", "mismatched")}

    try:
        wait_for(lambda: said().get("read_through_seq") == n // 2, timeout=120, what="the audit at the mark")
        assert said()["findings"] == 0 and 0 < said()["expected"] < said()["delivered"] == len(lines)
        journal.mark_committed(n)
        wait_for(lambda: said().get("read_through_seq") == n, timeout=60, what="the audit at the log's end")
        assert said()["findings"] == 0 and said()["expected"] == said()["delivered"] == len(lines)
        deleted = json.loads(lines[len(lines) // 2])
        forged = {**json.loads(lines[1]), "alert_id": "TAPE:999999999", "purchase_seq": 3}
        alerts.write_text("".join(lines[:len(lines) // 2] + lines[len(lines) // 2 + 1:]) + json.dumps(forged) + "\n")
        wait_for(lambda: counts() == {"missing": 1, "duplicate": 0, "unexpected": 1, "mismatched": 0}, timeout=30,
                 what="the deleted and the forged alert found")
        assert said()["missing"]["first"] == [deleted["alert_id"]]
        assert said()["unexpected"]["first"] == ["TAPE:999999999"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
