import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import messages as msg
from tape.protocol import moldudp64 as m
from tape.protocol import replication as rep
from tape.protocol.follower import FollowerCore
from tape.protocol.limits import PACE_FROM_MESSAGES
from tape.sequencer.leader_core import InvariantViolation, LeaderCore, rebuild_client_state

S = b"TAPE      "
A, B = b"clientA   ", b"clientB   "
F1, F2 = b"rw-1      ", b"rw-2      "


def leader(**kw):
    core = LeaderCore(S, b"seq-a     ", 1, [F1, F2], {A: None, B: b"k" * 32}, **kw)
    start = core.start_term(100, 100)
    return core, start


def batch(client, cseq, n, key=None):
    data = m.encode_packet(client, cseq, [msg.purchase_request(cseq + i, 10, "X", "Y") for i in range(n)])
    return data + hmac.new(key, data, hashlib.sha256).digest() if key else data


def test_term_start_is_the_first_entry_and_nothing_publishes_before_a_majority():
    core, start = leader()
    assert start.first_seq == 1 and msg.decode(start.messages[0])[msg.TYPE] == msg.TERM_START
    assert core.on_journaled(1) == []  # the leader alone is 1 of 3
    packets = core.on_ack(F1, 1, True, 1)
    assert [m.decode_packet(p).seq for p in packets] == [1]  # leader + rw-1 = 2 of 3
    assert core.on_ack(F2, 1, True, 1) == []  # already published


def test_each_client_message_is_sequenced_once_in_client_order():
    core, _ = leader()
    assert core.on_inbound(batch(A, 1, 5), 200) is None
    assert core.on_inbound(batch(A, 1, 5), 200) == "duplicate"
    assert core.on_inbound(batch(A, 4, 4), 200) is None  # overlap: only 6 and 7 are new
    b = core.flush(300, 300)
    assert [msg.decode(x)[msg.CLIENT_SEQ] for x in b.messages] == [1, 2, 3, 4, 5, 6, 7]
    assert {msg.decode(x)[msg.STAMP] for x in b.messages} == {300}
    assert b.first_seq == 2 and b.prev_seq == 1


def test_batches_ahead_of_a_lost_one_are_held_until_it_arrives():
    core, _ = leader()
    assert core.on_inbound(batch(A, 6, 5), 1) is None  # 1..5 lost
    assert core.on_inbound(batch(A, 11, 5), 1) is None
    assert core.flush(2, 2) is None
    core.on_inbound(batch(A, 1, 5), 3)
    b = core.flush(4, 4)
    assert [msg.decode(x)[msg.CLIENT_SEQ] for x in b.messages] == list(range(1, 16))


def test_authentication_and_unknown_clients():
    core, _ = leader()
    assert core.on_inbound(batch(B, 1, 2), 1) == "unauthenticated"
    assert core.on_inbound(batch(B, 1, 2, key=b"x" * 32), 1) == "unauthenticated"
    assert core.on_inbound(batch(B, 1, 2, key=b"k" * 32), 1) is None
    assert core.on_inbound(batch(b"nobody    ", 1, 2), 1) == "unknown_client"
    assert core.on_inbound(b"junk", 1) == "truncated"
    assert core.dropped == {"unauthenticated": 2, "unknown_client": 1, "truncated": 1}


def test_commit_is_a_majority_and_publishes_whole_batches_in_order():
    core, _ = leader()
    core.on_journaled(1)
    core.on_ack(F1, 1, True, 1)
    for i in range(3):
        core.on_inbound(batch(A, 1 + 40 * i, 40), 10)
        core.on_journaled(core.flush(10, 10).last_seq)
    assert core.last_seq == 121 and core.commit_seq == 1
    pkts = core.on_ack(F2, 1, True, 50)  # mid-batch: 2..41 is whole, 42..81 is not yet
    assert [(p.seq, p.count) for p in map(m.decode_packet, pkts)] == [(2, 17), (19, 17), (36, 6)]
    assert core.commit_seq == 50 and core.published_seq == 41
    pkts = core.on_ack(F1, 1, True, 121)
    seqs = [(p.seq, p.count) for p in map(m.decode_packet, pkts)]
    assert seqs[0][0] == 42 and sum(c for _, c in seqs) == 80 and core.published_seq == 121


def test_acks_beyond_the_log_are_dropped_and_a_later_terms_never_reaches_the_leader():
    core, _ = leader()
    assert core.on_ack(F1, 1, True, 99) == [] and core.dropped == {"ack_beyond_log": 1}
    assert core.match[F1] == 0 and core.commit_seq == 0  # a peer's word moved nothing
    with pytest.raises(InvariantViolation):  # the election steps the node down first (sequencer/sequencer_node_core.py)
        core.on_ack(F1, 2, True, 0)


