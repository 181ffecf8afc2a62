"""The listener drops malformed and unauthenticated datagrams, but reports an
undecodable message in authenticated committed data instead of waiting;
without keys nothing it receives can stop it. Its gap-answer socket is
drained a bounded batch per wake-up."""

import dataclasses
import socket
import tomllib

import pytest
from conftest import Clock, until

from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol.limits import GAP_ASKED_OF, HINT_TRIES
from tape.protocol.listener import Deliver
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import StreamKeys
from tape.runtime.config import default_toml, parse
from tape.runtime.tuning import DRAIN_DATAGRAMS
from tape.sequencer.client_shell import StreamListener

SESSION = moldudp64.session_bytes("TAPE")
KEY = b"k" * 32


def config(keys: bool):
    cfg = parse(tomllib.loads(default_toml("/nonexistent")))
    return dataclasses.replace(cfg, stream_keys=[KEY] if keys else [])


def good(n, first=1):
    return [M.stamp(M.purchase_request(i, 10, "C", "S"), 1, b"o" * 10, i) for i in range(first, first + n)]


def sealed(seq, raw_messages):
    return StreamKeys([KEY]).seal_packet(SESSION, seq, raw_messages, 1, b"seq-a     ")[1]


def listener(keys: bool, **kwargs):
    delivered, failures = [], []
    lst = StreamListener(config(keys), "127.0.0.1", lambda runs: delivered.extend(r.first_seq for r in runs),
                         on_undecodable=lambda seq, e: failures.append((seq, e.reason)), **kwargs)
    return lst, delivered, failures


def test_with_keys_an_undecodable_message_in_a_sealed_range_is_reported_at_its_seq():
    lst, delivered, failures = listener(keys=True)
    lst.on_datagram(sealed(1, good(3)))  # seqs 1-4 (the seal is 4)
    bad = good(2, 5)
    bad[1] = b"Z" + bad[1][1:]  # a type this version does not know, at seq 6
    lst.on_datagram(PacketBuilder(SESSION, 5).add_sequenced(bad)[0])  # unsealed: dropped, not fatal
    assert failures == [] and lst.bad == {"unsealed": 1}
    lst.on_datagram(sealed(5, bad))  # sealed by the leader: the log itself
    assert failures == [(6, "unknown_type")] and delivered == [1]


def test_without_keys_nothing_received_is_fatal():
    lst, delivered, failures = listener(keys=False)
    lst.on_datagram(PacketBuilder(SESSION, 1).add_sequenced(good(3))[0])
    bad = good(2, 4)
    bad[1] = b"Z" + bad[1][1:]
    forged = PacketBuilder(SESSION, 4).add_sequenced(bad)[0]
    lst.on_datagram(forged)
    lst.on_datagram(forged)  # again ("from a rewinder": anyone can send that)
    assert failures == [] and lst.bad == {"unknown_type": 2} and delivered == [1]


def fake_rewinder(lst):
    """A socket that is every rewinder the config names: a request asked again after the answer
    timeout (a slow machine) goes to the next one, which must exist."""
    rewinder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rewinder.bind(("127.0.0.1", 0))
    rewinder.settimeout(2)
    lst.sockets.rewinders = [rewinder.getsockname()] * len(lst.sockets.rewinders)
    return rewinder


def open_gap(lst, rewinder) -> tuple:
    """Seqs 1-2 and 5-6 received, 3-4 missing and asked for (as a drain that sees the gap does):
    returns where the answer goes."""
    lst.on_datagram(PacketBuilder(SESSION, 1).add_sequenced(good(2))[0])
    lst.on_datagram(PacketBuilder(SESSION, 5).add_sequenced(good(2, 5))[0])  # asked at once
    request, reply_to = rewinder.recvfrom(100)
    assert moldudp64.decode_header(request)[1:] == (3, 2)
    return reply_to


async def test_answers_are_read_a_bounded_batch_a_wake_up():
    lst, delivered, _ = listener(keys=False)
    rewinder = fake_rewinder(lst)
    lst.start()
    try:
        reply_to = open_gap(lst, rewinder)
        for _ in range(DRAIN_DATAGRAMS + 10):  # a flood at the answer socket
            rewinder.sendto(b"x", reply_to)
        before = lst.datagrams
        lst.sockets._drain(lst.sockets.req)
        assert lst.datagrams - before == DRAIN_DATAGRAMS  # the rest waits in the kernel, not in a queue
        rewinder.sendto(PacketBuilder(SESSION, 3).add_sequenced(good(2, 3))[0], reply_to)  # the answer
        await until(lambda: delivered == [1, 3, 5] and delivered, "the answer to be delivered")
        assert lst.datagrams - before == DRAIN_DATAGRAMS + 11
        assert lst.bad == {"truncated": DRAIN_DATAGRAMS + 10}
    finally:
        rewinder.close()
        await lst.close()


