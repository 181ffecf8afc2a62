"""The authenticated record layer of TCP links (protocol/linkauth.py)."""

import hashlib
import os

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

from tape.protocol.errors import ProtocolError
from tape.protocol.linkauth import (
    HELLO,
    MAGIC,
    MAX_RECORD,
    OLDER,
    RECORD,
    LinkEnd,
    LinkKeys,
    OlderPeer,
    offered,
    pair_key,
    record_digests,
)

K1, K2 = os.urandom(32), os.urandom(32)


def pair(client_keys: LinkKeys, server_keys: LinkKeys, nc: bytes = b"c" * 16, ns: bytes = b"s" * 16,
         version: bytes = MAGIC):
    """(client sealer, client opener, server sealer, server opener) after a handshake."""
    _, cs, co = client_keys.accept(nc, server_keys.hello(ns, version), initiator=True, version=version)
    _, ss, so = server_keys.accept(ns, client_keys.hello(nc, version), initiator=False, version=version)
    return cs, co, ss, so


@pytest.mark.parametrize("version", [MAGIC, OLDER])
def test_each_version_tags_its_own_digest_of_the_payload(version):
    """TPL3: the tag keys the record counter and the payload's BLAKE3-256; TPL2: its BLAKE2b-256.
    A record of one version does not open in the other."""
    payload = os.urandom(3000)
    digest = blake3(payload).digest() if version == MAGIC else hashlib.blake2b(payload, digest_size=32).digest()
    assert record_digests(payload, version) == [digest]
    cs, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]), version=version)
    wire = cs.seal(payload) + cs.seal(payload)
    c2s = hashlib.blake2b(b"c" * 16 + b"s" * 16, key=K1, person=b"tape-link-c2s").digest()
    tag = hashlib.blake2b((1).to_bytes(8, "big") + digest, key=c2s, digest_size=16).digest()
    assert wire[len(wire) // 2:][:RECORD.size] == RECORD.pack(len(payload), tag)  # the second record's
    assert so.open(wire) == payload * 2
    other = pair(LinkKeys([K1]), LinkKeys([K1]), version=OLDER if version == MAGIC else MAGIC)[3]
    with pytest.raises(ProtocolError) as e:
        other.open(wire)
    assert e.value.reason == "bad_tag"


def test_the_accepting_side_takes_the_version_offered_and_an_older_answer_is_named():
    server, client, nc, ns = LinkKeys([K1]), LinkKeys([K1]), b"c" * 16, b"s" * 16
    assert offered(client.hello(nc)) == MAGIC == b"TPL3" and offered(client.hello(nc, OLDER)) == OLDER == b"TPL2"
    with pytest.raises(OlderPeer) as e:  # offered TPL3, answered TPL2 (a node not yet upgraded): offer TPL2 again
        client.accept(nc, server.hello(ns, OLDER), initiator=True)
    assert e.value.version == OLDER
    with pytest.raises(ProtocolError) as e:  # answered in a version other than the one we offered
        client.accept(nc, server.hello(ns), initiator=True, version=OLDER)
    assert e.value.reason == "bad_hello" and not isinstance(e.value, OlderPeer)
    with pytest.raises(ProtocolError) as e:  # an accepting side takes a hello only in the version it answered
        server.accept(ns, client.hello(nc, OLDER), initiator=False)
    assert e.value.reason == "bad_hello"
    for junk in (b"TPL1" + bytes(24), b"TPL4" + bytes(24), b"TPL3" + bytes(10)):
        with pytest.raises(ProtocolError) as e:
            offered(junk)
        assert e.value.reason == "bad_hello"


@given(st.lists(st.binary(max_size=3000), max_size=8), st.integers(1, 97))
def test_what_is_sealed_opens_whole_whatever_the_chunking(writes, chunk):
    cs, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    wire = b"".join(cs.seal(w) for w in writes)
    got = b"".join(so.open(wire[i:i + chunk]) for i in range(0, len(wire), chunk))
    assert got == b"".join(writes)


def test_both_directions_and_a_write_larger_than_a_record():
    cs, co, ss, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    big = os.urandom(MAX_RECORD * 2 + 5)
    wire = cs.seal(big)
    assert len(wire) == len(big) + 3 * RECORD.size  # three records
    assert so.open(wire) == big
    assert co.open(ss.seal(b"ack")) == b"ack"


def test_bytes_for_several_links_are_hashed_once_and_each_link_opens_its_own():
    """A leader's append to its followers: one set of digests, a record of each link's key and count."""
    data = os.urandom(MAX_RECORD + 99)  # two records
    links = [pair(LinkKeys([K]), LinkKeys([K]), nc=bytes([i]) * 16) for i, K in enumerate((K1, K2, K1))]
    digests = record_digests(data)
    assert len(digests) == 2
    wires = [cs.seal(data, digests) for cs, _, _, _ in links]
    assert len(set(wires)) == 3  # each under its own direction key
    for wire, (_, _, _, so) in zip(wires, links):
        assert so.open(wire) == data
    with pytest.raises(ProtocolError):  # a digest of other bytes seals nothing that opens
        links[0][3].open(links[0][0].seal(b"x" * 10, record_digests(b"y" * 10)))


def test_a_flipped_bit_anywhere_in_a_record_is_refused():
    cs, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    wire = cs.seal(b"append frame bytes")
    for i in range(4, len(wire)):  # past the length (a bad length is refused as such, or waits)
        bad = bytearray(wire)
        bad[i] ^= 0x01
        opener = pair(LinkKeys([K1]), LinkKeys([K1]))[3]
        with pytest.raises(ProtocolError) as e:
            opener.open(bytes(bad))
        assert e.value.reason == "bad_tag"
    assert so.open(wire) == b"append frame bytes"


def test_records_replayed_reordered_or_from_another_connection_are_refused():
    cs, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    first, second = cs.seal(b"one"), cs.seal(b"two")
    with pytest.raises(ProtocolError, match="record 0"):
        so.open(second)  # reordered (or the first dropped)
    cs, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    assert so.open(cs.seal(b"one")) == b"one"
    with pytest.raises(ProtocolError):
        so.open(first)  # the same record again: the counter moved on
    _, _, _, other = pair(LinkKeys([K1]), LinkKeys([K1]), ns=b"t" * 16)  # the server's fresh nonce
    with pytest.raises(ProtocolError) as e:
        other.open(first)
    assert e.value.reason == "bad_tag"


def test_a_peer_without_the_key_is_refused_at_its_hello_or_first_record():
    with pytest.raises(ProtocolError) as e:
        LinkKeys([K1]).accept(b"s" * 16, LinkKeys([K2]).hello(b"c" * 16), initiator=False)
    assert e.value.reason == "unknown_key"
    with pytest.raises(ProtocolError) as e:
        LinkKeys([K1]).accept(b"s" * 16, b"\x00\x00\x00\x05Zjunk" + bytes(HELLO.size - 10), initiator=False)
    assert e.value.reason == "bad_hello"
    # A server without the client's key cannot even answer: its opener never verifies the client.
    cs, _, _, _ = pair(LinkKeys([K2]), LinkKeys([K2]))
    _, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    with pytest.raises(ProtocolError):
        so.open(cs.seal(b"forged"))


def test_rotation_either_key_is_accepted_the_first_is_offered():
    old, both, new = LinkKeys([K1]), LinkKeys([K2, K1]), LinkKeys([K2])
    for client, server in ((old, both), (both, new), (both, both)):
        cs, co, ss, so = pair(client, server)
        assert so.open(cs.seal(b"x")) == b"x" and co.open(ss.seal(b"y")) == b"y"
    with pytest.raises(ProtocolError):
        pair(old, new)


def test_an_oversized_record_length_is_refused_before_it_is_buffered():
    _, _, _, so = pair(LinkKeys([K1]), LinkKeys([K1]))
    with pytest.raises(ProtocolError) as e:
        so.open(RECORD.pack(MAX_RECORD + 1, bytes(16)))
    assert e.value.reason == "bad_record"


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(at, at[1:])]