def test_time_ticks_when_idle_and_heartbeats_carry_the_next_published_seq():
    core, _ = leader(tick_ns=1000, heartbeat_ns=500)
    b, hb = core.on_timer(2000, 2000)
    assert msg.decode(b.messages[0])[msg.TYPE] == msg.TIME_TICK
    assert m.decode_packet(hb).seq == 1  # nothing published yet
    assert core.on_timer(2100, 2100) == (None, None)


def test_stamps_never_go_backwards():
    core, _ = leader()
    core.on_inbound(batch(A, 1, 1), 0)
    b1 = core.flush(1000, 1000)
    core.on_inbound(batch(A, 2, 1), 0)
    b2 = core.flush(10, 10)  # the clock stepped back
    assert msg.decode(b2.messages[0])[msg.STAMP] >= msg.decode(b1.messages[0])[msg.STAMP]


def fill(core, client, cseq, n, now):
    """`n` messages from `client` from `cseq` on, in datagrams of 20; returns the next cseq."""
    for first in range(cseq, cseq + n, 20):
        assert core.on_inbound(batch(client, first, min(20, cseq + n - first)), now) is None
    return cseq + n


def test_batches_are_paced_only_after_a_large_one():
    ms = 1_000_000
    core, _ = leader(batch_interval_ns=10 * ms)
    assert core.batch_due_ns(0) == 0  # the term start was small: at once
    cseq = fill(core, A, 1, PACE_FROM_MESSAGES - 1, 0)
    core.flush(1 * ms, 1 * ms)
    cseq = fill(core, A, cseq, 20, 2 * ms)
    assert core.batch_due_ns(2 * ms) == 2 * ms  # after a small batch: at once (low rates keep their latency)
    core.flush(2 * ms, 2 * ms)
    cseq = fill(core, A, cseq, PACE_FROM_MESSAGES, 3 * ms)
    core.flush(3 * ms, 3 * ms)
    fill(core, A, cseq, 20, 4 * ms)
    assert core.batch_due_ns(4 * ms) == 13 * ms  # after a large one: an interval after it began
    assert core.batch_due_ns(14 * ms) == 14 * ms  # (overdue: at once)
    assert core.batch_due_ns(1 * ms) == 11 * ms  # a clock stepped back waits one interval at most
    unpaced, _ = leader()
    fill(unpaced, A, 1, PACE_FROM_MESSAGES, 0)
    unpaced.flush(1 * ms, 1 * ms)
    assert unpaced.batch_due_ns(2 * ms) == 2 * ms  # batch_interval_ns 0: never paced


def test_a_new_leader_whose_clock_is_behind_stamps_no_earlier_than_the_log():
    new = LeaderCore(S, b"seq-b     ", 2, [F1, F2], {A: None}, last_seq=8, last_term=1, last_stamp_ns=5000)
    start = new.start_term(10, 10)  # its host's clock is behind the old leader's
    new.on_inbound(batch(A, 1, 1), 20)
    b = new.flush(20, 20)
    assert [msg.decode(m)[msg.STAMP] for m in start.messages + b.messages] == [5000, 5000]


def test_rebuilt_dedupe_state_drops_retransmits_of_what_the_log_holds():
    core, start = leader()
    core.on_inbound(batch(A, 1, 7), 1)
    b = core.flush(2, 2)
    state, last_seq, last_term = rebuild_client_state([*start.records(), *b.records()])
    assert state == {A: 7} and last_seq == 8 and last_term == 1
    new = LeaderCore(S, b"seq-b     ", 2, [F1, F2], {A: None}, last_seq=8, last_term=1, client_last=state)
    assert new.on_inbound(batch(A, 1, 7), 3) == "duplicate"
    assert new.on_inbound(batch(A, 5, 5), 3) is None and new.pending == 2


