"""The leader's advice (protocol/backoff.py) from LeaderCore to ClientCore: back-offs under
overload, and requests to resend a batch that later ones overtook."""

import hashlib
import hmac
import json
import os
import signal
import time

import pytest
from conftest import wait_for

from tape.ops.verification.local import LocalCluster
from tape.protocol import backoff
from tape.protocol import messages as M
from tape.protocol import messages as msg
from tape.protocol import moldudp64 as m
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import (
    BACKOFF_INTERVAL_NS,
    BACKOFF_RETRY_MS,
    MAX_RESEND_TIMEOUT_NS,
    MAX_RETRY_MS,
    OVERLOAD_NS,
    RESEND_ASK_FLOOR_NS,
    RESEND_ASK_INTERVAL_NS,
)
from tape.protocol.stamping import PacketBuilder
from tape.runtime.storage.journal_store import Journal
from tape.sequencer.client_core import ClientCore
from tape.sequencer.leader_core import LeaderCore

S = b"TAPE      "
A, B = b"clientA   ", b"clientB   "
KEY = b"k" * 32
MS = 1_000_000
TRADES = 300_000


def leader():
    core = LeaderCore(S, b"seq-a     ", 3, [b"rw-1      ", b"rw-2      "], {A: None, B: KEY})
    core.start_term(0, 0)
    return core


def batch(client, cseq, n, key=None):
    data = m.encode_packet(client, cseq, [msg.purchase_request(cseq + i, 10, "X", "Y") for i in range(n)])
    return data + hmac.new(key, data, hashlib.sha256).digest() if key else data


def overloaded_leader(now=0):
    core = leader()
    core.note_drain(False, now)  # a drain stopped at its limit: the socket still holds datagrams
    return core


def test_the_leader_is_overloaded_only_once_no_drain_has_emptied_its_socket_for_the_interval():
    core = leader()
    core.note_drain(False, 0)
    core.note_drain(False, OVERLOAD_NS - 1)
    assert not core.overloaded(OVERLOAD_NS - 1)
    assert core.overloaded(OVERLOAD_NS)
    core.note_drain(True, OVERLOAD_NS + 1)  # read empty once: the backlog is gone
    assert not core.overloaded(10 * OVERLOAD_NS)
    core.note_drain(False, 10 * OVERLOAD_NS)
    assert not core.overloaded(11 * OVERLOAD_NS - 1) and core.overloaded(11 * OVERLOAD_NS)


def test_an_overloaded_leader_answers_each_client_at_most_once_per_interval_and_still_sequences():
    core = overloaded_leader()
    t = OVERLOAD_NS
    assert core.on_inbound(batch(B, 1, 3, KEY), t, "addr-b") is None
    assert core.on_inbound(batch(B, 4, 3, KEY), t + 1, "addr-b") is None  # within the interval: no second
    assert core.on_inbound(batch(A, 1, 2), t + 2, "addr-a") is None
    out = core.take_advice()
    assert [src for src, _ in out] == ["addr-b", "addr-a"] and core.take_advice() == []
    assert backoff.decode(out[0][1], KEY) == backoff.BackOff(B, 3, 1, BACKOFF_RETRY_MS)
    assert backoff.decode(out[1][1], None) == backoff.BackOff(A, 3, 1, BACKOFF_RETRY_MS)
    assert len(out[0][1]) == backoff.FIELDS.size + backoff.MAC_SIZE and len(out[1][1]) == backoff.FIELDS.size
    core.on_inbound(batch(B, 7, 1, KEY), t + BACKOFF_INTERVAL_NS, "addr-b")  # a resend counts too
    assert [backoff.decode(d, KEY).client_seq for _, d in core.take_advice()] == [7]
    assert core.backoffs_sent == 3
    later = t + BACKOFF_INTERVAL_NS
    assert len(core.flush(later, later).messages) == 3 + 3 + 2 + 1  # nothing refused


def test_no_back_off_without_overload_a_source_or_an_authenticated_batch():
    core = leader()
    core.on_inbound(batch(A, 1, 1), 0, "addr")
    assert core.take_advice() == []  # not overloaded
    core = overloaded_leader()
    t = OVERLOAD_NS
    core.on_inbound(batch(A, 1, 1), t)  # no source: the simulator's or a test's batch
    # Forged or broken input is never answered: a leader is no reflector for spoofed sources.
    assert core.on_inbound(batch(B, 1, 1, b"x" * 32), t, "victim") == "unauthenticated"
    assert core.on_inbound(batch(b"nobody    ", 1, 1), t, "victim") == "unknown_client"
    assert core.on_inbound(b"junk", t, "victim") == "truncated"
    assert core.take_advice() == [] and core.backoffs_sent == 0


