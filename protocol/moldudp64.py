"""MoldUDP64 (NASDAQ spec 1.00): downstream packets, heartbeats, end of
session, request packets, and a packer that fills packets to a size limit.

Sans-I/O: functions over bytes only. All integers are big-endian.

    downstream packet: session(10 ASCII) seq(u64) count(u16) blocks...
    block:             length(u16, not counting itself) message bytes
    request packet:    session(10 ASCII) seq(u64) count(u16)  -- 20 bytes

The same framing carries inbound client batches (session = client id,
seq = the client's own sequence number of the first message).
"""

from __future__ import annotations

import struct
from typing import Iterable, NamedTuple

from tape.protocol.errors import ProtocolError

try:
    from tape.protocol._speedups import header as _header
except ImportError:  # built without a C compiler
    _header = None

HEADER = struct.Struct(">10sQH")
HEADER_SIZE = HEADER.size  # 20
BLOCK_LEN = struct.Struct(">H")
HEARTBEAT_COUNT = 0
END_OF_SESSION_COUNT = 0xFFFF
MAX_BLOCKS = 0xFFFE
DEFAULT_MAX_PACKET = 1400  # whole UDP payload, header included: a 1,500-byte Ethernet frame's, with room to spare
JUMBO_MAX_PACKET = 8972  # a 9,000-byte jumbo frame's UDP payload; what a loopback cluster uses (docs/decisions.md)
MAX_UDP_PAYLOAD = 65507
SESSION_LEN = 10


class Packet(NamedTuple):
    session: bytes  # 10 bytes as on the wire
    seq: int
    count: int  # 0 heartbeat, 0xFFFF end of session, else number of blocks
    blocks: list  # list[bytes]

    @property
    def is_heartbeat(self) -> bool:
        return self.count == HEARTBEAT_COUNT

    @property
    def is_end_of_session(self) -> bool:
        return self.count == END_OF_SESSION_COUNT


def session_bytes(name: str | bytes) -> bytes:
    """A session or client id as its 10-byte, space-padded wire form."""
    raw = name.encode("ascii") if isinstance(name, str) else bytes(name)
    if len(raw) > SESSION_LEN or not _printable(raw.rstrip(b" ")) or not raw.strip():
        raise ProtocolError("bad_session", f"session {name!r} must be 1-10 printable ASCII characters")
    return raw.ljust(SESSION_LEN, b" ")


def session_name(raw: bytes) -> str:
    return raw.decode("ascii").rstrip(" ")


_PRINTABLE = bytes(range(0x20, 0x7F))


def _printable(raw: bytes) -> bool:
    return not raw.translate(None, _PRINTABLE)


def check_session(raw: bytes, offset: int = 0) -> None:
    if not _printable(raw) or raw[:1] == b" ":
        raise ProtocolError("bad_session", f"session field {raw!r} is not left-justified printable ASCII", offset)


def encode_packet(session: bytes, seq: int, messages: Iterable[bytes]) -> bytes:
    """One downstream packet holding `messages` (all of them: the caller sizes it)."""
    msgs = messages if isinstance(messages, list) else list(messages)
    if len(msgs) > MAX_BLOCKS:
        raise ValueError(f"{len(msgs)} messages do not fit one packet (max {MAX_BLOCKS})")
    if len(set(map(len, msgs))) == 1:  # the usual case, one message type: one length prefix for all
        prefix = BLOCK_LEN.pack(len(msgs[0]))
        body = prefix + prefix.join(msgs)
    else:
        body = b"".join(BLOCK_LEN.pack(len(msg)) + msg for msg in msgs)
    return HEADER.pack(session, seq, len(msgs)) + body


def encode_heartbeat(session: bytes, next_seq: int) -> bytes:
    return HEADER.pack(session, next_seq, HEARTBEAT_COUNT)


def encode_end_of_session(session: bytes, next_seq: int) -> bytes:
    return HEADER.pack(session, next_seq, END_OF_SESSION_COUNT)


def encode_request(session: bytes, seq: int, count: int) -> bytes:
    """A retransmission request: `count` messages from `seq` (listener -> rewinder)."""
    if not 1 <= count <= MAX_BLOCKS:
        raise ValueError(f"request count {count} outside 1..{MAX_BLOCKS}")
    return HEADER.pack(session, seq, count)


def decode_header(data, max_size: int = MAX_UDP_PAYLOAD) -> tuple[bytes, int, int]:
    """Validate the 20-byte header and size; return (session, seq, count)."""
    header = _header(data, max_size) if _header else None
    return decode_header_pure(data, max_size) if header is None else header


