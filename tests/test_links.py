"""The link shell's socket reads: both ends of a link, with keys and without, read at most
SOCKET_RECV bytes a recv() (not asyncio's 256 KiB, each an mmap), a voter's inbound link up to
BEHIND_RECV, and a payload many reads long still arrives whole."""

import asyncio
import contextlib
import os

import pytest
from conftest import until

from tape.protocol.linkauth import HELLO, MAGIC, MAX_RECORD, OLDER, LinkKeys
from tape.runtime import links
from tape.runtime.tuning import BEHIND_RECV, HANDSHAKE_TIMEOUT_S, SOCKET_RECV

KEYS = pytest.mark.parametrize("keys", [None, LinkKeys([os.urandom(32)])], ids=["plain", "sealed"])


@contextlib.asynccontextmanager
async def linked(handler, keys, refused: dict | None = None):
    """A link server on loopback handing its connections to `handler`, and a client's (reader,
    writer) connected to it; the server closed after."""
    server = await links.start_server(links.serving(handler, keys, {} if refused is None else refused),
                                         "127.0.0.1", 0)
    try:
        yield await links.connect("127.0.0.1", server.sockets[0].getsockname()[1], keys, {}, timeout=5)
    finally:
        server.close()
        await server.wait_closed()


async def awaited_reads(reader, on_data) -> None:
    """What read_each does, by awaiting each read."""
    while data := await reader.read(1 << 20):
        on_data(data)


@KEYS
async def test_both_ends_of_a_link_read_small_and_a_large_payload_arrives_whole(keys):
    payload = os.urandom(5 * SOCKET_RECV + 123)
    got = asyncio.get_running_loop().create_future()

    async def handler(reader, writer):
        assert writer.transport.max_size == SOCKET_RECV
        data = b""
        while len(data) < len(payload):
            data += await reader.read(1 << 20)
        got.set_result(data)
        writer.close()

    async with linked(handler, keys) as (reader, writer):
        assert writer.transport.max_size == SOCKET_RECV < 128 << 10
        writer.write(payload)
        async with asyncio.timeout(10):
            assert await got == payload
        writer.close()


@KEYS
@pytest.mark.parametrize("read", [awaited_reads, links.read_each], ids=["awaited", "handed"])
async def test_a_voters_link_reads_what_is_pending_in_few_reads(keys, read):
    """A voter's link (links.large_reads): up to BEHIND_RECV a recv(), so an append of a paced
    batch, or what a leader ahead sent, takes as few reads as the socket's buffer allows (at
    SOCKET_RECV a recv() 13), and a short frame after it still comes whole. What came while
    nothing read (more than a reader buffers before it pauses the transport) is read all the
    same, handed too."""
    payload, small = os.urandom(12 * SOCKET_RECV), b"a short frame"
    reads = []
    ended, sent = asyncio.get_running_loop().create_future(), asyncio.Event()

    async def handler(reader, writer):
        links.large_reads(writer)
        assert writer.transport.max_size == BEHIND_RECV
        await sent.wait()  # the whole payload is pending when the reads begin
        await read(reader, lambda data: reads.append(len(data)))
        ended.set_result(None)
        writer.close()

    async with linked(handler, keys) as (reader, writer):
        writer.write(payload)
        await until(lambda: writer.transport.get_write_buffer_size() == 0, "the payload to leave for the socket")
        sent.set()
        await until(lambda: sum(reads) >= len(payload), "the payload to be read", every=0.01)
        writer.write(small)
        await until(lambda: sum(reads) == len(payload) + len(small), "the short frame to be read")
        writer.close()
        async with asyncio.timeout(10):
            await ended
    assert sum(reads) == len(payload) + len(small) and len(reads) <= 6 and max(reads) > SOCKET_RECV, reads


async def test_a_handed_read_runs_in_the_turn_its_bytes_arrive():
    """read_each: what was buffered first, then each chunk inside the transport's own call
    (no second loop turn), the end of the stream ends it, and after it the reader buffers."""
    reader = links.LinkReader(loop=asyncio.get_running_loop())
    reader.feed_data(b"early ")
    chunks = []
    reading = asyncio.ensure_future(links.read_each(reader, chunks.append))
    await asyncio.sleep(0)
    assert chunks == [b"early "]
    reader.feed_data(b"now")
    assert chunks == [b"early ", b"now"]  # before feed_data returned: in the transport's turn
    reader.feed_eof()
    async with asyncio.timeout(1):
        await reading
    assert reader._arrive is None


async def test_a_handed_read_raises_what_its_callback_or_the_connection_raised():
    loop = asyncio.get_running_loop()

    def refuse(data: bytes) -> None:
        raise ValueError(data)

    reader = links.LinkReader(loop=loop)
    reading = asyncio.ensure_future(links.read_each(reader, refuse))
    await asyncio.sleep(0)
    reader.feed_data(b"bad")
    reader.feed_data(b"ignored: the caller closes")
    with pytest.raises(ValueError, match="bad"):
        await reading
    reader = links.LinkReader(loop=loop)
    reading = asyncio.ensure_future(links.read_each(reader, refuse))
    await asyncio.sleep(0)
    reader.set_exception(ConnectionResetError("reset"))
    with pytest.raises(ConnectionResetError):
        await reading


