"""ReplicaNode (replicas/replica_node_core.py): every decision of a replica process -- the stream,
the alert link, the catch-up over replay, snapshots, a rebuild -- as its shell and the
simulator drive it."""

import pytest
from strategies import packet_of
from test_replica_core import msg, overfill

from tape.protocol import alertlink, moldudp64
from tape.protocol import messages as M
from tape.protocol import soupbintcp as soup
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import REPLAY_BEHIND
from tape.protocol.streamauth import StreamKeys
from tape.replicas.audit_core import Alert, AuditMachine
from tape.replicas.replica_node_core import (
    HOUSEKEEPING_NS,
    REDIAL_NS,
    Applied,
    AskRewinder,
    Close,
    Dial,
    Rebuild,
    ReplicaNode,
    Send,
    TakeSnapshot,
)

MS = 1_000_000
SESSION = b"TEST      "
ME, EMITTER, RW1, RW2 = (n.ljust(10).encode() for n in ("replica-A", "emitter", "rw-1", "rw-2"))


def replica(snapshot_every: int = 1000, machine: AuditMachine | None = None, outbox=()) -> ReplicaNode:
    return ReplicaNode(ME, machine or AuditMachine(), list(outbox), SESSION, [RW1, RW2], EMITTER, 100 * MS, None, 1400,
                       snapshot_every, 10_000 * MS, False, 0.0, 0)


def linked(node: ReplicaNode, now: int = 0) -> object:
    """The alert link dialled, connected and welcomed at mark 0; its connection."""
    dial = next(a for a in node.on_timer(now) if isinstance(a, Dial))
    assert dial.peer == EMITTER
    assert node.on_connected(dial.conn, now) == [Send(dial.conn, alertlink.hello(ME))]
    node.on_data(dial.conn, alertlink.welcome(0), now)
    return dial.conn


def sent_alerts(actions, conn) -> list[int]:
    data = b"".join(a.data for a in actions if isinstance(a, Send) and a.conn == conn)
    return [Alert.emit_seq_of(p) for k, p in alertlink.Reader().feed(data) if k == alertlink.ALERT]


def test_the_stream_is_applied_in_order_and_its_alerts_go_once_the_link_is_welcomed():
    node = replica()
    out = node.on_datagrams([packet_of(1, overfill(1, 2), SESSION)], 1)
    assert isinstance(out[0], Applied) and node.machine.last_seq == 4 and not any(isinstance(a, Send) for a in out)
    conn = next(a for a in node.on_timer(0) if isinstance(a, Dial)).conn
    node.on_connected(conn, 2)
    out = node.on_data(conn, alertlink.welcome(0), 3)
    assert sent_alerts(out, conn) == [2, 4]  # what the emitter lacks, now
    out = node.on_datagrams([packet_of(5, overfill(3, 1), SESSION)], 4)
    assert sent_alerts(out, conn) == [6]
    node.on_data(conn, alertlink.ack(4), 5)
    assert [Alert.emit_seq_of(a) for a in node.core.outbox] == [6]


def test_a_gap_is_asked_of_the_rewinders_at_once_and_again_at_the_tick():
    node = replica()
    out = node.on_datagrams([packet_of(3, overfill(2, 1), SESSION)], 1)  # seqs 1-2 missing
    assert any(isinstance(a, AskRewinder) for a in out) and node.machine.last_seq == 0
    assert node.ask_at is not None and node.next_deadline(2) <= node.ask_at


def test_a_lost_alert_link_is_dialled_again_after_a_pause():
    node = replica()
    conn = linked(node)
    node.on_closed(conn, 10)
    assert not node.core.linked and not any(isinstance(a, Dial) for a in node.on_timer(11))
    assert any(isinstance(a, Dial) and a.peer == EMITTER for a in node.on_timer(10 + REDIAL_NS))


