"""`tape config check FILE`: is this config valid, and valid on this host?

The same file is copied to every host. It must parse; no two nodes on one host may share a
port; a cluster-wide [stream] interface given as an address cannot be every host's. Then, for
each node that lives here (its host is one of this host's addresses, or it is named with
--node), the address it binds and its multicast interface must exist here."""

from __future__ import annotations

import hashlib
import ipaddress
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tape.runtime import interfaces
from tape.runtime.config import ConfigError, load

PORTS = ("inbound_port", "replication_port", "gapfill_port", "replay_port", "soup_port", "alert_port", "metrics_port")
FEW_DISTINCT_BYTES = 16  # a random 32-byte key has ~28 distinct bytes; fewer than this looks typed by hand


def fingerprint(key: bytes) -> str:
    """What the tools print of a key: enough to tell two apart, nothing to use."""
    return hashlib.blake2b(key, digest_size=4, person=b"tape-key-fpr").hexdigest()


def named_keys(cfg) -> list[tuple[str, bytes]]:
    keys = [(f"stream[{i}]", k) for i, k in enumerate(cfg.stream_keys)]
    keys += [(f"listeners[{i}]", k) for i, k in enumerate(cfg.listener_keys)]
    keys += [(f"cluster[{i}]", k) for i, k in enumerate(cfg.cluster_keys)]
    keys += [(f"link {a}/{b}[{i}]", k) for (a, b), pair in cfg.link_keys.items() for i, k in enumerate(pair)]
    return keys + [(f"client {c.name}", c.key) for c in cfg.clients if c.key]


def key_warnings(cfg) -> list[str]:
    """What is weak about the config's keys: links left open, keys typed by hand, one key in two roles."""
    out = []
    stream = cfg.stream_keys or cfg.listener_keys  # a client's host holds the listener key alone
    if not stream or not cfg.links_keyed:
        missing = [k for k, held in (("stream", stream), ("cluster or links", cfg.links_keyed)) if not held]
        out.append(f"no [keys] {' and '.join(missing)}: those links are unauthenticated (docs/security.md)")
    if cfg.stream_keys and not cfg.listener_keys and cfg.clients:
        out.append("no [keys] listeners: every client holds the stream key and can seal packets the replicas "
                   "take (tape config makes a listener key; docs/security.md)")
    out += [f"client {c.name} has no key: the sequencers take its batches unauthenticated"
            for c in cfg.clients if not c.key]
    seen: dict[bytes, str] = {}
    for name, key in named_keys(cfg):
        if len(set(key)) < FEW_DISTINCT_BYTES:
            out.append(f"{name} ({fingerprint(key)}) has {len(set(key))} distinct bytes: not random (tape config "
                       f"makes keys)")
        if (other := seen.setdefault(key, name)) != name:
            out.append(f"{name} is the same key as {other} ({fingerprint(key)}): one key, one role")
    return out


def durability_warnings(cfg) -> list[str]:
    """Voters that share a host (one power supply) under durability "replicated": one power loss
    takes the unflushed writes of them all, which a committed record may need (docs/failover.md)."""
    if cfg.durability != "replicated":
        return []
    by_host: dict[str, list[str]] = {}
    for v in cfg.voters:
        by_host.setdefault(v.host, []).append(v.name)
    return [f"durability \"replicated\" with voters {', '.join(names)} on one host ({host}): one power loss "
            f"takes what none of them flushed yet, which a committed record may need; give each voter a host, or "
            f"use durability = \"flush\" (docs/failover.md)" for host, names in by_host.items() if len(names) > 1]


def file_warnings(path: Path, cfg) -> list[str]:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077 and named_keys(cfg):
        return [f"{path} holds keys and is readable by {'others' if mode & 0o007 else 'its group'} "
                f"(mode {mode:04o}): chmod 600 {path}"]
    return []


def problems_anywhere(cfg) -> list[str]:
    """What is wrong wherever the file is used."""
    out, seen = [], {}
    for n in cfg.nodes:
        for key in PORTS:
            port = getattr(n, key)
            if port:
                other = seen.setdefault((n.host, port), f"{n.name}.{key}")
                if other != f"{n.name}.{key}":
                    out.append(f"{n.name}.{key} = {port} on {n.host} is also {other}")
    hosts = {n.host for n in cfg.nodes if not n.host.startswith("127.")}
    try:
        shared_address = bool(cfg.interface) and not ipaddress.IPv4Address(cfg.interface).is_loopback
    except ValueError:
        shared_address = False  # a name ("eth0") can be every host's
    if shared_address and len(hosts) > 1:
        out.append(f"[stream] interface = {cfg.interface!r} is one host's address, but the nodes live on "
                   f"{len(hosts)} hosts: give each [[node]] its own interface (or use an interface name)")
    return out


def lives_here(node) -> bool:
    """The node's host is one of this host's addresses."""
    return node.host not in ("", "0.0.0.0") and interfaces.is_local(node.host)


def units(path: str, out) -> int:
    """The systemd unit of every node of the config that lives here, one a line (ops/systemd)."""
    try:
        cfg = load(Path(path))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for n in cfg.nodes:
        if lives_here(n):
            print(f"tape-{n.role}@{n.name}.service", file=out)
    return 0


def check(path: str, node: str | None, console: Console) -> int:
    try:
        cfg = load(Path(path))
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {escape(str(e))}")
        return 2
    problems = problems_anywhere(cfg)
    table = Table(title=f"{path} on this host")
    for col in ("node", "role", "host", "interface", "here"):
        table.add_column(col)
    for n in cfg.nodes:
        spec = cfg.interface_of(n)
        here = n.name == node if node else lives_here(n)
        verdict = "elsewhere"
        if here:
            verdict = "[green]ok[/green]"
            if not interfaces.is_local(n.host):
                problems.append(f"{n.name}: host {n.host} is not an address of this host")
                verdict = "[red]host missing[/red]"
            elif n.metrics_host and not interfaces.is_local(n.metrics_host):
                problems.append(f"{n.name}: metrics_host {n.metrics_host} is not an address of this host")
                verdict = "[red]metrics host missing[/red]"
            elif n.role in ("sequencer", "replica"):
                try:
                    verdict = f"[green]ok[/green], multicast on {interfaces.resolve(spec)}"
                except interfaces.InterfaceError as e:
                    problems.append(f"{n.name}: {e}")
                    verdict = "[red]interface missing[/red]"
        table.add_row(n.name, n.role, n.host, spec, verdict)
    console.print(table)
    if node and node not in {n.name for n in cfg.nodes}:
        problems.append(f"no node named {node!r}")
    warnings = file_warnings(Path(path), cfg) + key_warnings(cfg) + durability_warnings(cfg)
    if not node and not any(lives_here(n) for n in cfg.nodes):
        warnings.append("no node of this config lives on this host (is it this host's file?)")
    console.print("keys: " + (", ".join(f"{name} {fingerprint(k)}" for name, k in named_keys(cfg)) or "none"))
    for w in warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
    for p in problems:
        console.print(f"[red]problem:[/red] {escape(p)}")
    if not problems:
        console.print("config ok here")
    return 2 if problems else 0
