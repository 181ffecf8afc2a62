"""The back-off datagram: an overloaded leader asks a client to pause. Pure.

Sent by the leader from its inbound socket to the source address of a batch
it accepted from that client (docs/protocol.md, section 4a). It names the
batch it answers by its first client seq: a client honours only a back-off
for a batch it has in flight and has not been told about before, so a
copy replayed later asks for nothing. With a client key it carries an
HMAC-SHA256 of its fields under that key; the magic keeps it from ever
reading as an inbound batch (whose first ten bytes are a client id).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from tape.protocol.errors import ProtocolError

MAGIC = b"TBO1"
FIELDS = struct.Struct(">4s10sQQH")  # magic, client id, leader term, first client seq answered, retry after (ms)
MAC_SIZE = 32


@dataclass(frozen=True)
class BackOff:
    client: bytes
    term: int
    client_seq: int
    retry_ms: int


def encode(client: bytes, term: int, client_seq: int, retry_ms: int, key: bytes | None) -> bytes:
    body = FIELDS.pack(MAGIC, client, term, client_seq, retry_ms)
    return body + hmac.new(key, body, hashlib.sha256).digest() if key else body


def decode(data: bytes, key: bytes | None) -> BackOff:
    """Raises ProtocolError: `bad_backoff` (size or magic), `unauthenticated` (MAC)."""
    want = FIELDS.size + (MAC_SIZE if key else 0)
    if len(data) != want or data[:4] != MAGIC:
        raise ProtocolError("bad_backoff", f"{len(data)} bytes, not a {want}-byte back-off")
    if key:
        body, mac = data[:FIELDS.size], data[FIELDS.size:]
        if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
            raise ProtocolError("unauthenticated", "the back-off's MAC is not the client key's", FIELDS.size)
    _, client, term, client_seq, retry_ms = FIELDS.unpack_from(data)
    return BackOff(client, term, client_seq, retry_ms)
