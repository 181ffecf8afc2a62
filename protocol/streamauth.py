"""The public stream's authentication: seals in the log. Pure.

With a stream key, the leader ends every packet it cuts with a *seal*: a
sequenced control message ('A') that is a log entry like any other (it has
its seq, is journaled, replicated and replayed) and carries a keyed
128-bit tag over the whole packet that holds it:

    'A' | first seq covered u64 | entries covered i64 | tag 16 | key id 8 |
    algorithm u64 | stamp u64 | origin (the leader) 10 | listener tag 8

Two tags, for two classes of reader. The tag, by the stream key, is what the
cluster's listeners (replicas, rewinders) check. The listener tag, by the
listener key, made first (the tag covers it) and cut to 8 bytes, is what
clients and readers outside the cluster check: they hold the listener key
and not the stream key, so a client host can make nothing a replica or a
rewinder takes (an 8-byte tag: one forgery in 2^64 tries, each a datagram).
Without a listener key the field is zero, as it was before it existed.

The algorithm names the tag's hash: 0 keyed BLAKE2b-128 (the first
algorithm; its logs are still read), 1 keyed BLAKE3 cut to 16 bytes, its 32-byte key
derived from the stream key (`blake3_key`). A leader makes the one its
config names (`[stream] seal`); listeners check either, so a log sealed
both ways verifies whole.

The tag is computed over the packet's bytes (MoldUDP64 header and every
block) with the tag field zeroed, the listener tag with both tags zeroed. A
packet sealed so is exactly one *range*: the entries from its first seq
through the seal. Whoever sends that range
again (a rewinder's gap fill, from its journal) sends the same bytes, so
the tag verifies whatever the path; a packet that is not one whole sealed
range, or whose tag does not verify, changes nothing. Every counted block
is a real log entry, so the packets stay plain MoldUDP64 (Wireshark's
dissector and any decoder of the spec read them as such).

Keys: the first of a list signs, any verifies (rotation); a seal names its
key by an 8-byte id (a hash of the key), never the key; a listener tries
each of its listener keys (two at most).

Gap-fill requests are signed with the stream key or a listener key, and name
the address the answer goes to, so a request recorded on the LAN and sent
again from a forged source address cannot aim answers at anyone but its
signer; its nonce, above any its signer sent before, refuses it sent again:

    MoldUDP64 request 20 | reply IPv4 4 | reply port u16 | nonce u64 | key id 8 | tag 16
    tag = BLAKE2b-128, keyed, personalised "tape-gap-req", over the first 34 bytes
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import struct

from blake3 import blake3

from tape.protocol.messages import (
    AUTH,
    BLOCK_PREFIX,
    CLIENT_SEQ_AT,
    ORIGIN_AT,
    SEQUENCED,
    SEQUENCED_BLOCK_SIZE,
    SEQUENCED_SIZE,
)
from tape.protocol.moldudp64 import HEADER, HEADER_SIZE

try:
    from tape.protocol._speedups import seal_run, set_blake3_tagger, verify_sealed
except ImportError:  # built without a C compiler
    seal_run = verify_sealed = set_blake3_tagger = None

TAG_SIZE = 16
LISTENER_TAG_SIZE = 8  # the seal's last field: the listener key's tag, cut to fit (0 without a listener key)
_REPLY = struct.Struct(">4sHQ")  # the reply address and port, and the request's nonce
_SIGNED_REQUEST = HEADER_SIZE + _REPLY.size  # the bytes a request's tag covers
SIGNED_REQUEST_SIZE = _SIGNED_REQUEST + 8 + TAG_SIZE
UNFRESH_REQUEST_SIZE = SIGNED_REQUEST_SIZE - 8  # an older version's signed request: no nonce
_REQUEST_PERSON = b"tape-gap-req"
_TAG_AT = 1 + 8 + 8  # offset of the tag inside a seal
SEAL_KEY_ID_AT = _TAG_AT + TAG_SIZE  # and of the key id that names the tag's key
_ZERO_TAG = bytes(TAG_SIZE)
SEAL_BLAKE2B, SEAL_BLAKE3 = 0, 1
SEALS = {"blake2b": SEAL_BLAKE2B, "blake3": SEAL_BLAKE3}  # `[stream] seal`: what a leader's seals are made with
# Packets from this size are sealed with BLAKE3 in the default configs: from eight of its 1 KiB chunks it
# hashes them side by side (4.4x BLAKE2b at 8,972 bytes here; at 1,400 bytes it is the slower).
BLAKE3_SEALS_FROM = 8192
_BLAKE3_CONTEXT = "tape 2026-11-28 stream seal BLAKE3 key"


def key_id(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8, person=b"tape-key-id").digest()


@functools.lru_cache(maxsize=64)
def blake3_key(key: bytes) -> bytes:
    """The 32-byte key a BLAKE3 seal is made with: derived from the stream key (of any length)."""
    return blake3(key, derive_key_context=_BLAKE3_CONTEXT).digest()


def blake3_tag(key: bytes, packet: bytes) -> bytes:
    return blake3(packet, key=blake3_key(key)).digest(TAG_SIZE)


def seal_tag(key: bytes, packet: bytes, algorithm: int) -> bytes:
    """The tag of `packet` (its tag field zeroed) by the seal algorithm named."""
    if algorithm == SEAL_BLAKE3:
        return blake3_tag(key, packet)
    return hashlib.blake2b(packet, key=key, digest_size=TAG_SIZE).digest()


if set_blake3_tagger is not None:
    set_blake3_tagger(blake3_tag)  # the C checks call it for BLAKE3 seals: it is the only BLAKE3 we have


SEAL_FAILURES = ("unsealed", "unknown_seal", "unknown_key", "bad_tag")  # what verify() returns of a bad packet


def _seal_shape(data: bytes) -> str | None:
    """None if `data` is one whole range ended by a seal of a known algorithm, else why not."""
    if len(data) < HEADER_SIZE + SEQUENCED_BLOCK_SIZE:
        return "unsealed"
    _, seq, count = HEADER.unpack_from(data)
    if len(data) != HEADER_SIZE + count * SEQUENCED_BLOCK_SIZE or data[-SEQUENCED_SIZE] != AUTH:
        return "unsealed"
    seal = SEQUENCED.unpack_from(data, len(data) - SEQUENCED_SIZE)
    if seal[1] != seq or seal[2] != count - 1:
        return "unsealed"
    return "unknown_seal" if seal[5] not in SEALS.values() else None


class StreamKeys:
    """The stream keys of a node: `keys[0]` signs, its seals made by `seal` (SEALS); any key
    verifies, and seals of either algorithm."""

    def __init__(self, keys: list[bytes], seal: str = "blake2b", listeners: list[bytes] = ()):
        """`listeners`: the listener keys (ListenerKeys): a leader tags its seals with the first too, a
        rewinder takes gap requests signed with any."""
        if not keys:
            raise ValueError("no stream key")
        self.signing = keys[0]
        self.signing_id = key_id(keys[0])
        self.by_id = {key_id(k): k for k in keys}
        self.verifying = self.by_id  # what the C check takes: the seal's tag, by its key id
        self.algorithm = SEALS[seal]
        self.listener_signing = listeners[0] if listeners else None
        self.request_keys = {**self.by_id, **{key_id(k): k for k in listeners}}

    def seal_packet(self, session: bytes, first_seq: int, entries: list[bytes], stamp_ns: int,
                    origin: bytes) -> tuple[bytes, bytes]:
        """(the seal entry, the packet of `entries` and the seal) for one range from `first_seq`."""
        unsigned = SEQUENCED.pack(AUTH, first_seq, len(entries), _ZERO_TAG, self.signing_id, self.algorithm,
                                  stamp_ns, origin, 0)
        # Every entry is a sequenced message (SEQUENCED_SIZE bytes): one block prefix joined between.
        packet = bytearray(HEADER.pack(session, first_seq, len(entries) + 1) + BLOCK_PREFIX
                           + BLOCK_PREFIX.join([*entries, unsigned]))
        at = len(packet) - SEQUENCED_SIZE + _TAG_AT
        if self.listener_signing is not None:  # first: the seal's tag covers it
            packet[-LISTENER_TAG_SIZE:] = seal_tag(self.listener_signing, packet, self.algorithm)[:LISTENER_TAG_SIZE]
        tag = seal_tag(self.signing, packet, self.algorithm)  # over the packet with a zero tag, then patched in
        packet[at:at + TAG_SIZE] = tag
        return bytes(packet[-SEQUENCED_SIZE:]), bytes(packet)

    def seal_run(self, session: bytes, first_seq: int, entries: list[bytes], per: int, stamp_ns: int,
                 origin: bytes) -> tuple[list[bytes], list[bytes]]:
        """The entries cut `per` to a packet, each packet one range ended by its seal: (the entries
        with every seal in its place, the packets). The leader's per-batch call: in C where built,
        `seal_run_pure` its definition."""
        if seal_run is None:
            return self.seal_run_pure(session, first_seq, entries, per, stamp_ns, origin)
        return seal_run(entries, per, session, first_seq, stamp_ns, origin, self.signing, self.signing_id,
                        self.algorithm, self.listener_signing)

    def seal_run_pure(self, session: bytes, first_seq: int, entries: list[bytes], per: int, stamp_ns: int,
                      origin: bytes) -> tuple[list[bytes], list[bytes]]:
        sealed, packets = [], []
        for i in range(0, len(entries), per):
            chunk = entries[i:i + per]
            seal, packet = self.seal_packet(session, first_seq, chunk, stamp_ns, origin)
            sealed += chunk
            sealed.append(seal)
            packets.append(packet)
            first_seq += len(chunk) + 1
        return sealed, packets

    def verify(self, data: bytes) -> str | None:
        """None if `data` is one whole sealed range whose tag verifies, else the reason (the
        listeners' per-packet check: in C where built, `verify_pure` its definition)."""
        if verify_sealed is None:
            return self.verify_pure(data)
        return verify_sealed(data, self.by_id)

    def verify_pure(self, data: bytes) -> str | None:
        reason = _seal_shape(data)
        if reason is not None:
            return reason
        seal = SEQUENCED.unpack_from(data, len(data) - SEQUENCED_SIZE)
        key = self.by_id.get(seal[4])
        if key is None:
            return "unknown_key"
        at = len(data) - SEQUENCED_SIZE + _TAG_AT
        tag = seal_tag(key, data[:at] + _ZERO_TAG + data[at + TAG_SIZE:], seal[5])
        if not hmac.compare_digest(tag, data[at:at + TAG_SIZE]):
            return "bad_tag"
        return None


    def sign_request(self, request: bytes, reply: tuple[str, int], nonce: int) -> bytes:
        """A MoldUDP64 request signed, its answer bound to `reply` (IPv4 host, port), with a nonce
        greater than any its requester used before (a rewinder refuses one it saw surpassed)."""
        body = request + _REPLY.pack(ipaddress.IPv4Address(reply[0]).packed, reply[1], nonce)
        tag = hashlib.blake2b(body, key=self.signing, digest_size=TAG_SIZE, person=_REQUEST_PERSON).digest()
        return body + self.signing_id + tag

    def verify_request(self, data: bytes, source: tuple[str, int]) -> str | int:
        """The nonce of a signed request whose tag verifies and that names `source` (where the
        datagram came from) as its reply address, else the reason it does not (a str)."""
        if len(data) != SIGNED_REQUEST_SIZE:
            return "unfresh_request" if len(data) == UNFRESH_REQUEST_SIZE else "unsigned_request"
        key = self.request_keys.get(data[_SIGNED_REQUEST:_SIGNED_REQUEST + 8])
        if key is None:
            return "unknown_key"
        body = data[:_SIGNED_REQUEST]
        tag = hashlib.blake2b(body, key=key, digest_size=TAG_SIZE, person=_REQUEST_PERSON).digest()
        if not hmac.compare_digest(tag, data[-TAG_SIZE:]):
            return "bad_tag"
        host, port, nonce = _REPLY.unpack_from(data, HEADER_SIZE)
        if (str(ipaddress.IPv4Address(host)), port) != tuple(source):
            return "wrong_source"
        return nonce


class ListenerKeys:
    """A listener's keys where it is trusted to read the stream, never to write it: a client's, or a
    reader's outside the cluster. It checks a seal's listener tag, which the leader makes with the
    first listener key and nobody else can: the seal's own tag, by the stream key that replicas and
    rewinders check, it cannot make (docs/security.md). It signs gap requests and replay logins."""

    def __init__(self, keys: list[bytes]):
        if not keys:
            raise ValueError("no listener key")
        self.verifying = tuple(keys)  # what the C check takes: every listener key, tried in turn
        self._signing = StreamKeys(keys[:1])  # signs gap requests as a stream key would, named by its id

    def verify(self, data: bytes) -> str | None:
        """None if `data` is one whole sealed range whose listener tag verifies, else the reason
        ("unknown_key": sealed without a listener tag)."""
        if verify_sealed is None:
            return self.verify_pure(data)
        return verify_sealed(data, self.verifying)

    def verify_pure(self, data: bytes) -> str | None:
        reason = _seal_shape(data)
        if reason is not None:
            return reason
        algorithm = SEQUENCED.unpack_from(data, len(data) - SEQUENCED_SIZE)[5]
        at = len(data) - SEQUENCED_SIZE + _TAG_AT
        unsigned = data[:at] + _ZERO_TAG + data[at + TAG_SIZE:-LISTENER_TAG_SIZE] + _ZERO_TAG[:LISTENER_TAG_SIZE]
        tag = data[-LISTENER_TAG_SIZE:]
        if any(hmac.compare_digest(seal_tag(k, unsigned, algorithm)[:LISTENER_TAG_SIZE], tag) for k in self.verifying):
            return None
        return "unknown_key" if tag == _ZERO_TAG[:LISTENER_TAG_SIZE] else "bad_tag"

    def sign_request(self, request: bytes, reply: tuple[str, int], nonce: int) -> bytes:
        return self._signing.sign_request(request, reply, nonce)


def seal_origin(packet: bytes) -> bytes | None:
    """The leader named by the seal that ends a packet (its origin field), or None if the packet
    does not end with a seal. Read only from packets a listener verified."""
    if len(packet) < HEADER_SIZE + SEQUENCED_BLOCK_SIZE or packet[-SEQUENCED_SIZE] != AUTH:
        return None
    seal = len(packet) - SEQUENCED_SIZE
    return packet[seal + ORIGIN_AT:seal + CLIENT_SEQ_AT]


def seal_covers(entry: bytes) -> tuple[int, int] | None:
    """(first seq, entries) a seal covers, or None if `entry` is no seal."""
    if entry[0] != AUTH:
        return None
    m = SEQUENCED.unpack(entry)
    return m[1], m[2]


def sealed_ranges(entries: list[bytes], first_seq: int) -> tuple[list[tuple[int, list[bytes]]], int]:
    """Consecutive log entries from `first_seq` (a TCP replay) cut into the sealed ranges they
    hold, so that each can be sent through a listener as the packet its leader sealed (the tag
    verifies only over that packet). Returns ([(a range's first seq, its entries and seal)], how
    many entries were used); entries after the last seal wait for the next ones. Entries before
    a range's first seq that no seal here covers are skipped: counted as used, never delivered
    (a listener asks a rewinder for them)."""
    ranges, start = [], 0
    for i, entry in enumerate(entries):
        covers = seal_covers(entry)
        if covers is None:
            continue
        first, count = covers
        at = first - first_seq  # the range's first entry in `entries`
        if first + count == first_seq + i and at >= start:
            ranges.append((first, entries[at:i + 1]))
        start = i + 1
    return ranges, start
