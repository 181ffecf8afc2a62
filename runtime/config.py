"""Cluster configuration: one TOML file, or the embedded loopback default.

    session = "TAPE"
    [stream]    group, port, max_packet, seal, heartbeat_ms, tick_ms, batch_interval_ms; interface (one
                multicast interface for every node and client: only where
                every host has it, e.g. loopback or a common interface name)
    [journal]   durability ("flush" | "replicated"), flush_ms, fsync ("batch" | "never" | ms), segment_mb
    [timeouts]  client_resend_ms, gap_request_ms, election_ms (minimum election
                timeout; each wait is drawn from [election_ms, 2 x election_ms]),
                leader_heartbeat_ms
    [audit]     book_ttl_s, orphan_ttl_s, snapshot_every, snapshot_ms,
                books_expected (open books a replica sizes its table for at
                start; 0 = start small and double)
    [[node]]    name, role ("sequencer" | "rewinder" | "replica" | "emitter"),
                host (the address it binds), interface (its host's multicast
                interface: an address or a name like "eth0"; default:
                [stream] interface, else host), data, metrics_port (0 =
                none), metrics_host (default: host); sequencer: inbound_port,
                replication_port; rewinder: replication_port, gapfill_port,
                replay_port; emitter: alert_port, sinks (["jsonl", "webhook",
                "stdout"]; default ["jsonl"]), webhook_url, webhook_timeout_ms,
                webhook_authorization, webhook_secret, delivery ("first" | "quorum"; default "first")
    [metrics]   certfile, keyfile, client_cafile, client_auth_required: HTTPS on
                every metrics endpoint, as prometheus-client's server takes them
    [keys]      stream, listeners, cluster: a hex key, or a list of up to two
                during a rotation (the first signs, either verifies); absent:
                that link is not authenticated (docs/security.md). stream: the
                seal's tag (sequencers, rewinders, replicas); listeners: its
                listener tag, what a client holds instead (it cannot seal)
    [[client]]  name, key (hex HMAC-SHA256 key, optional), interface (as a
                node's; default [stream] interface, else loopback)

Every problem raises ConfigError naming the key.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import random
import secrets
import tomllib
import urllib.parse
from pathlib import Path

from tape.protocol import moldudp64
from tape.protocol.alertlink import DELIVERY
from tape.protocol.limits import MAX_BOOKS_EXPECTED
from tape.protocol.linkauth import pair_key
from tape.protocol.messages import SEQUENCED_BLOCK_SIZE
from tape.protocol.streamauth import BLAKE3_SEALS_FROM, SEALS
from tape.runtime.settings import (
    KEYS,
    ROLES,
    SINKS,
    VOTER_ROLES,
    ClientSettings,
    Config,
    NodeSettings,
    default_of,
    may_link,
    pair_of,
)
from tape.runtime.udp import free_port

MIN_PACKET = 120  # a header and one sequenced block, with room to spare
MIN_KEY_BYTES = 16
# Generated configs pace the leader's batches while messages come fast: their nine processes share a
# machine's cores (or a few hosts'), where a batch's fixed cost decides what a message costs
# (docs/performance.md).
GENERATED_BATCH_INTERVAL_MS = 10
MAX_BATCH_INTERVAL_MS = 100  # a message waits at most this for its batch: more is a mistake, not a setting
MAX_FLUSH_MS = 1000  # durability "replicated": writes wait at most this for the disk
DURABILITIES = ("flush", "replicated")
KEY_BYTES = 32  # what `tape config` generates

__all__ = ["ClientSettings", "Config", "ConfigError", "NodeSettings", "default", "default_toml", "load", "parse"]


class ConfigError(ValueError):
    pass


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


def _opt(table: dict, key: str, kind, where: str):
    """An optional [section] key of Config, defaulting to the schema's default."""
    return _get(table, key, kind, where, default_of(Config, key))


def _positive(cfg: Config, where: str, *keys: str) -> None:
    """Keys that timers wait on or run every fraction of: zero or less would spin them."""
    for key in keys:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{where}{key}: must be positive, not {getattr(cfg, key)}")