def test_back_off_datagrams_refuse_what_is_not_one():
    good = backoff.encode(B, 1, 5, 50, KEY)
    assert backoff.decode(good, KEY).retry_ms == 50
    flipped = good[:-1] + bytes([good[-1] ^ 1])
    for bad, reason in ((good[:-1], "bad_backoff"), (b"XBO1" + good[4:], "bad_backoff"), (flipped, "unauthenticated"),
                        (good[:backoff.FIELDS.size], "bad_backoff"), (batch(B, 1, 1, KEY), "bad_backoff")):
        with pytest.raises(ProtocolError) as e:
            backoff.decode(bad, KEY)
        assert e.value.reason == reason
    with pytest.raises(ProtocolError):
        backoff.decode(good, b"y" * 32)
    # Read by a sequencer as an inbound batch, a back-off is not a known client's.
    assert leader().on_inbound(good, 0, "x") == "unknown_client"


def client(key=None, origin=A):
    return ClientCore(origin, key, 1400, 100 * MS)


def test_a_client_pauses_new_batches_and_resends_for_the_retry_after():
    c = client(KEY, B)
    c.submit([msg.purchase_request(i, 10, "X", "Y") for i in range(40)], 0)  # two batches
    assert c.on_advice(backoff.encode(B, 1, c.per_batch + 1, 50, KEY), 10 * MS) is None
    assert c.pause_left_ns(10 * MS) == 50 * MS and c.pause_left_ns(60 * MS) == 0
    assert c.on_timer(59 * MS + 100 * MS) != []  # due, and no longer paused
    c2 = client(KEY, B)
    c2.submit([msg.purchase_request(1, 10, "X", "Y")], 0)
    c2.on_advice(backoff.encode(B, 1, 1, 300, KEY), 90 * MS)
    assert c2.on_timer(150 * MS) == []  # the batch is due (100 ms), but the leader asked for quiet
    assert len(c2.on_timer(390 * MS)) == 1
    assert (c2.backoffs, c2.paused_ns) == (1, 300 * MS)


def test_a_client_honours_only_fresh_authentic_back_offs_for_batches_in_flight():
    c = client(KEY, B)
    c.submit([msg.purchase_request(i, 10, "X", "Y") for i in range(2 * c.per_batch)], 0)  # two batches
    assert c.on_advice(backoff.encode(B, 1, 1, 50, KEY), 0, from_sequencer=False) == "not_a_sequencer"
    assert c.on_advice(backoff.encode(B, 1, 1, 50, b"x" * 32), 0) == "unauthenticated"
    assert c.on_advice(backoff.encode(A, 1, 1, 50, KEY), 0) == "wrong_client"
    assert c.on_advice(backoff.encode(B, 1, c.next_cseq, 50, KEY), 0) == "stale"  # names a batch not sent
    honoured = backoff.encode(B, 1, c.per_batch + 1, 50, KEY)
    assert c.on_advice(honoured, 0) is None
    assert c.on_advice(honoured, 20 * MS) == "stale"  # a replay of one honoured
    assert c.on_advice(backoff.encode(B, 1, 1, 50, KEY), 20 * MS) == "stale"  # older than one honoured
    assert c.advice_drops == {"not_a_sequencer": 1, "unauthenticated": 1, "wrong_client": 1, "stale": 3}


def test_a_back_off_for_an_acknowledged_batch_asks_for_nothing_and_a_pause_is_bounded():
    c = client(KEY, B)
    c.submit([msg.purchase_request(i, 10, "X", "Y") for i in range(54)], 0)
    lead = leader()
    lead.on_inbound(c.unacked[0].datagram, 1)
    for p in PacketBuilder(S, 2).add_sequenced(lead.flush(2, 2).messages):
        c.on_delivered(p, 0, 3)
    second = c.per_batch + 1
    assert c.acked == second - 1
    assert c.on_advice(backoff.encode(B, 3, 1, 50, KEY), 4) == "stale"
    assert c.on_advice(backoff.encode(B, 3, second, 65_535, KEY), 4) is None
    assert c.pause_left_ns(4) == MAX_RETRY_MS * MS  # whatever a back-off says


