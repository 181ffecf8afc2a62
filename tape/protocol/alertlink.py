"""The alert channel (replica -> emitter, TCP). Sans-I/O.

Frames: length u32 (of what follows), type u8, payload.

    'H' hello    replica name (10 ASCII)            replica -> emitter, first
    'W' welcome  mark u64: highest emit seq the emitter has recorded
    'A' alert    one alert record (replicas.audit.Alert.encode)
    'K' ack      mark u64

A replica sends its alerts in emit-seq order and, on (re)connecting,
resends everything after the welcome's mark.
"""

from __future__ import annotations

import struct

from .errors import ProtocolError

FRAME = struct.Struct(">IB")
MARK = struct.Struct(">Q")
HELLO, WELCOME, ALERT, ACK = ord("H"), ord("W"), ord("A"), ord("K")
MAX_FRAME = 4096


def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(1 + len(payload), kind) + payload


def hello(name: bytes) -> bytes:
    return frame(HELLO, name)


def welcome(mark: int) -> bytes:
    return frame(WELCOME, MARK.pack(mark))


def ack(mark: int) -> bytes:
    return frame(ACK, MARK.pack(mark))


def alert(record: bytes) -> bytes:
    return frame(ALERT, record)


class Reader:
    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= FRAME.size:
            length, kind = FRAME.unpack_from(buf, pos)
            if not 1 <= length <= MAX_FRAME:
                raise ProtocolError("bad_frame", f"alert frame length {length}", pos)
            if kind not in (HELLO, WELCOME, ALERT, ACK):
                raise ProtocolError("unknown_type", f"alert frame type 0x{kind:02x}", pos + 4)
            if len(buf) - pos - 4 < length:
                break
            out.append((kind, bytes(buf[pos + 5:pos + 4 + length])))
            pos += 4 + length
        del buf[:pos]
        return out
