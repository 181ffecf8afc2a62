"""The link shell's socket reads: both ends of a link, with keys and without, read at most
SOCKET_RECV bytes a recv() (not asyncio's 256 KiB, each an mmap), and a payload many reads
long still arrives whole."""

import asyncio
import os

import pytest

from tape.node import authlink
from tape.protocol.limits import SOCKET_RECV
from tape.protocol.linkauth import LinkKeys


@pytest.mark.parametrize("keys", [None, LinkKeys([os.urandom(32)])], ids=["plain", "sealed"])
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

    server = await asyncio.start_server(authlink.serving(handler, keys, {}), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await authlink.connect("127.0.0.1", port, keys, {}, timeout=5)
        assert writer.transport.max_size == SOCKET_RECV < 128 << 10
        writer.write(payload)
        async with asyncio.timeout(10):
            assert await got == payload
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
