"""The link shell's socket reads: both ends of a link, with keys and without, read at most
SOCKET_RECV bytes a recv() (not asyncio's 256 KiB, each an mmap), and a payload many reads
long still arrives whole."""

import asyncio
import contextlib
import os

import pytest

from tape.node import authlink
from tape.protocol.limits import BEHIND_RECV, SOCKET_RECV
from tape.protocol.linkauth import LinkKeys

KEYS = pytest.mark.parametrize("keys", [None, LinkKeys([os.urandom(32)])], ids=["plain", "sealed"])


@contextlib.asynccontextmanager
async def linked(handler, keys, refused: dict | None = None):
    """A link server on loopback handing its connections to `handler`, and a client's (reader,
    writer) connected to it; the server closed after."""
    server = await authlink.start_server(authlink.serving(handler, keys, {} if refused is None else refused),
                                         "127.0.0.1", 0)
    try:
        yield await authlink.connect("127.0.0.1", server.sockets[0].getsockname()[1], keys, {}, timeout=5)
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
@pytest.mark.parametrize("read", [awaited_reads, authlink.read_each], ids=["awaited", "handed"])
async def test_a_reader_behind_reads_large_until_it_has_caught_up(keys, read):
    """A voter's link (authlink.reads_to_keep_up): after a read that came full the next recv()
    takes up to BEHIND_RECV, so what is pending comes in few reads; a short read sets it back.
    What came while nothing read (more than a reader buffers before it pauses the transport)
    is read all the same, handed too."""
    payload, small = os.urandom(12 * SOCKET_RECV), b"a short frame"
    reads, sizes = [], []
    ended = asyncio.get_running_loop().create_future()

    async def handler(reader, writer):
        def on_data(data: bytes) -> None:
            reads.append(len(data))
            authlink.reads_to_keep_up(reader, writer, data)
            sizes.append(writer.transport.max_size)

        await asyncio.sleep(0.3)  # the whole payload is pending when the reads begin
        await read(reader, on_data)
        ended.set_result(None)
        writer.close()

    async with linked(handler, keys) as (reader, writer):
        writer.write(payload)
        await asyncio.sleep(0.6)
        writer.write(small)
        await asyncio.sleep(0.1)
        writer.close()
        async with asyncio.timeout(10):
            await ended
    assert sum(reads) == len(payload) + len(small) and len(reads) <= 6, reads  # 13 at SOCKET_RECV a recv()
    assert sizes[0] == BEHIND_RECV and sizes[-1] == SOCKET_RECV, sizes


async def test_a_handed_read_runs_in_the_turn_its_bytes_arrive():
    """read_each: what was buffered first, then each chunk inside the transport's own call
    (no second loop turn), the end of the stream ends it, and after it the reader buffers."""
    reader = authlink.LinkReader(loop=asyncio.get_running_loop())
    reader.feed_data(b"early ")
    chunks = []
    reading = asyncio.ensure_future(authlink.read_each(reader, chunks.append))
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

    reader = authlink.LinkReader(loop=loop)
    reading = asyncio.ensure_future(authlink.read_each(reader, refuse))
    await asyncio.sleep(0)
    reader.feed_data(b"bad")
    reader.feed_data(b"ignored: the caller closes")
    with pytest.raises(ValueError, match="bad"):
        await reading
    reader = authlink.LinkReader(loop=loop)
    reading = asyncio.ensure_future(authlink.read_each(reader, refuse))
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
            await authlink.read_each(reader, got.extend)
            ended.set_result("closed")
        except Exception as e:
            ended.set_result(e)
        writer.close()

    async with linked(handler, keys, refused) as (reader, writer):
        writer.write(payload[:1000])
        writer.write(payload[1000:])
        if keys is not None:
            async with asyncio.timeout(10):
                while len(got) < len(payload):
                    await asyncio.sleep(0.01)
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