@given(st.lists(st.binary(min_size=1, max_size=300), max_size=5), st.lists(st.integers(0, 2000), max_size=8),
       st.lists(st.integers(0, 2000), max_size=8))
def test_two_link_ends_over_bytes_cut_anywhere_hand_on_every_write_in_order(writes, cuts_in, cuts_out):
    """The hellos, then records both ways, as a connection hands them over: the accepting side's
    hello coalesced with its first records, hellos in pieces."""
    keys = LinkKeys([K1])
    client, server = LinkEnd(keys, b"c" * 16, True), LinkEnd(keys, b"s" * 16, False)
    assert server.opening() == b"" and not client.established
    got_server = b""
    hello = client.opening()
    for piece in chunks(hello, cuts_in):
        reply, plain = server.receive(piece)
        got_server += plain
    assert server.established and len(reply) == HELLO.size and got_server == b""
    toward_client = reply + b"".join(server.seal(w) for w in writes)
    got_client = b"".join(client.receive(piece)[1] for piece in chunks(toward_client, cuts_out))
    assert client.established and got_client == b"".join(writes)
    assert server.receive(client.seal(b"back"))[1] == b"back"


def test_a_link_end_refuses_a_stranger_without_answering_and_answers_an_older_offer_in_kind():
    end = LinkEnd(LinkKeys([K1]), b"s" * 16, False)
    with pytest.raises(ProtocolError, match="unknown_key|not one of ours"):
        end.receive(LinkKeys([K2]).hello(b"c" * 16))
    assert not end.established  # (and nothing to write: a stranger learns no nonce)
    with pytest.raises(ProtocolError, match="not a link hello"):
        LinkEnd(LinkKeys([K1]), b"s" * 16, False).receive(b"HTTP/1.1 GET /" + bytes(14))
    older = LinkEnd(LinkKeys([K1]), b"s" * 16, False)
    reply, _ = older.receive(LinkKeys([K1]).hello(b"c" * 16, OLDER))
    assert reply[:4] == OLDER and older.version == OLDER
    with pytest.raises(OlderPeer):
        LinkEnd(LinkKeys([K1]), b"c" * 16, True).receive(reply)


