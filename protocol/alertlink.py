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

from . import framing

FRAME = framing.FRAME
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
        self._reader = framing.FrameReader(MAX_FRAME, bytes((HELLO, WELCOME, ALERT, ACK)))

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        return [(kind, payload) for kind, payload, _ in self._reader.frames(data)]
