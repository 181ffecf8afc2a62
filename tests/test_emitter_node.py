"""EmitterNode (replicas/emitter_node_core.py): the emitter process's decisions over the links' bytes."""

from test_emitter_core import alert

from tape.protocol import alertlink
from tape.protocol.actions import Close, Send
from tape.protocol.limits import ACK_EVERY_NS, DONE_ALONE_AFTER_NS, RECORD_AFTER_NS
from tape.replicas.emitter_node_core import (
    DeliverAlerts,
    Divergence,
    EmitterNode,
    LookUp,
    RecordDone,
    RecordIntent,
    Reject,
    Why,
)

A, B, C = b"replica-A ", b"replica-B ", b"replica-C "
MS = 1_000_000


def node(deliver_first: bool = False, mark: int = 0, delivery: str = "first") -> EmitterNode:
    return EmitterNode({A, B, C}, mark, delivery, deliver_first)


def linked(n: EmitterNode, conn, name: bytes) -> list:
    n.on_connected(conn, 0)
    return n.on_data(conn, alertlink.hello(name), 0)


def sent(actions: list, conn) -> list:
    return [f for a in actions if isinstance(a, Send) and a.conn == conn for f in alertlink.Reader().feed(a.data)]


def test_a_known_replica_is_welcomed_a_stranger_refused_and_counted():
    n = node(mark=5)
    assert sent(linked(n, "a", A), "a") == [(alertlink.WELCOME, alertlink.MARK.pack(5))]
    out = linked(n, "m", b"mallory   ")
    assert out == [Close("m", Reject.UNKNOWN_REPLICA, "hello b'mallory   '")] and n.rejected == {"unknown_replica": 1}
    assert n.on_data("m", alertlink.alert(alert(6)), 0) == []  # closed: what was in flight counts for nothing


def test_a_hello_must_name_the_replica_the_link_proved():
    n = node()
    n.on_connected("b", 0, peer=A)  # replica-A's pair key, replica-B's name: refused
    assert n.on_data("b", alertlink.hello(B), 0) == [Close("b", Reject.NOT_THE_PEER, f"hello {B!r} on {A!r}'s link")]
    n.on_connected("a", 0, peer=A)
    assert sent(n.on_data("a", alertlink.hello(A), 0), "a")[0][0] == alertlink.WELCOME


def test_a_read_holding_a_bad_frame_is_refused_whole():
    n = node()
    linked(n, "a", A)
    out = n.on_data("a", alertlink.alert(alert(1)) + alertlink.hello(A), 0)  # a second hello after an alert
    assert out == [Close("a", Reject.UNEXPECTED_FRAME, "type 72 from b'replica-A '")] and n.core.delivered == 0
    linked(n, "b", B)
    assert n.on_data("b", alertlink.alert(b"short"), 0)[0].reason is Reject.MALFORMED_ALERT
    linked(n, "c", C)
    assert n.on_data("c", b"\x00\x00\x00\x05Zjunk", 0)[0].reason is Reject.BAD_FRAME


def test_one_delivery_at_a_time_the_rest_of_the_read_after_it():
    n = node()
    linked(n, "a", A)
    out = n.on_data("a", alertlink.alert(alert(1)) + alertlink.digest(7, bytes(16)) + alertlink.alert(alert(2)), 0)
    assert [type(a) for a in out] == [RecordIntent, DeliverAlerts] and out[1].alerts == [alert(1)]
    n.on_recorded(out[0], 0)
    assert n.on_timer(DONE_ALONE_AFTER_NS) == [Send("a", alertlink.ack(1))]  # no done while it is on its way
    then = n.on_delivered(out[1], 0)
    assert [type(a) for a in then] == [RecordIntent, DeliverAlerts] and then[1].alerts == [alert(2)]
    assert then[0].done == [alert(1)]  # the first batch's done rides in the next intent


def test_a_refused_record_closes_every_link_and_drops_the_rest_of_the_read():
    n = node()
    linked(n, "a", A), linked(n, "b", B)
    out = n.on_data("a", alertlink.alert(alert(1)) + alertlink.digest(7, bytes(16)) + alertlink.alert(alert(2)), 0)
    assert n.on_record_failed(out[0], 0) == [Close("a"), Close("b")]
    assert n.core.mark == 0 and not n.links and not n.delivering and n.next_deadline() is None
    assert sent(linked(n, "a2", A), "a2") == [(alertlink.WELCOME, alertlink.MARK.pack(0))]  # sends again from 0