def _port(table, key, where, required=False) -> int:
    value = _get(table, key, int, where, 0, required)
    if not 0 <= value <= 65535:
        raise ConfigError(f"{where}{key}: port {value} outside 0..65535")
    return value


def _only_known(table: dict, section: str, where: str, tables: tuple[str, ...] = ()) -> None:
    """A key the schema does not name is refused with its name: a typo is never silently ignored."""
    known = {*KEYS[section], *tables}
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}{key}: unknown key (known: {', '.join(sorted(known))})")


def parse(doc: dict, base: Path | None = None) -> Config:
    _only_known(doc, "", "", tuple(s for s in KEYS if s))
    session = _get(doc, "session", str, "", default_of(Config, "session"))
    try:
        moldudp64.session_bytes(session)
    except Exception:
        raise ConfigError(f"session: {session!r} must be 1-10 printable ASCII characters") from None
    cfg = _parse_stream(_get(doc, "stream", dict, "", {}), session)
    _parse_journal(cfg, _get(doc, "journal", dict, "", {}))
    _parse_timeouts(cfg, _get(doc, "timeouts", dict, "", {}))
    _parse_audit(cfg, _get(doc, "audit", dict, "", {}))
    _parse_keys(cfg, _get(doc, "keys", dict, "", {}))
    _parse_metrics(cfg, _get(doc, "metrics", dict, "", {}), base)
    _parse_replay(cfg, _get(doc, "replay", dict, "", {}), base)
    if cfg.stream_keys and cfg.max_packet < MIN_PACKET + SEQUENCED_BLOCK_SIZE:
        raise ConfigError(f"stream.max_packet: {cfg.max_packet} holds no message and its seal")
    names = set()
    for i, n in enumerate(_get(doc, "node", list, "", [])):
        node = _parse_node(n, f"node[{i}].", base)
        if node.name in names:
            raise ConfigError(f"node[{i}].name: {node.name!r} appears twice")
        names.add(node.name)
        cfg.nodes.append(node)
    if not cfg.by_role("sequencer"):
        raise ConfigError("node: at least one node with role = \"sequencer\" is needed")
    _check_link_pairs(cfg)
    _check_soup_ports(cfg)
    for i, c in enumerate(_get(doc, "client", list, "", [])):
        cfg.clients.append(_parse_client(c, f"client[{i}]."))
    if not cfg.clients:
        raise ConfigError("client: at least one [[client]] is needed")
    return cfg


def _parse_stream(stream: dict, session: str) -> Config:
    _only_known(stream, "stream", "stream.")
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
        interface=_opt(stream, "interface", str, "stream."),
        max_packet=_opt(stream, "max_packet", int, "stream."),
        seal=_opt(stream, "seal", str, "stream."),
        heartbeat_ms=_opt(stream, "heartbeat_ms", int, "stream."),
        tick_ms=_opt(stream, "tick_ms", int, "stream."),
        batch_interval_ms=_opt(stream, "batch_interval_ms", int, "stream."),
    )
    if not MIN_PACKET <= cfg.max_packet <= moldudp64.MAX_UDP_PAYLOAD:
        raise ConfigError(f"stream.max_packet: {cfg.max_packet} outside {MIN_PACKET}..{moldudp64.MAX_UDP_PAYLOAD}")
    if cfg.seal not in SEALS:
        raise ConfigError(f"stream.seal: {cfg.seal!r}: use one of {', '.join(map(repr, SEALS))}")
    _positive(cfg, "stream.", "heartbeat_ms", "tick_ms")
    if not 0 <= cfg.batch_interval_ms <= MAX_BATCH_INTERVAL_MS:
        raise ConfigError(f"stream.batch_interval_ms: must be from 0 (no pacing) to {MAX_BATCH_INTERVAL_MS}")
    return cfg


