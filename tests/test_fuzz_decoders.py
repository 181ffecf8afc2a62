"""Every decoder of bytes from a socket or a disk, fuzzed: random and mutated input gives a value
or the format's one error (ProtocolError on the wire; journal.FormatError, CorruptRecord or
SnapshotInvalid on disk; a node's own state InvariantViolation), never another exception. Inputs
are bounded (a few KiB), so a decoder that took unbounded time would show as a slow example.
(tests/test_fuzz.py: the stream, inbound, SoupBinTCP, back-off and election.json decoders.)"""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import mutated

from tape.ops.cli.onramp import parse_line
from tape.protocol import alertlink, linkauth, moldudp64, soupbintcp
from tape.protocol import journal as fmt
from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.journal_columns import CorruptRecord, decode_chunk
from tape.protocol.streamauth import StreamKeys
from tape.replicas.audit_core import Alert, AuditMachine
from tape.replicas.emitter_node_core import EmitterNode
from tape.replicas.snapshot import SnapshotInvalid, SnapshotStore
from tape.rewinder.gapfill_core import Answer, GapFillCore, Parked, Refuse
from tape.rewinder.replay_core import Accept, Reject, on_login

SESSION = moldudp64.session_bytes("TAPE")
KEY = b"k" * 32
A = b"replica-A "
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` as a stream brings it: in pieces."""
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def either(valid):
    return st.binary(max_size=3000) | mutated(valid)


REPLICATION = st.sampled_from([
    rep.encode_hello(3, b"seq-a     ", 10, 2),
    rep.encode_vote_request(4, b"seq-b     ", 9, 3, pre=True),
    rep.encode_vote(4, b"rw-1      ", True),
    rep.encode_ack(2, b"rw-1      ", True, 77),
    rep.encode_fetch(5, 1),
    rep.encode_append(2, b"seq-a     ", 4, 1, 3, 2, [M.time_tick(9, b"seq-a     ")] * 3),
]).flatmap(lambda one: st.lists(st.just(one), min_size=1, max_size=3).map(b"".join))


@FUZZ
@given(either(REPLICATION), st.lists(st.integers(0, 4000), max_size=4))
def test_replication_frames(data, cuts):
    reader = rep.FrameReader()
    try:
        for piece in chunks(data, cuts):
            reader.feed(piece)
    except ProtocolError:
        pass


ALERT_RECORD = Alert(5, 4, 3, 2, b"client".ljust(16), b"ACME".ljust(8), 100, 120, 10**18).encode()
ALERT_LINK = st.sampled_from([
    alertlink.hello(A), alertlink.welcome(9), alertlink.ack(9), alertlink.alert(ALERT_RECORD),
    alertlink.alerts([ALERT_RECORD] * 3), alertlink.digest(64, b"c" * 32), alertlink.rebuild(64),
]).flatmap(lambda one: st.lists(st.just(one), min_size=1, max_size=3).map(b"".join))


@FUZZ
@given(either(ALERT_LINK), st.lists(st.integers(0, 4000), max_size=4))
def test_alert_link_frames_and_alert_records(data, cuts):
    reader = alertlink.Reader()
    try:
        for piece in chunks(data, cuts):
            for kind, payload in reader.feed(piece):
                if kind == alertlink.ALERT:
                    Alert.decode(payload)
    except ProtocolError:
        pass


@FUZZ
@given(either(ALERT_LINK), st.lists(st.integers(0, 4000), max_size=4), st.booleans())
def test_the_emitters_node_core_takes_any_bytes_on_a_link(data, cuts, hello_first):
    """What a replica's link brings is counted, refused or closed on, never raised (the emitter's
    handler of every link)."""
    node = EmitterNode({A}, 0, "first", False)
    node.on_connected("c", 0)
    if hello_first:
        node.on_data("c", alertlink.hello(A), 0)
    for piece in chunks(data, cuts):
        node.on_data("c", piece, 1)


@FUZZ
@given(st.lists(st.binary(max_size=120) | mutated(st.just(ALERT_RECORD)), max_size=5))
def test_the_emitters_outbox_records_at_start(records):
    """Its own LMDB's intents found at start (records it wrote): redelivered, or an impossible state."""
    try:
        EmitterNode({A}, 0, "first", False).start(records, 0)
    except InvariantViolation:
        pass


LINK_KEYS = linkauth.LinkKeys([KEY])


def established_pair() -> tuple[linkauth.LinkEnd, linkauth.LinkEnd]:
    dialer, answerer = (linkauth.LinkEnd(LINK_KEYS, os.urandom(16), initiator) for initiator in (True, False))
    reply, _ = answerer.receive(dialer.opening())
    dialer.receive(reply)
    return dialer, answerer


@FUZZ
@given(either(st.just(LINK_KEYS.hello(b"n" * 16))), st.booleans())
def test_link_hellos(data, initiator):
    end = linkauth.LinkEnd(LINK_KEYS, os.urandom(16), initiator)
    try:
        end.receive(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=2000) | st.builds(lambda d: established_pair()[0].seal(d), st.binary(max_size=600))
       .flatmap(lambda sealed: mutated(st.just(sealed))), st.lists(st.integers(0, 3000), max_size=3))
def test_link_records(data, cuts):
    """A record on an established link: its payload, or refused (forged, replayed, cut)."""
    _, answerer = established_pair()
    try:
        for piece in chunks(data, cuts):
            answerer.receive(piece)
    except ProtocolError:
        pass


STREAM_KEYS = StreamKeys([KEY])
SOURCE = ("127.0.0.1", 5000)
SIGNED_REQUEST = STREAM_KEYS.sign_request(moldudp64.encode_request(SESSION, 3, 4), SOURCE, 7)


@FUZZ
@given(either(st.just(SIGNED_REQUEST)))
def test_signed_gap_fill_requests(data):
    """verify_request: the nonce (it verifies) or why not; the real one verifies, from its source only."""
    try:
        STREAM_KEYS.verify_request(data, SOURCE)
    except ProtocolError:
        pass
    assert STREAM_KEYS.verify_request(SIGNED_REQUEST, SOURCE) == 7
    assert isinstance(STREAM_KEYS.verify_request(SIGNED_REQUEST, ("127.0.0.1", 5001)), str)


@FUZZ
@given(either(st.just(SIGNED_REQUEST)), st.booleans(), st.integers(0, 2**64 - 1))
def test_the_gap_fill_handler_answers_parks_or_refuses(data, keyed, committed):
    core = GapFillCore(SESSION, 1400, STREAM_KEYS if keyed else None, park_s=1.0)
    assert isinstance(core.on_request(data, SOURCE, 1.0, committed), Answer | Parked | Refuse)


LOGIN = soupbintcp.login("user", "pass", "TAPE", 7)[3:]  # the payload, after length and type


@FUZZ
@given(st.binary(max_size=200) | mutated(st.just(LOGIN)))
def test_the_replay_login_handler(payload):
    try:
        assert isinstance(on_login(payload, SESSION, 100), Accept | Reject)
    except ProtocolError:
        pass


SEGMENT = fmt.encode_segment_header(SESSION, 1) + b"".join(fmt.encode_record(s, 1, M.time_tick(s, SESSION))
                                                            for s in range(1, 4))


@FUZZ
@given(either(st.just(SEGMENT)))
def test_journal_segment_headers_and_records(data):
    try:
        fmt.decode_segment_header(data)
    except fmt.FormatError:
        pass
    try:
        fmt.scan(data, min(len(data), fmt.SEGMENT_HEADER_SIZE), 1)
    except fmt.FormatError:
        pass


@FUZZ
@given(either(st.just(SEGMENT[fmt.SEGMENT_HEADER_SIZE:])), st.booleans(), st.booleans())
def test_the_spark_sources_chunk_decoder(data, skip, final):
    """What each Spark task decodes of a journal's bytes: rows, and what is corrupt, as it was told."""
    try:
        decode_chunk(data, fmt.SEGMENT_HEADER_SIZE, 1, skip, final)
    except CorruptRecord:
        pass


@FUZZ
@given(st.text(max_size=200) | st.sampled_from([
    '{"id": 1, "# shares": 100, "client": "Acme", "stock": "ACME"}',
    '{"id": 2, "# shares": 10, "client": "Acme", "stock": "ACME", "initial order id": 1}',
]).flatmap(lambda line: mutated(st.just(line.encode())).map(lambda b: b.decode("utf-8", "replace"))))
def test_onramp_lines(line):
    try:
        assert len(parse_line(line)) == M.INBOUND_SIZE
    except ValueError:
        pass


def saved_snapshot(tmp_path) -> SnapshotStore:
    m = AuditMachine(10**12, 10**12)
    msgs = [M.stamp(M.purchase_request(i, 100, "c", "S"), i, SESSION, i) for i in range(1, 30)]
    m.apply_run(1, [M.SEQUENCED.unpack(x) for x in msgs])
    store = SnapshotStore(tmp_path / "lmdb")
    store.save(m)
    return store


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_snapshots(tmp_path_factory, data):
    """A replica's snapshot with any of its values altered: loaded, or SnapshotInvalid (a rebuild
    from the journal), never another exception."""
    store = saved_snapshot(tmp_path_factory.mktemp("snap"))
    with store.env.begin(write=True) as txn:
        entries = [(db, k, v) for db in (store.meta, store.books, store.orphans) for k, v in txn.cursor(db=db)]
        db, key, value = data.draw(st.sampled_from(entries))
        txn.put(key, data.draw(mutated(st.just(bytes(value)))), db=db)
    try:
        store.load(AuditMachine(10**12, 10**12))
    except SnapshotInvalid:
        pass
    except RuntimeError as e:  # its windows' digits altered: as if taken under another config (replayed)
        assert "other book/orphan windows" in str(e)
    finally:
        store.close()


def test_the_fuzzed_inputs_start_from_valid_encodings():
    assert fmt.decode_segment_header(SEGMENT) == (SESSION, 1)
    assert len(fmt.scan(SEGMENT, fmt.SEGMENT_HEADER_SIZE, 1).records) == 3
    assert on_login(LOGIN, SESSION, 1) == Accept(7)
    assert [k for k, _ in alertlink.Reader().feed(alertlink.alert(ALERT_RECORD))] == [alertlink.ALERT]
    assert len(rep.FrameReader().feed(rep.encode_fetch(5, 1))) == 1
    assert Alert.decode(ALERT_RECORD).purchase_seq == 4
    assert len(parse_line('{"id": 1, "# shares": 100, "client": "Acme", "stock": "ACME"}')) == M.INBOUND_SIZE


def test_a_snapshot_whose_metadata_lacks_a_key_is_invalid(tmp_path):
    """What the fuzzing found: metadata that parses as JSON but lacks a key (a space in its name)
    raised KeyError past the decoder's checks."""
    import json

    from tape.replicas.snapshot import META_KEYS, STATE

    store = saved_snapshot(tmp_path)
    with store.env.begin(write=True) as txn:
        raw = bytes(txn.get(b"state", db=store.meta))
    head_size = STATE.size + STATE.unpack_from(raw)[4]
    meta = json.loads(raw[head_size:])
    for key in META_KEYS:
        with store.env.begin(write=True) as txn:
            txn.put(b"state", raw[:head_size] + json.dumps({k: v for k, v in meta.items() if k != key}).encode(),
                    db=store.meta)
        try:
            store.load(AuditMachine(10**12, 10**12))
        except SnapshotInvalid as e:
            assert key in str(e)
        else:
            raise AssertionError(f"a snapshot without {key!r} loaded")
    store.close()
