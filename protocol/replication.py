"""Replication frames between the leader and its followers (TCP), Raft-style.

Every frame: length u32 (of what follows), type u8, payload.

    'A' append     term u64, leader 10, prev_seq u64, prev_term u64,
                   commit_seq u64, entries_term u64, count u32,
                   then count x 75-byte sequenced messages (seqs prev_seq+1..)
                   count 0 is a heartbeat that carries the commit point
    'K' ack        term u64, follower 10, success u8, last_seq u64
                   (success: the follower holds the leader's log through
                   last_seq; failure: its log ends at last_seq or disagrees
                   at prev_seq, so the leader must send from earlier)
    'H' hello      term u64, node 10, last_seq u64, last_term u64
                   (first frame of a follower on a new connection)
    'V' vote req.  term u64, candidate 10, last_seq u64, last_term u64, pre u8
                   (Raft's RequestVote: a candidate asks every voter; pre = 1
                   is a pre-vote, which changes no one's term)
    'G' vote       term u64, voter 10, granted u8, pre u8
                   (the answer, on the same connection)
    'F' fetch      from_seq u64, prev_term u64
                   (a sequencer whose log is behind a voter's asks for the
                   entries from from_seq; the answer is append frames of the
                   voter's own log, then an empty append)

All entries of one append share a term, so a catch-up that crosses terms is
sent as several appends. Sans-I/O.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from tape.protocol import framing
from tape.protocol.errors import ProtocolError
from tape.protocol.messages import SEQUENCED_SIZE

FRAME = framing.FRAME
APPEND = struct.Struct(">Q10sQQQQI")
ACK = struct.Struct(">Q10sBQ")
HELLO = struct.Struct(">Q10sQQ")
VOTE_REQUEST = struct.Struct(">Q10sQQB")
VOTE = struct.Struct(">Q10sBB")
FETCH = struct.Struct(">QQ")
T_APPEND, T_ACK, T_HELLO, T_VOTE_REQUEST, T_VOTE, T_FETCH = (ord("A"), ord("K"), ord("H"), ord("V"), ord("G"),
                                                            ord("F"))
MAX_FRAME = 16 << 20


class Append(NamedTuple):
    term: int
    leader: bytes
    prev_seq: int
    prev_term: int
    commit_seq: int
    entries_term: int
    count: int
    entries: bytes  # count x 75 bytes (journal.RecordRun reads them as records)


class Ack(NamedTuple):
    term: int
    follower: bytes
    success: bool
    last_seq: int


class Hello(NamedTuple):
    term: int
    node: bytes
    last_seq: int
    last_term: int


class VoteRequest(NamedTuple):
    term: int
    candidate: bytes
    last_seq: int
    last_term: int
    pre: bool = False


class Vote(NamedTuple):
    term: int
    voter: bytes
    granted: bool
    pre: bool = False


class Fetch(NamedTuple):
    from_seq: int
    prev_term: int


def encode_fetch(from_seq: int, prev_term: int) -> bytes:
    return FRAME.pack(1 + FETCH.size, T_FETCH) + FETCH.pack(from_seq, prev_term)


def encode_vote_request(term: int, candidate: bytes, last_seq: int, last_term: int, pre: bool = False) -> bytes:
    return FRAME.pack(1 + VOTE_REQUEST.size, T_VOTE_REQUEST) + VOTE_REQUEST.pack(term, candidate, last_seq, last_term,
                                                                                  1 if pre else 0)


def encode_vote(term: int, voter: bytes, granted: bool, pre: bool = False) -> bytes:
    return FRAME.pack(1 + VOTE.size, T_VOTE) + VOTE.pack(term, voter, 1 if granted else 0, 1 if pre else 0)


def encode_append(term, leader, prev_seq, prev_term, commit_seq, entries_term, messages: list[bytes]) -> bytes:
    body = b"".join(messages)
    head = APPEND.pack(term, leader, prev_seq, prev_term, commit_seq, entries_term, len(messages))
    return FRAME.pack(1 + len(head) + len(body), T_APPEND) + head + body


def encode_runs(term, leader, prev_seq, prev_term, commit_seq, records: list) -> bytes:
    """Journal records [(seq, term, message)] following prev_seq as appends,
    one per run of equal terms (every entry of an append shares its term)."""
    out = []
    start = 0
    while start < len(records):
        run_term = records[start][1]
        end = start
        while end < len(records) and records[end][1] == run_term:
            end += 1
        out.append(encode_append(term, leader, prev_seq, prev_term, commit_seq, run_term,
                                 [m for _, _, m in records[start:end]]))
        prev_seq, prev_term = records[end - 1][0], run_term
        start = end
    return b"".join(out)


def encode_ack(term: int, follower: bytes, success: bool, last_seq: int) -> bytes:
    return FRAME.pack(1 + ACK.size, T_ACK) + ACK.pack(term, follower, 1 if success else 0, last_seq)


def encode_hello(term: int, node: bytes, last_seq: int, last_term: int) -> bytes:
    return FRAME.pack(1 + HELLO.size, T_HELLO) + HELLO.pack(term, node, last_seq, last_term)


def _decode(kind: int, payload: bytes, where: int):
    if kind == T_APPEND:
        if len(payload) < APPEND.size:
            raise ProtocolError("truncated", "append frame shorter than its header", where)
        fields = APPEND.unpack_from(payload, 0)
        entries = payload[APPEND.size:]
        if len(entries) != fields[-1] * SEQUENCED_SIZE:
            raise ProtocolError("bad_length", f"append says {fields[-1]} entries, carries {len(entries)} bytes", where)
        return Append(*fields, entries)
    if kind == T_ACK:
        if len(payload) != ACK.size:
            raise ProtocolError("bad_length", f"ack is {ACK.size} bytes, got {len(payload)}", where)
        term, follower, ok, last = ACK.unpack(payload)
        return Ack(term, follower, bool(ok), last)
    if kind == T_HELLO:
        if len(payload) != HELLO.size:
            raise ProtocolError("bad_length", f"hello is {HELLO.size} bytes, got {len(payload)}", where)
        return Hello(*HELLO.unpack(payload))
    if kind == T_VOTE_REQUEST:
        if len(payload) != VOTE_REQUEST.size:
            raise ProtocolError("bad_length", f"vote request is {VOTE_REQUEST.size} bytes, got {len(payload)}", where)
        term, candidate, last_seq, last_term, pre = VOTE_REQUEST.unpack(payload)
        return VoteRequest(term, candidate, last_seq, last_term, bool(pre))
    if kind == T_VOTE:
        if len(payload) != VOTE.size:
            raise ProtocolError("bad_length", f"vote is {VOTE.size} bytes, got {len(payload)}", where)
        term, voter, granted, pre = VOTE.unpack(payload)
        return Vote(term, voter, bool(granted), bool(pre))
    if kind == T_FETCH:
        if len(payload) != FETCH.size:
            raise ProtocolError("bad_length", f"fetch is {FETCH.size} bytes, got {len(payload)}", where)
        return Fetch(*FETCH.unpack(payload))
    raise ProtocolError("unknown_type", f"replication frame type 0x{kind:02x}", where)


class FrameReader:
    """Incremental decoder of a replication byte stream."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self._reader = framing.FrameReader(max_frame)

    def feed(self, data: bytes) -> list:
        return [_decode(kind, payload, where) for kind, payload, where in self._reader.frames(data)]
