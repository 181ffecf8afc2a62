"""The rewinder's replay rules (rewinder/replay_core.py)."""

from tape.protocol import soupbintcp as soup
from tape.rewinder import replay_core

SESSION = b"TAPE      "


def login(session: str, seq: int) -> bytes:
    return soup.login("rep", "", session, seq)[3:]  # the payload, after length and type


def test_a_login_for_this_session_or_any_is_accepted_from_its_seq():
    assert replay_core.on_login(login("TAPE", 42), SESSION, 100) == replay_core.Accept(42)
    assert replay_core.on_login(login("", 42), SESSION, 100) == replay_core.Accept(42)


def test_seq_zero_means_from_the_newest_committed_message_on():
    assert replay_core.on_login(login("TAPE", 0), SESSION, 100) == replay_core.Accept(101)


def test_another_session_is_rejected():
    assert replay_core.on_login(login("OTHER", 1), SESSION, 100) == replay_core.Reject(soup.REJECT_SESSION_UNAVAILABLE)


def test_only_committed_messages_are_sent_in_bounded_chunks():
    assert replay_core.next_chunk(101, 100) is None
    assert replay_core.next_chunk(1, 100) == (1, 100)
    assert replay_core.next_chunk(1, 10**6) == (1, replay_core.REPLAY_CHUNK)


def test_on_the_standard_port_a_login_must_be_a_configured_user_with_its_password():
    users = {b"alice": b"s3cret"}

    def as_(user: str, password: str) -> bytes:
        return soup.login(user, password, "TAPE", 1)[3:]

    assert replay_core.on_login(as_("alice", "s3cret"), SESSION, 5, users) == replay_core.Accept(1)
    for user, password in (("alice", "wrong"), ("alice", ""), ("bob", "s3cret"), ("", "")):
        assert replay_core.on_login(as_(user, password), SESSION, 5, users) == \
            replay_core.Reject(soup.REJECT_NOT_AUTHORIZED), (user, password)
    assert replay_core.on_login(as_("bob", "x"), SESSION, 5) == replay_core.Accept(1)  # the replay port: its link
