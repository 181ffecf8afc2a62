"""ReplicaCore (replicas/replica_core.py): the outbox and the emitter's marks, snapshot timing, the exit."""

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import packet_of

from tape.protocol import messages as M
from tape.protocol.receiver import Deliver, StreamReceiver
from tape.replicas.audit_core import Alert, AuditMachine
from tape.replicas.replica_core import Exit, ReplicaCore, SendAlerts, SendDigest, Snapshot

MS = 1_000_000
C, S = b"c".ljust(16), b"S".ljust(8)


def msg(kind, order, shares, pid=0, stamp=1):
    return (kind, order, shares, C, S, pid, stamp, b"o".ljust(10), 1)


def overfill(first_order: int, n: int) -> list:
    """n orders, each overfilled by its one purchase: an alert per order."""
    out = []
    for k in range(n):
        out += [msg(M.REQUEST, first_order + k, 10), msg(M.PURCHASE, first_order + k, 11, pid=k + 1)]
    return out


def applied(c: ReplicaCore, first: int, msgs: list) -> list:
    """The messages as a delivered packet, as the replica and the simulator apply them."""
    return c.on_packets([Deliver(first, packet_of(first, msgs), 0)])


def core(**kw) -> ReplicaCore:
    args = dict(snapshot_every=1000, snapshot_ns=100 * MS, exit_on_end=True, now_ns=0)
    return ReplicaCore(AuditMachine(), [], **{**args, **kw})


def test_alerts_wait_in_the_outbox_until_the_channel_is_up_and_acknowledged():
    c = core()
    assert applied(c, 1, overfill(1, 2)) == []  # no channel yet: kept, not sent
    assert len(c.outbox) == 2
    sent, = c.on_welcome(0)  # no fold point crossed yet: no digest
    assert [Alert.emit_seq_of(a) for a in sent.alerts] == [2, 4]
    actions = applied(c, 5, overfill(3, 1))
    assert actions == [SendAlerts([c.outbox[-1]])]
    c.on_ack(4)
    assert [Alert.emit_seq_of(a) for a in c.outbox] == [6]
    c.on_link_lost()
    assert c.on_welcome(4)[0].alerts == list(c.outbox)  # what the emitter has not recorded goes again


def test_alerts_raised_at_or_below_the_mark_told_are_sent_to_be_judged_but_not_kept():
    """A replica behind the others raises alerts the emitter recorded already: their copies go
    (the emitter judges them), and no acknowledgement is needed to let them go."""
    c = core()
    c.on_welcome(0)
    c.on_ack(3)  # the others' alerts up to emit seq 3 were recorded
    sent, = applied(c, 1, overfill(1, 2))
    assert [Alert.emit_seq_of(a) for a in sent.alerts] == [2, 4]
    assert [Alert.emit_seq_of(a) for a in c.outbox] == [4]
    c.on_ack(8)
    c.on_link_lost()
    assert c.on_welcome(1)[0].alerts == []  # an emitter that lost its records: its mark is the one told
    assert [Alert.emit_seq_of(a) for a in applied(c, 5, overfill(3, 1))[0].alerts] == [6]
    assert [Alert.emit_seq_of(a) for a in c.outbox] == [6]  # kept: above 1


SEQS = st.integers(0, 40) | st.sampled_from([2**64 - 2, 2**64 - 1])  # marks equal to emit seqs, often


@given(st.lists(SEQS, unique=True, max_size=20), SEQS,
       st.sampled_from([b"\x00" * 80, b"\xff" * 80]) | st.binary(min_size=80, max_size=80))
def test_an_ack_takes_out_exactly_the_alerts_at_or_below_its_mark(emit_seqs, mark, rest):
    """The outbox holds records in emit-seq order; an ack removes those with an emit seq at or
    below the mark, whatever the rest of their bytes (all 0xff included)."""
    c = core()
    records = [seq.to_bytes(8, "big") + rest for seq in sorted(emit_seqs)]
    c.outbox.extend(records)
    c.on_ack(mark)
    assert list(c.outbox) == [r for r in records if Alert.emit_seq_of(r) > mark]