def _parse_journal(cfg: Config, journal: dict) -> None:
    _only_known(journal, "journal", "journal.")
    cfg.fsync = journal.get("fsync", default_of(Config, "fsync"))
    if cfg.fsync not in ("batch", "never") and not (isinstance(cfg.fsync, (int, float)) and cfg.fsync >= 0):
        raise ConfigError(f"journal.fsync: {cfg.fsync!r}: use \"batch\", \"never\" or milliseconds")
    cfg.segment_mb = _opt(journal, "segment_mb", int, "journal.")
    cfg.durability = _opt(journal, "durability", str, "journal.")
    if cfg.durability not in DURABILITIES:
        raise ConfigError(f"journal.durability: {cfg.durability!r}: use \"flush\" or \"replicated\"")
    if cfg.durability == "replicated" and "fsync" in journal:
        raise ConfigError("journal.fsync: with durability = \"replicated\" the journal flushes in the background "
                          "(journal.flush_ms): leave fsync out")
    cfg.flush_ms = _opt(journal, "flush_ms", int, "journal.")
    if not 1 <= cfg.flush_ms <= MAX_FLUSH_MS:
        raise ConfigError(f"journal.flush_ms: must be from 1 to {MAX_FLUSH_MS}")


def _parse_timeouts(cfg: Config, timeouts: dict) -> None:
    _only_known(timeouts, "timeouts", "timeouts.")
    cfg.client_resend_ms = _opt(timeouts, "client_resend_ms", int, "timeouts.")
    cfg.gap_request_ms = _opt(timeouts, "gap_request_ms", int, "timeouts.")
    cfg.election_ms = _opt(timeouts, "election_ms", int, "timeouts.")
    cfg.leader_heartbeat_ms = _opt(timeouts, "leader_heartbeat_ms", int, "timeouts.")
    _positive(cfg, "timeouts.", "client_resend_ms", "gap_request_ms")
    if not 0 < cfg.leader_heartbeat_ms * 3 <= cfg.election_ms:
        raise ConfigError("timeouts.leader_heartbeat_ms: must be positive and at most a third of timeouts.election_ms")


def _parse_audit(cfg: Config, audit: dict) -> None:
    _only_known(audit, "audit", "audit.")
    cfg.book_ttl_s = _opt(audit, "book_ttl_s", float, "audit.")
    cfg.orphan_ttl_s = _opt(audit, "orphan_ttl_s", float, "audit.")
    cfg.snapshot_every = _opt(audit, "snapshot_every", int, "audit.")
    cfg.snapshot_ms = _opt(audit, "snapshot_ms", int, "audit.")
    cfg.books_expected = _opt(audit, "books_expected", int, "audit.")
    if cfg.book_ttl_s <= 0 or cfg.orphan_ttl_s <= 0:
        raise ConfigError("audit.book_ttl_s / audit.orphan_ttl_s: must be positive")
    if not 0 <= cfg.books_expected <= MAX_BOOKS_EXPECTED:
        raise ConfigError(f"audit.books_expected: must be from 0 to {MAX_BOOKS_EXPECTED:,}")


def _parse_replay(cfg: Config, replay: dict, base: Path | None) -> None:
    _only_known(replay, "replay", "replay.")
    for key in ("certfile", "keyfile"):
        path = _get(replay, key, str, "replay.", "")
        setattr(cfg, f"replay_{key}", str(base / path) if path and base is not None and not Path(path).is_absolute()
                else path)
    cfg.replay_plain = _get(replay, "plain", bool, "replay.", False)
    for user, password in _get(replay, "users", dict, "replay.", {}).items():
        if not (isinstance(password, str) and 0 < len(user) <= 6 and len(password) <= 10
                and (user + password).isascii() and user.strip() == user and password.strip() == password):
            raise ConfigError(f"replay.users.{user[:6]!r}: a SoupBinTCP login is a username of 1-6 and a password of "
                              f"at most 10 ASCII characters, neither padded with spaces")
        cfg.replay_users[user.encode()] = password.encode()


def _check_soup_ports(cfg: Config) -> None:
    """A soup_port is TLS with a certificate, or plain where the operator says so; with logins."""
    served = [n.name for n in cfg.nodes if n.soup_port]
    if served and not (cfg.replay_certfile or cfg.replay_plain):
        raise ConfigError(f"replay.certfile: {served[0]}'s soup_port serves SoupBinTCP over TLS: name its "
                          f"certificate, or set replay.plain = true on a network you trust")
    if served and not cfg.replay_users:
        raise ConfigError(f"replay.users: {served[0]}'s soup_port checks every login: name at least one")


