"""`tape rewinder`: a follower that keeps the whole log; the asyncio shell around
RewinderNode (rewinder/rewinder_node_core.py), which decides, through the voter shell
(runtime/voter_shell.py), which carries out what every voter does.

- Replication (TCP, tape/voter.py): the leader connects; the rewinder says
  hello with its log position, appends what the leader sends to its journal
  (durably, per the fsync policy) and only then acknowledges. A restarted
  rewinder says where its journal ends and is caught up by the leader from
  there before it acknowledges anything new. It votes in elections (never
  campaigns), and drops an uncommitted suffix that conflicts with a new
  leader's log.
- Gap fill (UDP): answers MoldUDP64 request packets with committed messages.
- Replay (TCP, SoupBinTCP): streams committed messages from any seq, then
  follows the log live, with heartbeats when idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from pathlib import Path

from tape.protocol import soupbintcp as soup
from tape.rewinder.rewinder_node_core import DroppedRequest, ReadGap, ReplayRecords, RewinderNode, SendDatagram
from tape.runtime import links
from tape.runtime.loss import LossInjector
from tape.runtime.process import NodeProcess
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.settings import Config, NodeSettings
from tape.runtime.storage.journal_repair import open_checked
from tape.runtime.tuning import GAP_REQUEST_BUFFER, GAP_REQUEST_DRAIN
from tape.runtime.udp import udp_socket
from tape.runtime.voter_shell import VoterShell

log = logging.getLogger("tape.rewinder")


class Rewinder(NodeProcess):
    METRICS_PREFIX = "tape_rewinder"

    def __init__(self, cfg: Config, node: NodeSettings, drop: float = 0.0, seed: int = 0):
        super().__init__(cfg, node, log)
        self.loss = LossInjector(drop, seed)
        self.badlog = RateLimitedLog(log)
        self.journal, self.voter, self.journal_repaired = open_checked(
            lambda: cfg.open_journal(node), Path(node.data),
            lambda journal: VoterShell(cfg, node, journal, can_lead=False, on_fatal=self.fail,  # votes, never leads
                                  link_refused=self.link_refused, wrap=self._node, on_other=self._carry_out))
        self.node_core: RewinderNode = self.voter.node_core
        self._draining: set[asyncio.Task] = set()

    def _node(self, endpoint) -> RewinderNode:
        # A request for what this rewinder does not yet know committed waits as long as its listener
        # waits for an answer before asking again.
        return RewinderNode(endpoint, self.cfg.session_bytes, self.cfg.max_packet, self.cfg.stream_auth,
                            self.cfg.gap_request_ms * 1_000_000)

    @property
    def commit_seq(self) -> int:
        return self.voter.commit_seq

    def report(self):
        n = self.node_core
        yield "last_seq", "gauge", "highest seq in the journal", self.journal.last_seq
        yield "commit_seq", "gauge", "highest seq known committed", self.commit_seq
        yield "messages_appended", "counter", "messages appended from the leader", self.voter.appended
        yield "gapfill_requests_served", "counter", "gap-fill requests answered", n.gapfill.served
        yield "gapfill_messages_sent", "counter", "messages sent in gap-fill answers", n.gap_messages_sent
        dropped = {**n.gapfill.dropped, "injected_loss": self.loss.dropped}
        yield "dropped_datagrams", "counter", "gap-fill requests dropped, by reason", dropped
        yield "replay_sessions", "counter", "TCP replay sessions accepted", n.replay_sessions
        yield "replay_idle_closed", "counter", "replay sessions closed: the client fell silent", n.replay_idle_closed
        yield "replay_stalled_closed", "counter", "replay sessions closed: the client stopped reading", \
            n.replay_stalled_closed
        yield "replay_messages", "counter", "messages sent over TCP replay", n.replayed
        yield "replay_held_back", "counter", "replay chunks that waited their turn in the replay budget", \
            n.replay_held_back
        yield "bad_frames", "counter", "malformed TCP frames (connection closed)", self.voter.bad_frames
        yield "refused", "counter", "peers' messages that contradict this node's log, by reason", \
            dict(self.voter.refused)
        yield from self.voter.report(self.journal_repaired)
        yield "truncations", "counter", "uncommitted suffixes dropped on a new leader's word", self.voter.truncations

    async def main(self) -> None:
        voters = [v for v in self.cfg.voters if v.name != self.node.name]
        repl = await self.serve_links(self.voter.serve, self.voter.link_keys, self.node.host,
                                      self.node.replication_port, voters)
        replay = await self.serve_links(self._on_replay, self.cfg.replay_served, self.node.host,
                                        self.node.replay_port, self.cfg.by_role("replica"))
        servers = [repl, replay]
        if self.node.soup_port:  # standard SoupBinTCP: TLS, or plain where the operator trusts the network
            servers.append(await self.serve_links(self._on_soup, None, self.node.host, self.node.soup_port,
                                                  tls=self.cfg.soup_tls))
        self.gap_sock, granted = udp_socket(self.node.host, self.node.gapfill_port)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.gap_sock, self._on_gap_requests)
        ticker = self.spawn(self.voter.ticks())  # the node's timer, the drills' flag, the free space
        log.info(
            "%s at seq %d: replication :%d, gap fill :%d (rcvbuf %d), replay :%d, standard SoupBinTCP %s",
            self.node.name,
            self.journal.last_seq,
            self.node.replication_port,
            self.node.gapfill_port,
            granted,
            self.node.replay_port,
            f":{self.node.soup_port} ({'TLS' if self.cfg.soup_tls else 'plain'})" if self.node.soup_port else "off",
        )
        await self.stop.wait()
        ticker.cancel()
        self.voter.close()
        loop.remove_reader(self.gap_sock)
        for server in servers:
            server.close()
        self.journal.close()
        log.info("%s stopped at seq %d", self.node.name, self.journal.last_seq)

    def _carry_out(self, a) -> list:
        """The rewinder node's own actions (the voter shell carries out the rest)."""
        if isinstance(a, SendDatagram):
            try:
                self.gap_sock.sendto(a.data, a.addr)
            except OSError:
                pass  # the listener asks again
        elif isinstance(a, ReadGap):
            messages = [m for _, _, m in self.journal.read_batch(a.first, a.count)]
            return self.node_core.on_gap_read(a, messages, time.monotonic_ns())
        elif isinstance(a, ReplayRecords):
            self._replay(a)
        elif isinstance(a, DroppedRequest):
            self.badlog.warn(a.reason, "dropped gap request from %s: %s", a.addr, a.reason)
        return []

    def _on_gap_requests(self) -> None:
        """Up to GAP_REQUEST_DRAIN requests per wake-up: this process's loop also replicates and
        fsyncs, so one request per iteration (an asyncio-dgram stream) let requests queue behind
        fsyncs: p99 inbound-to-applied 2-3x at 2% loss (docs/decisions.md)."""
        for _ in range(GAP_REQUEST_DRAIN):
            try:
                data, addr = self.gap_sock.recvfrom(GAP_REQUEST_BUFFER)
            except BlockingIOError:
                return
            if not self.loss.drop():
                self.voter.event(None, self.node_core.on_datagram, addr, data)

    async def _on_replay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.voter.adopt(writer)
        self.voter.event(writer, partial(self.node_core.on_replay_connected, peer=links.peer_of(writer)), writer)
        await self.voter.read(writer, reader, writer)

    async def _on_soup(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A standard SoupBinTCP client (the soup_port): its login checked against [replay.users]."""
        self.voter.adopt(writer)
        self.voter.event(writer, partial(self.node_core.on_replay_connected, users=self.cfg.replay_users), writer)
        await self.voter.read(writer, reader, writer)

    def _replay(self, a: ReplayRecords) -> None:
        """Committed messages as SoupBinTCP frames; the next chunk once the client took them."""
        writer = self.voter.writer(a.conn)
        if writer is None:
            return
        records = self.journal.read_batch(a.first, a.count)
        writer.write(b"".join([soup.sequenced(m) for _, _, m in records]))
        task = asyncio.ensure_future(self._drained(a, writer))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drained(self, a: ReplayRecords, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.drain()
        except ConnectionError:
            return  # its close comes through the read
        self.voter.event(a.conn, self.node_core.on_replayed, a)
