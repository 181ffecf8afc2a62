"""The cluster's settings: what every node process is configured with.

A plain schema with every default written once, here. `tape.runtime.config`
fills it from a TOML file (or the embedded loopback default); the roles
only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from tape.protocol import moldudp64

ROLES = ("sequencer", "rewinder", "replica", "emitter")
VOTER_ROLES = ("sequencer", "rewinder")
SINKS = ("jsonl", "webhook", "stdout")


@dataclass
class NodeSettings:
    name: str
    role: str
    host: str = "127.0.0.1"
    interface: str = ""  # multicast: an address or interface name of its host; "": [stream] interface, else host
    data: str = ""
    inbound_port: int = 0
    replication_port: int = 0
    gapfill_port: int = 0
    replay_port: int = 0
    soup_port: int = 0  # rewinder: standard SoupBinTCP replay ([replay]): TLS, or plain where marked trusted
    metrics_port: int = 0
    metrics_host: str = ""  # the metrics endpoint's address, e.g. a management network's ("": host)
    alert_port: int = 0
    sinks: list[str] = field(default_factory=lambda: ["jsonl"])
    webhook_url: str = ""
    webhook_timeout_ms: int = 5000
    webhook_authorization: str = ""  # the Authorization header's value (a secret: never logged)
    webhook_secret: str = ""  # Standard Webhooks signing secret, whsec_<base64>
    delivery: str = "first"  # emitter: "first" copy of an alert, or once a "quorum" of replicas sent it

    @property
    def metrics_address(self) -> str:
        return self.metrics_host or self.host

    @property
    def wire_name(self) -> bytes:
        return moldudp64.session_bytes(self.name)


@dataclass
class ClientSettings:
    name: str
    key: bytes | None = None
    interface: str = ""  # where it hears the stream (its acks): as a node's


@dataclass
class Config:
    group: str
    port: int
    session: str = "TAPE"
    # [stream]
    interface: str = ""  # one multicast interface for every node: only where each host has it (a name, loopback)
    max_packet: int = moldudp64.DEFAULT_MAX_PACKET
    seal: str = "blake2b"  # the hash of the leader's seals (protocol/streamauth.py SEALS); listeners check either
    heartbeat_ms: int = 1000
    tick_ms: int = 1000
    batch_interval_ms: int = 0  # pace batches while messages come fast (leader_core.py batch_due_ns); 0: never
    # [journal]
    durability: str = "flush"  # "flush": committed once a majority has it on disk; "replicated": in memory
    flush_ms: int = 50  # "replicated": the background flush gathers this long's writes
    fsync: str | float = "batch"
    segment_mb: int = 64
    # [timeouts]
    client_resend_ms: int = 50
    gap_request_ms: int = 8
    election_ms: int = 300
    leader_heartbeat_ms: int = 50
    # [audit]
    book_ttl_s: float = 3600.0
    orphan_ttl_s: float = 10.0
    snapshot_every: int = 100_000
    snapshot_ms: int = 1000
    books_expected: int = 0  # books a replica's table is sized and its memory written for at start
    # [replay]: the standard SoupBinTCP port (soup_port)
    replay_certfile: str = ""
    replay_keyfile: str = ""
    replay_plain: bool = False
    replay_users: dict[bytes, bytes] = field(default_factory=dict)  # username -> password, as a login pads them
    # [metrics]: TLS on every metrics endpoint of this file's nodes, as prometheus-client's own server takes it
    certfile: str = ""  # "": plain HTTP
    keyfile: str = ""
    client_cafile: str = ""  # the CA a scraper's certificate must be signed by
    client_auth_required: bool = False  # refuse a scraper without such a certificate
    # [keys]: the first of each list signs, any verifies (rotation); empty: that link is not authenticated
    stream_keys: list[bytes] = field(default_factory=list)  # the public stream, gap fill, replay logins
    listener_keys: list[bytes] = field(default_factory=list)  # the seals' listener tags: clients read, never seal
    cluster_keys: list[bytes] = field(default_factory=list)  # every pair's link key derives from it
    link_keys: dict[tuple[str, str], list[bytes]] = field(default_factory=dict)  # [keys.links]: by pair (sorted)
    nodes: list[NodeSettings] = field(default_factory=list)
    clients: list[ClientSettings] = field(default_factory=list)

    @property
    def stream_auth(self):
        """The stream's StreamKeys (with the listener keys, if any: a leader tags for them, a
        rewinder takes requests signed by them); a host with the listener keys alone, a client's,
        its ListenerKeys; None without either."""
        from tape.protocol.streamauth import ListenerKeys, StreamKeys

        if self.stream_keys:
            return StreamKeys(self.stream_keys, self.seal, self.listener_keys)
        return ListenerKeys(self.listener_keys) if self.listener_keys else None

    @property
    def soup_tls(self):
        """The soup_port's ssl.SSLContext (TLS 1.2 or later), None where it serves plain."""
        if not self.replay_certfile:
            return None
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.replay_certfile, self.replay_keyfile or None)
        return context

    @property
    def metrics_tls(self):
        """The metrics endpoints' ssl.SSLContext (TLS 1.2 or later), None for plain HTTP; raises
        OSError or ssl.SSLError if a file cannot be read."""
        if not self.certfile:
            return None
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile or None)
        if self.client_cafile:
            context.load_verify_locations(self.client_cafile)
            context.verify_mode = ssl.CERT_REQUIRED if self.client_auth_required else ssl.CERT_OPTIONAL
        return context

    @property
    def listener_auth(self):
        """What a client checks the stream and signs its gap requests with: the listener keys where
        the config has them (its path the same in one file as on a host of its own), else stream_auth."""
        from tape.protocol.streamauth import ListenerKeys

        return ListenerKeys(self.listener_keys) if self.listener_keys else self.stream_auth

    @property
    def links_keyed(self) -> bool:
        return bool(self.cluster_keys or self.link_keys)

    def pair_keys(self, a: str, b: str) -> list[bytes]:
        """The link keys nodes `a` and `b` share: [keys.links]' pair, else derived from the cluster key."""
        from tape.protocol.linkauth import pair_key

        return self.link_keys.get(pair_of(a, b)) or [pair_key(k, a, b) for k in self.cluster_keys]

    def links_of(self, node: NodeSettings):
        """`node`'s LinkKeys for replication and alert links: a key for each node it may link with (a
        voter with the other voters, a replica with the emitter, the emitter with the replicas) whose
        pair this host holds; None without link keys. Its listener accepts only those peers."""
        from tape.protocol.linkauth import LinkKeys

        if not self.links_keyed:
            return None
        peers = {p.wire_name: keys for p in self.nodes if may_link(node.role, p.role) and p.name != node.name
                 and (keys := self.pair_keys(node.name, p.name))}
        return LinkKeys(peers=peers)

    @property
    def replay_link(self):
        """LinkKeys for replay connections (the stream and listener keys: who may read the stream),
        or None."""
        from tape.protocol.linkauth import LinkKeys

        keys = self.stream_keys + self.listener_keys
        return LinkKeys(keys) if keys else None

    @property
    def replay_served(self):
        """A rewinder's LinkKeys for its replay port: a session's key names its class, MEMBER (the
        stream key: a replica) or LISTENER (the listener key: a client or a reader outside the
        cluster, whose sessions share the replay budget); None without either key."""
        from tape.protocol.limits import REPLAY_LISTENER, REPLAY_MEMBER
        from tape.protocol.linkauth import LinkKeys

        peers = {REPLAY_MEMBER: self.stream_keys, REPLAY_LISTENER: self.listener_keys}
        peers = {name: keys for name, keys in peers.items() if keys}
        return LinkKeys(peers=peers) if peers else None

    @property
    def session_bytes(self) -> bytes:
        return moldudp64.session_bytes(self.session)

    def interface_of(self, who: NodeSettings | ClientSettings) -> str:
        """The multicast interface of a node or client: its own, else the cluster's, else its host's
        address (loopback for a client, or a node bound to every address)."""
        host = getattr(who, "host", "")
        return who.interface or self.interface or (host if host not in ("", "0.0.0.0") else "127.0.0.1")

    @property
    def stream_sources(self) -> tuple:
        """The addresses the sequencers send the stream from (their multicast interfaces), which a
        listener joins the group from alone (source-specific); () where one of them is named by an
        interface name, whose address only its own host knows: then the group from any source."""
        import ipaddress

        sources = []
        for n in self.by_role("sequencer"):
            try:
                sources.append(str(ipaddress.IPv4Address(self.interface_of(n))))
            except ValueError:
                return ()
        return tuple(sorted(set(sources)))

    @property
    def client_addresses(self) -> frozenset:
        """The addresses the clients send from, where the config names them (an interface given
        as an IPv4 address, or loopback's): the leader checks each of their datagrams, whatever
        comes from anywhere else within a budget (protocol/budgets.py StrangerBudget)."""
        import ipaddress

        found = set()
        for c in self.clients:
            try:
                found.add(str(ipaddress.IPv4Address(self.interface_of(c))))
            except ValueError:  # an interface name (eth0): its address is the client host's to know
                continue
        return frozenset(found)

    def node(self, name: str) -> NodeSettings:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} (have {', '.join(n.name for n in self.nodes)})")

    def by_role(self, role: str) -> list[NodeSettings]:
        return [n for n in self.nodes if n.role == role]

    @property
    def voters(self) -> list[NodeSettings]:
        return [n for n in self.nodes if n.role in VOTER_ROLES]

    def client(self, name: str) -> ClientSettings:
        for c in self.clients:
            if c.name == name:
                return c
        raise KeyError(f"no client named {name!r}")

    def open_journal(self, node: NodeSettings):
        """The node's journal, with this cluster's session and journal settings."""
        from tape.runtime.storage.journal_store import Journal

        return Journal(Path(node.data) / "journal", self.session_bytes, fsync=self.fsync,
                       flush_every_s=self.flush_ms / 1000 if self.durability == "replicated" else None,
                       segment_bytes=self.segment_mb << 20)


