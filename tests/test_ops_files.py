"""The shipped operations files refer to what the code really exports and runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def exported_metrics() -> set[str]:
    """Every metric name a node serves: its prefix plus each reported name (+ _total for counters)."""
    names = set()
    for src in (ROOT / "tape").rglob("*.py"):
        text = src.read_text()
        prefix = re.search(r'metrics\.serve\([^,]+, "(tape_\w+)"', text)
        if not prefix:
            continue
        for name, kind in re.findall(r'yield "(\w+)", "(counter|gauge)"', text):
            names.add(f"{prefix.group(1)}_{name}" + ("_total" if kind == "counter" else ""))
    return names


def test_every_metric_in_the_alert_rules_is_exported():
    rules = (ROOT / "ops" / "prometheus" / "tape-alerts.yml").read_text()
    used = set(re.findall(r"\btape_[a-z_]+", rules))
    exported = exported_metrics()
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
    from tape.ops.cli import build_parser

    parser = build_parser()
    for unit in (ROOT / "ops" / "systemd").glob("tape-*@.service"):
        line = next(l for l in unit.read_text().splitlines() if l.startswith("ExecStart="))
        args = line.split()[1:]
        parsed = parser.parse_args(args)  # exits on an unknown subcommand or option
        assert parsed.node == "%i" and parsed.config == "/etc/tape/cluster.toml", unit.name
