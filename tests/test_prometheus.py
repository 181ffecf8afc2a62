"""The alert rules, the scrape config and the dashboard as a real Prometheus reads them: promtool
checks and unit-tests the rules, and a Prometheus server scrapes a live cluster and answers every
alert expression and every Grafana query; killing nodes makes their alerts fire (issue 62)."""

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import TAPE, small_disk, wait_for

from tape.ops.cli.scrape_config import scrape_config
from tape.ops.verification.certs import make_certificates
from tape.ops.verification.faults import fill
from tape.ops.verification.local import LocalCluster, dies_with
from tape.runtime.config import default_toml, load, parse
from tape.runtime.udp import free_port

ROOT = Path(__file__).resolve().parent.parent
RULES_DIR = ROOT / "ops" / "prometheus"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

pytestmark = [pytest.mark.process, pytest.mark.skipif(not (PROMETHEUS and PROMTOOL),
                                                      reason="no prometheus/promtool: make sysdeps installs them")]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60)


def alert_names() -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", (RULES_DIR / "tape-alerts.yml").read_text(), re.M)


def test_promtool_accepts_the_rules_and_the_shipped_scrape_config():
    for args in (("check", "rules", "tape-alerts.yml"), ("check", "config", "prometheus.yml")):
        done = promtool(*args)
        assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_every_alert_has_a_unit_test_that_makes_it_fire():
    done = promtool("test", "rules", "tape-alerts.test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    tests = (RULES_DIR / "tape-alerts.test.yml").read_text()
    fired = set(re.findall(r"alertname: (\w+).*\n\s+eval_time: \S+.*\n\s+exp_alerts:", tests))
    assert len(alert_names()) >= 20 and set(alert_names()) <= fired, sorted(set(alert_names()) - fired)


def test_the_shipped_scrape_config_is_that_of_the_default_cluster():
    cfg = parse(tomllib.loads(default_toml("/var/lib/tape", replicas=3, sequencers=2)))
    assert (RULES_DIR / "prometheus.yml").read_text() == scrape_config(cfg)


# --- a real Prometheus on a live cluster --------------------------------------------------------


class Prometheus:
    """A Prometheus server of the test's own (its own port and storage), scraping every second."""

    def __init__(self, root: Path, cluster: LocalCluster, tls: dict[str, str] | None = None):
        """`tls`: ca_file, cert_file, key_file (`tape config prometheus`'s --ca-file ...)."""
        root.mkdir()
        shutil.copy(RULES_DIR / "tape-alerts.yml", root)
        flags = [a for k, v in (tls or {}).items() for a in (f"--{k.replace('_', '-')}", v)]
        printed = subprocess.run(TAPE + ["config", "prometheus", str(cluster.config_path), *flags],
                                 capture_output=True, text=True, check=True).stdout
        assert printed == scrape_config(cluster.cfg, tls=tls)  # what an operator gets from `tape config prometheus`
        (root / "prometheus.yml").write_text(scrape_config(cluster.cfg, interval_s=1, tls=tls))
        checked = promtool("check", "config", str(root / "prometheus.yml"))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        self.port = free_port()
        self.log = root / "prometheus.log"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), preexec_fn=dies_with(os.getpid()))

    def ready(self) -> bool:
        """Whether it serves queries (503 while its storage opens: an OSError, which wait_for polls past)."""
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5).status == 200

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.load(urllib.request.urlopen(url, timeout=10))
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why in the body
            raise AssertionError(f"{params}: {e.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def wait_scraped(self, nodes: int) -> None:
        """Until every node has been scraped three times in a row (a rate needs two samples)."""
        wait_for(self.ready, "Prometheus to be ready", timeout=60)
        scraped = 'min_over_time(up{job="tape"}[1m]) == 1 and count_over_time(up{job="tape"}[1m]) >= 3'
        wait_for(lambda: len(self.query(scraped)) == nodes, "Prometheus to scrape every node three times", timeout=60)

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def active(self, alert: str) -> set[str]:
        """The nodes (or "" for an alert without one) for which `alert` is pending or firing."""
        return {s["metric"].get("node", "") for s in self.query(f'ALERTS{{alertname="{alert}"}}')}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def signal_of(expr: str) -> str:
    """An alert's expression with each comparison to a number made `bool`: 0 or 1 for every series
    it reads, so it returns series in a healthy run too (proving the metrics and labels exist)."""
    return re.sub(r" (==|!=|>=|<=|>|<) (?=\d)", r" \1 bool ", expr)


def dashboard_queries() -> list[str]:
    dashboard = json.loads((ROOT / "ops" / "grafana" / "tape.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def with_webhook(cluster: LocalCluster, url: str) -> None:
    """The emitter also posts to a webhook: the rules read its sink's counters."""
    text = cluster.config_path.read_text().replace(
        'role = "emitter"', f'role = "emitter"\nsinks = ["jsonl", "webhook"]\nwebhook_url = "{url}"')
    cluster.config_path.write_text(text)
    cluster.cfg = load(cluster.config_path)


def test_a_real_prometheus_answers_every_alert_and_panel_and_fires_on_dead_nodes(tmp_path):
    cluster = LocalCluster(tmp_path, replicas=3, sequencers=2)
    hook_port = free_port()
    with_webhook(cluster, f"http://127.0.0.1:{hook_port}/alerts")
    hook = subprocess.Popen([sys.executable, "-m", "tape.ops.verification.webhook_receiver", "--host", "127.0.0.1",
                             "--port", str(hook_port), "--out", str(tmp_path / "posts.jsonl")],
                            preexec_fn=dies_with(os.getpid()))
    prometheus = None
    try:
        cluster.start_all()
        prometheus = Prometheus(tmp_path / "prometheus", cluster)
        load_proc = cluster.start("load", "load", "--rate", "4000", "--messages", "40000", "--seed", "3")
        prometheus.wait_scraped(len(cluster.cfg.nodes))
        wait_for(lambda: prometheus.query("sum(rate(tape_sequencer_messages_published_total[30s])) > 0"),
                 "a rate of sequenced trades", timeout=60)
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        assert sorted(r["name"] for r in rules) == sorted(alert_names())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        silent = {r["name"]: r["query"] for r in rules if not prometheus.query(signal_of(r["query"]))}
        assert not silent, f"alert expressions that read no series from a live cluster: {silent}"
        empty = [q for q in dashboard_queries() if not prometheus.query(q)]
        assert not empty, f"Grafana queries that return no series from a live cluster: {empty}"
        assert load_proc.wait(timeout=120) == 0, cluster.output("load")

        cluster.kill("rw-2")
        wait_for(lambda: "rw-2" in prometheus.active("TapeRewinderDown"), "TapeRewinderDown for rw-2")
        for s in ("seq-a", "seq-b"):
            cluster.kill(s)
        wait_for(lambda: prometheus.active("TapeNoLeader"), "TapeNoLeader with every sequencer gone")
        assert prometheus.active("TapeSequencerDown") <= {"seq-a", "seq-b"}
        assert not prometheus.active("TapeReplicaDown") and not prometheus.active("TapeEmitterDown")
    finally:
        cluster.close()
        if prometheus:
            prometheus.close()
        hook.kill()
        hook.wait()


def test_a_real_prometheus_fires_the_disk_alert_when_a_voters_disk_fills(tmp_path):
    """rw-1's journal on a 32 MiB tmpfs, filled under load: TapeDiskFull for rw-1, then not once
    the filler is gone."""
    cluster = LocalCluster(tmp_path, sequencers=2)
    data = Path(cluster.cfg.node("rw-1").data)
    data.mkdir(parents=True)
    prometheus = None
    with small_disk(data, "32m") as filler:
        try:
            cluster.start_all()
            prometheus = Prometheus(tmp_path / "prometheus", cluster)
            cluster.start("load", "load", "--rate", "3000", "--messages", "30000", "--seed", "4")
            prometheus.wait_scraped(len(cluster.cfg.nodes))
            assert not prometheus.active("TapeDiskFull")
            fill(filler)
            wait_for(lambda: prometheus.active("TapeDiskFull") == {"rw-1"}, "TapeDiskFull for rw-1")
            filler.unlink()
            wait_for(lambda: not prometheus.active("TapeDiskFull"), "TapeDiskFull to clear once space returns")
        finally:
            cluster.close()
            if prometheus:
                prometheus.close()


def test_a_real_prometheus_scrapes_a_node_over_mutual_tls_and_a_scraper_without_the_certificate_is_refused(
        tmp_path):
    """[metrics] certfile, keyfile, client_cafile, client_auth_required on a real node; Prometheus
    with `tape config prometheus --ca-file --cert-file --key-file`'s scrape config: up, and the
    refusals of plain HTTP and of TLS without a client certificate counted (`reason="tls"`)."""
    certs = tmp_path / "certs"
    make_certificates(certs, ["rw-1"], ip="127.0.0.1")
    make_certificates(certs, ["prometheus"])
    tls = f'certfile = "{certs / "rw-1.pem"}"\nkeyfile = "{certs / "rw-1.key"}"\n' \
          f'client_cafile = "{certs / "ca.pem"}"\nclient_auth_required = true'
    cluster = LocalCluster(tmp_path, rewinders=1, sequencers=1, extra=f"[metrics]\n{tls}\n")
    cluster.metrics_client = ssl.create_default_context(cafile=certs / "ca.pem")
    cluster.metrics_client.load_cert_chain(certs / "prometheus.pem", certs / "prometheus.key")
    port = cluster.cfg.node("rw-1").metrics_port
    prometheus = None
    try:
        cluster.start_node("rw-1")  # returns once it answered over mutual TLS
        with pytest.raises(OSError):  # plain HTTP to it: no answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        with pytest.raises(OSError):  # TLS without a client certificate: refused at the handshake
            urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5,
                                   context=ssl.create_default_context(cafile=certs / "ca.pem")).read()
        files = {"ca_file": str(certs / "ca.pem"), "cert_file": str(certs / "prometheus.pem"),
                 "key_file": str(certs / "prometheus.key")}
        status = [*TAPE, "status", "--config", str(cluster.config_path), "--json"]
        assert subprocess.run(status, capture_output=True, text=True).returncode == 2  # TLS, and no CA named
        flags = ["--ca-file", files["ca_file"], "--cert-file", files["cert_file"], "--key-file", files["key_file"]]
        shown = json.loads(subprocess.run(status + flags, capture_output=True, text=True).stdout)
        assert [n["up"] for n in shown["nodes"] if n["node"] == "rw-1"] == [True]  # `tape status` over mutual TLS
        prometheus = Prometheus(tmp_path / "prometheus", cluster, tls=files)
        prometheus.wait_scraped(1)
        refused = prometheus.query('tape_rewinder_metrics_refused_total{reason="tls"}')
        assert float(refused[0]["value"][1]) >= 2, refused
    finally:
        cluster.close()
        if prometheus:
            prometheus.close()
