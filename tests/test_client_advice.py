"""The client's advice socket (the leader's back-offs and resend requests) on asyncio-dgram: a
flood at it queues nothing in the process beyond what one turn of the loop brings, and changes
nothing but a count (real sockets on loopback, no process)."""

import asyncio
import os
import socket

from conftest import until

from tape.runtime.config import default_toml, load
from tape.sequencer.client_shell import Client

FLOOD = 3_000


async def test_a_flood_at_the_advice_socket_queues_nothing_and_changes_nothing(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(default_toml(tmp_path, free=True))
    client = Client(load(path), "load0")
    await client.start()
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        target = client.sock.getsockname()
        peak = 0
        for i in range(FLOOD):
            attacker.sendto(os.urandom(64), target)
            if i % 100 == 99:  # the kernel holds the rest while the loop turns
                for _ in range(5):
                    await asyncio.sleep(0)
                    peak = max(peak, client.advice._recvq.qsize())  # (asyncio-dgram's queue)
        await until(lambda: sum(client.core.advice_drops.values()) >= FLOOD, "the flood to be read")
        assert sum(client.core.advice_drops.values()) == FLOOD  # each one read, judged and counted
        assert set(client.core.advice_drops) == {"not_a_sequencer"}
        assert client.backoffs == 0 and client.core.pause_left_ns(0) == 0
        assert peak <= 2  # a datagram a readiness event, handed on before the next is awaited
    finally:
        attacker.close()
        await client.close()


async def test_a_closed_client_stops_reading_its_advice(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(default_toml(tmp_path, free=True))
    client = Client(load(path), "load0")
    await client.start()
    await client.close()
    assert client._reading_advice.done() and client.sock.fileno() == -1


async def test_the_advice_socket_listens_on_the_clients_interface_only(tmp_path):
    path = tmp_path / "cluster.toml"
    text = default_toml(tmp_path, free=True)
    path.write_text(text.replace('name = "load0"', 'name = "load0"\ninterface = "127.0.0.5"'))
    client = Client(load(path), "load0")
    await client.start()
    try:
        assert client.sock.getsockname()[0] == "127.0.0.5"  # not 0.0.0.0, nor another loopback address
    finally:
        await client.close()
