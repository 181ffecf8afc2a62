"""protocol/_speedups.c against the pure functions it replaces (record encoding and scans, client seq
maxima, stamping, ingress checks, snapshot checksums): the same results for any input, the same
refusals; and where a C compiler exists it was built (else the tests and benchmarks would
measure the fallback unawares)."""

import hashlib
import struct
import zlib

import pytest
from compilers import where_built
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import journal as fmt
from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol.errors import ProtocolError
from tape.replicas import snapshot

compiled = pytest.mark.skipif(fmt.encode_records is fmt.encode_records_pure, reason="built without a C compiler")

RECORDS = st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                             st.one_of(st.binary(max_size=300), st.binary(min_size=75, max_size=75))), max_size=40)


@where_built
def test_the_c_encoder_was_built_where_a_compiler_exists():
    assert fmt.encode_records is not fmt.encode_records_pure


@compiled
@given(RECORDS, st.booleans())
def test_c_and_pure_encode_the_same_bytes(records, as_lists):
    if as_lists:
        records = [list(r) for r in records]
    assert fmt.encode_records(records) == fmt.encode_records_pure(records)


@compiled
@given(RECORDS, st.integers(0, 40), st.integers(1, 9))
def test_c_and_pure_find_the_same_record_offsets(records, start, every):
    offsets = fmt.record_offsets(records, start, every)
    assert offsets == fmt.record_offsets_pure(records, start, every)
    buf = fmt.encode_records(records)
    assert [fmt.scan(buf, at, None, 1).records[0][0] for at in offsets] == [r[0] for r in records[start::every]]


@compiled
@given(RECORDS, st.data())
def test_c_and_pure_scan_alike_whatever_the_buffer_holds(records, data):
    """Consecutive seqs, then one damage anywhere (a byte changed, the end cut, a seq skipped, a
    length too long), read from any offset, expecting any seq or none, up to any limit."""
    first = data.draw(st.one_of(st.integers(0, 2**40), st.integers(0, 2**64 - 1 - len(records))))  # (C: < 2**63)
    records = [(first + i, term, m) for i, (_, term, m) in enumerate(records)]
    buf = bytearray(fmt.encode_records(records))
    damage = data.draw(st.sampled_from(["none", "byte", "cut", "skip", "long"]))
    at = data.draw(st.integers(0, max(0, len(buf) - 1)))
    if damage == "byte" and buf:
        buf[at] ^= data.draw(st.integers(1, 255))
    elif damage == "cut":
        del buf[at:]
    elif damage in ("skip", "long") and records:
        i = data.draw(st.integers(0, len(records) - 1))
        offset = fmt.record_offsets(records, i, 1)[0]
        seq, term, message = records[i]
        record = fmt.encode_records([(seq + 1, term, message)])
        if damage == "long":  # a length past MAX_MESSAGE, its CRC recomputed
            body = struct.pack(">IQQ", fmt.MAX_MESSAGE + 1, seq, term) + message
            record = struct.pack(">I", zlib.crc32(body)) + body
        buf[offset:offset + fmt.RECORD_HEADER_SIZE + len(message)] = record
    pos = data.draw(st.sampled_from([0, *fmt.record_offsets(records, 0, 1)[:3], at]))
    expect = data.draw(st.sampled_from([None, first, first + 1, 2**62 + 1]))
    limit = data.draw(st.sampled_from([None, 0, 1, 3]))
    for whole in (bytes(buf), buf):
        assert fmt.scan(whole, pos, expect, limit) == fmt.scan_pure(whole, pos, expect, limit)


RECORD_RUNS = st.integers(1, 80).flatmap(lambda size: st.tuples(
    st.integers(0, 2**63), st.integers(0, 2**64 - 1), st.lists(st.binary(min_size=size, max_size=size), max_size=30),
    st.just(size)))


@given(RECORD_RUNS, st.integers(0, 40), st.integers(1, 9))
def test_a_record_run_reads_encodes_and_indexes_as_the_records_it_stands_for(run, start, every):
    first, term, messages, size = run
    records = [(first + i, term, m) for i, m in enumerate(messages)]
    r = fmt.RecordRun(first, term, b"".join(messages), size)
    assert list(r) == records and len(r) == len(records) and r == records and r[start:] == records[start:]
    assert [r[i] for i in range(-len(r), len(r))] == records + records
    assert r.encoded() == fmt.encode_records_pure(records) == fmt.encode_run_pure(first, term, r.messages, size)
    assert r.offsets(start, every) == fmt.record_offsets_pure(records, start, every)


