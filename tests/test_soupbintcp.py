import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import sequenced

from tape.protocol import soupbintcp as soup
from tape.protocol.errors import ProtocolError

frames = st.one_of(
    st.builds(soup.sequenced, sequenced),
    st.builds(soup.login, st.just("user"), st.just("pw"), st.just("TAPE"), st.integers(0, 10**19)),
    st.builds(soup.login_accepted, st.just(b"TAPE"), st.integers(0, 10**19)),
    st.sampled_from([soup.heartbeat(), soup.heartbeat(False), soup.end_of_session(), soup.logout(),
                     soup.login_rejected(soup.REJECT_NOT_AUTHORIZED), soup.frame(soup.DEBUG, b"hello")]),
)


@given(st.lists(frames, max_size=30), st.data())
def test_frames_survive_any_split_of_the_stream(fs, data):
    stream = b"".join(fs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = soup.FrameDecoder()
    got = []
    prev = 0
    for c in cuts + [len(stream)]:
        got.extend(dec.feed(stream[prev:c]))
        prev = c
    assert [soup.frame(k, p) for k, p in got] == fs
    assert dec.buffered == 0


def test_login_fields():
    kind, payload = soup.FrameDecoder().feed(soup.login("tail01", "secret", "TAPE", 12345))[0]
    assert kind == soup.LOGIN
    assert soup.parse_login(payload) == (b"tail01", b"secret", b"TAPE", 12345)
    kind, payload = soup.FrameDecoder().feed(soup.login_accepted(b"TAPE", 77))[0]
    assert soup.parse_login_accepted(payload) == (b"TAPE", 77)


@pytest.mark.parametrize("data, reason", [
    (b"\x00\x00", "bad_frame"),
    (b"\x00\x01Q", "unknown_type"),
    (b"\x00\x02H!", "bad_length"),
    (b"\x00\x05L1234", "bad_length"),
])
def test_bad_frames(data, reason):
    with pytest.raises(ProtocolError) as e:
        soup.FrameDecoder().feed(data)
    assert e.value.reason == reason


def test_oversized_frame_is_refused_before_it_is_buffered():
    with pytest.raises(ProtocolError) as e:
        soup.FrameDecoder(max_frame=100).feed(b"\x01\x00S")
    assert e.value.reason == "oversized"


def test_bad_login_numbers():
    payload = soup.login("u", "p", "TAPE", 1)[3:]
    with pytest.raises(ProtocolError):
        soup.parse_login(payload[:26] + b"x" * 20)
