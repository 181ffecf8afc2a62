"""The attacks of issue 13, as an outsider on the LAN would send them (no
keys), and of a compromised replica host (every key its host file holds:
issue 63), against a live local cluster: for `tape drill hostile` and the
adversarial tests. Each attack is bounded in what it sends and returns a
line saying what it did. Targets are found as an attacker on the host would
find them: every socket each node's process holds (/proc), not only the
ports in the config.

What must hold afterwards (the drill's checks and the verdict): with keys,
nothing forged is applied, delivered or journaled and nothing stops; without
keys, nothing stops or is stuck. (What a replica's keys still allow, it
speaking falsely in its own name and sealing the stream, docs/security.md
states.)
"""

from __future__ import annotations

import os
import random
import selectors
import socket
import time
from dataclasses import dataclass

from tape.ops.verification.local import LocalCluster
from tape.protocol import alertlink, moldudp64
from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol.errors import ProtocolError
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import SEAL_KEY_ID_AT, StreamKeys, key_id
from tape.replicas.audit_core import Alert
from tape.runtime.linkclient import LinkSocket

FORGED_TERM = 1000  # the term forged votes and appends claim: no node may ever take it
GAPFILL_FLOOD = 2_000  # requests to each rewinder
GAPFILL_PORTS = 50  # source ports the flood rotates through
GARBAGE_PER_SOCKET = 50  # random datagrams or connections to each socket of each process
MALLORY = b"mallory".ljust(10)
TCP_WAIT_S = 2.0  # how long an attack waits for the nodes to close its connections


@dataclass(frozen=True)
class Socket:
    proto: str  # "udp" | "tcp" (listening)
    host: str
    port: int


