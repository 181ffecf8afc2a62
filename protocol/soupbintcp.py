"""SoupBinTCP 4.0 framing for TCP replay. Sans-I/O.

Every frame: length(u16, big-endian, counts the type byte and payload),
type(1 ASCII), payload. Alphanumeric fields are left-justified and
space-padded, numeric fields right-justified and space-padded ASCII digits.

    client -> server                      server -> client
    'L' login: user(6) password(10)       'A' accepted: session(10) seq(20)
        session(10) seq(20)               'J' rejected: reason(1) 'A'|'S'
    'R' client heartbeat                  'S' sequenced data: one message
    'O' logout                            'H' server heartbeat
    'U' unsequenced data                  'Z' end of session
    '+' debug text (both ways)

After 'A' the sequenced messages that follow are numbered from the accepted
seq, one by one. A requested seq of 0 means "from the newest message".
"""

from __future__ import annotations

import struct

from tape.protocol.errors import ProtocolError

FRAME_LEN = struct.Struct(">H")
MAX_FRAME = 0xFFFF

LOGIN = b"L"
LOGIN_ACCEPTED = b"A"
LOGIN_REJECTED = b"J"
SEQUENCED = b"S"
UNSEQUENCED = b"U"
SERVER_HEARTBEAT = b"H"
CLIENT_HEARTBEAT = b"R"
END_OF_SESSION = b"Z"
LOGOUT = b"O"
DEBUG = b"+"
REJECT_NOT_AUTHORIZED = b"A"
REJECT_SESSION_UNAVAILABLE = b"S"

_FIXED_LEN = {  # payload sizes of the fixed-size frames
    LOGIN: 46,
    LOGIN_ACCEPTED: 30,
    LOGIN_REJECTED: 1,
    SERVER_HEARTBEAT: 0,
    CLIENT_HEARTBEAT: 0,
    END_OF_SESSION: 0,
    LOGOUT: 0,
}
_KNOWN = frozenset(_FIXED_LEN) | {SEQUENCED, UNSEQUENCED, DEBUG}


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    if len(payload) + 1 > MAX_FRAME:
        raise ValueError(f"a {len(payload)}-byte payload does not fit a SoupBinTCP frame")
    return FRAME_LEN.pack(len(payload) + 1) + kind + payload


def _alpha(value: str | bytes, width: int) -> bytes:
    raw = value.encode("ascii") if isinstance(value, str) else bytes(value)
    if len(raw) > width:
        raise ValueError(f"{value!r} is longer than {width}")
    return raw.ljust(width, b" ")


def _numeric(value: int, width: int) -> bytes:
    raw = str(value).encode("ascii")
    if value < 0 or len(raw) > width:
        raise ValueError(f"{value} does not fit {width} digits")
    return raw.rjust(width, b" ")


def login(username: str, password: str, session: str | bytes, seq: int) -> bytes:
    return frame(LOGIN, _alpha(username, 6) + _alpha(password, 10) + _alpha(session, 10) + _numeric(seq, 20))


def login_accepted(session: bytes, seq: int) -> bytes:
    return frame(LOGIN_ACCEPTED, _alpha(session, 10) + _numeric(seq, 20))


def login_rejected(reason: bytes) -> bytes:
    return frame(LOGIN_REJECTED, reason)


def sequenced(message: bytes) -> bytes:
    return FRAME_LEN.pack(len(message) + 1) + SEQUENCED + message


def heartbeat(server: bool = True) -> bytes:
    return frame(SERVER_HEARTBEAT if server else CLIENT_HEARTBEAT)


def end_of_session() -> bytes:
    return frame(END_OF_SESSION)


def logout() -> bytes:
    return frame(LOGOUT)


def _parse_numeric(raw: bytes, offset: int) -> int:
    digits = raw.strip(b" ")
    if not digits or not digits.isdigit():
        raise ProtocolError("bad_field", f"numeric field {raw!r} holds no number", offset)
    return int(digits)


def _parse_alpha(raw: bytes, offset: int) -> bytes:
    if not all(0x20 <= b < 0x7F for b in raw):
        raise ProtocolError("bad_field", f"alphanumeric field {raw!r} is not printable ASCII", offset)
    return raw.rstrip(b" ")


def parse_login(payload: bytes) -> tuple[bytes, bytes, bytes, int]:
    """(username, password, session, seq) of a login request payload."""
    return (
        _parse_alpha(payload[0:6], 0),
        _parse_alpha(payload[6:16], 6),
        _parse_alpha(payload[16:26], 16),
        _parse_numeric(payload[26:46], 26),
    )


def parse_login_accepted(payload: bytes) -> tuple[bytes, int]:
    return _parse_alpha(payload[0:10], 0), _parse_numeric(payload[10:30], 10)


class FrameDecoder:
    """Incremental decoder for a TCP byte stream: feed bytes, get frames."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()
        self._consumed = 0  # bytes of the stream already decoded (for offsets)

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """Returns [(type, payload), ...]; raises ProtocolError on a bad frame
        (the connection is then unusable: close it)."""
        buf = self._buf
        buf += data
        out = []
        pos = 0
        size = len(buf)
        while size - pos >= 2:
            (length,) = FRAME_LEN.unpack_from(buf, pos)
            where = self._consumed + pos
            if length == 0:
                raise ProtocolError("bad_frame", "frame length 0 has no type byte", where)
            if length > self.max_frame:
                raise ProtocolError("oversized", f"frame of {length} bytes exceeds {self.max_frame}", where)
            if size - pos - 2 < length:
                break
            kind = bytes(buf[pos + 2:pos + 3])
            payload = bytes(buf[pos + 3:pos + 2 + length])
            if kind not in _KNOWN:
                raise ProtocolError("unknown_type", f"unknown frame type {kind!r}", where + 2)
            want = _FIXED_LEN.get(kind)
            if want is not None and len(payload) != want:
                raise ProtocolError(
                    "bad_length", f"frame {kind!r} carries {len(payload)} bytes, expected {want}", where
                )
            out.append((kind, payload))
            pos += 2 + length
        if pos:
            del buf[:pos]
            self._consumed += pos
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)