def test_a_record_run_refuses_what_is_not_whole_messages():
    with pytest.raises(ValueError):
        fmt.encode_run(1, 1, bytes(10), 3)
    with pytest.raises(ValueError):
        fmt.encode_run_pure(1, 1, bytes(10), 3)
    with pytest.raises(IndexError):
        fmt.RecordRun(1, 1, bytes(6), 3)[2]


@compiled
@given(st.binary(max_size=9000))
def test_the_c_crc_is_zlibs_at_every_length(message):
    record = fmt.encode_records([(1, 2, message)])
    assert int.from_bytes(record[:4], "big") == zlib.crc32(record[4:])


@compiled
@given(st.binary(max_size=600))
def test_both_ways_of_the_c_crc_are_zlibs(data):
    """Folded by carry-less multiplication (where the processor can: the records' path, from 16
    bytes) and sliced by eight (the others'), at every length and for any bytes."""
    from tape.protocol import _speedups

    assert _speedups.crc32(data, True) == _speedups.crc32(data, False) == zlib.crc32(data)


@compiled
def test_the_folded_crc_is_zlibs_for_every_length_of_tail():
    """Each count of whole blocks (1 to 8) with each tail (0 to 15 bytes) after it."""
    from tape.protocol import _speedups

    data = bytes(range(256)) * 2
    for n in range(16, 16 * 9 + 16):
        assert _speedups.crc32(data[:n], True) == zlib.crc32(data[:n]), n


@compiled
def test_the_sums_of_a_run_four_at_a_time_are_zlibs_for_every_size():
    """encode_run sums four records side by side, then one at a time: runs of 1 to 9 records
    (two fours and a rest) of every size up to 80 bytes, so every tail of a record's last block."""
    for size in range(1, 81):
        messages = bytes((size * 7 + i) % 251 for i in range(9 * size))
        for count in (1, 4, 5, 9):
            blob = messages[:count * size]
            assert fmt.encode_run(2**40, 3, blob, size) == fmt.encode_run_pure(2**40, 3, blob, size), (size, count)


@compiled
@pytest.mark.parametrize("bad, c_error, pure_error", [
    ((1, 1, bytes(fmt.MAX_MESSAGE + 1)), ValueError, ValueError),  # longer than a length field allows
    ((-1, 1, b"x"), OverflowError, struct.error),  # seqs and terms are unsigned 64-bit
    ((1, 2**64, b"x"), OverflowError, struct.error),
    ((1, 1, "text"), TypeError, TypeError),
    ((1, 1), TypeError, ValueError),
])
def test_both_refuse_what_no_record_can_hold(bad, c_error, pure_error):
    with pytest.raises(c_error):
        fmt.encode_records([(1, 1, b"ok"), bad])
    with pytest.raises(pure_error):
        fmt.encode_records_pure([(1, 1, b"ok"), bad])


def sequenced_run(kinds_origins_cseqs) -> bytes:
    """Messages with only type, origin and client seq set (what client_seq_maxima reads)."""
    return b"".join(M.TYPE_ORIGIN_CSEQ.pack(kind, origin, cseq) for kind, origin, cseq in kinds_origins_cseqs)


ORIGINS = [b"load0     ", b"load1     ", b"seq-a     "]
RUNS = st.lists(st.tuples(st.sampled_from(M.ALL_TYPES + b"Z"), st.sampled_from(ORIGINS),
                          st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))), max_size=60)


@compiled
@given(RUNS)
def test_c_and_pure_find_the_same_client_seq_maxima(run):
    blob = sequenced_run(run)
    assert M.client_seq_maxima(blob) == M.client_seq_maxima_pure(blob)


def test_client_seq_maxima_reads_only_what_carries_a_client_seq():
    blob = sequenced_run([(M.PURCHASE, b"a" * 10, 7), (M.TIME_TICK, b"a" * 10, 99), (M.REQUEST, b"b" * 10, 3),
                          (M.PURCHASE, b"a" * 10, 5), (M.REJECTED, b"b" * 10, 4), (M.PURCHASE, b"c" * 10, 0)])
    assert M.client_seq_maxima(blob) == M.client_seq_maxima_pure(blob) == {b"a" * 10: 7, b"b" * 10: 4}
    with pytest.raises(ValueError):
        M.client_seq_maxima(blob[:-1])
    with pytest.raises(ValueError):
        M.client_seq_maxima_pure(blob[:-1])


