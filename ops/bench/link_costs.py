"""`tape bench links`: what authenticating the links and the stream costs at a given rate, each way
we could: the figures behind docs/security.md's choices ("Keys by role and identity").

Replication: the bytes a leader writes to three followers at `rate` (append frames of `batch`
messages), through Tape's link records (hash once, a keyed tag per link) and through TLS 1.3 with a
certificate per node and mutual authentication (the standard library's `ssl` over memory BIOs, so
only the cryptography and the record layer are timed, no socket). The stream: a packet's seal made
and checked as today (a keyed hash: every key holder can forge), and an Ed25519 signature made and
checked (nobody but the signer can) from `openssl speed`, the C library's own rate and so a floor
for any binding. Each row is CPU µs per message and the cores that takes at `rate`.
"""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.bench.throughput import host_speed
from tape.ops.verification.certs import make_certificates
from tape.protocol import moldudp64, replication
from tape.protocol.linkauth import LinkEnd, LinkKeys, record_digests
from tape.protocol.messages import SEQUENCED_BLOCK_SIZE, SEQUENCED_SIZE
from tape.protocol.moldudp64 import HEADER_SIZE
from tape.protocol.streamauth import BLAKE3_SEALS_FROM, ListenerKeys, StreamKeys

FOLLOWERS = 3  # a leader's followers in a four-voter cluster
LEADER = moldudp64.session_bytes("seq-a")
SESSION = moldudp64.session_bytes("BENCH")
OPENSSL_SPEED_S = 2


def _frames(batches: int, batch: int) -> list[bytes]:
    """Append frames of `batch` random 75-byte entries: what a leader writes to each follower."""
    entries = [os.urandom(SEQUENCED_SIZE) for _ in range(batch)]
    return [replication.encode_append(3, LEADER, 1 + k * batch, 3, k * batch, 3, entries) for k in range(batches)]


def _link_pair(keys: LinkKeys) -> tuple[LinkEnd, LinkEnd]:
    leader, follower = LinkEnd(keys, os.urandom(16), True), LinkEnd(keys, os.urandom(16), False)
    reply, _ = follower.receive(leader.opening())
    leader.receive(reply)
    return leader, follower


def _time_tape_links(frames: list[bytes]) -> tuple[float, float, float]:
    """(leader's seconds for every frame to three links, one follower's to open them, bytes on the
    wire per frame byte)."""
    keys = LinkKeys([os.urandom(32)])
    pairs = [_link_pair(keys) for _ in range(FOLLOWERS)]
    t0 = time.process_time()
    sent = []
    for frame in frames:
        digests = record_digests(frame)  # the same bytes to every follower: hashed once
        sent.append([leader.seal(frame, digests) for leader, _ in pairs])
    leader_s = time.process_time() - t0
    follower = pairs[0][1]
    t0 = time.process_time()
    opened = [follower.receive(records[0])[1] for records in sent]
    follower_s = time.process_time() - t0
    assert opened == frames, "the follower read other bytes than were sent"
    overhead = sum(len(r[0]) for r in sent) / sum(map(len, frames))
    return leader_s, follower_s, overhead


