"""protocol/_speedups.c against the pure functions it replaces: the same bytes for any
input, the same refusals; and where a C compiler exists it was built (else the tests
and benchmarks would measure the fallback without saying so)."""

import shutil
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol import journal as fmt

compiled = pytest.mark.skipif(fmt.encode_records is fmt.encode_records_pure, reason="built without a C compiler")

RECORDS = st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                             st.one_of(st.binary(max_size=300), st.binary(min_size=75, max_size=75))), max_size=40)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_the_c_encoder_was_built_where_a_compiler_exists():
    assert fmt.encode_records is not fmt.encode_records_pure


@compiled
@given(RECORDS, st.booleans())
def test_c_and_pure_encode_the_same_bytes(records, as_lists):
    if as_lists:
        records = [list(r) for r in records]
    assert fmt.encode_records(records) == fmt.encode_records_pure(records)


@compiled
@given(st.binary(max_size=9000))
def test_the_c_crc_is_zlibs_at_every_length(message):
    record = fmt.encode_records([(1, 2, message)])
    assert int.from_bytes(record[:4], "big") == zlib.crc32(record[4:])


@compiled
@pytest.mark.parametrize("bad, c_error, pure_error", [
    ((1, 1, bytes(fmt.MAX_MESSAGE + 1)), ValueError, ValueError),  # longer than a length field allows
    ((-1, 1, b"x"), OverflowError, struct.error),  # seqs and terms are unsigned 64-bit
    ((1, 2**64, b"x"), OverflowError, struct.error),
    ((1, 1, "text"), TypeError, TypeError),
    ((1, 1), TypeError, ValueError),
])
def test_both_refuse_what_no_record_can_hold(bad, c_error, pure_error):
    with pytest.raises(c_error):
        fmt.encode_records([(1, 1, b"ok"), bad])
    with pytest.raises(pure_error):
        fmt.encode_records_pure([(1, 1, b"ok"), bad])