@compiled
@given(RUNS)
def test_c_and_pure_read_the_same_maxima_from_a_packets_blocks(run):
    sequenced, size = sequenced_run(run), M.SEQUENCED_SIZE
    blocks = b"".join(M.BLOCK_PREFIX + sequenced[at:at + size] for at in range(0, len(sequenced), size))
    assert M.client_seq_maxima(blocks, 2) == M.client_seq_maxima_pure(blocks, 2) == \
        M.client_seq_maxima_pure(sequenced_run(run))


@compiled
@given(st.lists(st.binary(min_size=49, max_size=49), max_size=30), st.data(), st.binary(min_size=18, max_size=18),
       st.one_of(st.integers(0, 2**20), st.integers(2**64 - 40, 2**64 - 1)))
def test_c_and_pure_stamp_a_batchs_messages_from_its_blocks(msgs, data, head, first_cseq):
    batch = moldudp64.encode_packet(b"client1   ", 1, msgs) if msgs else bytes(moldudp64.HEADER_SIZE)
    skip = data.draw(st.integers(0, len(msgs)))
    try:
        want = M.stamp_blocks_pure(batch, skip, len(msgs), head, first_cseq)
    except OverflowError:  # client seqs past 64 bits: both refuse
        with pytest.raises(OverflowError):
            M.stamp_blocks(batch, skip, len(msgs), head, first_cseq)
        return
    assert M.stamp_blocks(batch, skip, len(msgs), head, first_cseq) == want
    assert want == [m + head + cseq.to_bytes(8, "big") for cseq, m in enumerate(msgs[skip:], first_cseq)]


@compiled
def test_stamping_from_blocks_refuses_blocks_past_the_batch():
    batch = moldudp64.encode_packet(b"client1   ", 1, [bytes(49)] * 3)
    with pytest.raises(ValueError, match="past the data"):
        M.stamp_blocks(batch[:-1], 0, 3, bytes(18), 1)


INBOUND = st.builds(lambda kind, order, shares, text, pid: M.INBOUND.pack(kind, order, shares, text[:16], text[16:],
                                                                           pid),
                    st.sampled_from(M.CLIENT_TYPES), st.integers(0, 2**64 - 1),
                    st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from([M.SHARES_LIMIT, -M.SHARES_LIMIT,
                                                                              M.SHARES_LIMIT - 1, 1 - M.SHARES_LIMIT])),
                    st.one_of(st.binary(min_size=24, max_size=24), st.just(b"A" * 24)), st.integers(0, 2**64 - 1))


def outcome(f, *args):
    """What f gives, or the reason of the ProtocolError it raises."""
    try:
        return f(*args)
    except ProtocolError as e:
        return e.reason


@compiled
@given(st.lists(INBOUND, max_size=30), st.binary(max_size=3),
       st.one_of(st.integers(0, 1600), st.integers(0, 29).map(lambda i: 22 + 51 * i)),  # any byte, or a type
       st.one_of(st.integers(0, 255), st.sampled_from(M.ALL_TYPES)), st.integers(-2, 2))
def test_c_and_pure_check_and_reject_the_same_inbound_batches(msgs, trailer, at, byte, count_off):
    """Any batch (well formed, a byte changed, bytes after it, a count that does not match): one C
    call gives what the definition gives, the same rejects or the same error."""
    batch = bytearray(moldudp64.encode_packet(b"client1   ", 1, msgs) + trailer)
    if at < len(batch):
        batch[at] = byte
    count = max(0, len(msgs) + count_off)
    assert outcome(M.inbound_rejects, bytes(batch), count) == outcome(M.inbound_rejects_pure, bytes(batch), count)


SESSIONS = st.one_of(st.binary(min_size=10, max_size=10),
                     st.sampled_from([b"client1   ", b" client1  ", b"client\x7f1  ", b"~~~~~~~~~~", b"          "]))


@compiled
@given(SESSIONS, st.integers(0, 2**64 - 1), st.integers(0, 0xFFFF), st.binary(max_size=30), st.integers(0, 60))
def test_c_and_pure_read_the_same_headers(session, seq, count, tail, max_size):
    from tape.protocol import _speedups

    data = moldudp64.HEADER.pack(session, seq, count) + tail
    for d in (data, data[:max_size]):
        pure = outcome(moldudp64.decode_header_pure, d, max_size)
        assert outcome(moldudp64.decode_header, d, max_size) == pure
        assert (_speedups.header(d, max_size) is None) == isinstance(pure, str)


