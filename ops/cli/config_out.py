"""`tape config --hosts A,B,... --out DIR`: one config file a host, holding only the keys that
host's nodes and clients need (runtime/config.py keys_of_host), each written owner-only (0600)
and atomically, and the Prometheus scrape config of the same cluster."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tape.ops.cli.config_check import fingerprint, named_keys
from tape.ops.cli.scrape_config import scrape_config
from tape.runtime.config import default_toml, keys_of_host, node_names, parse, place


def host_texts(hosts: list[str], keys: dict | None, data: str, sequencers: int, rewinders: int, replicas: int,
               clients: int) -> dict[str, str]:
    """{host: its config}: the same cluster (fixed ports, one placement) in every file, its keys cut to the host's."""
    where = place(hosts, node_names(sequencers, rewinders, replicas, clients))
    texts = {}
    for host in dict.fromkeys(hosts):
        here = {name for name, at in where.items() if at == host}
        texts[host] = default_toml(data, rewinders, clients, replicas=replicas, sequencers=sequencers, hosts=hosts,
                                   keys=keys_of_host(keys, here, list(where)) if keys else None)
    return texts


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """`text` at `path`, with `mode` from its first byte, whole or not at all (a reader never sees half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_host_configs(out: Path, texts: dict[str, str], say=print) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for host, text in texts.items():
        write_atomic(out / f"{host}.toml", text)
        cfg = parse(tomllib.loads(text))
        nodes = [n.name for n in cfg.nodes if n.host == host] + [c.name for c in cfg.clients if c.interface == host]
        keys = ", ".join(f"{name} {fingerprint(k)}" for name, k in named_keys(cfg)) or "none"
        say(f"{out / f'{host}.toml'}: {', '.join(nodes) or 'no node'}; keys {keys}")
    scrape = scrape_config(parse(tomllib.loads(next(iter(texts.values())))))
    write_atomic(out / "prometheus.yml", scrape, 0o644)  # no key in it; Prometheus's own user reads it
    say(f"{out / 'prometheus.yml'}: the scrape config (beside ops/prometheus/tape-alerts.yml)")
    return 0
