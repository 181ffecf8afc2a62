import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ascii_text, i64, inbound, sequenced, session, u64

from tape.protocol import messages as msg
from tape.protocol import moldudp64 as m
from tape.protocol.errors import ProtocolError
from tape.protocol.stamping import PacketBuilder, messages_per_packet


@given(u64, i64, ascii_text(16), ascii_text(8), u64, session, u64)
def test_request_round_trip(order_id, shares, client, stock, stamp, origin, cseq):
    raw = msg.purchase_request(order_id, shares, client, stock)
    msg.check_inbound(raw)
    d = msg.decode(msg.stamp(raw, stamp, origin, cseq))
    assert d[msg.TYPE] == msg.REQUEST
    assert (d[msg.ORDER_ID], d[msg.SHARES], d[msg.PURCHASE_ID]) == (order_id, shares, 0)
    assert d[msg.CLIENT].rstrip(b" ").decode() == client and d[msg.STOCK].rstrip(b" ").decode() == stock
    assert (d[msg.STAMP], d[msg.ORIGIN], d[msg.CLIENT_SEQ]) == (stamp, origin, cseq)


@given(u64, u64, i64, ascii_text(16), ascii_text(8))
def test_purchase_round_trip(pid, order_id, shares, client, stock):
    d = msg.decode(msg.stamp(msg.purchase(pid, order_id, shares, client, stock), 1, b"c" * 10, 1))
    assert (d[msg.TYPE], d[msg.PURCHASE_ID], d[msg.ORDER_ID], d[msg.SHARES]) == (msg.PURCHASE, pid, order_id, shares)
    assert msg.to_dict(d)["client"] == client


@given(u64, session, u64, ascii_text(10))
def test_control_messages(stamp, origin, term, leader):
    t = msg.decode(msg.term_start(stamp, origin, term, leader))
    assert (t[msg.TYPE], t[msg.TERM], t[msg.STAMP]) == (msg.TERM_START, term, stamp)
    assert msg.to_dict(t)["leader"] == leader
    k = msg.decode(msg.time_tick(stamp, origin))
    assert (k[msg.TYPE], k[msg.STAMP], k[msg.ORIGIN]) == (msg.TIME_TICK, stamp, origin)


@given(st.lists(sequenced, min_size=1, max_size=60), st.integers(1, 2**40), st.integers(97, 1400))
def test_packets_of_messages_round_trip(seqd, first, limit):
    packets = PacketBuilder(b"S" * 10, first, limit).add_sequenced(seqd)
    got = []
    for pkt in packets:
        assert len(pkt) <= limit
        p = m.decode_packet(pkt)  # the generic decoder agrees with the fast one
        fast = msg.decode_packet_messages(pkt, p.count)
        assert fast == [msg.decode(b) for b in p.blocks]
        got.extend(fast)
    assert got == [msg.decode(s) for s in seqd]
    assert messages_per_packet(1400) == 17


@given(st.lists(inbound, min_size=1, max_size=20), st.integers(0, 19))
def test_skip_and_inbound_batches(inb, skip):
    pkt = PacketBuilder(b"S" * 10, 1, 65000).add_stamped(inb, 5, b"o" * 10, 1)[0]
    skip = min(skip, len(inb) - 1)
    decoded = msg.decode_packet_messages(pkt, len(inb), skip)
    assert decoded == [msg.SEQUENCED.unpack(msg.stamp(m_, 5, b"o" * 10, cseq))
                       for cseq, m_ in enumerate(inb[skip:], 1 + skip)]  # the right messages, stamped, in order
    assert msg.decode_delivered(pkt, skip) == decoded  # a checked packet, delivered: the same, unchecked
    batch = m.encode_packet(b"o" * 10, 1, inb)
    msg.check_inbound_batch(batch, len(inb))
    assert [msg.inbound_message_bytes(batch, i) for i in range(len(inb))] == inb


def test_stamped_packets_equal_stamping_one_by_one():
    inb = [msg.purchase_request(i, 10, "A", "B") for i in range(1, 40)]
    packets = PacketBuilder(b"S" * 10, 100).add_stamped(inb, 7, b"o" * 10, 50)
    flat = [b for p in packets for b in m.decode_packet(p).blocks]
    assert flat == [msg.stamp(x, 7, b"o" * 10, 50 + i) for i, x in enumerate(inb)]
    assert [m.decode_packet(p).seq for p in packets] == [100, 117, 134]


def _packet_with(block: bytes, count=1):
    return m.HEADER.pack(b"S" * 10, 1, count) + block


@pytest.mark.parametrize("data, count, reason", [
    (_packet_with(msg.BLOCK_PREFIX + msg.stamp(msg.purchase(1, 1, 1, "a", "b"), 1, b"o" * 10, 1)[:-1]), 1, "truncated"),
    (_packet_with(b"\x00\x4a" + b"R" + bytes(74)), 1, "bad_length"),
    (_packet_with(b"\x01\x4b" + b"R" + bytes(74)), 1, "bad_length"),
    (_packet_with(b"\x00\x4b" + b"Z" + bytes(74)), 1, "unknown_type"),
    (_packet_with(b"\x00\x4b" + b"R" + bytes(74) + b"!"), 1, "trailing_bytes"),
    (_packet_with(b"\x00\x4b" + b"R" + bytes(74)), 2, "truncated"),
])
def test_bad_message_blocks(data, count, reason):
    with pytest.raises(ProtocolError) as e:
        msg.decode_packet_messages(data, count)
    assert e.value.reason == reason


def test_clients_cannot_submit_control_messages_or_wrong_sizes():
    with pytest.raises(ProtocolError):
        msg.check_inbound(msg.term_start(1, b"o" * 10, 1, "x")[:49])
    with pytest.raises(ProtocolError):
        msg.check_inbound(msg.purchase_request(1, 1, "a", "b") + b"x")
    with pytest.raises(ProtocolError):
        msg.check_inbound_batch(m.encode_packet(b"o" * 10, 1, [b"T" + bytes(48)]), 1)
    with pytest.raises(ValueError):
        msg.purchase_request(1, 1, "a" * 17, "b")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, -1, 5, 2**24 - 1, 2**24, -(2**24) + 1, -(2**24), 2**62, -(2**63)]),
                          st.sampled_from([b"Acme", b"caf\xc3\xa9", b"\x00", b"~"])), min_size=1, max_size=20))
def test_ingress_validation_equals_the_rule_message_by_message(cases):
    msgs = [msg.INBOUND.pack(msg.PURCHASE, 1, shares, client.ljust(16), b"AAPL".ljust(8), 1)
            for shares, client in cases]
    want = [(i, 1) if not -(2**24) < shares < 2**24 else (i, 2)
            for i, (shares, client) in enumerate(cases)
            if not -(2**24) < shares < 2**24 or any(b < 0x20 or b > 0x7E for b in client)]
    assert msg.inbound_rejects(m.encode_packet(b"c" * 10, 1, msgs), len(msgs)) == want
