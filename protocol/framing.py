"""Incremental reader of a TCP stream of frames: length u32 (of what
follows), type u8, payload. Used by the replication and alert links."""

from __future__ import annotations

import struct

from tape.protocol.errors import ProtocolError

try:
    from tape.protocol._speedups import frames as _frames
except ImportError:  # built without a C compiler
    _frames = None

FRAME = struct.Struct(">IB")


class FrameReader:
    def __init__(self, max_frame: int, kinds: bytes | None = None):
        self.max_frame = max_frame
        self.kinds = kinds  # accepted type bytes, or None for any
        self._buf = bytearray()
        self._consumed = 0  # bytes of the stream already decoded (for offsets)

    def frames(self, data: bytes) -> list[tuple[int, bytes, int]]:
        """[(type, payload, stream offset), ...] of the complete frames so far."""
        buf = self._buf
        buf += data
        out, pos = _frames(buf, self.max_frame, self.kinds, self._consumed) if _frames else ([], 0)
        pos = self._frames_pure(buf, pos, out)  # what C left: a frame that is bad (named here) or not whole
        if pos:
            del buf[:pos]
            self._consumed += pos
        return out

    def _frames_pure(self, buf: bytearray, pos: int, out: list) -> int:
        """The definition: the complete frames of `buf` from `pos` appended to `out`; returns where
        the first incomplete one starts. `_speedups.frames` is the same loop in C, which stops at a
        frame this one refuses (ProtocolError)."""
        while len(buf) - pos >= FRAME.size:
            length, kind = FRAME.unpack_from(buf, pos)
            where = self._consumed + pos
            if not 1 <= length <= self.max_frame:
                raise ProtocolError("bad_frame", f"frame length {length}", where)
            if self.kinds is not None and kind not in self.kinds:
                raise ProtocolError("unknown_type", f"frame type 0x{kind:02x}", where + 4)
            if len(buf) - pos - 4 < length:
                break
            out.append((kind, bytes(buf[pos + 5:pos + 4 + length]), where))
            pos += 4 + length
        return pos