def decode_header_pure(data, max_size: int = MAX_UDP_PAYLOAD) -> tuple[bytes, int, int]:
    """decode_header's definition, which names what is wrong (ProtocolError); `_speedups.header`
    is the same checks in C for the headers that pass them."""
    size = len(data)
    if size > max_size:
        raise ProtocolError("oversized", f"{size} bytes exceed the limit of {max_size}", max_size)
    if size < HEADER_SIZE:
        raise ProtocolError("truncated", f"{size} bytes, a header needs {HEADER_SIZE}", size)
    session, seq, count = HEADER.unpack_from(data, 0)
    check_session(session)
    return session, seq, count


def decode_request(data) -> tuple[bytes, int, int]:
    """A request packet: exactly 20 bytes, count 1..0xFFFE, seq >= 1."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(
            "bad_request", f"a request is {HEADER_SIZE} bytes, got {len(data)}", min(len(data), HEADER_SIZE)
        )
    session, seq, count = decode_header(data)
    if count == 0 or count == END_OF_SESSION_COUNT:
        raise ProtocolError("bad_request", f"request count {count} is not 1..{MAX_BLOCKS}", 18)
    if seq == 0:
        raise ProtocolError("bad_request", "request for seq 0 (the first seq is 1)", 10)
    return session, seq, count


def decode_packet(data, max_size: int = MAX_UDP_PAYLOAD) -> Packet:
    """Decode and fully validate a downstream packet (or inbound batch)."""
    session, seq, count = decode_header(data, max_size)
    size = len(data)
    if count == HEARTBEAT_COUNT or count == END_OF_SESSION_COUNT:
        if size != HEADER_SIZE:
            kind = "heartbeat" if count == 0 else "end-of-session"
            raise ProtocolError(
                "trailing_bytes", f"{kind} packet carries {size - HEADER_SIZE} extra bytes", HEADER_SIZE
            )
        return Packet(session, seq, count, [])
    blocks = split_blocks(data, HEADER_SIZE, count)
    return Packet(session, seq, count, blocks)


def split_blocks(data, offset: int, count: int) -> list:
    """The `count` blocks after `offset`, which must end exactly at len(data)."""
    size = len(data)
    blocks = []
    unpack = BLOCK_LEN.unpack_from
    for i in range(count):
        if offset + 2 > size:
            raise ProtocolError("wrong_count", f"header says {count} blocks, data ends after {i}", offset)
        (length,) = unpack(data, offset)
        start = offset + 2
        offset = start + length
        if offset > size:
            raise ProtocolError("truncated", f"block {i} claims {length} bytes, {size - start} remain", start - 2)
        blocks.append(bytes(data[start:offset]))
    if offset != size:
        raise ProtocolError(
            "trailing_bytes", f"{size - offset} bytes after the {count} blocks the header declares", offset
        )
    return blocks


class Packer:
    """Packs messages into downstream packets of at most `max_packet` bytes.

    `add` returns a finished packet when the next message would not fit,
    `flush` returns what is pending.
    """

    def __init__(self, session: bytes, next_seq: int = 1, max_packet: int = DEFAULT_MAX_PACKET):
        if max_packet < HEADER_SIZE + 3 or max_packet > MAX_UDP_PAYLOAD:
            raise ValueError(f"max_packet {max_packet} outside {HEADER_SIZE + 3}..{MAX_UDP_PAYLOAD}")
        self.session = session
        self._first_seq = next_seq  # seq of the first pending message
        self.max_packet = max_packet
        self._parts: list[bytes] = []
        self._count = 0
        self._size = HEADER_SIZE

    @property
    def next_seq(self) -> int:
        """The seq the next message added will get."""
        return self._first_seq + self._count

    @property
    def pending(self) -> int:
        return self._count

    def add(self, msg: bytes) -> bytes | None:
        need = 2 + len(msg)
        if HEADER_SIZE + need > self.max_packet:
            raise ValueError(f"a {len(msg)}-byte message cannot fit a {self.max_packet}-byte packet")
        out = None
        if self._size + need > self.max_packet or self._count == MAX_BLOCKS:
            out = self.flush()
        self._parts.append(BLOCK_LEN.pack(len(msg)))
        self._parts.append(msg)
        self._count += 1
        self._size += need
        return out

    def add_many(self, messages: Iterable[bytes]) -> list[bytes]:
        """Add messages; return the packets that filled up (not the partial one)."""
        out = []
        for msg in messages:
            pkt = self.add(msg)
            if pkt is not None:
                out.append(pkt)
        return out

    def flush(self) -> bytes | None:
        if not self._count:
            return None
        pkt = HEADER.pack(self.session, self._first_seq, self._count) + b"".join(self._parts)
        self._first_seq += self._count
        self._parts = []
        self._count = 0
        self._size = HEADER_SIZE
        return pkt


def pack_messages(
    session: bytes, first_seq: int, messages: Iterable[bytes], max_packet: int = DEFAULT_MAX_PACKET
) -> list[bytes]:
    """All `messages` as full packets, numbered from `first_seq`."""
    packer = Packer(session, first_seq, max_packet)
    out = packer.add_many(messages)
    last = packer.flush()
    if last is not None:
        out.append(last)
    return out
