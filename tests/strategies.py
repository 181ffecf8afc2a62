"""Hypothesis strategies for Tape's wire formats."""

from hypothesis import strategies as st

from tape.protocol import messages, moldudp64


def ascii_text(n):
    return st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=n)


u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
session = ascii_text(10).map(lambda s: s.encode().ljust(10, b" "))

inbound = st.one_of(
    st.builds(messages.purchase_request, u64, i64, ascii_text(16), ascii_text(8)),
    st.builds(messages.purchase, u64, u64, i64, ascii_text(16), ascii_text(8)),
)
sequenced = st.one_of(
    st.builds(messages.stamp, inbound, u64, session, u64),
    st.builds(messages.term_start, u64, session, u64, ascii_text(10)),
    st.builds(messages.time_tick, u64, session),
)


def packet_of(first_seq: int, msgs: list, session: bytes = b"TEST      ") -> bytes:
    """A downstream packet holding these decoded sequenced messages (as a listener delivers it)."""
    return moldudp64.encode_packet(session, first_seq, [messages.SEQUENCED.pack(*m) for m in msgs])


@st.composite
def mutated(draw, valid):
    """A valid encoding with a few bytes flipped, cut or inserted."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[draw(st.integers(0, len(data))):]
        else:
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)
