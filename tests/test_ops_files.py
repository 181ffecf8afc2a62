"""The shipped operations files refer to what the code really exports and runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def exported_metrics(data: Path) -> set[str]:
    """Every metric family the four role runtimes serve, read from their real collectors."""
    from tape.replicas.emitter_shell import Emitter
    from tape.replicas.replica_shell import Replica
    from tape.rewinder.rewinder_shell import Rewinder
    from tape.runtime.config import default
    from tape.runtime.metrics import FunctionCollector
    from tape.sequencer.sequencer_shell import Sequencer

    cfg = default(data)
    cfg.nodes += [type(cfg.nodes[0])("replica-A", "replica", data=str(data / "replica-A")),
                  type(cfg.nodes[0])("emitter", "emitter", data=str(data / "emitter"), alert_port=1,
                                     sinks=["jsonl", "webhook"], webhook_url="http://127.0.0.1:9/")]
    runtimes = [Sequencer(cfg, cfg.node("seq-a")), Rewinder(cfg, cfg.node("rw-1")), Replica(cfg, cfg.node("replica-A")),
                Emitter(cfg, cfg.node("emitter"))]
    names = set()
    for r in runtimes:
        for family in FunctionCollector(r.METRICS_PREFIX, r.name, r.report).collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
            names.update(family.name + s for s in suffixes)
    return names


def test_every_metric_in_the_alert_rules_is_exported(tmp_path):
    rules = (ROOT / "ops" / "prometheus" / "tape-alerts.yml").read_text()
    used = set(re.findall(r"\btape_[a-z_]+", rules))
    exported = exported_metrics(tmp_path)
    assert used and used <= exported, sorted(used - exported)
    assert "tape_sequencer_leader" in exported and "tape_emitter_divergences_total" in exported


def test_every_alert_links_to_a_runbook_section_that_exists():
    rules = (ROOT / "ops" / "prometheus" / "tape-alerts.yml").read_text()
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = re.findall(r"runbook\.md#([\w-]+)", rules)
    assert len(anchors) >= 10
    for a in anchors:
        assert f'<a id="{a}"></a>' in runbook, a


def test_systemd_units_run_real_subcommands():
    from tape.ops.cli.main import build_parser

    parser = build_parser()
    for unit in (ROOT / "ops" / "systemd").glob("tape-*@.service"):
        line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
        args = line.split()[1:]
        parsed = parser.parse_args(args)  # exits on an unknown subcommand or option
        assert parsed.node == "%i" and parsed.config == "%d/cluster.toml", unit.name  # the credential
        assert "LoadCredential=cluster.toml:/etc/tape/cluster.toml" in unit.read_text().splitlines()


def test_every_unit_is_hardened_alike():
    """The four units differ only in their role: one hardening, reviewed once."""
    units = sorted((ROOT / "ops" / "systemd").glob("tape-*@.service"))
    roles = [u.name.removeprefix("tape-").removesuffix("@.service") for u in units]
    texts = {u.read_text().replace(role, "ROLE").replace(role.capitalize(), "ROLE") for u, role in zip(units, roles)}
    assert sorted(roles) == ["emitter", "replica", "rewinder", "sequencer"] and len(texts) == 1


def test_every_grafana_query_names_a_metric_the_processes_export(tmp_path):
    import json

    dashboard = json.loads((ROOT / "ops" / "grafana" / "tape.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"\btape_[a-z_]+", e)}
    exported = exported_metrics(tmp_path)
    assert len(exprs) >= 20 and used <= exported, sorted(used - exported)
    assert "tape_replica_latency_seconds_bucket" in used and "tape_emitter_divergences_total" in used
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    provisioning = (ROOT / "ops" / "grafana" / "provisioning" / "dashboards" / "tape.yml").read_text()
    assert "/var/lib/grafana/dashboards/tape" in provisioning


def test_the_runbook_says_who_must_reach_every_port_a_node_listens_on():
    from tape.ops.cli.config_check import PORTS

    runbook = (ROOT / "docs" / "runbook.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)`[^|]* \| ([^|]+) \|", runbook, re.M))
    assert set(PORTS) <= set(rows), sorted(set(PORTS) - set(rows))


def test_the_runbooks_key_reference_is_the_schemas():
    from tape.ops.cli.config_keys import key_reference

    runbook = (ROOT / "docs" / "runbook.md").read_text()
    shown = runbook.split("<!-- tape config keys -->\n", 1)[1].split("<!-- /tape config keys -->", 1)[0]
    assert shown == key_reference()


def test_every_key_a_generated_config_writes_is_in_the_schema_and_any_other_is_refused():
    import tomllib

    from tape.runtime.config import ConfigError, default_toml, new_keys, parse
    from tape.runtime.settings import KEYS

    doc = tomllib.loads(default_toml("/x", replicas=3, sequencers=2, keys=new_keys(2), hosts=["10.9.0.1"]))
    written = {("node", k) for n in doc["node"] for k in n} | {("client", k) for c in doc["client"] for k in c}
    written |= {(s, k) for s in ("stream", "journal", "keys") for k in doc[s]}
    assert all(k in KEYS[s] for s, k in written), sorted((s, k) for s, k in written if k not in KEYS[s])
    for section, table in (("stream", doc["stream"]), ("node[0].", doc["node"][0]), ("client[1].", doc["client"][1])):
        table["electoin_ms"] = 300  # a typo
        with pytest.raises(ConfigError, match=r"electoin_ms: unknown key \(known: "):
            parse(doc)
        del table["electoin_ms"]
    parse(doc)
