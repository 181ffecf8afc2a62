import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import session, u64

from tape.protocol import moldudp64 as m
from tape.protocol.errors import ProtocolError

blobs = st.lists(st.binary(min_size=0, max_size=200), min_size=1, max_size=40)
same_size_blobs = st.integers(0, 80).flatmap(lambda n: st.lists(st.binary(min_size=n, max_size=n), max_size=40))


@given(session, st.integers(1, 2**63), blobs | same_size_blobs)
def test_packet_round_trip(sess, seq, msgs):
    pkt = m.encode_packet(sess, seq, msgs)
    got = m.decode_packet(pkt)
    assert (got.session, got.seq, got.count, got.blocks) == (sess, seq, len(msgs), msgs)


@given(session, u64)
def test_heartbeat_and_end_of_session(sess, seq):
    hb = m.decode_packet(m.encode_heartbeat(sess, seq))
    assert hb.is_heartbeat and hb.seq == seq and hb.blocks == []
    eos = m.decode_packet(m.encode_end_of_session(sess, seq))
    assert eos.is_end_of_session and eos.seq == seq


@given(session, st.integers(1, 2**64 - 1), st.integers(1, 0xFFFE))
def test_request_round_trip(sess, seq, count):
    assert m.decode_request(m.encode_request(sess, seq, count)) == (sess, seq, count)


@given(session, st.integers(1, 1000), blobs, st.integers(60, 1400))
def test_packer_fills_packets_in_order_and_within_limit(sess, first, msgs, limit):
    msgs = [x[: limit - m.HEADER_SIZE - 2] for x in msgs]
    packets = m.pack_messages(sess, first, msgs, limit)
    seq = first
    out = []
    for pkt in packets:
        assert len(pkt) <= limit
        p = m.decode_packet(pkt)
        assert p.seq == seq
        seq += p.count
        out.extend(p.blocks)
    assert out == msgs
    # Every packet but the last could not take the next message.
    for pkt, nxt in zip(packets, packets[1:]):
        first_next = m.decode_packet(nxt).blocks[0]
        assert len(pkt) + 2 + len(first_next) > limit


@pytest.mark.parametrize("data, reason", [
    (b"", "truncated"),
    (b"SESSION   " + bytes(9), "truncated"),
    (b"SESSION   " + (1).to_bytes(8, "big") + (0).to_bytes(2, "big") + b"x", "trailing_bytes"),
    (b"SESSION   " + (1).to_bytes(8, "big") + (0xFFFF).to_bytes(2, "big") + b"\x00\x01x", "trailing_bytes"),
    (b"SESSION   " + (1).to_bytes(8, "big") + (2).to_bytes(2, "big") + b"\x00\x01x", "wrong_count"),
    (b"SESSION   " + (1).to_bytes(8, "big") + (1).to_bytes(2, "big") + b"\x00\x09x", "truncated"),
    (b"SESSION   " + (1).to_bytes(8, "big") + (1).to_bytes(2, "big") + b"\x00\x01xy", "trailing_bytes"),
    (b"SESS\xffON   " + (1).to_bytes(8, "big") + (0).to_bytes(2, "big"), "bad_session"),
    (b" SESSION  " + (1).to_bytes(8, "big") + (0).to_bytes(2, "big"), "bad_session"),
    (b"S" * 10 + bytes(10) + bytes(70000), "oversized"),
])
def test_bad_packets_name_the_reason(data, reason):
    with pytest.raises(ProtocolError) as e:
        m.decode_packet(data)
    assert e.value.reason == reason


@pytest.mark.parametrize("data", [
    m.encode_request(b"S" * 10, 1, 1) + b"x",
    b"S" * 10 + (1).to_bytes(8, "big") + (0).to_bytes(2, "big"),
    b"S" * 10 + (0).to_bytes(8, "big") + (3).to_bytes(2, "big"),
    b"S" * 10 + (5).to_bytes(8, "big") + (0xFFFF).to_bytes(2, "big"),
])
def test_bad_requests(data):
    with pytest.raises(ProtocolError):
        m.decode_request(data)


def test_session_bytes_validates():
    assert m.session_bytes("ABC") == b"ABC       "
    for bad in ("", "ELEVENCHARS", "tab\there", "é"):
        with pytest.raises((ProtocolError, UnicodeEncodeError)):
            m.session_bytes(bad)