def _parse_metrics(cfg: Config, metrics: dict, base: Path | None) -> None:
    _only_known(metrics, "metrics", "metrics.")
    for key in ("certfile", "keyfile", "client_cafile"):
        path = _opt(metrics, key, str, "metrics.")
        setattr(cfg, key, str(base / path) if path and base is not None and not Path(path).is_absolute() else path)
    cfg.client_auth_required = _opt(metrics, "client_auth_required", bool, "metrics.")
    if (cfg.keyfile or cfg.client_cafile) and not cfg.certfile:
        raise ConfigError("metrics: keyfile and client_cafile need a certfile (the endpoint's TLS certificate)")
    if cfg.client_auth_required and not cfg.client_cafile:
        raise ConfigError("metrics.client_auth_required: name the CA of the scrapers' certificates (client_cafile)")


def _parse_keys(cfg: Config, keys: dict) -> None:
    _only_known(keys, "keys", "keys.")
    cfg.stream_keys = _key_list(keys.get("stream"), "keys.stream")
    cfg.listener_keys = _key_list(keys.get("listeners"), "keys.listeners")
    cfg.cluster_keys = _key_list(keys.get("cluster"), "keys.cluster")
    links = _get(keys, "links", dict, "keys.", {})
    for pair, value in links.items():
        names = pair.split("/")
        if len(names) != 2 or names[0] == names[1]:
            raise ConfigError(f"keys.links.{pair}: name a pair of nodes, \"NODE/NODE\"")
        cfg.link_keys[pair_of(*names)] = _key_list(value, f"keys.links.{pair}")


def _check_link_pairs(cfg: Config) -> None:
    """Each [keys.links] pair names two configured nodes whose roles link."""
    roles = {n.name: n.role for n in cfg.nodes}
    for a, b in cfg.link_keys:
        if a not in roles or b not in roles:
            raise ConfigError(f"keys.links.{a}/{b}: {b if a in roles else a!r} is no configured node")
        if not may_link(roles[a], roles[b]):
            raise ConfigError(f"keys.links.{a}/{b}: a {roles[a]} and a {roles[b]} share no link")


