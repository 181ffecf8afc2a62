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
from conftest import TAPE, wait_for

from tape.node.transport import free_port

pytestmark = [pytest.mark.spark, pytest.mark.process]
SPARK_HOME = Path(__import__("pyspark").__file__).parent


@pytest.fixture(scope="module")
def worker_python(tmp_path_factory):
    """A Python with pyarrow and without Tape: what a cluster's workers have."""
    venv = tmp_path_factory.mktemp("worker") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "pyarrow"], check=True, capture_output=True,
                   timeout=600)
    assert subprocess.run([str(python), "-c", "import tape"], capture_output=True).returncode == 1
    return str(python)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """spark://127.0.0.1:PORT: a master and a one-core worker, killed (with their process groups) after."""
    logs = tmp_path_factory.mktemp("standalone")
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
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
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def tape(*args: str, python: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PYSPARK_PYTHON": python} if python else {})}
    return subprocess.run(TAPE + list(args), capture_output=True, text=True, timeout=600, env=env)


def test_audit_analytics_and_export_on_a_standalone_cluster_whose_workers_lack_tape(standalone, worker_python, run_dir,
                                                                        tmp_path):
    journal, alerts = str(run_dir / "journal" / "seq-a"), str(run_dir / "alerts.jsonl")
    reports = {}
    for master, python in (("local[2]", None), (standalone, worker_python)):
        report = tmp_path / f"{master.split(':')[0]}.json"
        done = tape("audit", "--journal", journal, "--alerts", alerts, "--master", master, "--report", str(report),
                    python=python)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        reports[master] = {k: v for k, v in json.loads(report.read_text()).items() if k != "seconds"}
    local, remote = reports.values()
    assert remote == local and local["findings"] == 0 and local["expected"] > 10
    exported = tmp_path / "parquet"
    done = tape("journal", "export", journal, "--out", str(exported), "--master", standalone, python=worker_python)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = tape("audit", "--journal", str(exported), "--alerts", alerts, "--master", "local[2]", "--report",
                 str(tmp_path / "parquet.json"))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    charts = {}
    for master, python in (("local[2]", None), (standalone, worker_python)):
        out = tmp_path / f"analytics-{master.split(':')[0]}"
        done = tape("analytics", "--journal", journal, "--out", str(out), "--master", master, python=python)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        charts[master] = {k: v for k, v in json.loads((out / "analytics.json").read_text()).items() if k != "seconds"}
    assert charts[standalone] == charts["local[2]"]
    assert {k: v for k, v in json.loads((tmp_path / "parquet.json").read_text()).items() if k != "seconds"} == local
