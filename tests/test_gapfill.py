from tape.protocol import moldudp64 as m
from tape.rewinder.gapfill import Answer, GapFillCore, Refuse

S = b"TAPE      "
A, B = ("10.0.0.1", 40001), ("10.0.0.2", 40001)


def test_serves_only_committed_and_caps_the_count():
    core = GapFillCore(S, max_count=17)
    assert core.on_request(m.encode_request(S, 5, 100), A, 0.0, committed_seq=50) == Answer(5, 17)
    assert core.on_request(m.encode_request(S, 45, 100), A, 0.0, committed_seq=50) == Answer(45, 6)
    assert core.on_request(m.encode_request(S, 51, 1), A, 0.0, committed_seq=50) == Refuse("not_committed")


def test_drops_bad_and_foreign_requests_with_a_reason():
    core = GapFillCore(S, max_count=17)
    assert core.on_request(b"garbage", A, 0.0, 50) == Refuse("bad_request")
    assert core.on_request(m.encode_request(b"OTHER     ", 1, 1), A, 0.0, 50) == Refuse("foreign_session")
    assert core.dropped == {"bad_request": 1, "foreign_session": 1}


def test_rate_limit_per_requester_refills_with_time():
    core = GapFillCore(S, max_count=17, rate_per_s=10, burst=3)
    req = m.encode_request(S, 1, 1)
    assert [core.on_request(req, A, 0.0, 50) for _ in range(4)] == [Answer(1, 1)] * 3 + [Refuse("rate_limited")]
    assert core.on_request(req, B, 0.0, 50) == Answer(1, 1)  # another requester has its own bucket
    assert core.on_request(req, A, 0.1, 50) == Answer(1, 1)  # 0.1 s at 10/s refills one
    assert core.on_request(req, A, 0.1, 50) == Refuse("rate_limited")


def test_a_host_rotating_its_ports_shares_one_bucket():
    """A flood from one host through many ports is one requester."""
    core = GapFillCore(S, max_count=17, rate_per_s=10, burst=3)
    req = m.encode_request(S, 1, 1)
    answers = [core.on_request(req, ("10.0.0.9", port), 0.0, 50) for port in range(40000, 40010)]
    assert answers == [Answer(1, 1)] * 3 + [Refuse("rate_limited")] * 7


def test_the_server_budget_bounds_answers_whatever_the_number_of_hosts():
    core = GapFillCore(S, max_count=17, rate_per_s=10, burst=3, total_rate_per_s=100, total_burst=5)
    req = m.encode_request(S, 1, 1)
    answers = [core.on_request(req, (f"10.0.{i // 250}.{i % 250}", 9), 0.0, 50) for i in range(1000)]
    assert answers.count(Answer(1, 1)) == 5 and core.dropped == {"server_busy": 995}
    assert core.on_request(req, ("10.9.9.9", 9), 0.05, 50) == Answer(1, 1)  # 0.05 s at 100/s refills five


def test_the_hosts_remembered_are_bounded_the_least_recent_forgotten():
    core = GapFillCore(S, max_count=17, rate_per_s=10, burst=1, max_peers=2)
    req = m.encode_request(S, 1, 1)
    assert core.on_request(req, A, 0.0, 50) == Answer(1, 1)
    assert core.on_request(req, A, 0.0, 50) == Refuse("rate_limited")  # A's bucket is empty
    core.on_request(req, B, 0.0, 50)
    core.on_request(req, ("10.0.0.3", 1), 0.0, 50)  # A, the least recent, is forgotten
    assert core.on_request(req, A, 0.0, 50) == Answer(1, 1)  # a fresh bucket