def sockets_of(pid: int) -> list[Socket]:
    """The UDP sockets bound and the TCP sockets listening that process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for proto in ("udp", "tcp"):
        with open(f"/proc/{pid}/net/{proto}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if inode not in inodes or (proto == "tcp" and state != "0A"):  # 0A: LISTEN
                    continue
                addr, port = local.split(":")
                host = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
                found.append(Socket(proto, "127.0.0.1" if host == "0.0.0.0" else host, int(port, 16)))
    return found


def _commit_seq(cluster: LocalCluster) -> int:
    seqs = []
    for n in cluster.cfg.by_role("sequencer"):
        try:
            seqs.append(cluster.metrics(n.name).get(f'tape_sequencer_commit_seq{{node="{n.name}"}}', 0))
        except OSError:
            continue
    return int(max(seqs, default=0))


def _to_group(cluster: LocalCluster, packets: list[bytes]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(cluster.cfg.interface or "127.0.0.1"))
        for p in packets:
            s.sendto(p, (cluster.cfg.group, cluster.cfg.port))


def _forged_trades(first: int, n: int) -> list[bytes]:
    """Stamped purchases of an order never requested: each would raise an alert if applied."""
    return [M.stamp(M.purchase(10**9 + i, 10**9 + i, 10_000, "mallory", "EVIL"), time.time_ns(), MALLORY, i)
            for i in range(first, first + n)]


def forged_stream_packet(cluster: LocalCluster, rng: random.Random) -> str:
    seq = _commit_seq(cluster) + 3
    packet = PacketBuilder(cluster.cfg.session_bytes, seq, 61_000).add_sequenced(_forged_trades(seq, 790))[0]
    _to_group(cluster, [packet])
    return f"one {len(packet):,}-byte MoldUDP64 packet of forged trades at seq {seq:,} to the group"


def client_keys_seal_the_stream(cluster: LocalCluster, rng: random.Random) -> str:
    """A client's host seals forged trades with the listener key, its seal naming the stream key's
    id (on the wire in every seal): the replicas check it with the stream key, which it lacks."""
    seq, cfg = _commit_seq(cluster) + 3, cluster.cfg
    listener_key = cfg.listener_keys[0] if cfg.listener_keys else os.urandom(32)  # (a cluster without keys)
    stream_id = key_id(cfg.stream_keys[0]) if cfg.stream_keys else os.urandom(8)
    _, packet = StreamKeys([listener_key]).seal_packet(cfg.session_bytes, seq, _forged_trades(seq, 10),
                                                       time.time_ns(), moldudp64.session_bytes("seq-a"))
    at = len(packet) - M.SEQUENCED_SIZE + SEAL_KEY_ID_AT
    _to_group(cluster, [packet[:at] + stream_id + packet[at + 8:]])
    return f"forged trades at seq {seq:,} sealed with a client's listener key, naming the stream key, to the group"


def end_of_session(cluster: LocalCluster, rng: random.Random) -> str:
    _to_group(cluster, [moldudp64.encode_end_of_session(cluster.cfg.session_bytes, _commit_seq(cluster) + 1)])
    return "an end-of-session packet to the group"


def far_heartbeat(cluster: LocalCluster, rng: random.Random) -> str:
    _to_group(cluster, [moldudp64.encode_heartbeat(cluster.cfg.session_bytes, 2**62)])
    return "a heartbeat announcing seq 2^62 to the group"


def undecodable_unicast(cluster: LocalCluster, rng: random.Random) -> str:
    seq = _commit_seq(cluster) + 1
    junk = [b"Z" + m[1:] for m in _forged_trades(seq, 5)]
    packet = PacketBuilder(cluster.cfg.session_bytes, seq, 1400).add_sequenced(junk)[0]
    targets = [s for n in cluster.cfg.by_role("replica") if cluster.alive(n.name)
               for s in sockets_of(cluster.procs[n.name].pid) if s.proto == "udp"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for t in targets:
            s.sendto(packet, (t.host, t.port))
    return f"undecodable messages at seq {seq:,} by unicast to {len(targets)} replica sockets"


def _tcp_send(sends: list[tuple[int, bytes]]) -> None:
    """Connect to each port, send its bytes, then wait (all at once, up to TCP_WAIT_S) for the
    nodes to close: one slow peer costs the attack seconds, not each connection in turn."""
    conns = []
    for port, data in sends:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=TCP_WAIT_S)
            s.sendall(data)
            s.setblocking(False)
            conns.append(s)
        except OSError:
            pass  # refused or reset: what an unauthenticated peer should get
    deadline = time.monotonic() + TCP_WAIT_S
    with selectors.DefaultSelector() as sel:
        for s in conns:
            sel.register(s, selectors.EVENT_READ)
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                try:
                    if key.fileobj.recv(4096):
                        continue
                except OSError:
                    pass
                sel.unregister(key.fileobj)  # closed by the node
    for s in conns:
        s.close()


def forged_replication(cluster: LocalCluster, rng: random.Random) -> str:
    frames = (rep.encode_vote_request(FORGED_TERM, MALLORY, 10**9, FORGED_TERM - 1)
              + rep.encode_append(FORGED_TERM, MALLORY, 0, 0, 10**9, FORGED_TERM, [bytes(M.SEQUENCED_SIZE)])
              + rep.encode_ack(FORGED_TERM, MALLORY, True, 10**9))
    voters = [n for n in cluster.cfg.voters if cluster.alive(n.name)]
    _tcp_send([(n.replication_port, frames) for n in voters])
    return f"a vote request, an append and an ack of term {FORGED_TERM} to {len(voters)} replication ports"


def forged_alert(cluster: LocalCluster, rng: random.Random) -> str:
    fake = Alert(2**62, 2**62, 1, 1, b"mallory".ljust(16), b"EVIL".ljust(8), 1, 2, 0)
    frames = alertlink.hello(b"replica-A ") + alertlink.alert(fake.encode())
    _tcp_send([(cluster.cfg.node("emitter").alert_port, frames)])
    return "a replica's hello and an alert at emit seq 2^62 to the emitter"


def _insider_link(cluster: LocalCluster, port: int, frames: bytes) -> bool:
    """Open a link to `port` with replica-A's pair key with the emitter (all the link keys its host
    holds), send `frames`, and wait for the node to close it: False if the handshake was refused."""
    keys, emitter = cluster.cfg.links_of(cluster.cfg.node("replica-A")), cluster.cfg.node("emitter")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TCP_WAIT_S) as sock:
            link = LinkSocket(sock, keys, emitter.wire_name)
            link.sendall(frames)
            while link.recv(4096):
                pass
    except (OSError, ConnectionError, ProtocolError):
        return False  # refused, reset or timed out: all a replica's keys should earn here
    return True


def replica_keys_at_the_voters(cluster: LocalCluster, rng: random.Random) -> str:
    """A replica's keys pose as the leader and as a candidate: no voter shares a key with it."""
    a = cluster.cfg.node("replica-A").wire_name
    frames = (rep.encode_vote_request(FORGED_TERM, a, 10**9, FORGED_TERM - 1)
              + rep.encode_append(FORGED_TERM, a, 0, 0, 10**9, FORGED_TERM, [bytes(M.SEQUENCED_SIZE)]))
    voters = [n for n in cluster.cfg.voters if cluster.alive(n.name)]
    opened = sum(_insider_link(cluster, n.replication_port, frames) for n in voters)
    return f"a vote request and an append of term {FORGED_TERM} over replica-A's link key to {len(voters)} " \
           f"replication ports ({opened} handshakes answered)"