@compiled
@given(st.binary(max_size=20), st.lists(st.tuples(st.binary(max_size=16), st.binary(max_size=400)), max_size=20))
def test_c_and_pure_sum_the_same_snapshot_records(prefix, records):
    """BLAKE2b in C at every length around its 128-byte blocks, and the sum's wrap at 2^128."""
    assert snapshot.records_sum(prefix, records) == snapshot.records_sum_pure(prefix, records)


def test_a_records_sum_is_blake2b_128_of_prefix_and_record():
    one = int.from_bytes(hashlib.blake2b(b"books:" + b"k" * 8 + b"v" * 120, digest_size=16).digest(), "big")
    assert snapshot.records_sum(b"books:", [(b"k" * 8, b"v" * 120)]) == one
    assert snapshot.records_sum(b"books:", [(b"k" * 8, b"v" * 120)] * 3) == 3 * one % 2**128
    assert snapshot.records_sum(b"", []) == 0
    for bad in (["text"], [(b"k", "text")], [(b"k",)]):
        with pytest.raises((TypeError, ValueError)):
            snapshot.records_sum(b"books:", bad)


STREAM_KEYS = [b"k" * 32, bytes(range(64)), b""]  # a usual key, the longest, none (BLAKE2b unkeyed)
SEALS = ["blake2b", "blake3"]


@compiled
@given(st.integers(0, 40), st.sampled_from(STREAM_KEYS), st.sampled_from(STREAM_KEYS),
       st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=3), st.integers(0, 3),
       st.sampled_from(SEALS), st.sampled_from(SEALS))
def test_c_and_pure_verify_stream_seals_alike(entries, signer, verifier, flips, cut, made_by, checker_makes):
    """Real sealed packets of either algorithm, signed with one key and checked against another by a
    node that makes either, with bytes flipped (header, entries, seal, tag, algorithm) and tails cut:
    the same verdict from C and Python."""
    from tape.protocol.streamauth import StreamKeys

    msgs = [M.stamp(M.purchase(i, i, 5, "A", "X"), 7, b"load0     ", i + 1) for i in range(entries)]
    _, pkt = StreamKeys([signer], made_by).seal_packet(b"S         ", 9, msgs, 7, b"seq-a     ")
    data = bytearray(pkt[:len(pkt) - cut])
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    keys = StreamKeys([verifier], checker_makes)
    assert keys.verify(bytes(data)) == keys.verify_pure(bytes(data))
    if not flips and not cut:
        assert keys.verify(pkt) == (None if signer == verifier else "unknown_key")


@compiled
@given(st.sampled_from(STREAM_KEYS), st.integers(1, 120), st.integers(2, 2**64 - 1))
def test_a_blake3_seal_is_keyed_blake3_of_a_key_derived_from_the_stream_key(key, entries, algorithm):
    """Made in C, the tag is BLAKE3 keyed with the key derived as documented, cut to 16 bytes; a seal
    naming an algorithm there is none of is refused by C and Python alike."""
    from blake3 import blake3

    from tape.protocol.streamauth import StreamKeys

    msgs = [M.stamp(M.purchase(i, i, 5, "A", "X"), 7, b"load0     ", i + 1) for i in range(entries)]
    keys = StreamKeys([key], "blake3")
    [pkt] = keys.seal_run(b"S         ", 9, msgs, len(msgs), 7, b"seq-a     ")[1]
    seal = len(pkt) - M.SEQUENCED_SIZE
    assert int.from_bytes(pkt[seal + 41:seal + 49], "big") == 1
    derived = blake3(key, derive_key_context="tape 2026-11-28 stream seal BLAKE3 key").digest()
    unsealed = pkt[:seal + 17] + bytes(16) + pkt[seal + 33:]
    assert pkt[seal + 17:seal + 33] == blake3(unsealed, key=derived).digest(16)
    assert keys.verify(pkt) is None and StreamKeys([key]).verify(pkt) is None
    other = pkt[:seal + 41] + algorithm.to_bytes(8, "big") + pkt[seal + 49:]
    assert keys.verify(other) == keys.verify_pure(other) == "unknown_seal"


