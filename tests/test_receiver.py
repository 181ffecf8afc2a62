import pytest
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import moldudp64 as m
from tape.protocol.errors import ProtocolError
from tape.protocol.receiver import StreamReceiver

S = b"STREAM    "


def stream(n, per_packet):
    msgs = [f"m{i:05d}".encode() for i in range(1, n + 1)]
    return msgs, m.pack_messages(S, 1, msgs, m.HEADER_SIZE + per_packet * 8)


def feed(rx, pkt):
    p = m.decode_packet(pkt)
    out = []
    for run in rx.on_packet(p.session, p.seq, p.count, pkt):
        first, data, skip = run.first_seq, run.packet, run.skip
        blocks = m.decode_packet(data).blocks[skip:]
        assert first == m.decode_packet(data).seq + skip
        out.extend(blocks)
    return out


@given(st.integers(1, 200), st.integers(1, 9), st.randoms(use_true_random=False), st.integers(0, 3))
def test_any_order_with_duplicates_delivers_each_message_once_in_order(n, per, rnd, dups):
    msgs, packets = stream(n, per)
    # Retransmissions are re-cut differently from the live packets.
    retrans = m.pack_messages(S, 1, msgs, m.HEADER_SIZE + (per % 4 + 1) * 8)
    arrivals = packets + [rnd.choice(packets + retrans) for _ in range(dups * len(packets))]
    rnd.shuffle(arrivals)
    rx = StreamReceiver()
    got = []
    for pkt in arrivals:
        got.extend(feed(rx, pkt))
    assert got == msgs
    assert rx.next_seq == rx.high_seq == n + 1 and rx.lag() == 0 and rx.missing() is None and rx.held == 0


def test_gap_is_reported_then_filled():
    msgs, packets = stream(30, 5)  # 6 packets of 5
    rx = StreamReceiver()
    assert feed(rx, packets[0]) == msgs[:5]
    assert feed(rx, packets[2]) == []
    assert rx.missing() == (6, 5) and rx.gaps_detected == 1
    assert feed(rx, packets[1]) == msgs[5:15]
    assert rx.missing() is None


def test_every_missing_run_is_listed_in_seq_order_up_to_the_limit():
    msgs, packets = stream(40, 5)  # 8 packets of 5: seqs 1-5, 6-10, ...
    rx = StreamReceiver()
    for i in (0, 2, 3, 5, 7):  # 6-10, 21-25 and 31-35 lost
        feed(rx, packets[i])
    assert rx.missing_runs(8) == [(6, 5), (21, 5), (31, 5)] and rx.missing_runs(2) == [(6, 5), (21, 5)]
    feed(rx, m.encode_heartbeat(S, 51))  # 41-50 exist too
    assert rx.missing_runs(8) == [(6, 5), (21, 5), (31, 5), (41, 10)]
    feed(rx, packets[1])
    assert rx.missing_runs(8) == [(21, 5), (31, 5), (41, 10)] and rx.missing() == (21, 5)


def test_heartbeat_reveals_a_tail_gap_and_end_of_session_is_seen():
    msgs, packets = stream(10, 5)
    rx = StreamReceiver()
    feed(rx, packets[0])
    assert rx.missing() is None
    feed(rx, m.encode_heartbeat(S, 11))
    assert rx.missing() == (6, 5) and rx.lag() == 5
    feed(rx, m.encode_end_of_session(S, 11))
    assert rx.ended
    feed(rx, packets[1])
    assert rx.missing() is None and rx.next_seq == 11


def test_overlapping_packet_delivers_only_the_new_part():
    rx = StreamReceiver()
    msgs = [b"a", b"b", b"c", b"d"]
    feed(rx, m.encode_packet(S, 1, msgs[:2]))
    assert feed(rx, m.encode_packet(S, 2, msgs[1:])) == [b"c", b"d"]
    assert feed(rx, m.encode_packet(S, 1, msgs[:3])) == [] and rx.duplicates == 1


def test_foreign_session_and_seq_zero_are_errors():
    rx = StreamReceiver(S)
    with pytest.raises(ProtocolError) as e:
        rx.on_packet(b"OTHER     ", 1, 1, b"")
    assert e.value.reason == "foreign_session"
    with pytest.raises(ProtocolError):
        rx.on_packet(S, 0, 1, b"")


def test_held_messages_are_bounded():
    msgs, packets = stream(100, 10)
    rx = StreamReceiver(max_held=25)
    for pkt in packets[1:]:
        feed(rx, pkt)
    assert rx.held <= 25 and rx.held_dropped >= 65
    got = feed(rx, packets[0])
    # What was dropped is still reported missing and can be asked for again.
    while rx.missing():
        seq, count = rx.missing()
        got.extend(feed(rx, m.encode_packet(S, seq, msgs[seq - 1:seq - 1 + count])))
    assert msgs[:10] + got[10:] == msgs and len(got) == 100
