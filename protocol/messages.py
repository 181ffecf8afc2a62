"""Trade and control messages: fixed-width, big-endian, first byte the type.

Every message type shares one layout, so that a packet of N messages is N
equal blocks and decodes with a single C-level `Struct.iter_unpack` and a
few stride slices for validation (no Python loop per message).

An *inbound* message (client -> sequencer) is 49 bytes:

    type u8 | order_id u64 | shares i64 | client 16 | stock 8 | purchase_id u64

The sequencer *stamps* it by appending the 26-byte envelope, giving a
75-byte *sequenced* message:

    inbound (49) | stamp_ns u64 | origin 10 | client_seq u64

Types: 'R' purchase request (purchase_id 0), 'P' purchase, and three control
messages only the sequencer emits: 'T' term start (term in the order_id
slot, leader name in the client slot), 'K' time tick (body all zero), 'E'
the end of the session (body all zero; listeners finish there) and, with a
stream key, 'A' the seal that ends every packet (protocol/streamauth.py).
Text fields are ASCII, left-justified, space-padded. Shares are signed: a
non-positive count is a business reject, not a framing error.

Decoded messages are plain tuples, indexed by the constants below.
"""

from __future__ import annotations

import functools
import struct

from tape.protocol.errors import ProtocolError
from tape.protocol.moldudp64 import HEADER_SIZE

REQUEST = ord("R")
PURCHASE = ord("P")
TERM_START = ord("T")
TIME_TICK = ord("K")
AUTH = ord("A")
SESSION_END = ord("E")
REJECTED = ord("J")
TYPE_NAMES = {REQUEST: "purchase_request", PURCHASE: "purchase", TERM_START: "term_start", TIME_TICK: "time_tick",
              AUTH: "seal", SESSION_END: "session_end", REJECTED: "rejected"}
CLIENT_TYPES = bytes((REQUEST, PURCHASE))  # what a client may submit
ALL_TYPES = bytes((REQUEST, PURCHASE, TERM_START, TIME_TICK, AUTH, SESSION_END, REJECTED))
CLIENT_SEQ_TYPES = (REQUEST, PURCHASE, REJECTED)  # entries that carry (and use up) a client's seq
# Why the sequencer rejected a client's message at ingress (the code, from 1, in a 'J' entry's shares slot).
INGRESS_REJECTS = ("shares_out_of_range", "bad_text")
SHARES_LIMIT = 1 << 24  # |shares| below this: a cumulative sum stays far inside i64 (docs/security.md)
_PRINTABLE = bytes(range(0x20, 0x7F))

# Field positions in a decoded message.
TYPE, ORDER_ID, SHARES, CLIENT, STOCK, PURCHASE_ID, STAMP, ORIGIN, CLIENT_SEQ = range(9)
TERM, LEADER = ORDER_ID, CLIENT  # in 'T'

INBOUND = struct.Struct(">BQq16s8sQ")
ENVELOPE = struct.Struct(">Q10sQ")
SEQUENCED = struct.Struct(">BQq16s8sQQ10sQ")
INBOUND_SIZE = INBOUND.size  # 49
SEQUENCED_SIZE = SEQUENCED.size  # 75
# A whole block (u16 length + message) with the length skipped: iter_unpack over a packet payload.
_SEQUENCED_BLOCK = struct.Struct(">2x" + SEQUENCED.format[1:])
_INBOUND_BLOCK = struct.Struct(">2x" + INBOUND.format[1:])
SEQUENCED_BLOCK_SIZE = _SEQUENCED_BLOCK.size  # 77
INBOUND_BLOCK_SIZE = _INBOUND_BLOCK.size  # 51
BLOCK_PREFIX = SEQUENCED_SIZE.to_bytes(2, "big")  # the length prefix of every sequenced block
INBOUND_MAC_SIZE = 32  # HMAC-SHA256 trailer of an inbound batch from a client with a key


def text(value: str | bytes, width: int) -> bytes:
    """A text field as its fixed-width wire form."""
    raw = value.encode("ascii") if isinstance(value, str) else bytes(value)
    if len(raw) > width:
        raise ValueError(f"{value!r} is longer than {width} bytes")
    return raw.ljust(width, b" ")


# --- building messages --------------------------------------------------------