@compiled
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 300)), min_size=1, max_size=40))
def test_a_seal_is_keyed_blake2b_whichever_keys_came_before(uses):
    """More keys in turn than the C keeps the keyed state of (one a length, so that only the length
    tells two apart), each seal equal to hashlib's keyed BLAKE2b-128 of its packet."""
    from tape.protocol.streamauth import StreamKeys

    for k, entries in uses:
        key = bytes([7]) * (k + 1) if k < 5 else bytes([k]) * 64
        msgs = [M.stamp(M.purchase(i, i, 5, "A", "X"), 7, b"load0     ", i + 1) for i in range(1 + entries % 40)]
        keys = StreamKeys([key])
        [pkt] = keys.seal_run(b"S         ", 9, msgs, len(msgs), 7, b"seq-a     ")[1]  # sealed in C
        at = len(pkt) - M.SEQUENCED_SIZE + 17
        unsealed = pkt[:at] + bytes(16) + pkt[at + 16:]
        assert pkt[at:at + 16] == hashlib.blake2b(unsealed, key=key, digest_size=16).digest()
        assert keys.verify(pkt) is None


@compiled
@given(st.lists(st.binary(min_size=M.SEQUENCED_SIZE, max_size=M.SEQUENCED_SIZE), max_size=60), st.integers(1, 20),
       st.integers(1, 2**63), st.integers(0, 2**64 - 1), st.sampled_from(STREAM_KEYS), st.sampled_from(SEALS))
def test_c_and_pure_seal_a_run_alike(entries, per, first, stamp, key, seal):
    """The leader's batch cut into sealed packets: the same entries, seals and packets from C and
    Python, every packet verifying and holding its part of the entries."""
    from tape.protocol.streamauth import StreamKeys

    keys = StreamKeys([key], seal)
    session, origin = b"S         ", b"seq-a     "
    sealed, packets = keys.seal_run(session, first, entries, per, stamp, origin)
    assert (sealed, packets) == keys.seal_run_pure(session, first, entries, per, stamp, origin)
    assert len(packets) == -(-len(entries) // per) and len(sealed) == len(entries) + len(packets)
    assert [m for m in sealed if m[0] != M.AUTH or m in entries] == entries
    seq = first
    for pkt in packets:
        assert keys.verify_pure(pkt) is None
        _, pkt_seq, count = moldudp64.decode_header(pkt)
        assert pkt_seq == seq
        assert [pkt[at + 2:at + 2 + M.SEQUENCED_SIZE] for at in range(20, len(pkt), M.SEQUENCED_BLOCK_SIZE)] \
            == sealed[seq - first:seq - first + count]
        seq += count


@compiled
def test_c_seal_run_refuses_what_is_not_a_run_of_sequenced_messages():
    from tape.protocol import _speedups

    good = (b"S         ", 1, 7, b"seq-a     ", b"k" * 32, bytes(8))
    for entries, per, session, key_id, algorithm in (
            ([bytes(74)], 5, good[0], good[5], 0), (["text" * 19], 5, good[0], good[5], 1),
            ([bytes(75)], 0, good[0], good[5], 0), ([bytes(75)], 5, b"S", good[5], 0),
            ([bytes(75)], 5, good[0], bytes(7), 1), ([bytes(75)], 5, good[0], good[5], 2)):
        with pytest.raises((TypeError, ValueError)):
            _speedups.seal_run(entries, per, session, 1, 7, good[3], good[4], key_id, algorithm)


@compiled
@given(st.binary(max_size=300))
def test_c_and_pure_refuse_random_datagrams_alike(data):
    from tape.protocol.streamauth import StreamKeys

    keys = StreamKeys([b"k" * 32])
    assert keys.verify(data) == keys.verify_pure(data) is not None


BLOCK_FIELDS = st.builds(lambda k, field: moldudp64.HEADER_SIZE + k * M.SEQUENCED_BLOCK_SIZE + field,
                         st.integers(0, 40), st.integers(0, 2))  # a block's length bytes or its type byte


@compiled
@given(st.integers(0, 40), st.booleans(), st.sampled_from(STREAM_KEYS[:2]),
       st.lists(st.tuples(st.one_of(st.integers(0, 4000), BLOCK_FIELDS), st.integers(0, 255)), max_size=3),
       st.integers(0, 3))
def test_the_c_check_of_a_stream_packet_passes_exactly_what_the_python_checks_pass(entries, sealed, key, flips,
                                                                                   cut):
    """Real packets, sealed or plain, with bytes flipped (header, block lengths, type bytes, seal,
    tag) and tails cut: the C check gives the header exactly when the listener's checks in Python
    find nothing wrong, and gives it for every good data packet."""
    from tape.protocol.errors import ProtocolError
    from tape.protocol.listener import ListenerCore, good_stream_packet
    from tape.protocol.streamauth import StreamKeys

    session = b"S         "
    msgs = [M.stamp(M.purchase(i, i, 5, "A", "X"), 7, b"load0     ", i + 1) for i in range(entries)]
    pkt = StreamKeys([key]).seal_packet(session, 9, msgs, 7, b"seq-a     ")[1] if sealed \
        else moldudp64.encode_packet(session, 9, msgs)
    data = bytearray(pkt[:len(pkt) - cut])
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    data = bytes(data)
    core = ListenerCore(session, 2, 20_000_000, keys=StreamKeys([key]) if sealed else None)
    try:
        checked = core._check(data)
    except ProtocolError:
        checked = None
    header = checked if isinstance(checked, tuple) else None  # (a list: a hint, or an undecodable message)
    assert good_stream_packet(data, moldudp64.MAX_UDP_PAYLOAD, M.ALL_TYPES, core._key_ids) == header
    if not flips and not cut and (entries or sealed):
        assert header == (session, 9, entries + sealed)


@compiled
@given(st.binary(max_size=300), st.booleans())
def test_the_c_check_of_a_stream_packet_refuses_random_datagrams(data, keyed):
    from tape.protocol.listener import good_stream_packet

    keys = {b"id" * 4: b"k" * 32} if keyed else None
    assert good_stream_packet(data, moldudp64.MAX_UDP_PAYLOAD, M.ALL_TYPES, keys) is None


FRAMES = st.lists(st.tuples(st.sampled_from([-1, 0, 1, 2, 3, 5, 9]), st.sampled_from(b"AKHZ"), st.binary(max_size=12)),
                  max_size=12)  # (length - payload's, type, payload): some lengths and types refused


def read_frames(stream: bytes, cuts: list[int]) -> tuple[list, str | None]:
    """The frames a reader gives the stream fed in these cuts, and the error that stopped it."""
    from tape.protocol.framing import FrameReader

    reader, out, at = FrameReader(8, b"AKH"), [], 0
    for cut in [*cuts, len(stream)]:
        try:
            out += reader.frames(stream[at:at + cut])
        except ProtocolError as e:
            return out, f"{e.reason} at {e.offset}"
        at += cut
    return out, None


@compiled
@given(FRAMES, st.lists(st.integers(0, 20), max_size=10))
def test_c_and_pure_read_the_same_frames(frames, cuts):
    """Any stream of frames, whole or not, well formed or not, however it arrives: the reader with
    C gives the frames, and stops with the error, that the definition does."""
    from unittest import mock

    from tape.protocol import framing

    stream = b"".join(struct.pack(">IB", len(payload) + 1 + extra, kind) + payload
                      for extra, kind, payload in frames)
    with mock.patch.object(framing, "_frames", None):
        pure = read_frames(stream, cuts)
    assert read_frames(stream, cuts) == pure


@compiled
@given(st.sets(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 700)), max_size=200),
       st.sets(st.integers(0, 700), max_size=200), st.integers(0, 12), st.randoms(use_true_random=False))
