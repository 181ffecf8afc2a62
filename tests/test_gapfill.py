from tape.protocol import moldudp64 as m
from tape.protocol.limits import GAP_PARKED_MAX, MAX_BATCH_MESSAGES
from tape.protocol.streamauth import StreamKeys
from tape.rewinder.gapfill_core import PARKED, Answer, GapFillCore, Refuse

S = b"TAPE      "
P = 1400  # the stream's packet size: 17 blocks of 77 bytes after the header
A, B = ("10.0.0.1", 40001), ("10.0.0.2", 40001)
K1, K2 = b"k" * 32, b"j" * 32


def padded(seq: int, count: int, size: int = P, session: bytes = S) -> bytes:
    return m.encode_request(session, seq, count).ljust(size, b"\0")


def test_serves_only_committed_and_caps_the_count():
    core = GapFillCore(S, P)
    assert core.on_request(padded(5, 100), A, 0.0, committed_seq=50) == Answer(5, 17)
    assert core.on_request(padded(45, 100), A, 0.0, committed_seq=50) == Answer(45, 6)
    assert core.on_request(padded(51, 1), A, 0.0, committed_seq=50) == Refuse("not_committed")


def test_drops_bad_and_foreign_requests_with_a_reason():
    core = GapFillCore(S, P)
    assert core.on_request(m.HEADER.pack(S, 0, 1).ljust(P, b"\0"), A, 0.0, 50) == Refuse("bad_request")
    assert core.on_request(padded(1, 1, session=b"OTHER     "), A, 0.0, 50) == Refuse("foreign_session")
    assert core.dropped == {"bad_request": 1, "foreign_session": 1}


def test_without_keys_no_answer_is_larger_than_its_request():
    """A forged source address gets no more bytes than the forger sent: the answer's messages must
    fit the request's size (a spec-sized 20-byte request fits none: refused as unpadded)."""
    core = GapFillCore(S, P)
    assert core.on_request(m.encode_request(S, 1, 100), A, 0.0, 50) == Refuse("unpadded")
    assert core.on_request(padded(1, 100, 20 + 76), A, 0.0, 50) == Refuse("unpadded")
    assert core.on_request(padded(1, 100, 20 + 77), A, 0.0, 50) == Answer(1, 1)
    assert core.on_request(padded(1, 100, 20 + 5 * 77 + 76), A, 0.0, 50) == Answer(1, 5)
    assert core.on_request(padded(1, 100, 9000), A, 0.0, 50) == Answer(1, 17)  # never above a stream packet


def test_with_a_key_only_signed_requests_naming_their_source_are_answered():
    core = GapFillCore(S, P, StreamKeys([K1]))
    signer = StreamKeys([K1])
    good = signer.sign_request(m.encode_request(S, 5, 100), A, 1)
    assert core.on_request(good, A, 0.0, 50) == Answer(5, 17)
    assert core.on_request(padded(5, 100), A, 0.0, 50) == Refuse("unsigned_request")
    assert core.on_request(good, B, 0.0, 50) == Refuse("wrong_source")  # replayed from elsewhere: aimed at B
    assert core.on_request(good[:-1] + bytes([good[-1] ^ 1]), A, 0.0, 50) == Refuse("bad_tag")
    other = StreamKeys([K2]).sign_request(m.encode_request(S, 5, 100), A, 2)
    assert core.on_request(other, A, 0.0, 50) == Refuse("unknown_key")
    rotating = GapFillCore(S, P, StreamKeys([K2, K1]))  # during a rotation either key verifies
    assert rotating.on_request(good, A, 0.0, 50) == rotating.on_request(other, A, 0.0, 50) == Answer(5, 17)


def test_a_signed_request_sent_again_is_refused_and_a_fresh_one_answered():
    """A request recorded on the LAN and sent again from its signer's address (the only source its
    signature allows) would earn a whole sealed range each time: its nonce is refused once an
    equal or greater one from that address was answered. An older version's request, without a
    nonce, is refused by its size."""
    core = GapFillCore(S, P, StreamKeys([K1]), max_peers=2)
    signer = StreamKeys([K1])
    ask = lambda nonce, at=A: signer.sign_request(m.encode_request(S, 5, 100), at, nonce)  # noqa: E731
    assert core.on_request(ask(10), A, 0.0, 50) == Answer(5, 17)
    assert core.on_request(ask(10), A, 0.0, 50) == Refuse("replayed_request")
    assert core.on_request(ask(9), A, 0.0, 50) == Refuse("replayed_request")
    assert core.on_request(ask(11), A, 0.0, 50) == Answer(5, 17)
    assert core.on_request(ask(1, B), B, 0.0, 50) == Answer(5, 17)  # each address its own count
    assert core.on_request(ask(2, ("10.0.0.9", 1)), ("10.0.0.9", 1), 0.0, 50) == Answer(5, 17)
    assert len(core._nonces) == 2  # bounded: the least recent forgotten
    unfresh = ask(12)[:-32] + ask(12)[-24:]  # (the older layout: no nonce field)
    assert core.on_request(unfresh, A, 0.0, 50) == Refuse("unfresh_request")


