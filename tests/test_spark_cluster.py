"""Spark beyond one machine (issue 14): a standalone master and a worker started from PySpark's
own scripts, whose executors run a Python that does not have Tape (only pyarrow): the command
ships Tape to them, and the audit and the export equal the local ones."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TAPE, short_lived_jvm, wait_for

from tape.runtime.udp import free_port

pytestmark = [pytest.mark.spark, pytest.mark.process]
SPARK_HOME = Path(__import__("pyspark").__file__).parent


@pytest.fixture(scope="module")
def worker_python(tmp_path_factory):
    """A Python with pyarrow and without Tape: what a cluster's workers have (pyarrow linked in from
    this environment, as a worker's own install would put it, rather than downloaded again)."""
    import pyarrow

    venv = tmp_path_factory.mktemp("worker") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    installed = Path(pyarrow.__file__).parent
    for part in [installed, *installed.parent.glob("pyarrow-*.dist-info")]:
        (site / part.name).symlink_to(part)
    assert subprocess.run([str(python), "-c", "import pyarrow"], capture_output=True).returncode == 0
    assert subprocess.run([str(python), "-c", "import tape"], capture_output=True).returncode == 1
    return str(python)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """spark://127.0.0.1:PORT: a master and a two-core worker, killed (with their process groups) after."""
    logs = tmp_path_factory.mktemp("standalone")
    env = {**short_lived_jvm(), "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_WORKER_DIR": str(logs / "work")}
    port = free_port()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    procs = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(free_port())],
                              stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)]
    try:
        wait_for(lambda: "I have been elected leader" in (logs / "master.log").read_text(), "the master", 90)
        procs.append(subprocess.Popen([spark_class, "org.apache.spark.deploy.worker.Worker",
                                       f"spark://127.0.0.1:{port}", "--host", "127.0.0.1", "--cores", "2",
                                       "--memory", "2g", "--webui-port", str(free_port())],
                                      stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        wait_for(lambda: "Successfully registered with master" in (logs / "worker.log").read_text(),
                 "the worker to register", 90)
        yield f"spark://127.0.0.1:{port}"
    finally:
        stop(procs)


def on_cluster(master: str, python: str, out: Path, *args: str) -> subprocess.Popen:
    """A tape Spark command started on `master`, its executors running `python`, with shuffle
    partitions sized to the one two-core worker (as docs/runbook.md says to size them) and one of
    its cores: the commands run side by side, as several users' jobs share a cluster (one after
    another they took three minutes of `make test`). Its output goes to `out` and its errors to
    `out` with the suffix .err."""
    env = {**short_lived_jvm(), "PYSPARK_PYTHON": python}
    with open(out, "w") as log, open(out.with_suffix(".err"), "w") as err:
        return subprocess.Popen(TAPE + list(args) + ["--master", master, "--conf", "spark.sql.shuffle.partitions=4",
                                                     "--conf", "spark.cores.max=1"],
                                stdout=log, stderr=err, env=env, start_new_session=True)


def stop(processes: list[subprocess.Popen]) -> None:
    """Kill what is left of processes started in sessions of their own, with their process groups
    (a command's JVM, the master's and the worker's children)."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def without(report: dict, *keys: str) -> dict:
    """The report as its JSON file holds it, less the keys that differ between runs."""
    return {k: v for k, v in json.loads(json.dumps(report)).items() if k not in keys}


def test_audit_analytics_and_export_on_a_standalone_cluster_whose_workers_lack_tape(standalone, worker_python, run_dir,
                                                                        spark, tmp_path):
    """The commands on the cluster give what the same functions give in this process (local[2]):
    the audit of alerts with one missing finds it and exits 1 (test_spark: 0 when all match)."""
    from tape.ops.spark.analytics import compute
    from tape.ops.spark.source import reconcile
    from tape.runtime.config import load

    cfg = load(None, tmp_path / "embedded")
    ttls = int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9)
    journal, alerts = str(run_dir / "journal" / "seq-a"), str(run_dir / "alerts.jsonl")
    first, *rest = Path(alerts).read_text().splitlines()
    one_missing = tmp_path / "one-missing.jsonl"
    one_missing.write_text("\n".join(rest) + "\n")
    exported, out = tmp_path / "parquet", tmp_path / "analytics"
    runs = {"audit": ["audit", "--journal", journal, "--alerts", str(one_missing),
                      "--report", str(tmp_path / "audit.json")],
            "export": ["journal", "export", journal, "--out", str(exported)],
            "analytics": ["analytics", "--journal", journal, "--out", str(out)]}
    logs = {name: tmp_path / f"{name}.log" for name in runs}
    commands = {name: on_cluster(standalone, worker_python, logs[name], *args) for name, args in runs.items()}
    try:
        local = without(reconcile(spark, journal, alerts, cfg.session, *ttls))  # (meanwhile, in this process)
        assert local["findings"] == 0 and local["expected"] > 10
        analysed = without(compute(spark, journal, *ttls))
        codes = {name: command.wait(600) for name, command in commands.items()}
    finally:
        stop(list(commands.values()))
    errors = {name: logs[name].with_suffix(".err").read_text() for name in runs}
    assert codes == {"audit": 1, "export": 0, "analytics": 0}, errors
    assert not any("Traceback" in text for text in errors.values()), errors
    missing = {"count": 1, "first": [json.loads(first)["alert_id"]]}
    assert without(json.loads((tmp_path / "audit.json").read_text()), "seconds") == \
        {**local, "findings": 1, "delivered": local["delivered"] - 1, "missing": missing}
    assert without(reconcile(spark, str(exported), alerts, cfg.session, *ttls)) == local
    assert without(json.loads((out / "analytics.json").read_text()), "seconds") == analysed
    from tape.ops.spark.live import volume_windows  # (tape watch's windows: test_watch compares the two)

    windows = sorted(tuple(r) for r in spark.read.parquet(str(out / "windows")).collect())
    assert windows == sorted(tuple(r) for r in volume_windows(spark.read.format("tape").load(journal)).collect())
    printed = logs["analytics"].read_text()
    assert "volumes per stock" in printed and "fill ratio per order book" in printed and "WARN" not in printed
    page = (out / "index.html").read_text()
    for png in ("rate_per_second.png", "volume_by_stock.png", "fill_ratio.png", "overfill.png", "stamp_gaps.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png in page


def test_the_stream_on_a_standalone_cluster_whose_workers_lack_tape(standalone, worker_python, run_dir, spark,
                                                                    tmp_path):
    """`tape watch` and the live audit with their executors on the cluster: the windows the local
    batch gives, and the emitter's alerts, each once."""
    from tape.ops.spark.live import volume_windows

    journal, alerts = run_dir / "journal" / "seq-a", str(run_dir / "alerts.jsonl")
    runs = {"watch": ["watch", "--journal", str(journal), "--out", str(tmp_path / "watch"), "--window", "1 second"],
            "audit": ["audit", "--journal", str(journal), "--alerts", alerts, "--out", str(tmp_path / "audit"),
                      "--report", str(tmp_path / "audit.json")]}
    logs = {name: tmp_path / f"{name}.log" for name in runs}
    commands = {name: on_cluster(standalone, worker_python, logs[name], *args) for name, args in runs.items()}
    try:
        batch = volume_windows(spark.read.format("tape").load(str(journal)), "1 second")
        batch = [tuple(r) for r in batch.collect()]  # (meanwhile, in this process)
        codes = {name: command.wait(600) for name, command in commands.items()}
    finally:
        stop(list(commands.values()))
    errors = {name: logs[name].with_suffix(".err").read_text() for name in runs}
    assert codes == {"watch": 0, "audit": 0}, errors
    last = max(r[1] for r in batch)
    watched = [tuple(r) for r in spark.read.parquet(str(tmp_path / "watch" / "windows")).drop("batch").collect()]
    assert sorted(watched) == sorted(r for r in batch if r[1] < last)
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["findings"] == 0 and report["expected"] == report["delivered"] == len(Path(alerts).read_text()
                                                                                          .splitlines())