def test_a_saves_buckets_are_the_pure_ones(dirty, on_disk, shift, rnd):
    """Dirty ids anywhere in the u64 range or close together, some with a new record, over buckets
    on disk that hold other ids: the same buckets and merged values as the definition."""
    pair = 8 + 3
    joined = b"".join(i.to_bytes(8, "big") for i in sorted(dirty))
    packed = b"".join(i.to_bytes(8, "big") + rnd.randbytes(3) for i in sorted(dirty) if rnd.random() < 0.7)
    assert snapshot.bucket_keys(joined, shift) == snapshot.bucket_keys_pure(joined, shift)
    wanted = set(snapshot.bucket_keys_pure(joined, shift))
    disk: dict[bytes, bytes] = {}
    for i in sorted(on_disk):
        key = (i >> shift).to_bytes(8, "big")
        if key in wanted:
            disk[key] = disk.get(key, b"") + i.to_bytes(8, "big") + b"old"
    old = sorted(disk.items())
    merged = snapshot.merge_buckets(joined, packed, old, shift, pair)
    assert merged == snapshot.merge_buckets_pure(joined, packed, old, shift, pair)
    assert [k for k, _ in merged] == sorted(wanted)
    for broken in ((joined + b"x", packed, old, shift, pair), (joined, packed + b"x", old, shift, pair),
                   (joined, packed, [(b"\xff" * 8, b"")], shift, pair)):
        if broken[2] is old or b"\xff" * 8 not in wanted:  # (an old bucket no dirty id falls in)
            with pytest.raises(ValueError):
                snapshot.merge_buckets(*broken)
            with pytest.raises(ValueError):
                snapshot.merge_buckets_pure(*broken)