def test_rate_limit_per_requester_refills_with_time():
    core = GapFillCore(S, P, rate_per_s=10, burst=3)
    req = padded(1, 1)
    assert [core.on_request(req, A, 0.0, 50) for _ in range(4)] == [Answer(1, 1)] * 3 + [Refuse("rate_limited")]
    assert core.on_request(req, B, 0.0, 50) == Answer(1, 1)  # another requester has its own bucket
    assert core.on_request(req, A, 0.1, 50) == Answer(1, 1)  # 0.1 s at 10/s refills one
    assert core.on_request(req, A, 0.1, 50) == Refuse("rate_limited")


def test_a_host_rotating_its_ports_shares_one_bucket():
    """A flood from one host through many ports is one requester."""
    core = GapFillCore(S, P, rate_per_s=10, burst=3)
    req = padded(1, 1)
    answers = [core.on_request(req, ("10.0.0.9", port), 0.0, 50) for port in range(40000, 40010)]
    assert answers == [Answer(1, 1)] * 3 + [Refuse("rate_limited")] * 7


def test_the_server_budget_bounds_answers_whatever_the_number_of_hosts():
    core = GapFillCore(S, P, rate_per_s=10, burst=3, total_rate_per_s=100, total_burst=5)
    req = padded(1, 1)
    answers = [core.on_request(req, (f"10.0.{i // 250}.{i % 250}", 9), 0.0, 50) for i in range(1000)]
    assert answers.count(Answer(1, 1)) == 5 and core.dropped == {"server_busy": 995}
    assert core.on_request(req, ("10.9.9.9", 9), 0.05, 50) == Answer(1, 1)  # 0.05 s at 100/s refills five


def test_the_hosts_remembered_are_bounded_the_least_recent_forgotten():
    core = GapFillCore(S, P, rate_per_s=10, burst=1, max_peers=2)
    req = padded(1, 1)
    assert core.on_request(req, A, 0.0, 50) == Answer(1, 1)
    assert core.on_request(req, A, 0.0, 50) == Refuse("rate_limited")  # A's bucket is empty
    core.on_request(req, B, 0.0, 50)
    core.on_request(req, ("10.0.0.3", 1), 0.0, 50)  # A, the least recent, is forgotten
    assert core.on_request(req, A, 0.0, 50) == Answer(1, 1)  # a fresh bucket


def test_a_request_ahead_of_the_commit_point_waits_for_it_then_is_answered():
    """A listener sees a packet once the leader committed it; a rewinder learns of that commit with
    the next append. Refused, the listener waited a whole gap-request timeout to ask again."""
    core = GapFillCore(S, P, park_s=0.02)
    assert core.on_request(padded(51, 3), A, 0.0, committed_seq=50) == PARKED
    assert core.on_request(padded(60, 2), B, 0.0, committed_seq=50) == PARKED
    assert core.due(52, 0.001) == [] and core.parked == 2  # 53 not yet committed
    assert core.due(55, 0.002) == [(Answer(51, 3), A)] and core.parked == 1
    assert core.due(61, 0.003) == [(Answer(60, 2), B)] and core.parked == 0
    assert core.served == 2 and core.dropped == {}


def test_a_parked_request_expires_answered_with_what_is_committed_or_dropped():
    core = GapFillCore(S, P, park_s=0.02)
    core.on_request(padded(51, 10), A, 0.0, 50)
    core.on_request(padded(70, 1), B, 0.0, 50)
    assert core.due(55, 0.019) == []  # neither covered whole, neither expired
    assert core.due(55, 0.02) == [(Answer(51, 5), A)]  # expired: the committed part (the listener asks for the rest)
    assert core.parked == 0 and core.dropped == {"not_committed": 1}  # 70: nothing committed to send


def test_parking_is_bounded_in_count_distance_and_tokens():
    core = GapFillCore(S, P, park_s=0.02, rate_per_s=10, burst=GAP_PARKED_MAX + 5,
                       total_rate_per_s=10, total_burst=GAP_PARKED_MAX + 5)
    assert core.on_request(padded(50 + MAX_BATCH_MESSAGES + 1, 1), A, 0.0, 50) == Refuse("not_committed")
    assert core.on_request(padded(50 + MAX_BATCH_MESSAGES, 1), A, 0.0, 50) == PARKED  # within a batch of it
    for _ in range(GAP_PARKED_MAX - 1):
        assert core.on_request(padded(51, 1), A, 0.0, 50) == PARKED
    assert core.on_request(padded(51, 1), A, 0.0, 50) == Refuse("parked_full")
    assert core.on_request(padded(50, 1), A, 0.0, 50) == Answer(50, 1)  # committed: answered as ever
    limited = GapFillCore(S, P, park_s=0.02, rate_per_s=10, burst=2)
    assert [limited.on_request(padded(51, 1), A, 0.0, 50) for _ in range(3)] == [PARKED, PARKED,
                                                                                 Refuse("rate_limited")]


def test_without_parking_a_request_ahead_of_the_commit_point_is_refused():
    core = GapFillCore(S, P)
    assert core.on_request(padded(51, 1), A, 0.0, 50) == Refuse("not_committed") and core.parked == 0
