"""Cluster configuration: one TOML file, or the embedded loopback default.

    session = "TAPE"
    [stream]    group, port, interface, max_packet, heartbeat_ms, tick_ms
    [journal]   fsync ("batch" | "never" | ms), segment_mb
    [timeouts]  client_resend_ms, gap_request_ms, election_ms (minimum election
                timeout; each wait is drawn from [election_ms, 2 x election_ms]),
                leader_heartbeat_ms
    [audit]     book_ttl_s, orphan_ttl_s, snapshot_every, snapshot_ms
    [[node]]    name, role ("sequencer" | "rewinder" | "replica" | "emitter"),
                host, data, metrics_port (0 = none); sequencer: inbound_port,
                replication_port; rewinder: replication_port, gapfill_port,
                replay_port; emitter: alert_port, sinks (["jsonl", "webhook",
                "stdout"]; default ["jsonl"]), webhook_url, webhook_timeout_ms
    [[client]]  name, key (hex HMAC-SHA256 key, optional)

Every problem raises ConfigError naming the key.
"""

from __future__ import annotations

import ipaddress
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tape.protocol import moldudp64
from tape.transport import free_port


class ConfigError(ValueError):
    pass


SINKS = ("jsonl", "webhook", "stdout")


@dataclass
class Node:
    name: str
    role: str
    host: str
    data: str
    inbound_port: int = 0
    replication_port: int = 0
    gapfill_port: int = 0
    replay_port: int = 0
    metrics_port: int = 0
    alert_port: int = 0
    sinks: list[str] = field(default_factory=lambda: ["jsonl"])
    webhook_url: str = ""
    webhook_timeout_ms: int = 5000

    @property
    def wire_name(self) -> bytes:
        return moldudp64.session_bytes(self.name)


@dataclass
class Client:
    name: str
    key: bytes | None = None


@dataclass
class Config:
    session: str
    group: str
    port: int
    interface: str = "127.0.0.1"
    max_packet: int = 1400
    heartbeat_ms: int = 1000
    tick_ms: int = 1000
    fsync: str | float = "batch"
    segment_mb: int = 64
    client_resend_ms: int = 50
    gap_request_ms: int = 20
    election_ms: int = 300
    leader_heartbeat_ms: int = 50
    book_ttl_s: float = 3600.0
    orphan_ttl_s: float = 10.0
    snapshot_every: int = 100_000
    snapshot_ms: int = 1000
    nodes: list[Node] = field(default_factory=list)
    clients: list[Client] = field(default_factory=list)

    @property
    def session_bytes(self) -> bytes:
        return moldudp64.session_bytes(self.session)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"node: no node named {name!r} (have {', '.join(n.name for n in self.nodes)})")

    def by_role(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role]

    @property
    def voters(self) -> list[Node]:
        return [n for n in self.nodes if n.role in ("sequencer", "rewinder")]

    def open_journal(self, node: Node):
        """The node's journal, with this cluster's session and journal settings."""
        from tape.journal.store import Journal

        return Journal(Path(node.data) / "journal", self.session_bytes, fsync=self.fsync,
                       segment_bytes=self.segment_mb << 20)

    def client(self, name: str) -> Client:
        for c in self.clients:
            if c.name == name:
                return c
        raise ConfigError(f"client: no client named {name!r}")


def _get(table: dict, key: str, kind, where: str, default=None, required=False):
    if key not in table:
        if required:
            raise ConfigError(f"{where}{key}: missing")
        return default
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _port(table, key, where, required=False) -> int:
    value = _get(table, key, int, where, 0, required)
    if not 0 <= value <= 65535:
        raise ConfigError(f"{where}{key}: port {value} outside 0..65535")
    return value