def test_snapshots_every_n_messages_or_t_nanoseconds():
    c = core(snapshot_every=4)
    assert Snapshot() in applied(c, 1, overfill(1, 2))
    c.snapshot_taken(10 * MS)
    applied(c, 5, overfill(3, 1))
    rx = StreamReceiver(b"TAPE      ")
    assert c.on_timer(50 * MS, rx) == []
    assert c.on_timer(110 * MS, rx) == [Snapshot()]


def test_a_phase_brings_only_the_first_snapshot_forward():
    """Replicas started together save at different times: phase 1/2 saves first after half of
    `snapshot_every` messages (or of `snapshot_ns`), then every `snapshot_every` as phase 0 does."""
    rx = StreamReceiver(b"TAPE      ")
    c = core(snapshot_every=8, phase=0.5)
    assert Snapshot() not in applied(c, 1, overfill(1, 1))  # 2 of 4
    assert Snapshot() in applied(c, 3, overfill(2, 1))  # 4 of 4
    c.snapshot_taken(10 * MS)
    assert Snapshot() not in applied(c, 5, overfill(3, 2))  # 4 of 8 now
    assert Snapshot() in applied(c, 9, overfill(5, 2))
    timed = core(snapshot_ns=100 * MS, phase=0.5, now_ns=0)
    applied(timed, 1, overfill(1, 1))
    assert timed.on_timer(40 * MS, rx) == [] and timed.on_timer(50 * MS, rx) == [Snapshot()]
    timed.snapshot_taken(50 * MS)
    applied(timed, 3, overfill(2, 1))
    assert timed.on_timer(140 * MS, rx) == [] and timed.on_timer(150 * MS, rx) == [Snapshot()]


def test_exit_only_once_the_end_entry_is_applied_and_every_alert_acknowledged():
    c = core()
    rx = StreamReceiver(b"TAPE      ")

    def delivered(first: int, msgs: list) -> None:  # through the listener's receiver, then applied
        rx.on_packet(b"TAPE      ", first, len(msgs), packet_of(first, msgs, b"TAPE      ")[20:])
        applied(c, first, msgs)

    rx.on_packet(b"TAPE      ", 5, 0xFFFF, b"")  # an end-of-session packet: a hint, not the end
    delivered(1, overfill(1, 2))
    assert Exit() not in c.on_timer(0, rx)
    end = M.decode(M.session_end(9, b"seq-a     "))
    delivered(5, [end, M.decode(M.time_tick(9, b"seq-a     "))])  # the end entry, then (say) its seal
    assert Exit() not in c.on_timer(0, rx)  # alerts not acknowledged
    c.on_welcome(4)
    assert Exit() in c.on_timer(0, rx)
    rx.on_packet(b"TAPE      ", 9, 0xFFFF, b"")  # the stream shows more: a next leader ends it again
    assert Exit() not in c.on_timer(0, rx)


def test_the_digest_at_each_fold_point_crossed_goes_to_the_emitter_and_again_on_every_welcome():
    c = core(snapshot_every=10**6)
    c.on_welcome(0)
    msgs = overfill(1, 2100)  # 4,200 messages: past the fold at 4,096
    assert not any(isinstance(a, SendDigest) for a in applied(c, 1, msgs[:4000]))
    sent = [a for a in applied(c, 4001, msgs[4000:]) if isinstance(a, SendDigest)]
    assert sent == [SendDigest(4096, c.machine.chain)] and c.machine.last_seq == 4200
    c.on_link_lost()
    assert c.on_welcome(0)[-1] == SendDigest(4096, c.machine.chain)


