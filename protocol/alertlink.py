"""The alert channel (replica -> emitter, TCP). Sans-I/O.

Frames: length u32 (of what follows), type u8, payload.

    'H' hello    replica name (10 ASCII)            replica -> emitter, first
    'W' welcome  mark u64: highest emit seq the emitter has recorded
    'A' alert    one alert record (replicas.audit.Alert.encode)
    'K' ack      mark u64
    'D' digest   fold seq u64, digest chain (16)    replica -> emitter, at each fold point
    'X' rebuild  fold seq u64                       emitter -> replica: the other replicas
                                                    agree on another digest there

A replica sends its alerts in emit-seq order and, on (re)connecting,
resends everything after the welcome's mark, then its last fold's digest.
A replica told to rebuild discards its state and applies the journal again
from seq 1 (docs/replicas.md, "A replica that diverged").
"""

from __future__ import annotations

import struct
from itertools import groupby
from operator import itemgetter

from tape.protocol import framing

# How many replicas must send an alert before the emitter delivers it: the first, or a majority.
DELIVERY = ("first", "quorum")
FRAME = framing.FRAME
MARK = struct.Struct(">Q")
HELLO, WELCOME, ALERT, ACK, DIGEST, REBUILD = (ord(c) for c in "HWAKDX")
FOLD = struct.Struct(">Q16s")
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


def alerts(records: list[bytes]) -> bytes:
    """alert() of each record, joined: records of one size (every alert record is ALERT_SIZE
    bytes) share one frame header, so a replica's batch is framed in one join, not a call each."""
    if len(set(map(len, records))) != 1:
        return b"".join(map(alert, records))
    head = FRAME.pack(1 + len(records[0]), ALERT)
    return head + head.join(records)


def digest(fold_seq: int, chain: bytes) -> bytes:
    return frame(DIGEST, FOLD.pack(fold_seq, chain))


def rebuild(fold_seq: int) -> bytes:
    return frame(REBUILD, MARK.pack(fold_seq))


class Reader:
    def __init__(self):
        self._reader = framing.FrameReader(MAX_FRAME, bytes((HELLO, WELCOME, ALERT, ACK, DIGEST, REBUILD)))

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        return [(kind, payload) for kind, payload, _ in self._reader.frames(data)]

    def runs(self, data: bytes) -> list[tuple[int, list[bytes]]]:
        """feed(data) as runs of frames of one kind, in order: (kind, [payload, ...]). A replica's
        alerts come a few dozen to a read, so the emitter takes them a run at a time, not a frame."""
        return [(kind, list(map(_PAYLOAD, run))) for kind, run in groupby(self._reader.frames(data), _KIND)]


_KIND, _PAYLOAD = itemgetter(0), itemgetter(1)