def node_keys(cluster: bytes, me: str, peers: list[str]) -> LinkKeys:
    return LinkKeys(peers={p.encode(): [pair_key(cluster, me, p)] for p in peers})


def test_a_pairs_key_proves_each_end_and_opens_no_other_pair():
    """Each pair of nodes shares a key of its own: the listener learns from the handshake which
    peer connected, and a node holding no pair with the listener (a third node, another role)
    is refused at its hello, whatever name it would claim afterwards."""
    assert pair_key(K1, "seq-a", "rw-1") == pair_key(K1, "rw-1", "seq-a")  # either order
    assert len({pair_key(K1, "seq-a", "rw-1"), pair_key(K1, "seq-a", "rw-2"), pair_key(K2, "seq-a", "rw-1")}) == 3
    seq_a = node_keys(K1, "seq-a", ["rw-1", "rw-2"])
    client = LinkEnd(node_keys(K1, "rw-1", ["seq-a", "rw-2"]), b"c" * 16, True, peer=b"seq-a")
    server = LinkEnd(seq_a, b"s" * 16, False)
    reply, _ = server.receive(client.opening())
    client.receive(reply)
    assert server.peer == b"rw-1" and client.peer == b"seq-a"
    _, plain = server.receive(client.sealer.seal(b"append"))
    assert plain == b"append"
    for stranger in (node_keys(K1, "replica-A", ["seq-a"]),  # derivable, but seq-a holds no pair with it
                     node_keys(K2, "rw-1", ["seq-a"])):  # another cluster's key
        with pytest.raises(ProtocolError) as e:
            LinkEnd(seq_a, b"s" * 16, False).receive(stranger.hello(b"c" * 16, peer=b"seq-a"))
        assert e.value.reason == "unknown_key"
    with pytest.raises(KeyError):  # nothing to offer a node we hold no pair with
        seq_a.hello(b"c" * 16, peer=b"replica-A")
