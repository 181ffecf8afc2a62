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


def on_cluster(master: str, python: str, *args: str) -> subprocess.CompletedProcess:
    """A tape Spark command on `master`, its executors running `python`, with shuffle partitions
    sized to the one two-core worker (as docs/runbook.md says to size them)."""
    env = {**os.environ, "PYSPARK_PYTHON": python}
    return subprocess.run(TAPE + list(args) + ["--master", master, "--conf", "spark.sql.shuffle.partitions=4"],
                          capture_output=True, text=True, timeout=600, env=env)


def without(report: dict, *keys: str) -> dict:
    """The report as its JSON file holds it, less the keys that differ between runs."""
    return {k: v for k, v in json.loads(json.dumps(report)).items() if k not in keys}


def test_audit_analytics_and_export_on_a_standalone_cluster_whose_workers_lack_tape(standalone, worker_python, run_dir,
                                                                        spark, tmp_path):
    """The commands on the cluster give what the same functions give in this process (local[2])."""
    from tape.ops.analytics import compute
    from tape.ops.config import load
    from tape.ops.spark import reconcile

    cfg = load(None)
    ttls = int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9)
    journal, alerts = str(run_dir / "journal" / "seq-a"), str(run_dir / "alerts.jsonl")
    local = without(reconcile(spark, journal, alerts, cfg.session, *ttls))
    assert local["findings"] == 0 and local["expected"] > 10
    done = on_cluster(standalone, worker_python, "audit", "--journal", journal, "--alerts", alerts, "--report",
                      str(tmp_path / "audit.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert without(json.loads((tmp_path / "audit.json").read_text()), "seconds") == local

    exported = tmp_path / "parquet"
    done = on_cluster(standalone, worker_python, "journal", "export", journal, "--out", str(exported))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert without(reconcile(spark, str(exported), alerts, cfg.session, *ttls)) == local

    out = tmp_path / "analytics"
    done = on_cluster(standalone, worker_python, "analytics", "--journal", journal, "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert without(json.loads((out / "analytics.json").read_text()), "seconds") == without(
        compute(spark, journal, *ttls))
