"""`tape node replace NAME`: the one procedure for a voter whose disk failed or was swapped.

The data directory is moved aside (never deleted) and an empty one put in its place. Started
on it, the node finds no election state and recovers it before it votes or follows: it asks
every other voter for its term and log position (protocol/election.py, docs/failover.md), so
it can never vote twice in a term, then the leader catches its journal up."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tape.runtime.settings import Config
from tape.runtime.storage.quarantine import aside_path

VOTER_ROLES = ("sequencer", "rewinder")


def _running(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def replace(cfg: Config, name: str, out) -> int:
    """Move NAME's data directory aside for an empty one; 1 (and why) if it cannot be done safely."""
    try:
        node = cfg.node(name)
    except KeyError:
        print(f"tape node replace: no node {name!r} in the config", file=out)
        return 1
    if node.role not in VOTER_ROLES:
        print(f"tape node replace: {name} is a {node.role}; only voters (sequencers, rewinders) are replaced so "
              f"(docs/runbook.md, 'Replacing a failed node')", file=out)
        return 1
    if _running(node.metrics_address, node.metrics_port):
        print(f"tape node replace: {name} answers on {node.metrics_address}:{node.metrics_port}: stop it first",
              file=out)
        return 1
    data = Path(node.data)
    owner = data.stat() if data.exists() else None
    if owner and any(data.iterdir()):
        aside = aside_path(data, "replaced")
        data.rename(aside)
        print(f"{name}: moved {data} to {aside} (delete it once the node has caught up)", file=out)
    data.mkdir(parents=True, exist_ok=True)
    if owner:  # run as root for a node that runs as its own user: the empty directory must stay the node's
        os.chown(data, owner.st_uid, owner.st_gid)
        data.chmod(owner.st_mode & 0o7777)
    others = ", ".join(v.name for v in cfg.voters if v.name != name)
    print(f"{name}: {data} is empty. Start the node: it recovers its election state from every other voter "
          f"({others}; all must be reachable) before it votes or follows, then catches up from the leader.",
          file=out)
    return 0