def replica_in_anothers_name(cluster: LocalCluster, rng: random.Random) -> str:
    """Replica-A's own link to the emitter, saying it is replica-B and sending B's alert."""
    fake = Alert(2**62, 2**62, 1, 1, b"mallory".ljust(16), b"EVIL".ljust(8), 1, 2, 0)
    frames = alertlink.hello(cluster.cfg.node("replica-B").wire_name) + alertlink.alert(fake.encode())
    _insider_link(cluster, cluster.cfg.node("emitter").alert_port, frames)
    return "replica-A's link to the emitter, in replica-B's name, with an alert at emit seq 2^62"


def foreign_client_batch(cluster: LocalCluster, rng: random.Random) -> str:
    name = moldudp64.session_bytes(cluster.cfg.clients[0].name)
    batch = moldudp64.encode_packet(name, 10**6, [M.purchase(1, 1, 10, "mallory", "EVIL")])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for n in cluster.cfg.by_role("sequencer"):
            s.sendto(batch, ("127.0.0.1", n.inbound_port))
    return f"an inbound batch under {cluster.cfg.clients[0].name}'s name, without its key, to every sequencer"


def gapfill_flood(cluster: LocalCluster, rng: random.Random) -> str:
    request = moldudp64.encode_request(cluster.cfg.session_bytes, 1, 100).ljust(1400, b"\0")
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(GAPFILL_PORTS)]
    try:
        for n in cluster.cfg.by_role("rewinder"):
            for i in range(GAPFILL_FLOOD):
                socks[i % GAPFILL_PORTS].sendto(request, ("127.0.0.1", n.gapfill_port))
    finally:
        for s in socks:
            s.close()
    return f"{GAPFILL_FLOOD:,} unsigned gap requests to each rewinder from {GAPFILL_PORTS} ports"


def garbage_everywhere(cluster: LocalCluster, rng: random.Random) -> str:
    targets = [s for name, proc in cluster.procs.items() if name != "load" and cluster.alive(name)
               for s in sockets_of(proc.pid)]
    connections = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        for t in targets:
            for _ in range(GARBAGE_PER_SOCKET if t.proto == "udp" else 2):
                junk = rng.randbytes(rng.choice((0, 1, 19, 20, 21, 64, 1400, 9000)))
                if t.proto == "udp":
                    u.sendto(junk, (t.host, t.port))
                else:
                    connections.append((t.port, junk))
    _tcp_send(connections)
    return f"random bytes to {len(targets)} sockets of {len(cluster.procs) - 1} processes"


ATTACKS = (forged_stream_packet, client_keys_seal_the_stream, end_of_session, far_heartbeat, undecodable_unicast,
           forged_replication, forged_alert, replica_keys_at_the_voters, replica_in_anothers_name,
           foreign_client_batch, gapfill_flood, garbage_everywhere)


def run_all(cluster: LocalCluster, seed: int = 13) -> list[str]:
    rng = random.Random(seed)
    return [attack(cluster, rng) for attack in ATTACKS]