def parse(doc: dict, base: Path | None = None) -> Config:
    known = {"session", "stream", "journal", "timeouts", "audit", "node", "client"}
    for key in doc:
        if key not in known:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(sorted(known))})")
    session = _get(doc, "session", str, "", "TAPE")
    try:
        moldudp64.session_bytes(session)
    except Exception:
        raise ConfigError(f"session: {session!r} must be 1-10 printable ASCII characters") from None
    stream = _get(doc, "stream", dict, "", {})
    group = _get(stream, "group", str, "stream.", required=True)
    try:
        if not ipaddress.IPv4Address(group).is_multicast:
            raise ConfigError(f"stream.group: {group} is not a multicast address")
    except ipaddress.AddressValueError:
        raise ConfigError(f"stream.group: {group!r} is not an IPv4 address") from None
    cfg = Config(
        session=session,
        group=group,
        port=_port(stream, "port", "stream.", required=True),
        interface=_get(stream, "interface", str, "stream.", "127.0.0.1"),
        max_packet=_get(stream, "max_packet", int, "stream.", 1400),
        heartbeat_ms=_get(stream, "heartbeat_ms", int, "stream.", 1000),
        tick_ms=_get(stream, "tick_ms", int, "stream.", 1000),
    )
    if not 120 <= cfg.max_packet <= 65507:
        raise ConfigError(f"stream.max_packet: {cfg.max_packet} outside 120..65507")
    journal = _get(doc, "journal", dict, "", {})
    cfg.fsync = journal.get("fsync", "batch")
    if cfg.fsync not in ("batch", "never") and not (isinstance(cfg.fsync, (int, float)) and cfg.fsync >= 0):
        raise ConfigError(f"journal.fsync: {cfg.fsync!r}: use \"batch\", \"never\" or milliseconds")
    cfg.segment_mb = _get(journal, "segment_mb", int, "journal.", 64)
    timeouts = _get(doc, "timeouts", dict, "", {})
    cfg.client_resend_ms = _get(timeouts, "client_resend_ms", int, "timeouts.", 50)
    cfg.gap_request_ms = _get(timeouts, "gap_request_ms", int, "timeouts.", 20)
    cfg.election_ms = _get(timeouts, "election_ms", int, "timeouts.", 300)
    cfg.leader_heartbeat_ms = _get(timeouts, "leader_heartbeat_ms", int, "timeouts.", 50)
    if not 0 < cfg.leader_heartbeat_ms * 3 <= cfg.election_ms:
        raise ConfigError("timeouts.leader_heartbeat_ms: must be positive and at most a third of timeouts.election_ms")
    audit = _get(doc, "audit", dict, "", {})
    cfg.book_ttl_s = _get(audit, "book_ttl_s", float, "audit.", 3600.0)
    cfg.orphan_ttl_s = _get(audit, "orphan_ttl_s", float, "audit.", 10.0)
    cfg.snapshot_every = _get(audit, "snapshot_every", int, "audit.", 100_000)
    cfg.snapshot_ms = _get(audit, "snapshot_ms", int, "audit.", 1000)
    if cfg.book_ttl_s <= 0 or cfg.orphan_ttl_s <= 0:
        raise ConfigError("audit.book_ttl_s / audit.orphan_ttl_s: must be positive")
    names = set()
    for i, n in enumerate(_get(doc, "node", list, "", [])):
        where = f"node[{i}]."
        name = _get(n, "name", str, where, required=True)
        role = _get(n, "role", str, where, required=True)
        if role not in ("sequencer", "rewinder", "replica", "emitter"):
            raise ConfigError(f"{where}role: {role!r} is not sequencer, rewinder, replica or emitter")
        if name in names:
            raise ConfigError(f"{where}name: {name!r} appears twice")
        names.add(name)
        data = _get(n, "data", str, where, f"data/{name}")
        if base is not None and not Path(data).is_absolute():
            data = str(base / data)
        node = Node(name, role, _get(n, "host", str, where, "127.0.0.1"), data,
                    metrics_port=_port(n, "metrics_port", where))
        if role in ("sequencer", "rewinder"):
            node.replication_port = _port(n, "replication_port", where, required=True)
        if role == "sequencer":
            node.inbound_port = _port(n, "inbound_port", where, required=True)
        elif role == "rewinder":
            node.gapfill_port = _port(n, "gapfill_port", where, required=True)
            node.replay_port = _port(n, "replay_port", where, required=True)
        elif role == "emitter":
            node.alert_port = _port(n, "alert_port", where, required=True)
            node.sinks = _get(n, "sinks", list, where, ["jsonl"])
            unknown = [k for k in node.sinks if k not in SINKS]
            if unknown or not node.sinks or len(set(node.sinks)) != len(node.sinks):
                raise ConfigError(f"{where}sinks: {node.sinks!r}: a list of distinct sinks from {', '.join(SINKS)}")
            node.webhook_url = _get(n, "webhook_url", str, where, "")
            node.webhook_timeout_ms = _get(n, "webhook_timeout_ms", int, where, 5000)
            if "webhook" in node.sinks and not node.webhook_url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}webhook_url: the webhook sink needs an http:// or https:// URL")
        cfg.nodes.append(node)
    if not cfg.by_role("sequencer"):
        raise ConfigError("node: at least one node with role = \"sequencer\" is needed")
    for i, c in enumerate(_get(doc, "client", list, "", [])):
        where = f"client[{i}]."
        name = _get(c, "name", str, where, required=True)
        key = _get(c, "key", str, where)
        try:
            moldudp64.session_bytes(name)
            cfg.clients.append(Client(name, bytes.fromhex(key) if key else None))
        except ValueError:
            raise ConfigError(f"{where}: client name {name!r} (1-10 ASCII) or key (hex) is malformed") from None
    if not cfg.clients:
        raise ConfigError("client: at least one [[client]] is needed")
    return cfg