@KEYS
async def test_a_handed_read_gets_a_payload_whole_and_a_forged_record_refused(keys):
    payload = os.urandom(5 * SOCKET_RECV + 123)
    got, ended = bytearray(), asyncio.get_running_loop().create_future()
    refused: dict[str, int] = {}

    async def handler(reader, writer):
        try:
            await links.read_each(reader, got.extend)
            ended.set_result("closed")
        except Exception as e:
            ended.set_result(e)
        writer.close()

    async with linked(handler, keys, refused) as (reader, writer):
        writer.write(payload[:1000])
        writer.write(payload[1000:])
        if keys is not None:
            await until(lambda: len(got) >= len(payload), "the payload to be read", every=0.01)
            writer.transport.write(b"\x00" * 64)  # not a record the key sealed
        else:
            writer.close()
        async with asyncio.timeout(10):
            outcome = await ended
        assert bytes(got) == payload
        if keys is None:
            assert outcome == "closed"
        else:
            assert type(outcome).__name__ == "ProtocolError" and sum(refused.values()) == 1, (outcome, refused)
        writer.close()


async def test_links_with_a_node_not_yet_upgraded_run_in_its_version():
    """A cluster upgrades one node at a time. Connecting to a TPL2 node (it sends its hello at once
    and refuses a TPL3 one), `connect` connects again offering TPL2; a TPL2 node connecting is
    answered in TPL2. Either way frames pass both ways."""
    keys, refused = LinkKeys([os.urandom(32)]), {}

    async def old_node(reader, writer):  # speaks TPL2 only, as before 2026-11-28
        nonce = os.urandom(16)
        writer.write(keys.hello(nonce, OLDER))
        peer = await reader.readexactly(HELLO.size)
        if peer[:4] != OLDER:
            writer.close()
            return
        _, sealer, opener = keys.accept(nonce, peer, initiator=False, version=OLDER)
        writer.write(sealer.seal(b"echo " + opener.open(await reader.read(1 << 16))))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(old_node, "127.0.0.1", 0)
    try:
        reader, writer = await links.connect("127.0.0.1", server.sockets[0].getsockname()[1], keys, refused, 5)
        assert writer.version == OLDER and not refused
        writer.write(b"ping")
        async with asyncio.timeout(5):
            assert await reader.read(1 << 16) == b"echo ping"
        writer.close()
    finally:
        server.close()

    async def echo(reader, writer):
        writer.write(b"echo " + await reader.read(1 << 16))
        await writer.drain()

    server = await links.start_server(links.serving(echo, keys, refused), "127.0.0.1", 0)  # a new node
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        nonce = os.urandom(16)
        writer.write(keys.hello(nonce, OLDER))  # a TPL2 node connecting
        async with asyncio.timeout(5):
            answer = await reader.readexactly(HELLO.size)
        _, sealer, opener = keys.accept(nonce, answer, initiator=True, version=OLDER)
        writer.write(sealer.seal(b"ping"))
        async with asyncio.timeout(5):
            assert opener.open(await reader.read(1 << 16)) == b"echo ping"
        assert not refused
        writer.close()
    finally:
        server.close()


async def test_a_link_without_keys_that_says_nothing_is_closed_after_the_handshake_timeout():
    """Without keys there is no hello to wait for; a connection that sends not a byte in
    HANDSHAKE_TIMEOUT_S is closed and counted all the same, and one that talks is left alone."""
    refused: dict[str, int] = {}

    async def echo_forever(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)

    server = await links.start_server(links.serving(echo_forever, None, refused), "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        silent = await asyncio.open_connection("127.0.0.1", port)
        talking = await asyncio.open_connection("127.0.0.1", port)
        talking[1].write(b"hello")
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S + 5):
            assert await talking[0].readexactly(5) == b"hello"
            assert await silent[0].read(1) == b""  # closed by the server
        assert refused == {"hello_timeout": 1}
        talking[1].write(b"still here")
        async with asyncio.timeout(5):
            assert await talking[0].readexactly(10) == b"still here"
        for _, writer in (silent, talking):
            writer.close()
    finally:
        server.close()


def test_an_append_to_links_of_two_versions_is_hashed_once_a_version():
    """write_each: a leader whose followers speak TPL3 and TPL2 (an upgrade under way) seals the
    same bytes for each in its version; every follower opens them."""
    class Collected:
        transport = None

        def __init__(self):
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

    keys, data = LinkKeys([os.urandom(32)]), os.urandom(MAX_RECORD + 99)
    pairs = []
    for version in (MAGIC, OLDER, MAGIC):
        _, sealer, _ = keys.accept(b"c" * 16, keys.hello(b"s" * 16, version), initiator=True, version=version)
        _, _, opener = keys.accept(b"s" * 16, keys.hello(b"c" * 16, version), initiator=False, version=version)
        pairs.append((links.SealedWriter(Collected(), sealer, b""), opener))
    links.write_each([writer for writer, _ in pairs], data)
    for writer, opener in pairs:
        assert opener.open(writer._writer.data) == data
