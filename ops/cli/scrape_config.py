"""The Prometheus scrape config for a cluster config: one target a node (its host and
metrics_port), labelled with its node and role, which the alert rules read (`up{role=...}`)."""

from __future__ import annotations

import json

from tape.runtime.settings import ROLES, Config

SCRAPE_INTERVAL_S = 5


def scrape_config(cfg: Config, rules: str = "tape-alerts.yml", interval_s: float = SCRAPE_INTERVAL_S) -> str:
    """prometheus.yml for `cfg`, loading the alert rules from `rules` (relative to this file, as
    Prometheus reads it). honor_labels: a node's samples carry its own `node` label, the same
    as its target's, and must not be renamed to exported_node."""
    q = json.dumps  # a JSON string is a YAML string, quoted
    lines = [
        "# Written by `tape config prometheus FILE` for that cluster config: one target a node.",
        "global:",
        f"  scrape_interval: {interval_s:g}s",
        f"  evaluation_interval: {interval_s:g}s",
        "",
        "rule_files:",
        f"  - {q(rules)}",
        "",
        "scrape_configs:",
        "  - job_name: tape",
        "    honor_labels: true",
        "    static_configs:",
    ]
    for role in ROLES:
        for node in cfg.by_role(role):
            if node.metrics_port:
                lines += [f"      - targets: [{q(f'{node.metrics_address}:{node.metrics_port}')}]",
                          f"        labels: {{node: {q(node.name)}, role: {role}}}"]
    return "\n".join(lines) + "\n"
