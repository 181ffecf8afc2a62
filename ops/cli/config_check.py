"""`tape config check FILE`: is this config valid, and valid on this host?

The same file is copied to every host. It must parse; no two nodes on one host may share a
port; a cluster-wide [stream] interface given as an address cannot be every host's. Then, for
each node that lives here (its host is one of this host's addresses, or it is named with
--node), the address it binds and its multicast interface must exist here."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tape.runtime import interfaces
from tape.runtime.config import ConfigError, load

PORTS = ("inbound_port", "replication_port", "gapfill_port", "replay_port", "alert_port", "metrics_port")


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
        here = n.name == node if node else (n.host not in ("", "0.0.0.0") and interfaces.is_local(n.host))
        verdict = "elsewhere"
        if here:
            verdict = "[green]ok[/green]"
            if not interfaces.is_local(n.host):
                problems.append(f"{n.name}: host {n.host} is not an address of this host")
                verdict = "[red]host missing[/red]"
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
    for p in problems:
        console.print(f"[red]problem:[/red] {escape(p)}")
    if not problems:
        console.print("config ok here")
    return 2 if problems else 0
