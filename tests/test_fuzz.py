"""Random and mutated bytes never raise anything but ProtocolError (or, for a node's own files,
InvariantViolation)."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import inbound, mutated, sequenced

from tape.protocol import backoff
from tape.protocol import messages as msg
from tape.protocol import moldudp64 as m
from tape.protocol import soupbintcp as soup
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.receiver import StreamReceiver
from tape.protocol.stamping import PacketBuilder
from tape.runtime.voter_shell import VoteStore

KEY = b"k" * 32
VALID = st.one_of(
    st.lists(sequenced, min_size=1, max_size=17).map(lambda s: PacketBuilder(b"TAPE      ", 1).add_sequenced(s)[0]),
    st.lists(inbound, min_size=1, max_size=20).map(lambda s: m.encode_packet(b"client1   ", 1, s)),
    st.just(m.encode_heartbeat(b"TAPE      ", 9)),
    st.just(m.encode_request(b"TAPE      ", 3, 4)),
    st.just(backoff.encode(b"client1   ", 2, 1, 50, None)),
    st.just(backoff.encode(b"client1   ", 2, 1, 50, KEY)),
)


def every_decoder(data: bytes) -> None:
    for decode in (
        m.decode_packet,
        m.decode_request,
        msg.decode,
        msg.check_inbound,
        lambda d: msg.decode_packet_messages(d, m.decode_header(d)[2]),
        lambda d: msg.check_inbound_batch(d, m.decode_header(d)[2]),
        lambda d: StreamReceiver(b"TAPE      ").on_packet(*m.decode_header(d), d),
        lambda d: soup.FrameDecoder().feed(d),
        soup.parse_login,
        soup.parse_login_accepted,
        lambda d: backoff.decode(d, None),
        lambda d: backoff.decode(d, KEY),
    ):
        try:
            decode(data)
        except ProtocolError:
            pass


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000))
def test_random_bytes(data):
    every_decoder(data)


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(VALID))
def test_mutated_valid_packets(data):
    every_decoder(data)


ELECTION_JSON = st.one_of(
    st.binary(max_size=80),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                 lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                     st.sampled_from(["term", "voted_for", "log_floor", "x"]), kids, max_size=4),
                 max_leaves=8).map(lambda doc: json.dumps(doc).encode()),
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ELECTION_JSON)
def test_an_election_state_on_disk_loads_or_is_an_impossible_state(tmp_path, raw):
    """A voter's own election.json, whatever its bytes: its state, or InvariantViolation (exit 4),
    never another exception."""
    path = tmp_path / "election.json"
    path.write_bytes(raw)
    try:
        state = VoteStore(path).load()
    except InvariantViolation:
        return
    assert state.found and isinstance(state.term, int)
    VoteStore(path).save(state.term, state.voted_for, state.log_floor)
    assert VoteStore(path).load() == state