def may_link(role: str, other: str) -> bool:
    """Whether nodes of these roles hold a link key together: voters replicate with each other,
    replicas send alerts to the emitter. Nothing else shares a key, so nothing else can connect."""
    return (role in VOTER_ROLES and other in VOTER_ROLES) or {role, other} == {"replica", "emitter"}


def pair_of(a: str, b: str) -> tuple[str, str]:
    """A pair of nodes as [keys.links] names it ("a/b", either order)."""
    return tuple(sorted((a, b)))


def default_of(cls, name: str):
    """The default written above for `cls`'s field `name`."""
    for f in fields(cls):
        if f.name == name:
            return f.default_factory() if callable(f.default_factory) else f.default
    raise KeyError(name)


# Every key a cluster config may hold, by section ("" the top level, "node" each [[node]], "client"
# each [[client]]), with what it means. The parser refuses any other key (runtime/config.py), and
# `tape config keys` prints this table with each default, as docs/runbook.md shows it.
KEYS: dict[str, dict[str, str]] = {
    "": {
        "session": "the MoldUDP64 session name, 1-10 ASCII characters; a new one starts a new log",
    },
    "stream": {
        "group": "the multicast group of the stream (required)",
        "port": "the stream's UDP port (required)",
        "interface": "one multicast interface for every node: only where each host has it (a name, or loopback)",
        "max_packet": "the largest packet the leader cuts, bytes: 1400 on an Ethernet LAN, up to a jumbo frame's",
        "seal": "the hash of the leader's seals: \"blake2b\" or \"blake3\"",
        "heartbeat_ms": "a heartbeat packet this often while no message flows",
        "tick_ms": "the leader's clock message this often (replicas see time only through it)",
        "batch_interval_ms": "pace batches while messages come fast, at most one this often (0: never)",
    },
    "journal": {
        "durability": "when a record counts as held: \"flush\" (on a majority's disks: survives any power loss) or "
                      "\"replicated\" (in a majority's memory, flushed in the background: survives any one "
                      "process or host failing, not two voters' hosts losing power within flush_ms; "
                      "docs/failover.md)",
        "flush_ms": "with \"replicated\": the background flush gathers this many milliseconds of writes",
        "fsync": "when a voter flushes its journal: \"batch\" (each batch, before it acknowledges), \"never\", "
                 "or every that many milliseconds",
        "segment_mb": "a journal segment's size before the next one starts, MiB",
    },
    "timeouts": {
        "client_resend_ms": "a client resends what it has not seen sequenced after this",
        "gap_request_ms": "a listener asks a rewinder for a gap after this (it adapts upward to answers)",
        "election_ms": "the least election timeout; each wait is drawn from [election_ms, 2 x election_ms]",
        "leader_heartbeat_ms": "the leader heartbeats its followers this often (at most a third of election_ms)",
    },
    "audit": {
        "book_ttl_s": "an order's book stays open this long after its last event (the stamps' time)",
        "orphan_ttl_s": "an event for an unknown order is held this long for its order",
        "snapshot_every": "a replica snapshots to LMDB every this many messages",
        "snapshot_ms": "... or this often, whichever comes first",
        "books_expected": "the open books a replica's table is sized and its memory written for at start (0: grow)",
    },
    "replay": {
        "certfile": "the soup_port's TLS certificate (PEM, with its chain)",
        "keyfile": "its private key (PEM; default: in certfile)",
        "plain": "serve the soup_port without TLS: only on a network you trust",
        "users": "a table of SoupBinTCP logins, username = password (at most 6 and 10 ASCII characters)",
    },
    "metrics": {
        "certfile": "the metrics endpoints' TLS certificate (PEM, with its chain): HTTPS instead of HTTP",
        "keyfile": "its private key (PEM; default: in certfile)",
        "client_cafile": "the CA (PEM) whose certificates a scraper may present",
        "client_auth_required": "refuse a scraper without a certificate from client_cafile (mutual TLS)",
    },
    "keys": {
        "stream": "the stream key, hex (or a list of two while rotating): seals, gap fill, replay logins; held by "
                  "sequencers, rewinders and replicas",
        "listeners": "the listener key, hex (or a list of two): the seals' listener tags, which a client checks "
                     "instead of holding the stream key (it cannot seal), its gap requests and replay logins",
        "cluster": "the cluster key, hex (or a list of two): every pair of nodes' link key derives from it, so a "
                   "host that holds it can be any node (keep it on the build machine; hosts get [keys.links])",
        "links": "a table of link keys by pair, \"NODE/NODE\" = hex (or a list of two): a pair's key proves each end "
                 "to the other (voter/voter replication, replica/emitter alerts); `tape config --hosts` writes each "
                 "host its own nodes' pairs",
    },
    "node": {
        "name": "the node's name, 1-10 ASCII characters (required)",
        "role": "sequencer, rewinder, replica or emitter (required)",
        "host": "the address it binds (one of its host's)",
        "interface": "its multicast interface: an address or interface name of its host (default: [stream] "
                     "interface, else host)",
        "data": "its data directory (default data/NAME; relative: to the config file's directory)",
        "metrics_port": "its Prometheus metrics port (0: none)",
        "metrics_host": "the address its metrics port binds, e.g. on a management network (default: host)",
        "replication_port": "sequencer and rewinder: the voters' replication port (required)",
        "inbound_port": "sequencer: the clients' inbound port (required)",
        "gapfill_port": "rewinder: the gap-fill request port, UDP (required)",
        "replay_port": "rewinder: the SoupBinTCP replay port (required)",
        "soup_port": "rewinder: a port of standard SoupBinTCP 4.0 replay for clients written elsewhere: TLS "
                     "([replay] certfile), or plain where [replay] plain marks the network trusted; logins checked "
                     "against [replay.users] (0: none)",
        "alert_port": "emitter: the replicas' alert port (required)",
        "sinks": "emitter: where alerts go, a list of jsonl, webhook, stdout",
        "webhook_url": "emitter: the webhook sink's http(s) URL",
        "webhook_timeout_ms": "emitter: a webhook POST's timeout",
        "webhook_authorization": "emitter: the webhook POST's Authorization header, e.g. \"Bearer ...\" (a secret)",
        "webhook_secret": "emitter: sign each webhook POST (Standard Webhooks: webhook-id, -timestamp, -signature) "
                          "with this whsec_<base64> secret",
        "delivery": "emitter: deliver an alert on the \"first\" copy, or once a \"quorum\" of replicas sent it",
    },
    "client": {
        "name": "the client's name, 1-10 ASCII characters (required)",
        "key": "its inbound key, hex: only the client and the sequencers' hosts hold it",
        "interface": "where it hears the stream (its acknowledgements): as a node's",
    },
}
