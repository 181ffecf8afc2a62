"""Authenticated TCP links: a record layer under the frames. Pure.

With a key, the replication links between voters and the alert links from
replicas to the emitter (the cluster key), and replay connections to the
rewinders (the stream key), run the link's own frames inside authenticated
records; the frames themselves do not change.

Handshake: the connecting side sends its hello at once; the accepting side
answers with its own, in the version the connecting side offered, if that
hello names a key it holds (a stranger gets no nonce, only the close; both
sides wait for the other's nonce before their first record anyway, so
answering costs no round trip):

    magic "TPL3" (or "TPL2") | key id 8 | nonce 16          (28 bytes)

The key is the pair's: each pair of nodes that may talk shares a key of its
own (`pair_key`), so the key a hello names (by its id: rotation works as
for the stream, docs/security.md) says which configured node connects, and
the handshake proves it (`LinkEnd.peer`): only the two ends hold it. A
listener accepts only the pairs of the peers whose role may send to it, so
a replica's keys open no voter's port, and no node can speak in another's
name. (Replay logins share the stream key, whoever reads the stream: their
peer is `ANY_LISTENER`.) Each direction then has its own key,

    BLAKE2b-256(key=K, person="tape-link-c2s" or "-s2c", nonce_c | nonce_s)

and every record is

    length u32 (of the payload) | tag 16 | payload

where tag = BLAKE2b-128(key=direction key, counter u64 | digest) and
digest = BLAKE3-256(payload) (TPL3; BLAKE2b-256 in TPL2), the counter
numbering the direction's records from 0. The payload is hashed without
the key, so that a leader writing the same append to every follower hashes
it once (`record_digests`), not once a link. BLAKE3 hashes an append of 4
to 128 KiB 2.5-5.6x faster than BLAKE2b here (its chunks go through the
processor's vector units side by side), and every voter hashes every
message it replicates.
Fresh nonces from both sides make every connection's keys new, so a
recorded record is worth nothing on another connection, and the counter
rejects one replayed, dropped or reordered on the same. The first record
proves the key: a peer without it gets no further than its hello. The
nonces come from the shell (this module draws no randomness).

Versions: a TPL3 node accepts a TPL2 connection (and answers in TPL2), and
a TPL3 node whose peer answers in TPL2 (a node not yet upgraded, which
refused the TPL3 hello) connects again offering TPL2 (`OlderPeer`): a
cluster upgrades one node at a time.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Callable

from blake3 import blake3

from tape.protocol.errors import ProtocolError
from tape.protocol.streamauth import key_id

MAGIC = b"TPL3"  # the version offered when connecting
OLDER = b"TPL2"  # still spoken with a peer that offers or answers it
NONCE_SIZE = 16
HELLO = struct.Struct(">4s8s16s")
RECORD = struct.Struct(">I16s")
TAG_SIZE = 16
DIGEST_SIZE = 32  # a record payload's unkeyed digest, which the tag covers
MAX_RECORD = 1 << 20  # payload bytes of one record: larger writes are split
_COUNTER = struct.Struct(">Q")


def _blake3(data) -> bytes:
    return blake3(data).digest()


def _blake2b(data) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


DIGESTS: dict[bytes, Callable[[bytes], bytes]] = {MAGIC: _blake3, OLDER: _blake2b}  # a payload's, by version


class OlderPeer(ProtocolError):
    """The accepting side answered in an older version we speak: connect again offering it."""

    def __init__(self, version: bytes):
        super().__init__("older_link_version", f"the peer speaks {version.decode()}", 0)
        self.version = version


def offered(peer_hello: bytes) -> bytes:
    """The version a connecting side's hello offers, if we speak it; ProtocolError if not (or not a
    hello): nothing is answered then."""
    if len(peer_hello) != HELLO.size:
        raise ProtocolError("bad_hello", f"a link hello is {HELLO.size} bytes, got {len(peer_hello)}", 0)
    magic = peer_hello[:4]
    if magic not in DIGESTS:
        what = "an older link version (every node runs TPL2 or later)" if magic == b"TPL1" else "magic"
        raise ProtocolError("bad_hello", f"not a link hello ({what})", 0)
    return magic


ANY_LISTENER = b""  # the peer of a link whose key is shared (replay's: the stream key)
PAIR_PERSON = b"tape-link-pair"


def pair_key(cluster_key: bytes, a: str, b: str) -> bytes:
    """The key nodes `a` and `b` (and no other) share, derived from a cluster key: the config
    generator writes each host only the pairs of its own nodes (runtime/config.py keys_of_host)."""
    names = "/".join(sorted((a, b))).encode()
    return hashlib.blake2b(names, key=cluster_key, person=PAIR_PERSON, digest_size=32).digest()


class LinkKeys:
    """A node's link keys, by peer: each peer's first key is offered when connecting to it; any
    peer's key is accepted, and names the peer. `LinkKeys(keys)`: one shared key list, whose
    holders are all ANY_LISTENER."""

    def __init__(self, keys: list[bytes] | None = None, *, peers: dict[bytes, list[bytes]] | None = None):
        if peers is None and not keys:
            raise ValueError("no link key")
        peers = {ANY_LISTENER: keys} if peers is None else peers  # (no peers: a node alone, accepting none)
        if not all(peers.values()):
            raise ValueError("no link key")
        self.signing = {peer: keys[0] for peer, keys in peers.items()}
        self.by_id = {key_id(k): (peer, k) for peer, keys in peers.items() for k in keys}
        assert len(self.by_id) == sum(map(len, peers.values())), "two peers share a key"

    def hello(self, nonce: bytes, version: bytes = MAGIC, peer: bytes = ANY_LISTENER) -> bytes:
        """KeyError if we hold no key for `peer`."""
        assert len(nonce) == NONCE_SIZE and version in DIGESTS
        return HELLO.pack(version, key_id(self.signing[peer]), nonce)

    def accept(self, own_nonce: bytes, peer_hello: bytes, initiator: bool, version: bytes = MAGIC,
               peer: bytes = ANY_LISTENER) -> tuple[bytes, "Sealer", "Opener"]:
        """The peer and the two directions of a link in `version` (ours: offered when connecting,
        answered when accepting), once the peer's hello is in (`peer`: the one we connected to);
        ProtocolError if it is not a hello in that version (OlderPeer: the accepting side answered
        in an older one we speak), or names a key this side does not hold."""
        magic = offered(peer_hello)
        if magic != version:
            if initiator and magic == OLDER:
                raise OlderPeer(magic)
            raise ProtocolError("bad_hello", f"answered in {magic.decode()}, not {version.decode()}", 0)
        _, kid, peer_nonce = HELLO.unpack(peer_hello)
        if initiator:
            key = self.signing[peer]
        else:
            peer, key = self.by_id.get(kid, (None, None))
        if key is None:
            raise ProtocolError("unknown_key", "the peer's link key is not one we share with a peer that may "
                                "connect here", 4)
        nonces = own_nonce + peer_nonce if initiator else peer_nonce + own_nonce
        c2s, s2c = (hashlib.blake2b(nonces, key=key, person=p).digest() for p in (b"tape-link-c2s", b"tape-link-s2c"))
        out, into = (c2s, s2c) if initiator else (s2c, c2s)
        return peer, Sealer(out, version), Opener(into, version)


class LinkEnd:
    """One end of a link with keys: the hellos, then the records both ways. What `opening` and
    `receive` return is written to the connection, their payloads handed on; runtime/links.py
    does it over asyncio's streams, the simulator over its connections."""

    def __init__(self, keys: LinkKeys, nonce: bytes, initiator: bool, version: bytes = MAGIC,
                 peer: bytes = ANY_LISTENER):
        """`peer`: connecting, the node we connect to (accepting, the hello says who it is)."""
        self.keys, self.nonce, self.initiator, self.version = keys, nonce, initiator, version
        self.peer = peer  # proven once established: the only other holder of the link's key
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self._hello = b""  # the peer's hello, as far as it has come

    def opening(self) -> bytes:
        """What to write as the connection opens: the connecting side's hello (the accepting
        side answers the hello it is offered)."""
        return self.keys.hello(self.nonce, self.version, self.peer) if self.initiator else b""

    @property
    def established(self) -> bool:
        return self.opener is not None

    def on_hello(self, peer_hello: bytes) -> bytes:
        """The peer's hello, whole: the link's two directions, and what to write back (accepting:
        its own hello, in the version offered). ProtocolError if it is not a hello we accept
        (OlderPeer: connecting, the peer answered in an older version we speak)."""
        assert not self.established
        if not self.initiator:
            self.version = offered(peer_hello)
        self.peer, self.sealer, self.opener = self.keys.accept(self.nonce, peer_hello, self.initiator, self.version,
                                                               self.peer)
        return b"" if self.initiator else self.keys.hello(self.nonce, self.version, self.peer)

    def receive(self, data: bytes) -> tuple[bytes, bytes]:
        """Bytes as they came: (what to write back, the payloads they complete). ProtocolError as
        on_hello, or if a record does not verify."""
        if self.opener is not None:
            return b"", self.opener.open(data)
        self._hello += data
        if len(self._hello) < HELLO.size:
            return b"", b""
        hello, rest = self._hello[:HELLO.size], self._hello[HELLO.size:]
        self._hello = b""
        reply = self.on_hello(hello)
        return reply, self.opener.open(rest) if rest else b""

    def seal(self, data: bytes, digests: list[bytes] | None = None) -> bytes:
        assert self.sealer is not None, "a record before the handshake"
        return self.sealer.seal(data, digests)