def test_a_batch_ahead_of_a_lost_one_makes_the_leader_ask_for_the_lost_one_once_per_interval():
    core = leader()
    assert core.on_inbound(batch(B, 1, 3, KEY), 0, "addr-b") is None and core.take_advice() == []  # in order
    assert core.on_inbound(batch(B, 7, 2, KEY), 1, "addr-b") is None  # 4-6 lost: held
    assert core.on_inbound(batch(B, 9, 2, KEY), 2, "addr-b") is None
    assert core.on_inbound(batch(A, 3, 1), 3) is None  # no source known: nothing to answer
    out = core.take_advice()
    assert out == [("addr-b", backoff.encode_resend(B, core.term, 4, KEY))]
    assert backoff.decode(out[0][1], KEY) == backoff.Resend(B, core.term, 4)
    core.on_inbound(batch(B, 11, 2, KEY), 1 + RESEND_ASK_INTERVAL_NS - 1, "addr-b")  # too soon to ask again
    assert core.take_advice() == []
    core.on_inbound(batch(B, 13, 2, KEY), 1 + RESEND_ASK_INTERVAL_NS, "addr-b")  # still missing: asked again
    assert [backoff.decode(d, KEY).client_seq for _, d in core.take_advice()] == [4]
    assert core.on_inbound(batch(B, 4, 3, KEY), RESEND_ASK_INTERVAL_NS + 2, "addr-b") is None  # the gap filled
    assert core.client_last[B] == 14 and core.take_advice() == [] and core.resends_asked == 2


def test_a_client_resends_a_batch_the_leader_asks_for_at_once_but_not_twice_in_a_row():
    c = client(KEY, B)
    c.submit([msg.purchase_request(i, 10, "X", "Y") for i in range(3 * c.per_batch)], 0)  # three batches
    second = c.per_batch + 1
    now = RESEND_ASK_FLOOR_NS
    assert c.on_timer(now) == []  # nothing due before the 100 ms timeout
    assert c.on_advice(backoff.encode_resend(B, 1, second + 2, KEY), now) is None  # inside the second batch
    assert c.on_timer(now) == [c.unacked[1].datagram] and c.resends_asked == 1
    assert c.on_advice(backoff.encode_resend(B, 1, second, KEY), now + 1) == "sent_recently"  # asked twice
    assert c.on_advice(backoff.encode_resend(B, 1, c.next_cseq, KEY), now) == "stale"  # never sent
    assert c.on_advice(backoff.encode_resend(B, 1, 1, b"x" * 32), now) == "unauthenticated"
    assert c.on_advice(backoff.encode_resend(A, 1, 1, KEY), now) == "wrong_client"
    assert c.on_advice(backoff.encode_resend(B, 1, 1, KEY), 2 * now, from_sequencer=False) == "not_a_sequencer"
    assert c.on_timer(2 * now) == []  # none of those made anything due


def test_a_lost_batch_is_sequenced_one_round_trip_after_the_next_one_arrives():
    """Leader and client cores end to end: with the first batch lost, the second one's arrival
    brings the first again long before the client's resend timeout."""
    c, lead = client(KEY, B), leader()
    c.submit([msg.purchase_request(i, 10, "X", "Y") for i in range(2 * c.per_batch)], 0)
    first, second = (u.datagram for u in c.unacked)
    lead.on_inbound(second, 1 * MS, "addr-b")  # the first was lost on the way
    for _, advice in lead.take_advice():
        assert c.on_advice(advice, 6 * MS) is None
    assert c.on_timer(6 * MS) == [first]  # 6 ms, not the 100 ms timeout
    lead.on_inbound(first, 7 * MS, "addr-b")
    assert lead.client_last[B] == 2 * c.per_batch


def sequenced_at(c, lead, datagram, now):
    """The leader sequences `datagram`; the client sees it in the stream at `now`."""
    lead.on_inbound(datagram, now, "addr-b")
    for p in PacketBuilder(S, 1).add_sequenced(lead.flush(now, now).messages):
        c.on_delivered(p, 0, now)


