"""The leader's advice to a client, two datagrams of one layout. Pure.

- Back-off (`TBO1`): an overloaded leader asks a client to pause. It names
  the batch it answers by its first client seq: a client honours only a
  back-off for a batch it has in flight and has not been told about before,
  so a copy replayed later asks for nothing.
- Resend (`TRS1`): a batch arrived ahead of one the leader never got (it
  holds it until the gap is filled); it names the first client seq missing,
  so that the client sends that batch again at once instead of after its
  resend timeout (docs/stream.md). A client acts on it only for a batch in
  flight and not sent in the last few ms, so a replayed copy costs at most
  one duplicate batch, which the leader drops.

Both are sent by the leader from its inbound socket to the source address of
a batch whose MAC checked out (docs/protocol.md, section 4a), smaller than
that batch. With a client key they carry an HMAC-SHA256 of their fields
under that key; the magic keeps them from ever reading as an inbound batch
(whose first ten bytes are a client id).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tape.protocol import clientmac
from tape.protocol.errors import ProtocolError

MAGIC = b"TBO1"
RESEND_MAGIC = b"TRS1"
# magic, client id, leader term, client seq (a back-off: the first of the batch answered; a resend:
# the first missing), retry after in ms (a back-off; 0 in a resend)
FIELDS = struct.Struct(">4s10sQQH")
MAC_SIZE = 32


@dataclass(frozen=True)
class BackOff:
    client: bytes
    term: int
    client_seq: int
    retry_ms: int


@dataclass(frozen=True)
class Resend:
    client: bytes
    term: int
    client_seq: int


def _sealed(body: bytes, key: bytes | None) -> bytes:
    return body + clientmac.mac(key, body) if key else body


def encode(client: bytes, term: int, client_seq: int, retry_ms: int, key: bytes | None) -> bytes:
    return _sealed(FIELDS.pack(MAGIC, client, term, client_seq, retry_ms), key)


def encode_resend(client: bytes, term: int, client_seq: int, key: bytes | None) -> bytes:
    return _sealed(FIELDS.pack(RESEND_MAGIC, client, term, client_seq, 0), key)


def decode(data: bytes, key: bytes | None) -> BackOff | Resend:
    """Raises ProtocolError: `bad_backoff` (size or magic), `unauthenticated` (MAC)."""
    want = FIELDS.size + (MAC_SIZE if key else 0)
    if len(data) != want or data[:4] not in (MAGIC, RESEND_MAGIC):
        raise ProtocolError("bad_backoff", f"{len(data)} bytes, not a {want}-byte back-off or resend")
    if key:
        body, mac = data[:FIELDS.size], data[FIELDS.size:]
        if not clientmac.verify(key, body, mac):
            raise ProtocolError("unauthenticated", "the advice's MAC is not the client key's", FIELDS.size)
    magic, client, term, client_seq, retry_ms = FIELDS.unpack_from(data)
    return BackOff(client, term, client_seq, retry_ms) if magic == MAGIC else Resend(client, term, client_seq)
