"""Every process runs on uvloop (node/process.py `run_async`), the tests' in-process shells on
asyncio's own loop: what the shells do with a link must hold on both."""

import asyncio
import contextlib

import pytest
import uvloop

from tape.node import authlink
from tape.node.process import run_async
from tape.protocol.linkauth import LinkKeys

KEYS = LinkKeys([b"k" * 32])
LOOPS = {"asyncio": asyncio.run, "uvloop": run_async}


def test_processes_run_on_uvloop():
    async def loop_type():
        return type(asyncio.get_running_loop())

    assert run_async(loop_type()) is uvloop.Loop


@pytest.mark.parametrize("keys", [None, KEYS], ids=["plain", "sealed"])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_write_to_a_link_that_closed_is_dropped(loop, keys):
    """A link can close under a write: its peer gone, or another task closing it (a leader's commit
    notice to a follower it just lost). asyncio drops such a write; uvloop raises, which would stop
    the process. The link writer drops it on either loop."""
    async def scenario():
        peer_gone = asyncio.Event()

        async def hang_up(reader, writer):
            writer.close()
            peer_gone.set()

        refused = {}
        server = await asyncio.start_server(authlink.serving(hang_up, keys, refused), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await authlink.connect("127.0.0.1", port, keys, refused, 2.0)
        await peer_gone.wait()
        assert await reader.read(100) == b""  # the peer's close has arrived
        for _ in range(3):
            writer.write(b"commit notice")
            await asyncio.sleep(0.01)
        writer.close()  # and a task closing the link itself
        writer.write(b"commit notice")
        with contextlib.suppress(ConnectionError):  # asyncio reports the broken pipe here
            await writer.wait_closed()
        server.close()
        await server.wait_closed()
        return refused

    assert LOOPS[loop](scenario()) == {}
