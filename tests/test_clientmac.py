"""The client MAC is HMAC-SHA256 exactly: what `hmac.digest` (an independent implementation, the
standard library's) computes, for keys of every length and any data."""

import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import clientmac
from tape.protocol.limits import MAX_CLIENT_KEYS


@given(st.binary(max_size=200), st.binary(max_size=3000))
def test_the_mac_is_hmac_sha256_for_any_key_and_data(key, data):
    assert clientmac.mac(key, data) == hmac.digest(key, data, "sha256")


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 128, 129])
def test_keys_about_the_block_size_pad_or_hash_as_rfc_2104_says(size):
    key = bytes(range(size))
    assert clientmac.mac(key, b"batch") == hmac.digest(key, b"batch", "sha256")


@given(st.binary(min_size=1, max_size=100), st.binary(min_size=1, max_size=500), st.data())
def test_a_changed_byte_of_the_data_or_the_tag_fails_verification(key, data, draw):
    tag = clientmac.mac(key, data)
    assert clientmac.verify(key, data, tag)
    at = draw.draw(st.integers(0, len(data) - 1))
    assert not clientmac.verify(key, data[:at] + bytes([data[at] ^ 1]) + data[at + 1:], tag)
    at = draw.draw(st.integers(0, len(tag) - 1))
    assert not clientmac.verify(key, data, tag[:at] + bytes([tag[at] ^ 0x80]) + tag[at + 1:])


def test_more_keys_than_are_kept_still_get_their_own_mac():
    keys = [i.to_bytes(4, "big") * 8 for i in range(MAX_CLIENT_KEYS + 10)]
    for key in keys + keys[:20]:  # the first ones again, after they were forgotten
        assert clientmac.mac(key, b"batch") == hmac.digest(key, b"batch", "sha256")