def test_far_behind_it_catches_up_over_a_rewinders_replay_then_logs_out():
    node = replica()
    n = REPLAY_BEHIND + 10
    node.on_datagrams([moldudp64.encode_heartbeat(SESSION, n + 1)], 1)  # (a hint: seqs up to n exist)
    assert node.receiver.lag() >= REPLAY_BEHIND
    dial = next(a for a in node.on_timer(1) if isinstance(a, Dial) and a.conn[0] == "replay")
    assert dial.peer in (RW1, RW2)
    login = node.on_connected(dial.conn, 2)[0]
    assert soup.FrameDecoder().feed(login.data)[0][0] == soup.LOGIN
    entries = [M.SEQUENCED.pack(*msg(M.REQUEST, i, 10)) for i in range(1, n + 1)]
    data = soup.login_accepted(SESSION, 1) + b"".join(soup.sequenced(e) for e in entries)
    out = node.on_data(dial.conn, data, 3)
    assert node.machine.last_seq == n and node.replayed == n
    assert out[-2:] == [Send(dial.conn, soup.logout()), Close(dial.conn)] and node.replay is None


def test_a_rebuild_order_discards_the_state_once_and_starts_again_from_seq_1():
    node = replica()
    conn = linked(node)
    node.on_datagrams([packet_of(1, overfill(1, 2), SESSION)], 1)
    out = node.on_data(conn, alertlink.rebuild(4096), 2)
    assert out == [Rebuild(4096)]
    assert node.on_data(conn, alertlink.rebuild(4096), 3) == []
    out = node.on_rebuilt(AuditMachine(), [], 4)
    assert out == [Close(conn)] and node.machine.last_seq == 0 and node.receiver.next_seq == 1
    assert any(isinstance(a, Dial) and a.peer == EMITTER for a in node.on_timer(5))  # the new state links anew
    node.on_datagrams([packet_of(1, overfill(1, 2), SESSION)], 6)
    assert node.machine.last_seq == 4


def test_snapshots_come_at_their_cadence_one_at_a_time():
    node = replica(snapshot_every=4)
    out = node.on_datagrams([packet_of(1, overfill(1, 2), SESSION)], 1)
    assert TakeSnapshot() in out
    out = node.on_datagrams([packet_of(5, overfill(3, 2), SESSION)], 2)
    assert TakeSnapshot() not in out  # the save under way has not ended
    node.on_saved(3)
    out = node.on_datagrams([packet_of(9, overfill(5, 2), SESSION)], 4)
    assert TakeSnapshot() in out
    assert node.next_deadline(5) <= 5 + HOUSEKEEPING_NS


def test_a_committed_message_it_cannot_apply_stops_it():
    """Skipping it would diverge this replica from the others: an InvariantViolation (exit 4)."""
    node = replica()

    def refuse(runs):
        raise ProtocolError("bad_message", "a message this machine cannot apply", 0)

    node.machine.apply_runs = refuse
    with pytest.raises(InvariantViolation, match="cannot apply from seq 1"):
        node.on_datagrams([packet_of(1, overfill(1, 1), SESSION)], 1)


def test_a_rebuilt_state_asks_for_gaps_from_the_same_socket():
    """Its new listener signs requests with the address answers come back to, as the first did."""
    keys = StreamKeys([b"k" * 32])
    node = ReplicaNode(ME, AuditMachine(), [], SESSION, [RW1, RW2], EMITTER, 100 * MS, keys, 1400, 1000, 10**10,
                       False, 0.0, 0)
    node.reply_at("10.0.0.7", 7000, 0)
    conn = linked(node)
    node.on_data(conn, alertlink.rebuild(4096), 1)
    node.on_rebuilt(AuditMachine(), [], 2)
    sealed = keys.seal_packet(SESSION, 5, [M.SEQUENCED.pack(*msg(M.REQUEST, 1, 10))], 1, b"seq-a".ljust(10))[1]
    asks = [a for a in node.on_datagrams([sealed], 3) if isinstance(a, AskRewinder)]  # seqs 1-4 missing
    assert asks and keys.verify_request(asks[0].request, ("10.0.0.7", 7000)) == 1  # its first nonce