def purchase_request(order_id: int, shares: int, client: str | bytes, stock: str | bytes) -> bytes:
    return INBOUND.pack(REQUEST, order_id, shares, text(client, 16), text(stock, 8), 0)


def purchase(purchase_id: int, order_id: int, shares: int, client: str | bytes, stock: str | bytes) -> bytes:
    return INBOUND.pack(PURCHASE, order_id, shares, text(client, 16), text(stock, 8), purchase_id)


def stamp(inbound: bytes, stamp_ns: int, origin: bytes, client_seq: int) -> bytes:
    """The sequenced form of a checked inbound message."""
    return inbound + ENVELOPE.pack(stamp_ns, origin, client_seq)


def term_start(stamp_ns: int, origin: bytes, term: int, leader: str | bytes) -> bytes:
    return SEQUENCED.pack(TERM_START, term, 0, text(leader, 16), b" " * 8, 0, stamp_ns, origin, 0)


def time_tick(stamp_ns: int, origin: bytes) -> bytes:
    return SEQUENCED.pack(TIME_TICK, 0, 0, b" " * 16, b" " * 8, 0, stamp_ns, origin, 0)


def session_end(stamp_ns: int, origin: bytes) -> bytes:
    return SEQUENCED.pack(SESSION_END, 0, 0, b" " * 16, b" " * 8, 0, stamp_ns, origin, 0)


# --- checking and decoding ----------------------------------------------------

def check_inbound(msg: bytes) -> None:
    """Raise unless `msg` is a well-formed message a client may submit."""
    if len(msg) != INBOUND_SIZE:
        raise ProtocolError("bad_length", f"an inbound message is {INBOUND_SIZE} bytes, got {len(msg)}", 0)
    if msg[0] not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"type byte 0x{msg[0]:02x} is not one a client may submit", 0)


def decode(msg) -> tuple:
    """One sequenced message as a tuple; raises ProtocolError if malformed."""
    if len(msg) != SEQUENCED_SIZE:
        raise ProtocolError("bad_length", f"a sequenced message is {SEQUENCED_SIZE} bytes, got {len(msg)}", 0)
    if msg[0] not in ALL_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type byte 0x{msg[0]:02x}", 0)
    return SEQUENCED.unpack(msg)


def _check_blocks(data, count: int, block: int, msg_size: int, types: bytes, offset: int = HEADER_SIZE) -> None:
    """Validate `count` equal blocks after `offset` with stride slices (C speed)."""
    if len(data) != offset + count * block:
        if len(data) < offset + count * block:
            raise ProtocolError(
                "truncated", f"{count} messages need {count * block} bytes, {len(data) - offset} present", len(data)
            )
        raise ProtocolError(
            "trailing_bytes",
            f"{len(data) - offset - count * block} bytes after {count} messages",
            offset + count * block,
        )
    hi = data[offset::block]
    lo = data[offset + 1::block]
    if hi.count(0) != count or lo.count(msg_size) != count:
        i = next(k for k in range(count) if hi[k] != 0 or lo[k] != msg_size)
        raise ProtocolError(
            "bad_length",
            f"block {i} has length {hi[i] << 8 | lo[i]}, messages are {msg_size} bytes",
            offset + i * block,
        )
    kinds = data[offset + 2::block]
    if kinds.translate(None, types):
        i = next(k for k in range(count) if kinds[k] not in types)
        raise ProtocolError("unknown_type", f"block {i} has type byte 0x{kinds[i]:02x}", offset + i * block + 2)


def decode_packet_messages(data, count: int, skip: int = 0) -> list:
    """The messages of a downstream packet (header already validated, `count`
    from it) as tuples, from message index `skip` on."""
    _check_blocks(data, count, SEQUENCED_BLOCK_SIZE, SEQUENCED_SIZE, ALL_TYPES)
    start = HEADER_SIZE + skip * SEQUENCED_BLOCK_SIZE
    return list(_SEQUENCED_BLOCK.iter_unpack(memoryview(data)[start:]))


def decode_delivered(data, skip: int = 0) -> list:
    """The messages of a packet a ListenerCore delivered, from index `skip` on: its blocks were
    checked when it arrived (`check_packet_messages`), so they are not checked again."""
    return list(_SEQUENCED_BLOCK.iter_unpack(memoryview(data)[HEADER_SIZE + skip * SEQUENCED_BLOCK_SIZE:]))


