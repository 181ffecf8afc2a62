"""HMAC-SHA256 (RFC 2104) under a client key: the MAC of every inbound batch a client signs and the
leader checks, and of the leader's advice back to the client (protocol/backoff.py).

`hmac.digest` hashes the key's two padded blocks again on every call; here they are hashed once a
key and copied, which takes a 1,400-byte datagram's MAC from ~2.3 to ~1.4 µs on this project's
machine. The result is `hmac.digest(key, data, "sha256")` exactly (tests/test_clientmac.py)."""

from __future__ import annotations

import functools
import hashlib
import hmac

from tape.protocol.limits import MAX_CLIENT_KEYS

BLOCK_SIZE = 64  # SHA-256's block: keys longer than this are hashed first (RFC 2104, section 2)
_INNER_PAD = bytes(b ^ 0x36 for b in range(256))
_OUTER_PAD = bytes(b ^ 0x5C for b in range(256))


@functools.lru_cache(maxsize=MAX_CLIENT_KEYS)
def _pads(key: bytes) -> tuple:
    if len(key) > BLOCK_SIZE:
        key = hashlib.sha256(key).digest()
    key = key.ljust(BLOCK_SIZE, b"\0")
    return hashlib.sha256(key.translate(_INNER_PAD)), hashlib.sha256(key.translate(_OUTER_PAD))


def mac(key: bytes, data: bytes) -> bytes:
    """The 32-byte HMAC-SHA256 of `data` under `key`."""
    inner, outer = _pads(key)
    inner = inner.copy()
    inner.update(data)
    outer = outer.copy()
    outer.update(inner.digest())
    return outer.digest()


def verify(key: bytes, data: bytes, tag: bytes) -> bool:
    """Whether `tag` is `data`'s MAC under `key` (compared in constant time)."""
    return hmac.compare_digest(tag, mac(key, data))