def test_the_resend_timeout_follows_the_measured_submit_to_sequenced_time():
    """srtt + 4 rttvar of batches sent once: a cluster that takes 200 ms to sequence is not sent
    its batches again at the configured 50 ms; the configured timeout is the floor, 1 s the cap."""
    c, lead = ClientCore(B, KEY, 1400, 50 * MS), leader()
    assert c.resend_timeout_ns == 50 * MS  # nothing measured yet
    [first] = c.submit([msg.purchase_request(1, 10, "X", "Y")], 0)
    sequenced_at(c, lead, first, 200 * MS)
    assert (c.submitting.srtt_ns, c.submitting.rttvar_ns, c.resend_timeout_ns) == (200 * MS, 100 * MS, 600 * MS)
    [second] = c.submit([msg.purchase_request(2, 10, "X", "Y")], 300 * MS)
    assert c.on_timer(400 * MS) == [] and c.on_timer(899 * MS) == []  # a fixed 50 ms: resent at 350
    assert c.on_timer(900 * MS) == [second]
    assert c.on_timer(1_499 * MS) == [] and c.on_timer(1_500 * MS) == [second]  # and again a timeout later
    sequenced_at(c, lead, second, 5_000 * MS)  # resent: its time says nothing (Karn)
    assert c.resend_timeout_ns == 600 * MS
    for i in range(3, 40):  # quick now: down to the floor
        sequenced_at(c, lead, c.submit([msg.purchase_request(i, 10, "X", "Y")], i * 10 * MS)[0], i * 10 * MS + MS)
    assert c.resend_timeout_ns == 50 * MS
    slow = ClientCore(B, KEY, 1400, 50 * MS)
    sequenced_at(slow, leader(), slow.submit([msg.purchase_request(1, 10, "X", "Y")], 0)[0], 5_000 * MS)
    assert slow.resend_timeout_ns == MAX_RESEND_TIMEOUT_NS


# --- the processes ------------------------------------------------------------------------

@pytest.mark.process
def test_an_overloaded_leader_tells_the_clients_to_back_off_and_nothing_is_lost(tmp_path):
    """Two clients send 300,000 trades as fast as they can build them (a datagram costs a client
    far less than sequencing its trades costs the leader, so its socket backs up past the
    overload threshold): they are told to back off, pause, and every trade is sequenced once. On a
    fast quiet host the leader may keep up, so the overload is made to bite: the leader is stopped
    for three times the overload threshold while the load sends (well under the election timeout), and
    its inbound socket backs up."""
    cluster = LocalCluster(tmp_path)
    try:
        cluster.start_all()
        load = cluster.start("load", "load", "--rate", "100000000", "--messages", str(TRADES), "--seed", "3")
        wait_for(lambda: cluster.metrics("seq-a")['tape_sequencer_sequenced_seq{node="seq-a"}'] > 1000,
                 "the load under way")
        os.kill(cluster.procs["seq-a"].pid, signal.SIGSTOP)
        time.sleep(3 * OVERLOAD_NS / 1e9)  # the fault's length (half the election timeout), not a wait for an event
        os.kill(cluster.procs["seq-a"].pid, signal.SIGCONT)
        assert load.wait(timeout=180) == 0, cluster.output("load")
        report = json.loads(cluster.output("load"))
        assert report["acked"] == TRADES and report["backoffs"] > 0 and report["paused_s"] > 0, report
        sent = cluster.metrics("seq-a")['tape_sequencer_backoffs_sent_total{node="seq-a"}']
        assert sent >= report["backoffs"]
        for name in ("seq-a", "rw-1", "rw-2"):
            assert cluster.stop(name) == 0
        commit = json.loads((tmp_path / "data" / "seq-a" / "status.json").read_text())["commit_ms"]
        assert commit["count"] > TRADES and 0 < commit["p50"] <= commit["p99"] <= commit["max"]  # stamped to published
        seqs = {}
        for _, _, raw in Journal(cluster.journal_dir("rw-1")).read(1):
            m = M.SEQUENCED.unpack(raw)
            if m[M.TYPE] in M.CLIENT_SEQ_TYPES:
                seqs.setdefault(m[M.ORIGIN], []).append(m[M.CLIENT_SEQ])
        assert sorted(len(s) for s in seqs.values()) == [TRADES // 2] * 2
        assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())  # each once, in client order
    finally:
        cluster.close()