def test_a_restarted_client_resumes_after_what_the_stream_holds_and_nothing_is_sequenced_twice():
    from tape.protocol.stamping import PacketBuilder
    from tape.sequencer.client_core import ClientCore

    trades = [msg.purchase_request(i, 10, "X", "Y") for i in range(1, 21)]  # client seq i names trades[i - 1]
    core, start = leader()
    old = ClientCore(A, None, 1400, 10**9)
    sent = old.submit(trades[:5], 0) + old.submit(trades[5:10], 0)
    assert core.on_inbound(sent[0], 1) is None
    log = start.messages + core.flush(2, 2).messages  # the second batch is still on its way when the client dies
    new = ClientCore(A, None, 1400, 10**9)
    for p in PacketBuilder(S, 1).add_sequenced(log):
        new.on_delivered(p, 0, 3)
    assert new.resume() == 5 and new.next_cseq == 6
    again = new.submit(trades[5:20], 4)
    assert core.on_inbound(sent[1], 5) is None  # the old incarnation's batch arrives after all
    assert core.on_inbound(again[0], 5) is None  # 6-10 again (the same trades): only 11-20 are new
    log += core.flush(6, 6).messages
    sequenced = [(d[msg.CLIENT_SEQ], d[msg.ORDER_ID]) for d in map(msg.decode, log) if d[msg.TYPE] == msg.REQUEST]
    assert sequenced == [(i, i) for i in range(1, 21)]  # each trade once, under its own client seq
    with pytest.raises(InvariantViolation):
        new.resume()  # only before submitting


def test_a_resumed_client_does_not_wait_for_trades_its_earlier_run_got_in():
    from tape.protocol.stamping import PacketBuilder
    from tape.sequencer.client_core import ClientCore

    trades = [msg.purchase_request(i, 10, "X", "Y") for i in range(1, 11)]
    core, start = leader()
    sent = ClientCore(A, None, 1400, 10**9).submit(trades, 0)
    new = ClientCore(A, None, 1400, 10**9)
    assert new.resume() == 0  # the stream held nothing of ours yet
    core.on_inbound(sent[0], 1)  # then the dead run's batch is sequenced, before the new one submits
    for p in PacketBuilder(S, 1).add_sequenced(start.messages + core.flush(2, 2).messages):
        new.on_delivered(p, 0, 3)
    assert new.submit(trades, 4) == [] and not new.unacked and new.in_flight == 0  # nothing left to wait for


# --- follower ---------------------------------------------------------------------

class Log:
    def __init__(self):
        self.terms = {}

    def apply(self, core, res):
        if res.truncate_after is not None:
            for s in [s for s in self.terms if s > res.truncate_after]:
                del self.terms[s]
        for s, t, _ in res.records:
            self.terms[s] = t


def entries(n, first=1):
    return [msg.time_tick(first + i, b"x" * 10) for i in range(n)]


def append(term, prev, prev_term, commit, eterm, msgs):
    frame = rep.encode_append(term, b"seq-a     ", prev, prev_term, commit, eterm, msgs)
    return rep.FrameReader().feed(frame)[0]


def test_follower_appends_acks_and_tracks_commit():
    log = Log()
    f = FollowerCore(F1, 0, 0, lambda s: log.terms[s])
    res = f.on_append(append(1, 0, 0, 0, 1, entries(5)))
    log.apply(f, res)
    assert res.success and res.last_seq == 5 and [r[0] for r in res.records] == [1, 2, 3, 4, 5]
    res = f.on_append(append(1, 5, 1, 3, 1, []))
    assert res.success and f.commit_seq == 3


def test_follower_refuses_gaps_old_terms_and_mismatched_prev():
    log = Log()
    f = FollowerCore(F1, 0, 0, lambda s: log.terms[s])
    log.apply(f, f.on_append(append(2, 0, 0, 0, 2, entries(3))))
    assert not f.on_append(append(2, 7, 2, 0, 2, entries(1))).success  # gap: we end at 3
    assert not f.on_append(append(1, 3, 2, 0, 1, entries(1))).success  # stale leader
    res = f.on_append(append(2, 3, 1, 0, 2, entries(1)))  # our seq 3 is term 2, not 1
    assert not res.success and res.last_seq == 0  # back past all of term 2 in one step


def test_a_conflict_hint_skips_the_whole_conflicting_term():
    log = Log()
    f = FollowerCore(F1, 0, 0, lambda s: log.terms[s])
    log.apply(f, f.on_append(append(1, 0, 0, 0, 1, entries(3))))
    log.apply(f, f.on_append(append(3, 3, 1, 0, 3, entries(4, first=10))))  # seqs 4-7 in term 3
    res = f.on_append(append(4, 7, 2, 0, 4, entries(1)))  # the leader has term 2 at seq 7
    assert not res.success and res.last_seq == 3  # resend from seq 4, the first of our term 3