def load(path: str | Path | None, data_dir: str | Path = ".") -> Config:
    """The config at `path`, or the embedded loopback default."""
    if path is None:
        return default(data_dir)
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse(doc, path.parent)


DEFAULT_GROUP = "239.77.0.1"
DEFAULT_BASE_PORT = 31400


def default_toml(data_dir: str | Path = ".", rewinders: int = 2, clients: int = 2, free: bool = False,
                 seed: int | None = None, replicas: int = 0, sequencers: int = 1) -> str:
    """The embedded default: `sequencers` sequencers (seq-a, and seq-b as the
    standby) and `rewinders` rewinders on loopback. Fixed ports and group, so that separate processes agree; with
    `free`, free ports and a random group (tests, parallel runs)."""
    if free:
        rng = random.Random(seed)
        group = f"239.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}"
        taken: set[int] = set()

        def port() -> int:  # free now, and not already given to another node of this config
            while (p := free_port()) in taken:
                pass
            taken.add(p)
            return p
    else:
        group = DEFAULT_GROUP
        counter = iter(range(DEFAULT_BASE_PORT, DEFAULT_BASE_PORT + 100))
        port = lambda: next(counter)  # noqa: E731
    data = Path(data_dir)
    lines = [
        'session = "TAPE"',
        f'[stream]\ngroup = "{group}"\nport = {port()}\ninterface = "127.0.0.1"\nheartbeat_ms = 200\ntick_ms = 1000',
        '[journal]\nfsync = "batch"',
    ]
    for name in ("seq-a", "seq-b", "seq-c")[:sequencers]:
        lines.append(f'[[node]]\nname = "{name}"\nrole = "sequencer"\ndata = "{data / name}"\n'
                     f'inbound_port = {port()}\nreplication_port = {port()}\nmetrics_port = {port()}')
    for i in range(1, rewinders + 1):
        lines.append(
            f'[[node]]\nname = "rw-{i}"\nrole = "rewinder"\ndata = "{data / f"rw-{i}"}"\n'
            f'replication_port = {port()}\ngapfill_port = {port()}\nreplay_port = {port()}\n'
            f'metrics_port = {port()}')
    for name in "ABCDEFGH"[:replicas]:
        lines.append(f'[[node]]\nname = "replica-{name}"\nrole = "replica"\ndata = "{data / f"replica-{name}"}"\n'
                     f'metrics_port = {port()}')
    if replicas:
        lines.append(f'[[node]]\nname = "emitter"\nrole = "emitter"\ndata = "{data / "emitter"}"\n'
                     f'alert_port = {port()}\nmetrics_port = {port()}')
    for i in range(clients):
        lines.append(f'[[client]]\nname = "load{i}"')
    return "\n\n".join(lines) + "\n"


def default(data_dir: str | Path = ".") -> Config:
    return parse(tomllib.loads(default_toml(data_dir, sequencers=2)))