def _context(directory: Path, name: str, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(directory / f"{name}.pem", directory / f"{name}.key")
    ctx.load_verify_locations(directory / "ca.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: each side proves its node by its certificate
    ctx.check_hostname = False  # the peer is named by its certificate's CN, checked by the caller
    return ctx


class _TlsEnd:
    def __init__(self, ctx: ssl.SSLContext, server: bool):
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.incoming, self.outgoing, server_side=server)

    def step(self) -> bool:
        try:
            self.tls.do_handshake()
            return True
        except ssl.SSLWantReadError:
            return False


def _tls_pair(directory: Path, follower: str) -> tuple[_TlsEnd, _TlsEnd, float]:
    """(the leader's end, the follower's, seconds of CPU the handshake took both)."""
    leader = _TlsEnd(_context(directory, "seq-a", False), False)
    peer = _TlsEnd(_context(directory, follower, True), True)
    t0 = time.process_time()
    done = [False, False]
    while not all(done):
        done[0] = leader.step()
        peer.incoming.write(leader.outgoing.read())
        done[1] = peer.step()
        leader.incoming.write(peer.outgoing.read())
    assert peer.tls.getpeercert()["subject"][0][0][1] == "seq-a", "the follower knows its leader by its certificate"
    return leader, peer, time.process_time() - t0


def _time_tls(frames: list[bytes]) -> tuple[float, float, float, float]:
    """(leader's seconds, one follower's, one handshake's, bytes on the wire per frame byte)."""
    with tempfile.TemporaryDirectory(prefix="tape-bench-tls-") as tmp:
        directory = Path(tmp)
        names = [f"seq-{c}" for c in "bcd"]
        make_certificates(directory, ["seq-a", *names])
        pairs = [_tls_pair(directory, name) for name in names]
    handshake_s = sum(s for _, _, s in pairs) / len(pairs)
    t0 = time.process_time()
    sent = []
    for frame in frames:
        wire = []
        for leader, _, _ in pairs:
            leader.tls.write(frame)
            wire.append(leader.outgoing.read())
        sent.append(wire)
    leader_s = time.process_time() - t0
    follower = pairs[0][1]
    t0 = time.process_time()
    opened = []
    for wire in sent:
        follower.incoming.write(wire[0])
        while True:
            try:
                opened.append(follower.tls.read(1 << 20))
            except ssl.SSLWantReadError:
                break
    follower_s = time.process_time() - t0
    assert b"".join(opened) == b"".join(frames), "the follower read other bytes than were sent"
    overhead = sum(len(w[0]) for w in sent) / sum(map(len, frames))
    return leader_s, follower_s, handshake_s, overhead


def _packets(max_packet: int, count: int) -> tuple[StreamKeys, list[bytes], int]:
    """(keys, `count` sealed packets of `max_packet` bytes, messages a packet carries)."""
    per = (max_packet - HEADER_SIZE) // SEQUENCED_BLOCK_SIZE - 1  # the seal takes one block
    keys = StreamKeys([os.urandom(32)], "blake3" if max_packet >= BLAKE3_SEALS_FROM else "blake2b")
    entries = [os.urandom(SEQUENCED_SIZE) for _ in range(per * count)]
    return keys, entries, per


def _time_seals(max_packet: int, count: int, listener_tags: bool) -> tuple[float, float, int]:
    """(µs to seal a packet, µs to verify one, messages per packet); with `listener_tags` the leader
    tags for the listeners too, and the check is a client's (ListenerKeys)."""
    keys, entries, per = _packets(max_packet, count)
    listener_key = os.urandom(32)
    if listener_tags:
        keys = StreamKeys([keys.signing], "blake3" if keys.algorithm else "blake2b", [listener_key])
    checker = ListenerKeys([listener_key]) if listener_tags else keys
    origin = moldudp64.session_bytes("seq-a")
    t0 = time.process_time()
    _, packets = keys.seal_run(SESSION, 1, entries, per, 1, origin)
    seal_s = time.process_time() - t0
    t0 = time.process_time()
    assert all(checker.verify(p) is None for p in packets)
    return seal_s / count * 1e6, (time.process_time() - t0) / count * 1e6, per


def ed25519_speed() -> tuple[float, float] | None:
    """(signatures a second, verifications a second) on one core, from `openssl speed`; None without it."""
    try:
        out = subprocess.run(["openssl", "speed", "-seconds", str(OPENSSL_SPEED_S), "ed25519"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"Ed25519\)\s+\S+s\s+\S+s\s+([\d.]+)\s+([\d.]+)", out)
    return (float(found[1]), float(found[2])) if found else None


def bench_links(rate: float, batch: int, batches: int, packets: int) -> dict:
    console = Console()
    console.print(f"host speed: {host_speed():,.0f} msg/s encode (tape bench protocol)")
    frames = _frames(batches, batch)
    messages = batches * batch
    tls_leader, tls_follower, handshake, overhead = _time_tls(frames)
    links = {"tape": _time_tape_links(frames), "tls": (tls_leader, tls_follower, overhead)}
    table = Table(title=f"replication, a leader to {FOLLOWERS} followers: µs of CPU a message "
                        f"(appends of {batch}), cores at {rate:,.0f} msg/s")
    for column in ("links", "leader µs", "follower µs", "leader cores", "wire bytes / payload"):
        table.add_column(column, justify="right")
    for name, (lead, follow, wire) in links.items():
        table.add_row(name, f"{lead / messages * 1e6:.3f}", f"{follow / messages * 1e6:.3f}",
                      f"{lead / messages * rate:.3f}", f"{wire:.4f}")
    console.print(table)
    console.print(f"TLS 1.3 handshake, mutual, P-256 certificates: {handshake * 1e3:.1f} ms of CPU (both ends)")
    stream = _bench_stream(console, rate, packets)
    return {"links": {k: {"leader_us": v[0] / messages * 1e6, "follower_us": v[1] / messages * 1e6,
                          "wire_ratio": v[2]} for k, v in links.items()},
            "tls_handshake_ms": handshake * 1e3, "stream": stream}


def _bench_stream(console: Console, rate: float, packets: int) -> dict:
    ed = ed25519_speed()
    table = Table(title=f"the stream: a packet's authentication, CPU µs and cores at {rate:,.0f} msg/s")
    for column in ("packet bytes", "msgs a packet", "scheme", "make µs", "check µs", "leader cores",
                   "each listener cores"):
        table.add_column(column, justify="right")
    rows = {}
    for max_packet in (1400, 8972):
        seal_us, verify_us, per = _time_seals(max_packet, packets, False)
        schemes = {"keyed hash": (seal_us, verify_us),
                   "+ listener tag": _time_seals(max_packet, packets, True)[:2]}
        if ed:
            schemes["Ed25519"] = (1e6 / ed[0], 1e6 / ed[1])
        for scheme, (make, check) in schemes.items():
            per_s = rate / per
            table.add_row(str(max_packet), str(per), scheme, f"{make:.1f}", f"{check:.1f}",
                          f"{make * per_s / 1e6:.3f}", f"{check * per_s / 1e6:.3f}")
            rows[f"{max_packet} {scheme}"] = {"make_us": make, "check_us": check, "per_packet": per}
    console.print(table)
    console.print("keyed hash: the seal's tag, by the stream key (any holder can forge); + listener tag: the "
                  "leader tags for clients too, with the listener key, and the check is a client's (a client can "
                  "forge for clients only). TESLA would cost the keyed hash and hold every packet until its key "
                  "is disclosed: one key interval and the clocks' bound on every delivery.")
    if not ed:
        console.print("openssl speed ed25519 did not run: no signature row")
    return rows