def _key_list(value, where: str) -> list[bytes]:
    """One hex key, or a list of one or two (a rotation: the first signs)."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    try:
        keys = [bytes.fromhex(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: not a hex key or a list of one or two (not shown: it may be a key)") from None
    if not 1 <= len(keys) <= 2 or any(len(k) < MIN_KEY_BYTES for k in keys):
        raise ConfigError(f"{where}: one or two keys of at least {MIN_KEY_BYTES} bytes ({2 * MIN_KEY_BYTES} hex)")
    return keys


def _parse_node(n: dict, where: str, base: Path | None) -> NodeSettings:
    _only_known(n, "node", where)
    name = _get(n, "name", str, where, required=True)
    role = _get(n, "role", str, where, required=True)
    if role not in ROLES:
        raise ConfigError(f"{where}role: {role!r} is not sequencer, rewinder, replica or emitter")
    data = _get(n, "data", str, where, f"data/{name}")
    if base is not None and not Path(data).is_absolute():
        data = str(base / data)
    node = NodeSettings(name, role, _get(n, "host", str, where, default_of(NodeSettings, "host")), data=data,
                interface=_get(n, "interface", str, where, ""), metrics_port=_port(n, "metrics_port", where),
                metrics_host=_get(n, "metrics_host", str, where, ""))
    if role in VOTER_ROLES:
        node.replication_port = _port(n, "replication_port", where, required=True)
    if role == "sequencer":
        node.inbound_port = _port(n, "inbound_port", where, required=True)
    elif role == "rewinder":
        node.gapfill_port = _port(n, "gapfill_port", where, required=True)
        node.replay_port = _port(n, "replay_port", where, required=True)
        node.soup_port = _port(n, "soup_port", where)
    elif role == "emitter":
        _parse_emitter(node, n, where)
    return node


def _parse_emitter(node: NodeSettings, n: dict, where: str) -> None:
    node.alert_port = _port(n, "alert_port", where, required=True)
    node.sinks = _get(n, "sinks", list, where, default_of(NodeSettings, "sinks"))
    unknown = [k for k in node.sinks if k not in SINKS]
    if unknown or not node.sinks or len(set(node.sinks)) != len(node.sinks):
        raise ConfigError(f"{where}sinks: {node.sinks!r}: a list of distinct sinks from {', '.join(SINKS)}")
    node.webhook_url = _get(n, "webhook_url", str, where, default_of(NodeSettings, "webhook_url"))
    node.webhook_timeout_ms = _get(n, "webhook_timeout_ms", int, where, default_of(NodeSettings, "webhook_timeout_ms"))
    if "webhook" in node.sinks and not _is_http_url(node.webhook_url):  # not echoed: a URL may hold a secret
        raise ConfigError(f"{where}webhook_url: the webhook sink needs an http(s)://host[:port]/path URL")
    node.webhook_authorization = _get(n, "webhook_authorization", str, where, "")
    if not all(" " <= c <= "~" for c in node.webhook_authorization):  # not echoed: it is a secret
        raise ConfigError(f"{where}webhook_authorization: printable ASCII only (an HTTP header's value)")
    node.webhook_secret = _get(n, "webhook_secret", str, where, "")
    if node.webhook_secret and webhook_secret_bytes(node.webhook_secret) is None:
        raise ConfigError(f"{where}webhook_secret: expected whsec_ and the base64 of 24 to 64 random bytes "
                          f"(Standard Webhooks)")
    node.delivery = _get(n, "delivery", str, where, default_of(NodeSettings, "delivery"))
    if node.delivery not in DELIVERY:
        raise ConfigError(f"{where}delivery: {node.delivery!r} is not one of {', '.join(DELIVERY)}")


def webhook_secret_bytes(secret: str) -> bytes | None:
    """The signing key of a Standard Webhooks secret (whsec_<base64>), None if it is not one."""
    if not secret.startswith("whsec_"):
        return None
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        return None
    return key if 24 <= len(key) <= 64 else None


def _is_http_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port out of range or not a number
        return False


def _parse_client(c: dict, where: str) -> ClientSettings:
    _only_known(c, "client", where)
    name = _get(c, "name", str, where, required=True)
    key = _get(c, "key", str, where)
    try:
        moldudp64.session_bytes(name)
        return ClientSettings(name, bytes.fromhex(key) if key else None, _get(c, "interface", str, where, ""))
    except ValueError:
        raise ConfigError(f"{where}: client name {name!r} (1-10 ASCII) or key (hex) is malformed") from None


EMBEDDED_DATA_DIR = "data"  # the embedded default's nodes' data and keys, under the working directory


def load(path: str | Path | None, data_dir: str | Path = EMBEDDED_DATA_DIR) -> Config:
    """The config at `path`, or the embedded loopback default."""
    if path is None:
        return default(data_dir)
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable by this user, a directory, not text
        raise ConfigError(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse(doc, path.parent)


DEFAULT_GROUP = "239.77.0.1"
DEFAULT_BASE_PORT = 31400


def new_keys(clients: int) -> dict:
    """Fresh random keys (hex): the stream's, the listeners', the cluster's and one per client."""
    return {"stream": secrets.token_hex(KEY_BYTES), "listeners": secrets.token_hex(KEY_BYTES),
            "cluster": secrets.token_hex(KEY_BYTES),
            "clients": [secrets.token_hex(KEY_BYTES) for _ in range(clients)]}


def place(hosts: list[str], names: list[str]) -> dict[str, str]:
    """Which host each node lives on: the voters one a host (a host's failure costs one vote), then
    the replicas, the emitter and the clients round robin over every host from the one after the
    last voter's: on the hosts after the voters first, each replica on a host of its own while
    there are hosts for it (a host's failure costs one replica, never the alert quorum)."""
    voters = [n for n in names if n.startswith(("seq-", "rw-"))]
    where = {n: hosts[i % len(hosts)] for i, n in enumerate(voters)}
    rest = [n for n in names if n not in where]
    where.update({n: hosts[(len(voters) + i) % len(hosts)] for i, n in enumerate(rest)})
    return where


