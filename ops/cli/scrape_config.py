"""The Prometheus scrape config for a cluster config: one target a node (its host and
metrics_port), labelled with its node and role, which the alert rules read (`up{role=...}`)."""

from __future__ import annotations

import json

from tape.runtime.settings import ROLES, Config

SCRAPE_INTERVAL_S = 5


class ScrapeTlsError(ValueError):
    pass


def _tls_lines(cfg: Config, tls: dict[str, str] | None) -> list[str]:
    """A TLS cluster's (`[metrics] certfile`) scheme and tls_config: `tls`, the files on the
    Prometheus host (ca_file: the CA of the nodes' certificates; cert_file, key_file: its own,
    where the nodes ask for one)."""
    if not cfg.certfile:
        return []
    tls = {k: v for k, v in (tls or {}).items() if v}
    needed = ("ca_file", "cert_file", "key_file") if cfg.client_cafile else ("ca_file",)
    if missing := [k for k in needed if k not in tls]:
        flags = " ".join(f"--{m.replace('_', '-')}" for m in missing)
        asks = " and ask for a certificate" if cfg.client_cafile else ""
        raise ScrapeTlsError(f"the nodes serve metrics over TLS{asks}: name Prometheus's {', '.join(missing)} "
                             f"({flags})")
    return ["    scheme: https", "    tls_config:", *(f"      {k}: {json.dumps(v)}" for k, v in sorted(tls.items()))]


def scrape_config(cfg: Config, rules: str = "tape-alerts.yml", interval_s: float = SCRAPE_INTERVAL_S,
                  tls: dict[str, str] | None = None) -> str:
    """prometheus.yml for `cfg`, loading the alert rules from `rules` (relative to this file, as
    Prometheus reads it). honor_labels: a node's samples carry its own `node` label, the same
    as its target's, and must not be renamed to exported_node. `tls`: see _tls_lines."""
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
        *_tls_lines(cfg, tls),
        "    static_configs:",
    ]
    for role in ROLES:
        for node in cfg.by_role(role):
            if node.metrics_port:
                lines += [f"      - targets: [{q(f'{node.metrics_address}:{node.metrics_port}')}]",
                          f"        labels: {{node: {q(node.name)}, role: {role}}}"]
    return "\n".join(lines) + "\n"