def test_the_session_end_is_a_fold_point_so_that_the_days_last_block_is_compared_too():
    c, other = core(), core()
    c.on_welcome(0)
    end = M.decode(M.session_end(9, b"seq-a     "))
    tail = [end, M.decode(M.time_tick(9, b"seq-a     "))]  # the end entry, then (say) its seal
    sent = [a for a in applied(c, 1, overfill(1, 2) + tail) if isinstance(a, SendDigest)]
    assert sent == [SendDigest(5, c.machine.chain)] and c.machine.last_seq == 6
    applied(other, 1, overfill(1, 2))  # the same log in other cuts: the same fold
    applied(other, 5, tail[:1])
    applied(other, 6, tail[1:])
    assert other.last_fold == sent[0] and other.machine.digest() == c.machine.digest()


def test_a_replica_replays_over_tcp_for_what_it_misses_not_for_what_it_holds():
    """One lost packet holds everything after it: gap fill's work, however much is held. A
    replay starts past REPLAY_BEHIND missing and ends under a quarter of it."""
    from tape.protocol import moldudp64
    from tape.protocol.limits import REPLAY_BEHIND

    rx = StreamReceiver(moldudp64.session_bytes("TAPE"))
    packet = lambda seq, n: (rx.session, seq, n, b"")  # noqa: E731 (the receiver holds the bytes as given)
    rx.on_packet(*packet(1, 10))
    for seq in range(21, 21 + 3 * REPLAY_BEHIND, 10):  # seqs 11-20 lost: all after them held
        rx.on_packet(*packet(seq, 10))
    assert rx.lag() > 3 * REPLAY_BEHIND and not ReplicaCore.far_behind(rx)
    rx.on_packet(*packet(21 + 4 * REPLAY_BEHIND, 10))  # REPLAY_BEHIND more known to exist, missing
    assert ReplicaCore.far_behind(rx) and not ReplicaCore.caught_up(rx)
    rx.on_packet(*packet(21 + 3 * REPLAY_BEHIND, REPLAY_BEHIND - 400))  # a replay brings most of them
    assert not ReplicaCore.far_behind(rx) and ReplicaCore.caught_up(rx)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=12), st.lists(st.integers(1, 6), min_size=1, max_size=12),
       st.booleans())
def test_a_drain_of_packets_at_once_acts_as_the_packets_one_by_one(sizes, cuts, linked):
    """A replica applies the runs a wake-up brings in one call: the same state, outbox and digests
    as one packet at a time, each fold point's digest after every alert raised before it, and no
    more snapshots asked for than packets."""
    msgs = overfill(1, sum(sizes))  # an alert every second message; 4,096 (a fold) within reach
    runs, seq = [], 1
    for n in sizes:
        runs.append(Deliver(seq, packet_of(seq, msgs[seq - 1:seq - 1 + 2 * n]), 0))
        seq += 2 * n
    one, many = core(snapshot_every=1500), core(snapshot_every=1500)
    if linked:
        one.on_welcome(0), many.on_welcome(0)
    by_one = [a for run in runs for a in one.on_packets([run])]
    by_many, at = [], 0
    for i in range(len(runs)):  # drains of cuts[i] packets
        drain = runs[at:at + cuts[i % len(cuts)]]
        by_many += many.on_packets(drain)
        at += len(drain)
        if at == len(runs):
            break

    def sent(actions):  # the alerts' emit seqs, a digest as its fold seq (negative)
        return [x for a in actions for x in ([Alert.emit_seq_of(e) for e in a.alerts] if isinstance(a, SendAlerts) else
                                              [-a.fold_seq] if isinstance(a, SendDigest) else [])]

    assert sent(by_many) == sent(by_one) and (not linked or sent(by_one))
    assert many.machine.digest() == one.machine.digest() and many.machine.last_seq == seq - 1
    assert list(many.outbox) == list(one.outbox) and many.last_fold == one.last_fold
    assert many._since_snapshot == one._since_snapshot
    assert 0 < by_many.count(Snapshot()) <= by_one.count(Snapshot()) or by_one.count(Snapshot()) == 0
