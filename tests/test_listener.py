"""The listener drops malformed multicast, but reports an undecodable
message in the committed log (a rewinder's answer) instead of waiting."""

from tape.node.listener import StreamListener
from tape.ops.config import default
from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol.packets import PacketBuilder


def packet(seq, raw_messages):
    return PacketBuilder(moldudp64.session_bytes("TAPE"), seq).add_sequenced(raw_messages)[0]


def good(n):
    return [M.stamp(M.purchase_request(i, 10, "C", "S"), 1, b"o" * 10, i) for i in range(1, n + 1)]


def test_undecodable_committed_message_is_reported_at_its_seq():
    cfg = default("/tmp/none")
    delivered, failures = [], []
    listener = StreamListener(
        cfg, lambda f, p, s: delivered.append(f), on_undecodable=lambda seq, e: failures.append((seq, e.reason))
    )
    listener.on_datagram(packet(1, good(3)))
    bad = good(2)
    bad[1] = b"Z" + bad[1][1:]  # a type this version does not know, at seq 5
    forged = packet(4, bad)
    listener.on_datagram(forged)  # from the multicast group: dropped, counted, not fatal
    assert failures == [] and listener.bad == {"unknown_type": 1}
    listener.on_datagram(forged, committed=True)  # the same bytes from a rewinder: the log itself
    assert failures == [(5, "unknown_type")]
    assert delivered == [1]