async def test_an_answer_is_timed_when_it_arrives_not_at_the_next_tick():
    """The answer timeout follows how long answers take: the drain that fills a gap times it (a
    tick would add up to half the configured timeout to every sample, here 1 s)."""
    clock = Clock()
    lst, delivered, _ = listener(keys=False, clock=clock)
    lst.cfg = dataclasses.replace(lst.cfg, gap_request_ms=2000)
    rewinder = fake_rewinder(lst)
    lst.start()
    try:
        open_gap(lst, rewinder)
        assert lst.core.asking
        clock.advance(7)
        lst._drained([PacketBuilder(SESSION, 3).add_sequenced(good(2, 3))[0]])  # the drain that reads the answer
        assert not lst.core.asking and delivered == [1, 3, 5]  # timed there, no tick between
        assert lst.core.answers.srtt_ns == 7_000_000  # its first sample, exactly
    finally:
        rewinder.close()
        await lst.close()


async def test_the_time_something_stays_missing_is_measured_gap_by_gap():
    """The replica's tape_replica_stream_gap_seconds: from the drain that sees seqs missing to the
    one that sees them filled."""
    clock = Clock()
    lst, delivered, _ = listener(keys=False, clock=clock)
    rewinder = fake_rewinder(lst)
    lst.start()
    try:
        lst._drained([PacketBuilder(SESSION, first).add_sequenced(good(n, first))[0] for first, n in ((1, 2), (5, 2))])
        request, reply_to = rewinder.recvfrom(100)  # 3-4 seen missing, asked for
        assert sum(lst.gap_histogram.counts) == 0
        clock.advance(50)
        rewinder.sendto(PacketBuilder(SESSION, 3).add_sequenced(good(2, 3))[0], reply_to)
        await until(lambda: delivered == [1, 3, 5], "the answer to be delivered")
        assert sum(lst.gap_histogram.counts) == 1 and lst.gap_histogram.sum_seconds == pytest.approx(0.05)
    finally:
        rewinder.close()
        await lst.close()


async def test_a_drain_delivers_its_runs_in_one_call_and_keeps_their_order_with_the_rest():
    """A replica applies what one wake-up brings in one call; what is not a run (an undecodable
    committed message) is carried out after the runs before it."""
    events = []
    lst = StreamListener(config(keys=True), "127.0.0.1", lambda runs: events.append([r.first_seq for r in runs]),
                         on_undecodable=lambda seq, e: events.append(("undecodable", seq)))
    bad = good(3, 9)
    bad[1] = b"Z" + bad[1][1:]  # seq 10 cannot be decoded
    lst.start()
    try:
        # one drain's datagrams: 1-4, 5-8, 13-16 ahead, 9-12, 17-20
        lst._drained([sealed(first, msgs) for first, msgs in
                      ((1, good(3)), (5, good(3, 5)), (13, good(3, 13)), (9, bad), (17, good(3, 17)))])
        assert events == [[1, 5], ("undecodable", 10)]  # (13-16 and 17-20 held ahead: no run)
    finally:
        await lst.close()


def test_the_timer_is_wanted_only_while_a_run_is_missing_or_asked_for_or_a_hint_worth_asking():
    core = listener(keys=True)[0].core  # (the core alone: a drain through the shell asks at once)
    core.reply_at("127.0.0.1", 9, 0)
    delivered = []

    def feed(data: bytes) -> None:
        delivered.extend(a.first_seq for a in core.on_datagrams([data]) if isinstance(a, Deliver))

    feed(sealed(1, good(3)))  # 1-4
    assert not core.waiting
    feed(sealed(9, good(3, 9)))  # 9-12: 5-8 missing
    assert core.waiting
    assert len(core.on_timer(1)) == GAP_ASKED_OF and core.waiting  # asked for
    feed(sealed(5, good(3, 5)))
    assert delivered == [1, 5, 9] and core.waiting  # filled, its answer not yet timed
    assert core.on_timer(2) == [] and not core.waiting
    feed(moldudp64.encode_heartbeat(SESSION, 20))  # a hint: 13-19 may exist
    assert core.waiting
    for second in range(3, 100):  # asked about HINT_TRIES times (each after the answer timeout), then no more
        core.on_timer(second * 10**9)
        if not core.waiting:
            break
    assert not core.waiting and core.requests_sent == 2 * GAP_ASKED_OF + HINT_TRIES - 1


async def test_an_idle_listener_runs_no_timer_and_one_with_a_gap_asks_again_until_it_fills():
    lst, delivered, _ = listener(keys=False)
    rewinder = fake_rewinder(lst)
    timers = []
    on_timer = lst.core.on_timer
    lst.core.on_timer = lambda now: timers.append(now) or on_timer(now)
    lst.start()
    try:
        assert lst._timer is None  # nothing missing: no timer armed at all
        lst._drained([PacketBuilder(SESSION, first).add_sequenced(good(2, first))[0] for first in (1, 5)])
        rewinder.recvfrom(100)  # 3-4 seen missing, asked for
        await until(lambda: len(timers) > 3, "the timer to tick while 3-4 stay missing")
        lst.on_datagram(PacketBuilder(SESSION, 3).add_sequenced(good(2, 3))[0])
        assert delivered == [1, 3, 5]
        await until(lambda: lst._timer is None, "the timer to stop once the answer is timed")
        assert not lst.core.waiting
    finally:
        rewinder.close()
        await lst.close()
