"""The byte examples shown in docs/, rebuilt from code. test_docs.py checks
that every example in the docs equals these bytes."""

from tape.protocol import backoff, linkauth
from tape.protocol import journal as jfmt
from tape.protocol import messages as msg
from tape.protocol import moldudp64 as m
from tape.protocol import soupbintcp as soup
from tape.protocol.streamauth import StreamKeys

STAMP = 1_700_000_000_123_456_789
TAPE = m.session_bytes("TAPE")
CLIENT1 = m.session_bytes("client1")
R = msg.purchase_request(1, 100, "Sendence", "AAPL")
P = msg.purchase(2, 1, 90, "Sendence", "AAPL")
R_SEQ = msg.stamp(R, STAMP, CLIENT1, 1)
LINK_KEY = bytes(range(32))  # the docs' example key: 00 01 .. 1f
LINK = linkauth.LinkKeys([LINK_KEY])

EXAMPLES = {
    "inbound_purchase_request": R,
    "inbound_purchase": P,
    "sequenced_purchase_request": R_SEQ,
    "sequenced_purchase": msg.stamp(P, STAMP, CLIENT1, 2),
    "term_start": msg.term_start(STAMP, m.session_bytes("seq-a"), 2, "seq-a"),
    "time_tick": msg.time_tick(STAMP, m.session_bytes("seq-a")),
    "downstream_packet": m.encode_packet(TAPE, 1, [R_SEQ]),
    "heartbeat": m.encode_heartbeat(TAPE, 42),
    "end_of_session": m.encode_end_of_session(TAPE, 42),
    "request": m.encode_request(TAPE, 5, 3),
    "signed_request": StreamKeys([LINK_KEY]).sign_request(m.encode_request(TAPE, 5, 3), ("10.0.0.7", 40001), 1),
    "inbound_batch": m.encode_packet(CLIENT1, 1, [R, P]),
    "backoff": backoff.encode(CLIENT1, 2, 27, 50, LINK_KEY),
    "resend": backoff.encode_resend(CLIENT1, 2, 27, LINK_KEY),
    "soup_login": soup.login("tail01", "", "TAPE", 1),
    "soup_login_accepted": soup.login_accepted(TAPE, 1),
    "soup_sequenced": soup.sequenced(R_SEQ),
    "soup_heartbeat": soup.heartbeat(),
    "soup_end_of_session": soup.end_of_session(),
    "journal_segment_header": jfmt.encode_segment_header(TAPE, 1),
    "journal_record": jfmt.encode_record(1, 1, R_SEQ),
    "link_hello": LINK.hello(bytes(16)),
    # The connecting side's first record after hellos with nonces of zeros (its own) and 0x11s.
    "link_record": LINK.accept(bytes(16), LINK.hello(b"\x11" * 16), initiator=True)[1].seal(b"hello frame"),
}


def hexdump(data: bytes) -> str:
    return "\n".join(" ".join(f"{b:02x}" for b in data[i:i + 16]) for i in range(0, len(data), 16))
