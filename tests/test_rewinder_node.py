"""RewinderNode (rewinder/rewinder_node_core.py): every decision of the rewinder process -- its voter
endpoint, gap fill and replay -- as its shell and the simulator drive it."""

import random

from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol import replication as rep
from tape.protocol import soupbintcp as soup
from tape.protocol.actions import Close, Send
from tape.protocol.limits import (
    REPLAY_BUDGET_RETRY_NS,
    REPLAY_BURST,
    REPLAY_CHUNK,
    REPLAY_HEARTBEAT_NS,
    REPLAY_LISTENER,
    REPLAY_MEMBER,
    REPLAY_RATE,
)
from tape.protocol.streamauth import StreamKeys
from tape.protocol.voter_node import Committed, MarkCommitted, VoterNode
from tape.rewinder.rewinder_node_core import (
    IDLE_NS,
    LOGIN_NS,
    WRITE_NS,
    ReadGap,
    Reject,
    ReplayRecords,
    RewinderNode,
    SendDatagram,
)
from tape.runtime.tuning import FREE_SPACE

S = moldudp64.session_bytes("TEST")
A, B, R1, R2 = (n.ljust(10).encode() for n in ("seq-a", "seq-b", "rw-1", "rw-2"))
K1 = b"k" * 32
ASKER = ("10.0.0.9", 7000)


def trades(n: int, first: int = 1) -> list[bytes]:
    return [M.stamp(M.purchase_request(i, 10, "c", "S"), i, b"c0".ljust(10), i) for i in range(first, first + n)]


def rewinder(log: list[bytes], keys: StreamKeys | None = None, park_ns: int = 0) -> RewinderNode:
    records = [(s, 1, m) for s, m in enumerate(log, 1)]
    voter = VoterNode(R1, [A, B, R1, R2], False, random.Random(1), 300_000_000, 1, None, (0, 0), True, records, 0,
                      free_space=FREE_SPACE)
    return RewinderNode(voter, S, 1400, keys, park_ns)


def commit(node: RewinderNode, upto: int, now: int = 1, extra: list[bytes] = ()) -> list:
    """The leader's append (of `extra` after the log, if any) that tells the rewinder the commit point."""
    last = node.core.last_seq
    if "leader" not in node.voter.served:
        node.on_connected("leader", now)
    return node.on_data("leader", rep.encode_append(1, A, last, 1 if last else 0, upto, 1, list(extra)), now)


def carried(node: RewinderNode, actions: list, log: list[bytes]) -> list[tuple[int, list[bytes]]]:
    """Carry out the gap reads as the shell does; (first seq, messages) of each datagram sent."""
    sent, queue = [], list(actions)
    while queue:
        a = queue.pop(0)
        if isinstance(a, ReadGap):
            queue[:0] = node.on_gap_read(a, log[a.first - 1:a.first - 1 + a.count], 0)
        elif isinstance(a, SendDatagram):
            _, seq, count = moldudp64.decode_header(a.data)
            sent.append((seq, [M.packet_message_bytes(a.data, i) for i in range(count)]))
    return sent


def request(seq: int, count: int, pad: int = 1400) -> bytes:
    return moldudp64.encode_request(S, seq, count).ljust(pad, b"\0")


def test_replication_connections_are_the_voters():
    node = rewinder(trades(3))
    assert rep.FrameReader().feed(node.on_connected("c", 0)[0].data) == [rep.Hello(1, R1, 3, 1)]


def test_a_gap_request_for_committed_seqs_is_answered_from_the_journal():
    log = trades(10)
    node = rewinder(log)
    commit(node, 10)
    assert carried(node, node.on_datagram(ASKER, request(4, 3), 2), log) == [(4, log[3:6])]
    assert node.gap_messages_sent == 3 and node.gapfill.served == 1


def test_a_request_waits_for_the_commit_point_and_is_answered_after_the_ack_that_moves_it():
    log = trades(5)
    node = rewinder(log, park_ns=10**9)
    commit(node, 3)
    assert node.on_datagram(ASKER, request(4, 2), 2) == []  # parked
    out = commit(node, 5, 3)
    acked = next(i for i, a in enumerate(out) if isinstance(a, Send))
    assert isinstance(out[acked + 1], Committed) and isinstance(out[acked + 2], ReadGap)
    assert carried(node, out, log) == [(4, log[3:5])]


def test_a_sealed_stream_is_answered_with_the_whole_sealed_range_that_holds_the_seq_asked_for():
    keys = StreamKeys([K1])
    log = []
    for first, n in ((1, 5), (7, 3)):  # ranges 1-6 and 7-10
        log += trades(n, first) + [keys.seal_packet(S, first, trades(n, first), 1, A)[0]]
    node = rewinder(log, keys)
    commit(node, 10)
    assert carried(node, [ReadGap(ASKER, 8, 20, False)], log) == [(7, log[6:10])]
    assert carried(node, [ReadGap(ASKER, 3, 20, False)], log) == [(1, log[0:6])]
    fresh = rewinder(log, keys)
    commit(fresh, 9)
    assert carried(fresh, [ReadGap(ASKER, 8, 20, False)], log) == []  # the range is not all committed


def login(seq: int = 1, session: bytes = b"") -> bytes:
    return soup.login("u", "p", session or S, seq)


def frames(actions: list) -> list:
    data = b"".join(a.data for a in actions if isinstance(a, Send))
    return soup.FrameDecoder().feed(data)


