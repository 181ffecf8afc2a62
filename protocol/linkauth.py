"""Authenticated TCP links: a record layer under the frames. Pure.

With a key, the replication links between voters and the alert links from
replicas to the emitter (the cluster key), and replay connections to the
rewinders (the stream key), run the link's own frames inside authenticated
records; the frames themselves do not change.

Handshake: each side first sends a hello, both at once (no round trip is
waited for before sending it):

    magic "TPL2" | key id 8 | nonce 16                      (28 bytes)

The key is the connecting side's (named by its id: rotation works as for
the stream, docs/security.md); the accepting side must hold it. Each
direction then has its own key,

    BLAKE2b-256(key=K, person="tape-link-c2s" or "-s2c", nonce_c | nonce_s)

and every record is

    length u32 (of the payload) | tag 16 | payload

where tag = BLAKE2b-128(key=direction key, counter u64 | digest) and
digest = BLAKE2b-256(payload), the counter numbering the direction's
records from 0. The payload is hashed without the key, so that a leader
writing the same append to every follower hashes it once
(`record_digests`), not once a link (TPL1 keyed the tag over the payload
itself: three passes over every message at the leader). Fresh nonces from both
sides make every connection's keys new, so a recorded record is worth
nothing on another connection, and the counter rejects one replayed,
dropped or reordered on the same. The first record proves the key: a peer
without it gets no further than its hello. The nonces come from the shell
(this module draws no randomness).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .errors import ProtocolError
from .streamauth import key_id

MAGIC = b"TPL2"
NONCE_SIZE = 16
HELLO = struct.Struct(">4s8s16s")
RECORD = struct.Struct(">I16s")
TAG_SIZE = 16
DIGEST_SIZE = 32  # a record payload's BLAKE2b, which the tag covers
MAX_RECORD = 1 << 20  # payload bytes of one record: larger writes are split
_COUNTER = struct.Struct(">Q")


class LinkKeys:
    """A link's keys: `keys[0]` is offered when connecting; any is accepted."""

    def __init__(self, keys: list[bytes]):
        if not keys:
            raise ValueError("no link key")
        self.signing = keys[0]
        self.by_id = {key_id(k): k for k in keys}

    def hello(self, nonce: bytes) -> bytes:
        assert len(nonce) == NONCE_SIZE
        return HELLO.pack(MAGIC, key_id(self.signing), nonce)

    def accept(self, own_nonce: bytes, peer_hello: bytes, initiator: bool) -> tuple["Sealer", "Opener"]:
        """The two directions of a link, once the peer's hello is in; ProtocolError if it is not
        a hello, or names a key this side does not hold."""
        if len(peer_hello) != HELLO.size:
            raise ProtocolError("bad_hello", f"a link hello is {HELLO.size} bytes, got {len(peer_hello)}", 0)
        magic, kid, peer_nonce = HELLO.unpack(peer_hello)
        if magic != MAGIC:
            raise ProtocolError("bad_hello", "not a link hello (magic)", 0)
        key = self.signing if initiator else self.by_id.get(kid)
        if key is None:
            raise ProtocolError("unknown_key", "the peer's link key is not one of ours", 4)
        nonces = own_nonce + peer_nonce if initiator else peer_nonce + own_nonce
        c2s, s2c = (hashlib.blake2b(nonces, key=key, person=p).digest() for p in (b"tape-link-c2s", b"tape-link-s2c"))
        return (Sealer(c2s), Opener(s2c)) if initiator else (Sealer(s2c), Opener(c2s))


def record_digests(data: bytes) -> list[bytes]:
    """The digest of each record payload `Sealer.seal` cuts `data` into: the same for every link,
    so that bytes written to several are hashed once."""
    view = memoryview(data)
    return [hashlib.blake2b(view[at:at + MAX_RECORD], digest_size=DIGEST_SIZE).digest()
            for at in range(0, len(data), MAX_RECORD)]


def _tag(key: bytes, counter: int, digest: bytes) -> bytes:
    return hashlib.blake2b(_COUNTER.pack(counter) + digest, key=key, digest_size=TAG_SIZE).digest()


class Sealer:
    """One direction's writer: bytes to send for a payload."""

    def __init__(self, key: bytes):
        self._key = key
        self._counter = 0

    def seal(self, data: bytes, digests: list[bytes] | None = None) -> bytes:
        """`digests`: record_digests(data), if the caller has them (the same bytes to other links)."""
        digests = record_digests(data) if digests is None else digests
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

    def __init__(self, key: bytes):
        self._key = key
        self._counter = 0
        self._buf = bytearray()
        self._consumed = 0  # stream offset of _buf[0], for error offsets

    def open(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= RECORD.size:
            length, tag = RECORD.unpack_from(buf, pos)
            if not 1 <= length <= MAX_RECORD:
                raise ProtocolError("bad_record", f"record length {length}", self._consumed + pos)
            end = pos + RECORD.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[pos + RECORD.size:end])
            digest = hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()
            if not hmac.compare_digest(_tag(self._key, self._counter, digest), tag):
                raise ProtocolError("bad_tag", f"record {self._counter} does not verify", self._consumed + pos)
            self._counter += 1
            out.append(payload)
            pos = end
        if pos:
            del buf[:pos]
            self._consumed += pos
        return b"".join(out)