def decode_delivered_one(data, index: int) -> tuple:
    """Message number `index` of a delivered packet."""
    return _SEQUENCED_BLOCK.unpack_from(data, HEADER_SIZE + index * SEQUENCED_BLOCK_SIZE)


def check_packet_messages(data, count: int) -> None:
    _check_blocks(data, count, SEQUENCED_BLOCK_SIZE, SEQUENCED_SIZE, ALL_TYPES)


def check_inbound_batch(data, count: int) -> None:
    """Validate an inbound batch's blocks: only client message types."""
    _check_blocks(data, count, INBOUND_BLOCK_SIZE, INBOUND_SIZE, CLIENT_TYPES)


def inbound_rejects_pure(data, count: int) -> list[tuple[int, int]]:
    """An inbound batch's blocks checked (ProtocolError if they are malformed: `check_inbound_batch`),
    then (index, reject code) of its messages the rules cannot apply (`invalid_inbound_pure`). The
    definition of `inbound_rejects`, which is both in one C call (`_speedups.c`) where Tape was
    built with a compiler."""
    check_inbound_batch(data, count)
    return invalid_inbound_pure(data, count)


def invalid_inbound_pure(data, count: int) -> list[tuple[int, int]]:
    """(index, reject code) of the messages of a checked inbound batch that the rules cannot
    apply: |shares| >= SHARES_LIMIT, or client or stock not printable ASCII. Stride slices: the
    common batch (small non-negative shares, plain text) costs a few C calls."""
    base = HEADER_SIZE + 2  # the first message's type byte
    high = b"".join(data[base + k::INBOUND_BLOCK_SIZE] for k in range(9, 14))  # shares' top 5 bytes
    text = b"".join(data[base + k::INBOUND_BLOCK_SIZE] for k in range(17, 41))  # client and stock
    if high.count(0) == len(high) and not text.translate(None, _PRINTABLE):
        return []
    out = []
    for i in range(count):
        msg = data[base + i * INBOUND_BLOCK_SIZE:base + i * INBOUND_BLOCK_SIZE + INBOUND_SIZE]
        shares = int.from_bytes(msg[9:17], "big", signed=True)
        if not -SHARES_LIMIT < shares < SHARES_LIMIT:
            out.append((i, 1))
        elif bytes(msg[17:41]).translate(None, _PRINTABLE):
            out.append((i, 2))
    return out


def rejected(inbound: bytes, code: int) -> bytes:
    """A client's message the sequencer rejects at ingress, as the entry that takes its place:
    type 'J', the reject code in the shares slot, the rest as sent (text fields blanked if bad)."""
    text = inbound[17:41] if code != 2 else b" " * 24
    return bytes((REJECTED,)) + inbound[1:9] + code.to_bytes(8, "big") + text + inbound[41:49]


def packet_message_bytes(data, index: int) -> bytes:
    """The raw bytes of message `index` of a checked downstream packet."""
    start = HEADER_SIZE + index * SEQUENCED_BLOCK_SIZE + 2
    return bytes(data[start:start + SEQUENCED_SIZE])


def inbound_message_bytes(data, index: int) -> bytes:
    start = HEADER_SIZE + index * INBOUND_BLOCK_SIZE + 2
    return bytes(data[start:start + INBOUND_SIZE])


@functools.lru_cache(maxsize=4096)
def _inbound_slicer(skip: int, count: int) -> struct.Struct:
    return struct.Struct(f"{HEADER_SIZE + skip * INBOUND_BLOCK_SIZE}x" + f"2x{INBOUND_SIZE}s" * (count - skip))


def inbound_messages(data, skip: int, count: int) -> tuple:
    """Messages skip..count-1 of a checked inbound batch, in one C call."""
    return _inbound_slicer(skip, count).unpack_from(data)