def test_follower_drops_a_conflicting_uncommitted_suffix():
    log = Log()
    f = FollowerCore(F1, 0, 0, lambda s: log.terms[s])
    log.apply(f, f.on_append(append(1, 0, 0, 2, 1, entries(5))))
    res = f.on_append(append(2, 2, 1, 2, 2, entries(2, first=100)))
    log.apply(f, res)
    assert res.truncate_after == 2 and [r[:2] for r in res.records] == [(3, 2), (4, 2)]
    assert f.last_seq == 4 and f.last_term == 2
    # A resend of what we already hold changes nothing.
    again = f.on_append(append(2, 2, 1, 2, 2, entries(2, first=100)))
    assert again.success and again.truncate_after is None and again.records == []


@pytest.mark.parametrize("per_drain", [1, 2, 100])
def test_clients_sharing_one_read_of_each_drain_see_what_each_sees_reading_packets_alone(per_drain):
    """`tape load`'s clients share one listener, which reads each drain once for all of them: the
    leader the newest seal names, each client's acknowledgements and rejects, in order."""
    from tape.protocol.receiver import Deliver
    from tape.protocol.streamauth import StreamKeys
    from tape.sequencer.client_core import ClientCore, read_drain

    # No followers (what it journals is committed); sealed packets, each naming its leader
    core = LeaderCore(S, b"seq-a     ", 1, [], {A: None, B: b"k" * 32}, stream_keys=StreamKeys([b"s" * 32]))
    packets = core.on_journaled(core.start_term(100, 100).last_seq)
    alone = {A: ClientCore(A, None, 1400, 10**9), B: ClientCore(B, b"k" * 32, 1400, 10**9)}
    shared = {A: ClientCore(A, None, 1400, 10**9), B: ClientCore(B, b"k" * 32, 1400, 10**9)}
    for origin, trades in ((A, [msg.purchase_request(1, 10, "X", "Y"), msg.purchase(2, 1, 2**62, "X", "Y")]),
                           (B, [msg.purchase_request(3, 10, "X", "Y")] * 3)):
        sent = alone[origin].submit(trades, 0)
        assert sent == shared[origin].submit(trades, 0)
        for datagram in sent:
            assert core.on_inbound(datagram, 1) is None
    packets += core.on_journaled(core.flush(2, 2).last_seq)
    for p in packets:
        for c in alone.values():
            c.on_delivered(p, 0, 3)
    for at in range(0, len(packets), per_drain):
        read = read_drain([Deliver(0, p, 0) for p in packets[at:at + per_drain]])
        for c in shared.values():
            c.on_read(read, 3)
    for origin in (A, B):
        mine, theirs = alone[origin], shared[origin]
        assert (theirs.acked, theirs.rejected, theirs.leader) == (mine.acked, mine.rejected, mine.leader)
        assert not theirs.unacked
    assert shared[A].acked == 2 and shared[A].rejected == [(2, "shares_out_of_range")] and shared[B].acked == 3
    assert shared[A].leader == shared[B].leader == b"seq-a     "


ENTRIES = st.lists(st.builds(
    lambda kind, origin, cseq: msg.SEQUENCED.pack(kind, 1, 1, b"X" * 16, b"Y" * 8, 0, 5, origin, cseq),
    st.sampled_from([msg.PURCHASE, msg.REQUEST, msg.REJECTED, msg.AUTH]),
    st.sampled_from([b"load0     ", b"load1     ", b"seq-a     "]), st.integers(0, 2**64 - 1)), min_size=1, max_size=6)


@given(st.lists(st.tuples(ENTRIES, st.integers(0, 5)), min_size=1, max_size=8))
def test_a_drain_read_once_is_its_packets_read_one_by_one(packets):
    """read_drain against each packet's read from its `skip`: the newest seal's leader, each origin's
    highest client seq over them all, and the packets holding a reject, in order."""
    from tape.protocol.receiver import Deliver
    from tape.protocol.streamauth import seal_origin
    from tape.sequencer.client_core import read_drain

    runs = [Deliver(0, m.encode_packet(b"S         ", 1, entries), min(skip, len(entries) - 1))
            for entries, skip in packets]
    leader, maxima, rejected = None, {}, []
    for run in runs:
        start = m.HEADER_SIZE + run.skip * msg.SEQUENCED_BLOCK_SIZE
        leader = seal_origin(run.packet) or leader
        for origin, top in msg.client_seq_maxima(memoryview(run.packet)[start:], 2).items():
            maxima[origin] = max(top, maxima.get(origin, 0))
        if msg.REJECTED in run.packet[start + 2::msg.SEQUENCED_BLOCK_SIZE]:
            rejected.append((run.packet, run.skip))
    assert read_drain(runs) == (leader, maxima, rejected)


