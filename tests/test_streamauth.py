"""The public stream's seals (protocol/streamauth.py): what verifies, what does not, and the
leader, listener and rewinder rules built on them."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol.limits import GAP_ASKED_OF, GAPS_ASKED_AT_ONCE, HINT_TRIES
from tape.protocol.listener import Ahead, Deliver, ListenerCore
from tape.protocol.stamping import PacketBuilder, messages_per_packet
from tape.protocol.streamauth import SEAL_KEY_ID_AT, ListenerKeys, StreamKeys, key_id, seal_covers, sealed_ranges
from tape.sequencer.leader_core import InvariantViolation, LeaderCore

S = moldudp64.session_bytes("TAPE")
LEADER = moldudp64.session_bytes("seq-a")
K1, K2 = b"1" * 32, b"2" * 32
CLIENT = b"clientA   "


def trades(n, first=1):
    return [M.stamp(M.purchase_request(i, 10, "X", "Y"), 1000 + i, CLIENT, i) for i in range(first, first + n)]


def test_a_sealed_packet_verifies_and_any_changed_byte_does_not():
    keys = StreamKeys([K1])
    seal, packet = keys.seal_packet(S, 5, trades(3), 2000, LEADER)
    assert keys.verify(packet) is None and packet.endswith(seal)
    assert moldudp64.decode_header(packet) == (S, 5, 4)  # every block is counted: plain MoldUDP64
    for i in range(len(packet)):
        forged = packet[:i] + bytes([packet[i] ^ 1]) + packet[i + 1:]
        assert keys.verify(forged) is not None, f"byte {i}"


def test_keys_rotate_the_first_signs_either_verifies():
    old, both, new = StreamKeys([K1]), StreamKeys([K2, K1]), StreamKeys([K2])
    _, by_old = old.seal_packet(S, 1, trades(2), 1, LEADER)
    _, by_both = both.seal_packet(S, 1, trades(2), 1, LEADER)
    assert both.verify(by_old) is None and new.verify(by_both) is None
    assert new.verify(by_old) == "unknown_key" and old.verify(by_both) == "unknown_key"


L1, L2 = b"L" * 32, b"M" * 32


@pytest.mark.parametrize("seal", ["blake2b", "blake3"])
def test_a_listener_key_checks_the_seal_and_can_make_nothing_the_cluster_takes(seal):
    leader, cluster, listener = StreamKeys([K1], seal, [L1]), StreamKeys([K1], seal), ListenerKeys([L2, L1])
    sealed, packets = leader.seal_run(S, 1, trades(7), 3, 2000, LEADER)
    assert (sealed, packets) == leader.seal_run_pure(S, 1, trades(7), 3, 2000, LEADER)  # C as its definition
    for packet in packets:  # a cluster listener checks the tag as before (the listener tag is under it)
        assert cluster.verify(packet) is None and listener.verify(packet) is None is listener.verify_pure(packet)
        cluster_tag = range(len(packet) - M.SEQUENCED_SIZE + 17, len(packet) - M.SEQUENCED_SIZE + 33)
        for i in (i for i in range(len(packet)) if i not in cluster_tag):  # the only bytes it does not cover
            forged = packet[:i] + bytes([packet[i] ^ 1]) + packet[i + 1:]
            assert listener.verify(forged) is not None and listener.verify_pure(forged) is not None, f"byte {i}"
    assert ListenerKeys([L2]).verify(packets[0]) == "bad_tag" == ListenerKeys([L2]).verify_pure(packets[0])
    untagged = cluster.seal_run(S, 1, trades(3), 3, 2000, LEADER)[1][0]  # a leader without a listener key
    assert listener.verify(untagged) == "unknown_key" == listener.verify_pure(untagged)
    # What a client's host can make with all it holds: no packet a replica or a rewinder takes.
    by_listener_key = StreamKeys([L1], seal).seal_packet(S, 1, trades(2), 1, LEADER)[1]
    at = len(by_listener_key) - M.SEQUENCED_SIZE + SEAL_KEY_ID_AT
    named_as_the_stream_key = by_listener_key[:at] + key_id(K1) + by_listener_key[at + 8:]
    assert cluster.verify(by_listener_key) == "unknown_key" and cluster.verify(named_as_the_stream_key) == "bad_tag"


def test_a_rewinder_takes_gap_requests_signed_with_the_stream_or_a_listener_key():
    rewinder = StreamKeys([K1], listeners=[L1])
    request = moldudp64.encode_request(S, 5, 2)
    for signer in (StreamKeys([K1]), ListenerKeys([L1])):
        assert rewinder.verify_request(signer.sign_request(request, ("10.0.0.1", 9), 7), ("10.0.0.1", 9)) == 7
    assert StreamKeys([K1]).verify_request(ListenerKeys([L1]).sign_request(request, ("10.0.0.1", 9), 7),
                                           ("10.0.0.1", 9)) == "unknown_key"


@pytest.mark.parametrize("case", ["unsealed", "seal_not_last", "seal_covers_other_seqs", "half_a_range"])
def test_what_is_not_one_whole_sealed_range_is_refused(case):
    keys = StreamKeys([K1])
    seal, packet = keys.seal_packet(S, 5, trades(3), 2000, LEADER)
    blocks = trades(3) + [seal]
    if case == "unsealed":
        packet = PacketBuilder(S, 5).add_sequenced(trades(3))[0]
    elif case == "seal_not_last":
        packet = PacketBuilder(S, 5).add_sequenced([seal] + trades(3))[0]
    elif case == "seal_covers_other_seqs":
        packet = PacketBuilder(S, 6).add_sequenced(blocks)[0]
    else:
        packet = PacketBuilder(S, 6).add_sequenced(blocks[1:])[0]
    assert keys.verify(packet) == "unsealed"


def sealed_leader(term=1, **kw):
    core = LeaderCore(S, LEADER, term, [b"rw-1      "], {CLIENT: None}, stream_keys=StreamKeys([K1]), **kw)
    return core, core.start_term(100, 100)


def inbound(cseq, n):
    return moldudp64.encode_packet(CLIENT, cseq, [M.purchase_request(i, 10, "X", "Y") for i in range(cseq, cseq + n)])


def test_the_leader_ends_every_packet_with_a_seal_and_journals_what_it_publishes():
    core, start = sealed_leader()
    core.on_inbound(inbound(1, 60), 200)
    batch = core.flush(300, 300)
    per = messages_per_packet()
    packets = core.on_journaled(batch.last_seq) + core.on_ack(b"rw-1      ", 1, True, batch.last_seq)
    assert len(packets) == 1 + -(-60 // (per - 1))  # the term start's packet, then 60 trades
    log = start.messages + batch.messages
    blocks = [M.packet_message_bytes(p, i) for p in packets for i in range(moldudp64.decode_header(p)[2])]
    assert blocks == log  # each packet is exactly its range of the log
    assert all(StreamKeys([K1]).verify(p) is None for p in packets)
    covers = [c for c in map(seal_covers, log) if c]  # each seal covers its packet's entries before it
    assert covers == [(moldudp64.decode_header(p)[1], moldudp64.decode_header(p)[2] - 1) for p in packets]


def test_a_new_leader_seals_the_range_its_log_ends_with_first():
    tail = trades(4, first=7)  # seqs 7-10: the old leader's range, cut short by a catch-up chunk
    core, start = sealed_leader(2, last_seq=10, last_term=1, open_range=(7, tail))
    closing = start.messages[0]
    assert start.first_seq == 11 and M.decode(closing)[M.TYPE] == M.AUTH
    assert StreamKeys([K1]).verify(PacketBuilder(S, 7).add_sequenced(tail + [closing])[0]) is None
    assert M.decode(start.messages[1])[M.TYPE] == M.TERM_START and core.term_start_seq == 12
    assert core.published_seq == 11  # the sealed range is an earlier term's: listeners fill it


def test_a_log_with_more_unsealed_entries_than_a_packet_is_refused():
    with pytest.raises(InvariantViolation, match="keys apply from a new session"):
        sealed_leader(2, last_seq=100, last_term=1, open_range=(1, trades(messages_per_packet())))


def test_a_listener_with_the_key_delivers_sealed_ranges_only():
    keys = StreamKeys([K1])
    lc = ListenerCore(S, 2, 10**9, keys=keys)
    forged = PacketBuilder(S, 1).add_sequenced(trades(2))[0]
    assert lc.on_datagram(forged).reason == "unsealed" and lc.receiver.next_seq == 1
    assert lc.on_datagram(StreamKeys([K2]).seal_packet(S, 1, trades(2), 1, LEADER)[1]).reason == "unknown_key"
    _, real = keys.seal_packet(S, 1, trades(2), 1, LEADER)
    assert lc.on_datagram(real) == [Deliver(1, real, 0)] and lc.bad == {"unsealed": 1, "unknown_key": 1}


def test_a_sealed_packet_ahead_of_a_gap_is_handed_out_as_ahead_and_a_client_resends_none_of_it():
    """Only with keys (an unsealed packet could be anyone's), only ahead of the next seq; the
    client stops resending what it holds, and acknowledges it (rejects read) once delivered."""
    from tape.sequencer.client_core import ClientCore

    keys = StreamKeys([K1])
    lc, client = ListenerCore(S, 2, 10**9, keys=keys), ClientCore(CLIENT, None, 1400, 10**9)
    client.submit([M.purchase_request(i, 10, "X", "Y") for i in range(1, 6)], 0)
    (_, first), (_, second) = (keys.seal_packet(S, 1, trades(2), 1, LEADER),
                               keys.seal_packet(S, 4, trades(3, first=3), 1, LEADER))
    assert lc.on_datagram(second) == [Ahead(second)]  # seq 4 while 1 is next: held
    client.on_ahead(second, 7)
    assert not client.unacked and client.on_timer(10**10) == []  # sequenced: never sent again
    assert client.acked == 0 and client.latencies_ns == [7]  # acknowledged once delivered in order
    assert lc.on_datagram(second) == [Ahead(second)]  # again (a gap fill's copy): nothing new
    client.on_ahead(second, 8)
    assert client.latencies_ns == [7]
    assert lc.on_datagram(first) == [Deliver(1, first, 0), Deliver(4, second, 0)]
    assert client.on_delivered(first, 0, 9) and client.on_delivered(second, 0, 9) and client.acked == 5
    assert lc.on_datagram(first) == []  # a duplicate behind the stream: nothing
    plain = ListenerCore(S, 2, 10**9)
    assert plain.on_datagram(PacketBuilder(S, 4).add_sequenced(trades(3, first=3))[0]) == []


def test_a_client_sends_new_batches_to_the_leader_the_seals_name_and_resends_to_every_sequencer():
    """None (every sequencer) until a sealed packet names a leader, in order or ahead of a gap; an
    unsealed packet names none; a resend (nothing seen sequenced in time) forgets the leader
    until a packet names one again (it may be gone); a new leader's seals move it."""
    from tape.protocol.streamauth import seal_origin
    from tape.sequencer.client_core import ClientCore

    keys, other = StreamKeys([K1]), moldudp64.session_bytes("seq-b")
    client = ClientCore(moldudp64.session_bytes("clientB"), None, 1400, 10**6)  # the trades are clientA's
    assert client.leader is None
    unsealed = PacketBuilder(S, 1).add_sequenced(trades(2))[0]
    client.on_delivered(unsealed, 0, 0)
    assert client.leader is None and seal_origin(unsealed) is None
    _, first = keys.seal_packet(S, 3, trades(2, first=3), 1, LEADER)
    client.on_delivered(first, 0, 0)
    assert client.leader == LEADER == seal_origin(first)
    client.submit([M.purchase_request(1, 10, "X", "Y")], 0)
    assert client.on_timer(10**6 - 1) == [] and client.leader == LEADER  # not due: still the leader's
    assert len(client.on_timer(10**9)) == 1 and client.leader is None  # resent: to every sequencer
    client.on_delivered(unsealed, 0, 0)
    assert client.leader is None
    _, ahead = keys.seal_packet(S, 9, trades(2, first=9), 1, other)
    client.on_ahead(ahead, 0)
    assert client.leader == other


def test_a_listener_asks_for_every_missing_run_at_once_and_again_only_after_the_timeout():
    """Each of the first GAPS_ASKED_AT_ONCE runs, of GAP_ASKED_OF rewinders at once, the first of
    them in turn (the first answer fills it: one of them may be waiting out its fsync); a run not
    answered within gap_request_ns goes again to the rewinder after the last one asked; a filled
    run is not asked again."""
    assert GAP_ASKED_OF == 2
    keys = StreamKeys([K1])
    lc = ListenerCore(S, 3, 20 * 10**6, keys=keys)
    lc.reply_at("10.0.0.1", 7000, 0)
    packets = [keys.seal_packet(S, 1 + 4 * i, trades(3, first=1 + 3 * i), 1, LEADER)[1] for i in range(12)]
    for i in range(0, 12, 2):  # seqs 5-8, 13-16, ... lost: 5 gaps behind the last packet
        lc.on_datagram(packets[i])

    def asked(now):
        return [(a.index, moldudp64.decode_request(a.request[:20])[1:]) for a in lc.on_timer(now)]

    gaps = [(5 + 8 * i, 4) for i in range(GAPS_ASKED_AT_ONCE) if 5 + 8 * i < 41]
    assert asked(0) == [(j % 3, gap) for i, gap in enumerate(gaps) for j in (i, i + 1)]  # all at once, in turn
    assert asked(19 * 10**6) == []  # not before the timeout
    lc.on_datagram(packets[1])  # 5-8 answered
    assert asked(20 * 10**6) == [((i + 2) % 3, gap) for i, gap in enumerate(gaps) if i]  # the next rewinder
    assert lc.requests_sent == 3 * len(gaps) - 1


def test_a_listeners_gap_timeout_follows_how_long_answers_take():
    """Answered in 100 ms (a loaded rewinder), a run is not asked again at the configured 20 ms
    but at srtt + 4 rttvar; a run asked twice says nothing of the answers' time."""
    keys = StreamKeys([K1])
    lc = ListenerCore(S, 2, 20 * 10**6, keys=keys)
    lc.reply_at("10.0.0.1", 7000, 0)
    packets = [keys.seal_packet(S, 1 + 4 * i, trades(3, first=1 + 3 * i), 1, LEADER)[1] for i in range(6)]
    ms = 10**6
    for i in (0, 2):
        lc.on_datagram(packets[i])
    assert len(lc.on_timer(0)) == 2  # (of both rewinders)
    lc.on_datagram(packets[1])  # answered after 100 ms
    assert lc.on_timer(100 * ms) == [] and lc.answers.timeout_ns == 300 * ms
    lc.on_datagram(packets[4])  # 13-16 lost
    assert len(lc.on_timer(100 * ms)) == 2
    assert lc.on_timer(399 * ms) == [] and len(lc.on_timer(400 * ms)) == 1  # not at 120 ms; of the next one
    lc.on_datagram(packets[3])
    assert lc.on_timer(2_000 * ms) == [] and lc.answers.timeout_ns == 300 * ms  # asked twice: no sample


def test_with_keys_heartbeats_are_hints_that_claim_nothing():
    lc = ListenerCore(S, 2, 10**9, keys=StreamKeys([K1]))
    lc.reply_at("10.0.0.1", 7000, 0)
    assert lc.on_datagram(moldudp64.encode_heartbeat(S, 2**62)) == []
    assert lc.receiver.lag() == 0  # nothing believed to exist
    asks = [a for t in range(20) for a in lc.on_timer(t * 10**9)]  # but what follows is asked for, a few times
    # (the first time of GAP_ASKED_OF rewinders at once, then of one at a time)
    assert [moldudp64.decode_request(a.request[:20])[1] for a in asks] == [1] * (HINT_TRIES + GAP_ASKED_OF - 1)


def test_without_keys_a_far_fetched_heartbeat_is_dropped():
    lc = ListenerCore(S, 2, 10**9)
    lc.on_datagram(moldudp64.encode_heartbeat(S, 5))
    assert lc.on_datagram(moldudp64.encode_heartbeat(S, 2**62)).reason == "far_future"
    assert lc.receiver.lag() == 4


def sealed_log(sizes, first=1):
    """A log of sealed ranges of the given entry counts, and the packets the leader sent."""
    keys, log, packets, seq = StreamKeys([K1]), [], [], first
    for n in sizes:
        seal, packet = keys.seal_packet(S, seq, trades(n, seq), 2000, LEADER)
        log += trades(n, seq) + [seal]
        packets.append(packet)
        seq += n + 1
    return keys, log, packets


@given(st.lists(st.integers(1, 16), min_size=1, max_size=12), st.integers(0, 40),
       st.lists(st.integers(1, 30), min_size=1, max_size=20))
def test_replayed_entries_are_cut_back_into_the_packets_the_leader_sealed(sizes, start, reads):
    """A replay from any seq, read in any pieces (as the runtime feeds them): every range after
    the start comes out as the very packet the leader sealed, a range the start cuts is skipped."""
    keys, log, packets = sealed_log(sizes)
    start = min(start, len(log) - 1)
    pending, seq, out, pieces, rest = [], 1 + start, [], iter(reads), log[start:]
    while rest:
        n = next(pieces, len(rest))
        pending, rest = pending + rest[:n], rest[n:]
        ranges, used = sealed_ranges(pending, seq)
        out += [PacketBuilder(S, first, 1400).add_sequenced(entries)[0] for first, entries in ranges]
        seq, pending = seq + used, pending[used:]
    starts = [1 + sum(s + 1 for s in sizes[:i]) for i in range(len(sizes))]
    assert out == [p for p, at in zip(packets, starts) if at >= 1 + start]
    assert all(keys.verify(p) is None for p in out)
    assert not pending  # the log ends with a seal: nothing left over


def test_entries_after_the_last_seal_wait_for_the_rest_of_their_range():
    _, log, _ = sealed_log([3, 2])
    ranges, used = sealed_ranges(log[:6], 1)  # the first range (3 + seal), then 2 of the next 3
    assert [(first, len(entries)) for first, entries in ranges] == [(1, 4)] and used == 4
    assert sealed_ranges(log[4:6], 5) == ([], 0)


@given(order=st.permutations(range(5)), again=st.lists(st.integers(0, 4), max_size=4),
       forged_at=st.integers(0, 9), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_a_drain_in_one_call_gives_each_datagram_its_actions_in_order(order, again, forged_at, cuts):
    """`on_datagrams`, however the datagrams are cut into drains, gives what the stream's rules
    give each datagram in turn: a forged one its error in its place, a packet ahead of the next
    seq an Ahead, a duplicate nothing, the next one its run and every held one it frees."""
    keys = StreamKeys([K1])
    packets = [keys.seal_packet(S, 1 + 3 * i, trades(2, first=1 + 3 * i), 1, LEADER)[1] for i in range(5)]
    forged = packets[0][:-1] + bytes([packets[0][-1] ^ 1])
    arriving = [packets[i] for i in [*order, *again]]
    arriving.insert(forged_at % (len(arriving) + 1), forged)
    expected, next_seq, held = [], 1, {}
    for data in arriving:  # the rules, one datagram at a time
        if data is forged:
            expected.append("bad_tag")
            continue
        seq = moldudp64.HEADER.unpack_from(data)[1]
        if seq > next_seq:
            held[seq] = data
            expected.append(Ahead(data))
            continue
        if seq == next_seq:
            expected.append(Deliver(seq, data, 0))
            next_seq += 3
            while next_seq in held:
                expected.append(Deliver(next_seq, held.pop(next_seq), 0))
                next_seq += 3
    lc, got, at = ListenerCore(S, 2, 10**9, keys=keys), [], 0
    for cut in cuts * len(arriving):
        if at >= len(arriving):
            break
        got += lc.on_datagrams(arriving[at:at + cut])
        at += cut
    assert [a.reason if isinstance(a, Exception) else a for a in got] == expected
    assert lc.bad == {"bad_tag": 1} and lc.receiver.next_seq == 16