def record_digests(data: bytes, version: bytes = MAGIC) -> list[bytes]:
    """The digest of each record payload `Sealer.seal` cuts `data` into: the same for every link
    of a version, so that bytes written to several are hashed once."""
    digest, view = DIGESTS[version], memoryview(data)
    return [digest(view[at:at + MAX_RECORD]) for at in range(0, len(data), MAX_RECORD)]


def _tag(key: bytes, counter: int, digest: bytes) -> bytes:
    return hashlib.blake2b(_COUNTER.pack(counter) + digest, key=key, digest_size=TAG_SIZE).digest()


class Sealer:
    """One direction's writer: bytes to send for a payload."""

    def __init__(self, key: bytes, version: bytes = MAGIC):
        self._key = key
        self._counter = 0
        self.version = version

    def seal(self, data: bytes, digests: list[bytes] | None = None) -> bytes:
        """`digests`: record_digests(data, self.version), if the caller has them (the same bytes to
        other links)."""
        digests = record_digests(data, self.version) if digests is None else digests
        assert len(digests) == -(-len(data) // MAX_RECORD), "digests of other bytes"
        out = []
        view = memoryview(data)
        for at, digest in zip(range(0, len(data), MAX_RECORD), digests):
            part = view[at:at + MAX_RECORD]
            out += (RECORD.pack(len(part), _tag(self._key, self._counter, digest)), part)
            self._counter += 1
        return b"".join(out)


class Opener:
    """One direction's reader: the verified payload bytes of what has come in so far."""

    def __init__(self, key: bytes, version: bytes = MAGIC):
        self._key = key
        self._digest = DIGESTS[version]
        self._counter = 0
        self._buf = bytearray()
        self._consumed = 0  # stream offset of _buf[0], for error offsets

    def open(self, data: bytes) -> bytes:
        """The payloads of the records `data` completes, joined. Each is hashed where it lies in
        the buffer and copied once, into what is returned (slicing the buffer into bytes first
        copied it twice: ~11% of a rewinder endpoint's samples, py-spy)."""
        buf = self._buf
        buf += data
        payloads: list[memoryview] = []
        pos = 0
        with memoryview(buf) as view:
            try:
                while len(buf) - pos >= RECORD.size:
                    length, tag = RECORD.unpack_from(buf, pos)
                    if not 1 <= length <= MAX_RECORD:
                        raise ProtocolError("bad_record", f"record length {length}", self._consumed + pos)
                    end = pos + RECORD.size + length
                    if len(buf) < end:
                        break
                    payload = view[pos + RECORD.size:end]
                    if not hmac.compare_digest(_tag(self._key, self._counter, self._digest(payload)), tag):
                        raise ProtocolError("bad_tag", f"record {self._counter} does not verify",
                                            self._consumed + pos)
                    self._counter += 1
                    payloads.append(payload)
                    pos = end
                plain = b"".join(payloads)
            finally:
                for payload in payloads:  # the buffer can change size only once no view holds it
                    payload.release()
        if pos:
            del buf[:pos]
            self._consumed += pos
        return plain