def node_names(sequencers: int, rewinders: int, replicas: int, clients: int) -> list[str]:
    """The default topology's node and client names, in the order place() spreads them."""
    return [*("seq-a", "seq-b", "seq-c")[:sequencers], *(f"rw-{i}" for i in range(1, rewinders + 1)),
            *(f"replica-{r}" for r in "ABCDEFGH"[:replicas]), *(["emitter"] if replicas else []),
            *(f"load{i}" for i in range(clients))]


def role_of_name(name: str) -> str:
    """The role of a default topology's node (node_names; the simulator's too), "client" for any other name."""
    prefixes = {"seq-": "sequencer", "rw-": "rewinder", "replica-": "replica", "emitter": "emitter"}
    return next((role for prefix, role in prefixes.items() if name.startswith(prefix)), "client")


def keys_of_host(keys: dict, names_here: set[str], names: list[str]) -> dict:
    """What of `keys` (new_keys) the nodes and clients in `names_here` (of the topology's `names`)
    need, None for the rest: the stream key where the stream is sealed, served or applied
    (sequencers, rewinders, replicas), the listener key where it is made, served or only read (a
    client holds it instead of the stream key where there is one: it cannot seal); never the cluster
    key, but the link key of each pair a node here is one of (`links`: so a replica's host cannot
    open a voter's link, nor speak for another replica); every client's key where a sequencer
    checks them, else only the clients' own."""
    roles = {role_of_name(n) for n in names_here}
    listeners = keys.get("listeners")
    here = [n for n in names if n in names_here and role_of_name(n) != "client"]
    clusters = [bytes.fromhex(k) for k in _listed(keys["cluster"])]  # two while rotating: each pair's two
    links = {"/".join(pair_of(a, b)): _unlisted([pair_key(c, a, b).hex() for c in clusters]) for a in here
             for b in names if b != a and may_link(role_of_name(a), role_of_name(b))}
    stream_roles = {"sequencer", "rewinder", "replica"} | (set() if listeners else {"client"})
    return {"stream": keys["stream"] if roles & stream_roles else None,
            "listeners": listeners if roles & {"sequencer", "rewinder", "client"} else None,
            "cluster": None, "links": dict(sorted(links.items())),
            "clients": [k if "sequencer" in roles or f"load{i}" in names_here else None
                        for i, k in enumerate(keys["clients"])]}


def _listed(key: str | list[str]) -> list[str]:
    return key if isinstance(key, list) else [key]


def _unlisted(keys: list[str]) -> str | list[str]:
    return keys[0] if len(keys) == 1 else keys


