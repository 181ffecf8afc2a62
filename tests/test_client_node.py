"""ClientNode (sequencer/client_node_core.py): every decision of a process's clients on one
interface -- the stream's listener, each client's acknowledgements and resends, a restarted
client's recovery -- as the client library and the simulator drive it."""

from tape.protocol import backoff, moldudp64
from tape.protocol import messages as M
from tape.protocol.limits import GAP_ASKED_OF
from tape.protocol.stamping import PacketBuilder
from tape.sequencer import client_node_core as cn

S = moldudp64.session_bytes("TEST")
MS = 1_000_000
GAP_NS, RESEND_NS = 100 * MS, 100 * MS


def node(*clients: str) -> cn.ClientNode:
    n = cn.ClientNode(S, 2, GAP_NS, RESEND_NS)
    n.listener.reply_at("127.0.0.1", 9, 0)
    for c in clients:
        n.add(c, None)
    return n


def sequenced(client: str, cseqs) -> list[bytes]:
    origin = moldudp64.session_bytes(client)
    return [M.stamp(M.purchase_request(c, 1, client, "S"), 1, origin, c) for c in cseqs]


def packets(first: int, msgs: list[bytes]) -> list[bytes]:
    return PacketBuilder(S, first).add_sequenced(msgs)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def trades(n: int) -> list[bytes]:
    return [M.purchase_request(i, 1, "x", "S") for i in range(1, n + 1)]


def test_a_drain_is_delivered_once_and_each_client_finds_only_its_own_acknowledgements():
    n = node("c0", "c1")
    n.submit("c0", trades(2), 0)
    n.submit("c1", trades(1), 0)
    out = n.on_datagrams(packets(1, sequenced("c0", [1, 2])), MS)
    assert kinds(out) == ["Delivered", "Acked"] and out[1] == cn.Acked("c0")
    assert n.clients["c0"].acked == 2 and n.clients["c1"].acked == 0


def test_a_gap_is_asked_for_at_once_then_again_at_the_listeners_tick():
    n = node()
    out = n.on_datagrams(packets(1, sequenced("c0", [1])) + packets(3, sequenced("c0", [3])), 0)
    assert kinds(out) == ["Delivered"] + ["AskRewinder"] * GAP_ASKED_OF  # seq 2 missing: asked in the same drain
    assert n.next_deadline(0) == n.listen_tick_ns
    assert n.on_timer(n.listen_tick_ns - 1) == []
    assert set(kinds(n.on_timer(GAP_NS + n.listen_tick_ns))) == {"AskRewinder"}  # unanswered: asked again


def test_an_idle_node_wants_no_timer():
    n = node("c0")
    assert n.next_deadline(0) is None
    n.on_datagrams(packets(1, sequenced("c0", [1])), 0)
    assert n.next_deadline(0) is None  # nothing missing, nothing waiting for its acknowledgement


def test_what_is_not_acknowledged_in_time_goes_again_to_every_sequencer():
    n = node("c0")
    (sent,) = n.submit("c0", trades(3), 0)
    assert sent.to is None and len(sent.datagrams) == 1  # no leader known yet: every sequencer
    due = n.next_deadline(0)
    assert due == RESEND_NS // cn.RESEND_TICKS
    for t in range(due, RESEND_NS, due):
        assert n.on_timer(t) == []  # (looked, not due)
    assert n.on_timer(RESEND_NS) == [cn.SendInbound("c0", sent.datagrams, None)]


def test_a_packet_held_ahead_of_a_gap_stops_the_resends_it_shows_sequenced():
    from tape.protocol.streamauth import StreamKeys
    keys = StreamKeys([b"k" * 32])
    n = cn.ClientNode(S, 2, GAP_NS, RESEND_NS, keys=keys)
    n.listener.reply_at("127.0.0.1", 9, 0)
    n.add("c0", None)
    n.submit("c0", trades(2), 0)
    ahead = keys.seal_run(S, 3, sequenced("c0", [1, 2]), 10, 1, b"seq-a".ljust(10))[1]
    n.on_datagrams(ahead, MS)  # seqs 1-2 missing: held ahead, not delivered
    assert n.clients["c0"].acked == 0 and not n.clients["c0"].unacked
    assert all(not isinstance(a, cn.SendInbound) for a in n.on_timer(10 * RESEND_NS))


def test_advice_a_resend_request_is_sent_at_once_and_a_forged_one_dropped():
    n = node("c0")
    (sent,) = n.submit("c0", trades(1), 0)
    ask = backoff.encode_resend(moldudp64.session_bytes("c0"), 1, 1, None)
    assert n.on_advice("c0", ask, True, 50 * MS) == [cn.SendInbound("c0", sent.datagrams, None)]
    out = n.on_advice("c0", b"\x00" * 7, True, 60 * MS)
    assert kinds(out) == ["Dropped"]


def test_a_restarted_client_numbers_on_once_the_stream_is_read_to_its_head():
    n = node("c0")
    assert n.recover("c0", 0) == []
    n.on_datagrams([moldudp64.encode_heartbeat(S, 4)], 0)  # the head: seqs 1-3 exist
    out = n.on_datagrams(packets(1, sequenced("c0", [1, 2])), 0)
    assert "Recovered" not in kinds(out)
    out = n.on_datagrams(packets(3, sequenced("c0", [3])), 0)
    assert out[-1] == cn.Recovered("c0", 3) and n.clients["c0"].next_cseq == 4
