"""The leader's event loop (sequencer/sequencer_shell.py around sequencer/sequencer_node_core.py): what it does in which
turn. A real Sequencer, leading alone with its real journal, reading a real client's signed batch
from a real socket."""

import asyncio
import contextlib
import dataclasses
import select
import socket

from conftest import until

from tape.ops.verification.local import LocalCluster
from tape.ops.verification.tradegen import TradeGenerator
from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol.election import LEADER, Lead
from tape.runtime.udp import multicast_sender
from tape.sequencer.client_core import ClientCore
from tape.sequencer.sequencer_shell import Sequencer


@contextlib.contextmanager
def leading(leader: Sequencer, cfg):
    """The leader leading term 1 alone (its term's first entries journaled; its followers never
    answer) with a real inbound socket and publisher, inside a running event loop."""
    leader.inbound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    leader.inbound.bind(("127.0.0.1", 0))
    leader.inbound.setblocking(False)
    leader.publisher, leader.dest = multicast_sender("127.0.0.1"), (cfg.group, cfg.port)
    election = leader.voter.election
    election.term, election.role = 1, LEADER  # (won: the followers it dials are not running)
    leader.voter.act(leader.seq_node._after([Lead(1)]))
    try:
        yield
    finally:
        leader.voter.close()
        leader.inbound.close()
        leader.publisher.close()


def test_acknowledgements_ready_with_the_inbound_run_before_the_batchs_fsync(tmp_path):
    """Followers' acknowledgements that arrive while the leader's last fsync holds the loop are
    readable in the same turn as the inbound socket (readable first): they must commit and
    publish before the next batch's own fsync holds the loop again."""
    cluster = LocalCluster(tmp_path)  # a config with free ports; no node is started
    cfg = cluster.cfg
    leader = Sequencer(cfg, cfg.node("seq-a"))
    client = cfg.clients[0]
    batch = ClientCore(moldudp64.session_bytes(client.name), client.key, cfg.max_packet, 10**12).submit(
        TradeGenerator(seed=1).take(5), 0)[0]

    async def one_turn() -> list[int]:
        loop = asyncio.get_running_loop()
        with leading(leader, cfg):
            started = leader.journal.last_seq
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
                sender.sendto(batch, leader.inbound.getsockname())
            assert select.select([leader.inbound], [], [], 5)[0], "the batch never arrived"
            seen = []
            loop.call_soon(leader._on_inbound)  # the inbound socket's callback, first in the turn
            loop.call_soon(lambda: seen.append(leader.journal.last_seq))  # an acknowledgement's, after it
            for _ in range(3):
                await asyncio.sleep(0)
            return [started, *seen, leader.journal.last_seq]

    try:
        started, during, after = asyncio.run(one_turn())
    finally:
        leader.journal.close()
        cluster.close()
    assert during == started and after >= started + 5  # the batch's five trades only after it


def test_after_a_large_batch_the_next_waits_for_the_batch_interval(tmp_path):
    """Pacing in the real leader: a batch of `pace_from` messages or more (here 5, so that a batch
    is one datagram, in the socket whole once select says so) makes the next one wait until
    `stream.batch_interval_ms` after it (what arrives meanwhile joins it); the turns in between
    read and journal nothing."""
    cluster = LocalCluster(tmp_path)
    cfg = cluster.cfg
    cfg.batch_interval_ms = 1000  # (far longer than the turns between the two batches, on any machine)
    leader = Sequencer(cfg, cfg.node("seq-a"))
    leader.seq_node.settings = dataclasses.replace(leader.seq_node.settings, pace_from=5)
    client = cfg.clients[0]
    submitter = ClientCore(moldudp64.session_bytes(client.name), client.key, cfg.max_packet, 10**12)
    trades = TradeGenerator(seed=2).take(15)
    large, small = submitter.submit(trades[:5], 0), submitter.submit(trades[5:], 0)
    assert len(large) == len(small) == 1

    async def send_and_drain(sock, datagrams) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(datagrams[0], sock.getsockname())
        assert select.select([sock], [], [], 5)[0], "the batch never arrived"
        leader._on_inbound()
        for _ in range(3):
            await asyncio.sleep(0)

    async def run() -> list[int]:
        with leading(leader, cfg):
            started = leader.journal.last_seq
            await send_and_drain(leader.inbound, large)  # after the term start (small): at once
            after_large = leader.journal.last_seq
            await send_and_drain(leader.inbound, small)
            held = leader.journal.last_seq
            await until(lambda: leader.journal.last_seq >= after_large + 10, "the held batch to be stamped")
            return [started, after_large, held, leader.journal.last_seq]

    try:
        started, after_large, held, done = asyncio.run(run())
        stamps = {seq: M.SEQUENCED.unpack(raw)[M.STAMP] for seq, _, raw in leader.journal.read(after_large, done)}
    finally:
        leader.journal.close()
        cluster.close()
    assert after_large >= started + 5  # (and a seal ending each packet's worth)
    assert held == after_large  # held back, then stamped
    assert stamps[done] - stamps[after_large] >= 1_000_000_000  # (a lower bound the pacing guarantees)