def default_toml(data_dir: str | Path = ".", rewinders: int = 2, clients: int = 2, free: bool = False,
                 seed: int | None = None, replicas: int = 0, sequencers: int = 1, keys: dict | None = None,
                 delivery: str | None = None, hosts: list[str] | None = None, max_packet: int | None = None,
                 durability: str | None = None) -> str:
    """The embedded default: `sequencers` sequencers (seq-a, and seq-b as the
    standby) and `rewinders` rewinders on loopback. Fixed ports and group, so that separate processes agree; with
    `free`, free ports and a random group (tests, parallel runs). `keys` (from new_keys): every link authenticated.
    `hosts`: a LAN, each node on one of these addresses (place), which is also its multicast interface.
    `delivery`: the emitter's (default "quorum" on a LAN, where replicas live on hosts of their own;
    "first" on one host, where they share its fate). A key of `keys` that is None is left out.
    `max_packet`: the stream's packet size (default: a jumbo frame's on loopback, where no frame limits a
    datagram and each packet's costs are cut 6x; on a LAN the 1,400 bytes an Ethernet frame holds). Packets
    of BLAKE3_SEALS_FROM bytes or more are sealed with BLAKE3, smaller ones with BLAKE2b (the faster at each).
    `durability`: the journal's (default "replicated" where each voter has a host and power of its own;
    "flush" where some share one, as on one host: one power loss takes their memory: docs/failover.md)."""
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
    max_packet = max_packet or (None if hosts else moldudp64.JUMBO_MAX_PACKET)
    shared = ("" if hosts else '\ninterface = "127.0.0.1"') + (f"\nmax_packet = {max_packet}" if max_packet else "")
    if max_packet and max_packet >= BLAKE3_SEALS_FROM:  # BLAKE3 hashes a packet's 1 KiB chunks side by side
        shared += '\nseal = "blake3"'
    lines = [
        'session = "TAPE"',
        f'[stream]\ngroup = "{group}"\nport = {port()}{shared}\nheartbeat_ms = 200\ntick_ms = 1000\n'
        f'batch_interval_ms = {GENERATED_BATCH_INTERVAL_MS}',
    ]
    delivery = delivery or ("quorum" if hosts else "first")
    where = place(hosts, node_names(sequencers, rewinders, replicas, clients)) if hosts else {}
    voter_hosts = [where.get(name) for name in node_names(sequencers, rewinders, 0, 0)]
    apart = bool(hosts) and len(set(voter_hosts)) == len(voter_hosts)  # each voter a host (and power) of its own
    lines.append(f'[journal]\ndurability = "{durability or ("replicated" if apart else "flush")}"')

    def at(name: str) -> str:  # a node's (or client's) host and interface lines, on a LAN
        return f'\nhost = "{where[name]}"\ninterface = "{where[name]}"' if name in where else ""
    if keys and (held := [k for k in ("stream", "listeners", "cluster") if keys.get(k)]):
        lines.append("[keys]" + "".join(f'\n{k} = {json.dumps(keys[k])}' for k in held))
    if keys and keys.get("links"):
        lines.append("[keys.links]" + "".join(f'\n"{pair}" = {json.dumps(key)}' for pair, key in keys["links"].items()))
    for name in ("seq-a", "seq-b", "seq-c")[:sequencers]:
        lines.append(f'[[node]]\nname = "{name}"\nrole = "sequencer"{at(name)}\ndata = "{data / name}"\n'
                     f'inbound_port = {port()}\nreplication_port = {port()}\nmetrics_port = {port()}')
    for i in range(1, rewinders + 1):
        lines.append(
            f'[[node]]\nname = "rw-{i}"\nrole = "rewinder"{at(f"rw-{i}")}\ndata = "{data / f"rw-{i}"}"\n'
            f'replication_port = {port()}\ngapfill_port = {port()}\nreplay_port = {port()}\n'
            f'metrics_port = {port()}')
    for name in "ABCDEFGH"[:replicas]:
        lines.append(f'[[node]]\nname = "replica-{name}"\nrole = "replica"{at(f"replica-{name}")}\n'
                     f'data = "{data / f"replica-{name}"}"\nmetrics_port = {port()}')
    if replicas:
        lines.append(f'[[node]]\nname = "emitter"\nrole = "emitter"{at("emitter")}\ndata = "{data / "emitter"}"\n'
                     f'alert_port = {port()}\nmetrics_port = {port()}\ndelivery = "{delivery}"')
    for i in range(clients):
        key = f'\nkey = {json.dumps(keys["clients"][i])}' if keys and keys["clients"][i] else ""
        iface = f'\ninterface = "{where[f"load{i}"]}"' if where else ""
        lines.append(f'[[client]]\nname = "load{i}"{key}{iface}')
    return "\n\n".join(lines) + "\n"


def default(data_dir: str | Path = EMBEDDED_DATA_DIR) -> Config:
    """The embedded loopback cluster, with the keys every process using `data_dir` shares."""
    return parse(tomllib.loads(default_toml(data_dir, sequencers=2, keys=shared_keys(Path(data_dir)))))


def shared_keys(data_dir: Path, clients: int = 2) -> dict:
    """`data_dir/keys.json`: made once (by whichever process comes first), then read."""
    return keys_file(data_dir / "keys.json", clients)


def keys_file(path: Path, clients: int) -> dict:
    """The keys (new_keys' form, JSON) kept at `path`: made there owner-only if it does not exist,
    else read (`stream`, `listeners` and `cluster` may be lists of two while rotating: the first
    signs; a file from before listener keys has none, and its clients hold the stream key)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:  # 0600 from the start
            f.write(json.dumps(new_keys(clients)))
        try:
            os.link(tmp, path)  # atomic: the first one made stays
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    keys = json.loads(path.read_text())
    if len(keys.get("clients", [])) < clients:
        raise ConfigError(f"{path}: keys for {len(keys.get('clients', []))} clients, not {clients}")
    return keys