def to_dict(msg: tuple) -> dict:
    """A decoded message as a JSON-friendly dict (for dumps and tools)."""
    kind = msg[TYPE]
    out = {"type": TYPE_NAMES[kind]}
    if kind == REQUEST or kind == PURCHASE:
        if kind == PURCHASE:
            out["purchase_id"] = msg[PURCHASE_ID]
        out.update(order_id=msg[ORDER_ID], shares=msg[SHARES], client=_text(msg[CLIENT]), stock=_text(msg[STOCK]))
    elif kind == TERM_START:
        out.update(term=msg[TERM], leader=_text(msg[LEADER]))
    # (A seal's last field is its listener tag, no client seq: docs/protocol.md.)
    out.update(stamp_ns=msg[STAMP], origin=_text(msg[ORIGIN]), client_seq=msg[CLIENT_SEQ] if kind != AUTH else None)
    return out


def _text(raw: bytes) -> str:
    try:
        return raw.decode("ascii").rstrip(" ")
    except UnicodeDecodeError:
        return raw.hex()


STAMP_AT = struct.calcsize(">BQq16s8sQ")  # 49: where a sequenced message's stamp starts
ORIGIN_AT = STAMP_AT + 8  # 57: where its origin starts
CLIENT_SEQ_AT = ORIGIN_AT + 10  # 67
_CLIENT_SEQ_TYPES = bytes(CLIENT_SEQ_TYPES)


@functools.lru_cache(maxsize=4)
def _type_origin_cseq(prefix: int) -> struct.Struct:
    """Type, origin and client seq of a sequenced message after `prefix` bytes."""
    return struct.Struct(f">{prefix}xB{ORIGIN_AT - 1}x10sQ")


TYPE_ORIGIN_CSEQ = _type_origin_cseq(0)


def client_seq_maxima_pure(blob, prefix: int = 0) -> dict[bytes, int]:
    """The highest client seq (above 0) of each origin among the messages of `blob` that carry
    one. `blob` is whole blocks of `prefix` bytes and a 75-byte sequenced message: a journal
    append's entries (prefix 0) or a packet's blocks after its header (prefix 2, the length).
    The definition of `client_seq_maxima`, which is this in C (`_speedups.c`) where Tape was
    built with a compiler."""
    layout = _type_origin_cseq(prefix)
    if len(blob) % layout.size:
        raise ValueError("the blob is not whole messages of that layout")
    out: dict[bytes, int] = {}
    for kind, origin, cseq in layout.iter_unpack(blob):
        if kind in _CLIENT_SEQ_TYPES and cseq > out.get(origin, 0):
            out[origin] = cseq
    return out


def stamp_blocks_pure(data, skip: int, count: int, head: bytes, first_cseq: int) -> list[bytes]:
    """Messages skip..count-1 of a checked inbound batch as sequenced messages: each followed by
    `head` (its stamp and origin, ENVELOPE's first fields) and its client seq, from first_cseq.
    The definition of `stamp_blocks`, which reads them straight from the blocks in C where Tape
    was built with a compiler."""
    msgs = inbound_messages(data, skip, count)
    return [m + head + cseq.to_bytes(8, "big") for cseq, m in enumerate(msgs, first_cseq)]


try:
    from tape.protocol._speedups import client_seq_maxima as _maxima
    from tape.protocol._speedups import inbound_rejects as _inbound_rejects
    from tape.protocol._speedups import stamp_blocks as _stamp_blocks

    def stamp_blocks(data, skip: int, count: int, head: bytes, first_cseq: int) -> list[bytes]:
        return _stamp_blocks(data, HEADER_SIZE + skip * INBOUND_BLOCK_SIZE + 2, INBOUND_BLOCK_SIZE, INBOUND_SIZE,
                             count - skip, head, first_cseq)

    def inbound_rejects(data, count: int) -> list[tuple[int, int]]:
        rejects = _inbound_rejects(data, count, CLIENT_TYPES, SHARES_LIMIT)
        return inbound_rejects_pure(data, count) if rejects is None else rejects  # (None: malformed, named)

    def client_seq_maxima(blob, prefix: int = 0) -> dict[bytes, int]:
        return _maxima(blob, prefix + SEQUENCED_SIZE, prefix, prefix + ORIGIN_AT, 10, prefix + CLIENT_SEQ_AT,
                       _CLIENT_SEQ_TYPES)
except ImportError:  # installed without a C compiler
    client_seq_maxima, inbound_rejects = client_seq_maxima_pure, inbound_rejects_pure
    stamp_blocks = stamp_blocks_pure