def test_the_recorded_mark_is_told_at_the_ack_deadline_to_every_connection_naming_the_replica():
    n = node()
    linked(n, "a", A), linked(n, "a-again", A), linked(n, "b", B)
    record, deliver = n.on_data("a", alertlink.alert(alert(1)), 0)
    assert n.next_deadline() is None  # nothing recorded yet: nothing to tell
    n.on_recorded(record, 3 * MS)
    n.on_delivered(deliver, 3 * MS)
    assert n.next_deadline() == 3 * MS + ACK_EVERY_NS and n.on_timer(3 * MS + ACK_EVERY_NS - 1) == []
    acks = [a for a in n.on_timer(3 * MS + ACK_EVERY_NS) if isinstance(a, Send)]
    assert sorted(a.conn for a in acks) == ["a", "a-again", "b"]
    assert sent(acks, "b") == [(alertlink.ACK, alertlink.MARK.pack(1))]


def test_a_done_goes_alone_when_no_next_intent_carries_it():
    n = node()
    linked(n, "a", A)
    record, deliver = n.on_data("a", alertlink.alert(alert(1)), 0)
    n.on_recorded(record, 2 * MS)
    n.on_delivered(deliver, 2 * MS)
    assert n.next_deadline() == 2 * MS + min(ACK_EVERY_NS, DONE_ALONE_AFTER_NS)
    out = n.on_timer(2 * MS + DONE_ALONE_AFTER_NS)
    assert out[-1] == RecordDone([alert(1)]) and n.next_deadline() is None


def test_delivered_first_what_was_delivered_is_recorded_soon_after_the_first_batch():
    n = node(deliver_first=True)
    linked(n, "a", A)
    (deliver,) = n.on_data("a", alertlink.alert(alert(1)), 0)
    assert n.on_delivered(deliver, 5 * MS) == [] and n.next_deadline() == 5 * MS + RECORD_AFTER_NS
    (deliver,) = n.on_data("a", alertlink.alert(alert(2)), 9 * MS)
    n.on_delivered(deliver, 9 * MS)
    assert n.next_deadline() == 5 * MS + RECORD_AFTER_NS  # never put off by the batches after it
    (record,) = n.on_timer(5 * MS + RECORD_AFTER_NS)
    assert record == RecordIntent([alert(1), alert(2)], delivered=True)


def test_copies_are_judged_by_the_recorded_bytes_looked_up_when_not_recent():
    n = node(mark=3)
    linked(n, "a", A)
    (lookup,) = n.on_data("a", alertlink.alert(alert(2)) + alertlink.alert(alert(3, cumulative=999)), 0)
    assert lookup == LookUp([alert(2), alert(3, cumulative=999)], [None, None])
    out = n.on_looked_up(lookup, [alert(2), alert(3)], 0)
    assert out == [Divergence(Why.COPY_DIFFERS, alert=alert(3, cumulative=999))] and n.core.duplicates == 1
    record, deliver = n.on_data("a", alertlink.alert(alert(4)), 0)
    n.on_recorded(record, 0)
    assert n.on_data("a", alertlink.alert(alert(4)), 0) == []  # recent: judged at once, a duplicate


def test_a_replica_outvoted_on_its_digest_is_told_to_rebuild_on_its_latest_connection():
    n = node()
    for conn, name in (("a", A), ("b", B), ("c", C)):
        linked(n, conn, name)
    n.on_data("a", alertlink.digest(4096, b"x" * 16), 0)
    n.on_data("b", alertlink.digest(4096, b"x" * 16), 0)
    out = n.on_data("c", alertlink.digest(4096, b"y" * 16), 0)
    assert out[0] == Divergence(Why.DIGEST_OUTVOTED, replica=C, fold_seq=4096)
    assert sent(out, "c") == [(alertlink.REBUILD, alertlink.MARK.pack(4096))]
    assert sent(linked(n, "c2", C), "c2")[1] == (alertlink.REBUILD, alertlink.MARK.pack(4096))  # told again


def test_at_the_stop_the_last_batch_is_recorded_done_unless_it_is_still_on_its_way():
    n = node()
    linked(n, "a", A)
    record, deliver = n.on_data("a", alertlink.alert(alert(1)), 0)
    n.on_recorded(record, 0)
    assert n.on_stop(0) == []  # stopped on its way to the sinks: in doubt at the next start
    n.on_delivered(deliver, 0)
    assert n.on_stop(0) == [RecordDone([alert(1)])]