def test_a_replay_streams_committed_records_in_chunks_each_after_the_last_is_drained():
    node = rewinder(trades(REPLAY_CHUNK + 10))
    commit(node, REPLAY_CHUNK + 10)
    node.on_replay_connected("r", 0)
    out = node.on_data("r", login(1), 1)
    assert frames(out)[0][0] == soup.LOGIN_ACCEPTED and out[-1] == ReplayRecords("r", 1, REPLAY_CHUNK)
    assert node.on_timer(2) == [MarkCommitted(REPLAY_CHUNK + 10)]  # (no heartbeat while a chunk is being written)
    out = node.on_replayed(out[-1], 3)
    assert out == [ReplayRecords("r", REPLAY_CHUNK + 1, 10)]
    assert node.on_replayed(out[0], 4) == [] and node.replayed == REPLAY_CHUNK + 10
    out = commit(node, REPLAY_CHUNK + 11, 5, trades(1, REPLAY_CHUNK + 11))  # it follows the log live
    assert out[-1] == ReplayRecords("r", REPLAY_CHUNK + 11, 1)


def test_replays_share_a_budget_in_turn_so_that_many_from_seq_1_never_outrun_it():
    sessions, chunks = 20, 4
    node = rewinder(trades(chunks * REPLAY_CHUNK))
    commit(node, chunks * REPLAY_CHUNK)
    served = []
    for k in range(sessions):  # all at once: the burst serves the first few, the rest wait their turn
        node.on_replay_connected(k, 0, REPLAY_LISTENER)
        served += [a for a in node.on_data(k, login(1), 0) if isinstance(a, ReplayRecords)]
    assert [a.conn for a in served] == list(range(REPLAY_BURST // REPLAY_CHUNK)) and node.replay_held_back > 0
    t, sent = 0, len(served) * REPLAY_CHUNK
    while sent < sessions * chunks * REPLAY_CHUNK:
        t += REPLAY_BUDGET_RETRY_NS
        done, served = served, []
        for a in done:  # every client drains at once: only the budget holds the pace
            served += [b for b in node.on_replayed(a, t) if isinstance(b, ReplayRecords)]
        served += [b for b in node.on_timer(t) if isinstance(b, ReplayRecords)]
        sent += sum(a.count for a in served)
        assert sent <= REPLAY_BURST + REPLAY_RATE * t / 1e9  # never ahead of the budget
        assert t < 10**9, "the replays stalled"
    assert node.replayed + sum(a.count for a in served) == sessions * chunks * REPLAY_CHUNK
    node.on_replay_connected("replica", t, REPLAY_MEMBER)  # the budget spent: a replica is served at once
    assert [a for a in node.on_data("replica", login(1), t) if isinstance(a, ReplayRecords)] == \
        [ReplayRecords("replica", 1, REPLAY_CHUNK)]


def test_a_caught_up_replay_heartbeats_and_a_silent_client_is_closed():
    node = rewinder(trades(3))
    commit(node, 3)
    node.on_replay_connected("r", 0)
    node.on_replayed(node.on_data("r", login(1), 0)[-1], 0)
    assert node.next_deadline(1) <= REPLAY_HEARTBEAT_NS
    assert frames(node.on_timer(REPLAY_HEARTBEAT_NS)) == [(soup.SERVER_HEARTBEAT, b"")]
    node.on_data("r", soup.heartbeat(server=False), IDLE_NS // 2)  # the client is there
    assert not any(isinstance(a, Close) for a in node.on_timer(IDLE_NS))
    assert node.on_timer(IDLE_NS // 2 + IDLE_NS)[-1] == Close("r", Reject.IDLE)
    assert node.replay_idle_closed == 1 and "r" not in node.replays


def test_a_replay_client_that_stops_reading_is_closed_though_it_heartbeats():
    """Its heartbeats say it is there; a chunk it has not taken in REPLAY_WRITE_TIMEOUT_S says it
    stopped reading: closed, so that it holds neither a slot nor the chunk's buffer for ever."""
    node = rewinder(trades(REPLAY_CHUNK + 10))
    commit(node, REPLAY_CHUNK + 10)
    node.on_replay_connected("r", 0)
    chunk = node.on_data("r", login(1), 0)[-1]
    assert isinstance(chunk, ReplayRecords) and node.next_deadline(1) <= WRITE_NS
    for t in range(1, WRITE_NS // 10**9):  # it heartbeats every second, and reads nothing
        node.on_data("r", soup.heartbeat(server=False), t * 10**9)
        assert not any(isinstance(a, Close) for a in node.on_timer(t * 10**9))
    assert node.on_timer(WRITE_NS)[-1] == Close("r", Reject.NOT_READING)
    assert node.replay_stalled_closed == 1 and "r" not in node.replays
    assert node.on_replayed(chunk, WRITE_NS + 1) == []  # its drain, if it ever comes, finds it gone


def test_a_replay_without_a_login_in_time_a_bad_frame_a_foreign_session_and_a_logout_each_close_it():
    node = rewinder(trades(3))
    commit(node, 3)
    node.on_replay_connected("slow", 0)
    assert node.on_timer(LOGIN_NS)[-1] == Close("slow", Reject.NO_LOGIN)
    node.on_replay_connected("bad", 0)
    assert node.on_data("bad", b"\xff\xff" + b"x" * 2000, 1)[-1].reason is Reject.BAD_FRAME  # over the login's size
    node.on_replay_connected("other", 0)
    out = node.on_data("other", login(1, moldudp64.session_bytes("OTHER")), 1)
    assert frames(out)[0] == (soup.LOGIN_REJECTED, soup.REJECT_SESSION_UNAVAILABLE) and out[-1] == Close("other")
    node.on_replay_connected("done", 0)
    node.on_data("done", login(4), 1)
    assert node.on_data("done", soup.logout(), 2) == [Close("done")]
    assert node.replays == {} and node.replay_sessions == 1
