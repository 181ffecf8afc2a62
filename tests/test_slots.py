"""Connection slots (protocol/slots.py, issue 63): strangers never take a configured peer's slot,
and share a small pool, a few each."""

from hypothesis import given
from hypothesis import strategies as st

from tape.protocol.slots import Slots

PEER = "10.0.0.1"


def test_strangers_fill_their_pool_and_a_peer_still_gets_in():
    slots = Slots(frozenset({PEER}), per_peer=3, strangers=4, per_stranger=2)
    assert [slots.admit("10.9.9.1") for _ in range(3)] == [None, None, "host_busy"]  # a few each
    assert [slots.admit(h) for h in ("10.9.9.2", "10.9.9.2", "10.9.9.3")] == [None, None, "too_many_connections"]
    assert [slots.admit(PEER) for _ in range(4)] == [None, None, None, "host_busy"]  # its own, and only its own
    slots.release("10.9.9.1")
    assert slots.admit("10.9.9.3") is None and slots.admit("10.9.9.4") == "too_many_connections"
    for _ in range(3):
        slots.release(PEER)
    assert PEER not in slots.open and slots.strangers_open == 4


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=300))
def test_no_sequence_of_strangers_ever_refuses_a_peer_with_a_free_slot(moves):
    """Strangers from 41 addresses connect and leave in any order; a peer with a slot left is
    always let in, and no stranger address ever holds more than its share."""
    slots = Slots(frozenset({PEER}), per_peer=2, strangers=16, per_stranger=3)
    held: list[str] = []
    for connect, i in moves:
        host = f"10.9.0.{i}"
        if connect:
            if slots.admit(host) is None:
                held.append(host)
        elif host in held:
            held.remove(host)
            slots.release(host)
        assert slots.strangers_open == len(held) <= 16 and all(held.count(h) <= 3 for h in held)
    assert slots.admit(PEER) is None and slots.admit(PEER) is None and slots.admit(PEER) == "host_busy"