INBOUND_MSGS = st.lists(st.builds(
    lambda kind, shares, text: msg.INBOUND.pack(kind, 7, shares, text[:16], text[16:], 9),
    st.sampled_from(msg.CLIENT_TYPES), st.sampled_from([1, -5, 2**62, -2**62, msg.SHARES_LIMIT - 1]),
    st.sampled_from([b"X".ljust(24), b"X\xff".ljust(24), bytes(24)])), min_size=1, max_size=20)


@given(INBOUND_MSGS, st.data())
def test_a_batch_is_stamped_from_its_bytes_as_its_messages_one_by_one(msgs, data):
    """Whatever part of a batch an earlier one overlapped (a resend) and whichever of its messages
    ingress rejects: the entries are the messages after the overlap, each rejected in its place
    or as sent, stamped with the batch's stamp, origin and client seq (the definitions)."""
    seen = data.draw(st.integers(0, len(msgs) - 1))  # client seqs 1..seen arrived before
    core, _ = leader()
    if seen:
        assert core.on_inbound(m.encode_packet(A, 1, msgs[:seen]), 1) is None
        core.flush(1, 1)
    assert core.on_inbound(m.encode_packet(A, 1, msgs), 2) is None
    bad = dict(msg.invalid_inbound_pure(m.encode_packet(A, 1, msgs), len(msgs)))
    want = [msg.rejected(x, bad[i]) if i in bad else x for i, x in enumerate(msgs)][seen:]
    assert core.flush(200, 200).messages == [x + (200).to_bytes(8, "big") + A + cseq.to_bytes(8, "big")
                                         for cseq, x in enumerate(want, seen + 1)]


def test_what_the_rules_cannot_apply_is_sequenced_as_a_reject_the_client_sees():
    from tape.protocol.stamping import PacketBuilder
    from tape.sequencer.client_core import ClientCore

    huge = msg.purchase(1, 1, 2**62, "X", "Y")  # twice would overflow a replica's i64 cumulative shares
    ok = msg.purchase_request(1, 10, "X", "Y")
    bad_text = msg.INBOUND.pack(msg.PURCHASE, 1, 5, b"X\xff".ljust(16), b"Y".ljust(8), 2)
    negative = msg.purchase(3, 1, -5, "X", "Y")  # a business reject: the replicas' rule, sequenced as sent
    client = ClientCore(A, None, 1400, 10**9)
    core, start = leader()
    assert core.on_inbound(client.submit([ok, huge, bad_text, negative, huge], 0)[0], 1) is None
    b = core.flush(2, 2)
    types = [chr(msg.decode(x)[msg.TYPE]) for x in b.messages]
    assert types == ["R", "J", "J", "P", "J"] and core.client_last[A] == 5
    assert core.rejected == {"shares_out_of_range": 2, "bad_text": 1}
    for p in PacketBuilder(S, 1).add_sequenced(start.messages + b.messages):
        client.on_delivered(p, 0, 3)
    assert client.acked == 5 and not client.unacked  # answered, not lost
    assert client.rejected == [(2, "shares_out_of_range"), (3, "bad_text"), (5, "shares_out_of_range")]
    assert msg.inbound_rejects(m.encode_packet(A, 1, [ok, negative]), 2) == []


def test_the_timer_is_due_when_on_timer_first_has_something_to_do():
    core, _ = leader(tick_ns=1000, heartbeat_ns=500)
    core.on_timer(2000, 2000)
    for _ in range(3):
        due = core.timer_due_ns()
        assert core.on_timer(due - 1, due - 1) == (None, None) and core.on_timer(due, due) != (None, None)


def test_a_leaders_impossible_state_stops_it_rather_than_publishing_from_it():
    """Invariants asserted inside the core as it runs (the simulator checks the same from
    outside): each one fails on the state that breaks it."""
    core, _ = leader()
    core.on_journaled(1)
    core.on_ack(F1, 1, True, 1)
    core.check()  # (holds)
    core.commit_seq = core.last_seq + 1
    with pytest.raises(InvariantViolation, match="beyond the log's last seq"):
        core.check()
    core, _ = leader()
    core.match[F1] = core.last_seq + 5
    with pytest.raises(InvariantViolation, match="a follower's match"):
        core.check()
    core, _ = leader()
    core.commit_seq = 1  # committed, its packets never released
    with pytest.raises(InvariantViolation, match="committed .* and not published"):
        core.check()
    core, _ = leader()
    core.on_inbound(batch(A, 1, 1), 200)
    core._last_stamp_ns, core._last_sequenced_ns = 0, 10**18  # a stamp clock that went back
    with pytest.raises(InvariantViolation, match="before the last one"):
        core.flush(300, 300)
