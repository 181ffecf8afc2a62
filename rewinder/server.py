"""`tape rewinder`: a follower that keeps the whole log.

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
from pathlib import Path

from tape.node.journal_repair import open_checked
from tape.node.process import NodeProcess, within
from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config, Node
from tape.node.transport import LossInjector, udp_socket
from tape.node.voter import Voter
from tape.protocol import soupbintcp as soup
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import (
    CONTROL_READ,
    GAP_REQUEST_BUFFER,
    GAP_REQUEST_DRAIN,
    REPLAY_IDLE_TIMEOUT_S,
    REPLAY_LOGIN_FRAME,
    REPLAY_LOGIN_TIMEOUT_S,
)
from tape.protocol.packets import PacketBuilder
from tape.rewinder import replay
from tape.rewinder.gapfill import Answer, GapFillCore, Refuse

log = logging.getLogger("tape.rewinder")
FLOOD_REASONS = ("rate_limited", "server_busy", "parked_full")  # gap requests refused so: counted, not logged


class Rewinder(NodeProcess):
    METRICS_PREFIX = "tape_rewinder"

    def __init__(self, cfg: Config, node: Node, drop: float = 0.0, seed: int = 0):
        super().__init__(cfg, node, log)
        self.loss = LossInjector(drop, seed)
        self.badlog = RateLimitedLog(log)
        self.journal, self.voter, self.journal_repaired = open_checked(
            lambda: cfg.open_journal(node), Path(node.data),
            lambda journal: Voter(cfg, node, journal, can_lead=False, on_fatal=self.fail,
                                  link_refused=self.link_refused, on_commit=self._answer_parked))  # votes, never leads
        # A request for what this rewinder does not yet know committed waits as long as its listener
        # waits for an answer before asking again.
        self.gapfill = GapFillCore(cfg.session_bytes, cfg.max_packet, cfg.stream_auth,
                                   park_s=cfg.gap_request_ms / 1000)
        self.sealed = bool(cfg.stream_keys)  # the log's packets are sealed ranges
        self.replay_sessions = 0
        self.replay_idle_closed = 0
        self.replayed = 0
        self.gap_messages_sent = 0
        self.bad_frames = 0

    @property
    def commit_seq(self) -> int:
        return self.voter.commit_seq

    def report(self):
        yield "last_seq", "gauge", "highest seq in the journal", self.journal.last_seq
        yield "commit_seq", "gauge", "highest seq known committed", self.commit_seq
        yield "messages_appended", "counter", "messages appended from the leader", self.voter.appended
        yield "gapfill_requests_served", "counter", "gap-fill requests answered", self.gapfill.served
        yield "gapfill_messages_sent", "counter", "messages sent in gap-fill answers", self.gap_messages_sent
        dropped = {**self.gapfill.dropped, "injected_loss": self.loss.dropped}
        yield "dropped_datagrams", "counter", "gap-fill requests dropped, by reason", dropped
        yield "replay_sessions", "counter", "TCP replay sessions accepted", self.replay_sessions
        yield "replay_idle_closed", "counter", "replay sessions closed: the client fell silent", \
            self.replay_idle_closed
        yield "replay_messages", "counter", "messages sent over TCP replay", self.replayed
        bad = self.bad_frames + self.voter.bad_frames
        yield "bad_frames", "counter", "malformed TCP frames (connection closed)", bad
        yield "refused", "counter", "peers' messages that contradict this node's log, by reason", \
            dict(self.voter.refused)
        yield from self.voter.report(self.journal_repaired)
        yield "truncations", "counter", "uncommitted suffixes dropped on a new leader's word", self.voter.truncations

    async def main(self) -> None:
        repl = await self.serve_links(self.voter.serve, self.cfg.cluster_link, self.node.host,
                                      self.node.replication_port)
        replay = await self.serve_links(self._on_replay, self.cfg.replay_link, self.node.host,
                                        self.node.replay_port)
        self.gap_sock, granted = udp_socket(self.node.host, self.node.gapfill_port)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.gap_sock, self._on_gap_requests)
        ticker = self.spawn(self.voter.ticks())  # (a rewinder never campaigns: the flag and the free space)
        log.info(
            "%s at seq %d: replication :%d, gap fill :%d (rcvbuf %d), replay :%d",
            self.node.name,
            self.journal.last_seq,
            self.node.replication_port,
            self.node.gapfill_port,
            granted,
            self.node.replay_port,
        )
        await self.stop.wait()
        ticker.cancel()
        self.voter.close()
        loop.remove_reader(self.gap_sock)
        repl.close()
        replay.close()
        self.journal.close()
        log.info("%s stopped at seq %d", self.node.name, self.journal.last_seq)

    # --- gap fill ----------------------------------------------------------------------

    def _on_gap_requests(self) -> None:
        """Up to GAP_REQUEST_DRAIN requests per wake-up: this process's loop also replicates and
        fsyncs, so one request per iteration (an asyncio-dgram stream) let requests queue behind
        fsyncs: p99 inbound-to-applied 2-3x at 2% loss (docs/decisions.md)."""
        for _ in range(GAP_REQUEST_DRAIN):
            try:
                data, addr = self.gap_sock.recvfrom(GAP_REQUEST_BUFFER)
            except BlockingIOError:
                return
            if self.loss.drop():
                continue
            action = self.gapfill.on_request(data, addr, time.monotonic(), self.commit_seq)
            if isinstance(action, Answer):
                self._send(action, addr)
            elif isinstance(action, Refuse) and action.reason not in FLOOD_REASONS:
                self.badlog.warn(action.reason, "dropped gap request from %s: %s", addr, action.reason)

    def _answer_parked(self) -> None:
        """The commit point moved: answer what waited for it once the append's acknowledgement is
        out (the leader's commit waits for that, a listener's gap a little longer)."""
        if self.gapfill.parked:
            asyncio.get_running_loop().call_soon(self._send_due)

    def _send_due(self) -> None:
        for answer, addr in self.gapfill.due(self.commit_seq, time.monotonic()):
            self._send(answer, addr)

    def _send(self, answer: Answer, addr) -> None:
        first, msgs = self.gapfill.entries(answer, self._read, self.sealed, self.commit_seq)
        self.gap_messages_sent += len(msgs)
        for pkt in PacketBuilder(self.cfg.session_bytes, first, self.cfg.max_packet).add_sequenced(msgs):
            try:
                self.gap_sock.sendto(pkt, addr)
            except OSError:
                pass  # the listener asks again

    def _read(self, first: int, count: int) -> list[bytes]:
        return [m for _, _, m in self.journal.read_batch(first, count)]

    # --- replay --------------------------------------------------------------------------

    async def _on_replay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = soup.FrameDecoder(max_frame=REPLAY_LOGIN_FRAME)
        try:
            login = None
            while login is None:
                data = await within(reader.read(CONTROL_READ), REPLAY_LOGIN_TIMEOUT_S)
                if not data:
                    return
                for kind, payload in frames.feed(data):
                    if kind == soup.LOGIN:
                        login = replay.on_login(payload, self.cfg.session_bytes, self.commit_seq)
            if isinstance(login, replay.Reject):
                writer.write(soup.login_rejected(login.reason))
                await writer.drain()
                return
            seq = login.seq
            writer.write(soup.login_accepted(self.cfg.session_bytes, seq))
            self.replay_sessions += 1
            client = self.spawn(self._replay_client_frames(reader, frames))
            while not client.done():
                chunk = replay.next_chunk(seq, self.commit_seq)
                if chunk is not None:
                    records = self.journal.read_batch(*chunk)
                    writer.write(b"".join(soup.sequenced(m) for _, _, m in records))
                    seq += len(records)
                    self.replayed += len(records)
                    await writer.drain()
                    continue
                try:
                    await within(self._wait_commit(), 1.0)
                except asyncio.TimeoutError:
                    writer.write(soup.heartbeat())
                    await writer.drain()
            client.cancel()
        except (asyncio.TimeoutError, ConnectionError, asyncio.CancelledError):
            pass
        except ProtocolError as e:
            self.bad_frames += 1
            self.badlog.warn("replay", "bad replay frame, closing: %s", e)
        finally:
            writer.close()

    async def _wait_commit(self) -> None:
        await self.voter.committed.wait()

    async def _replay_client_frames(self, reader, frames) -> None:
        """Read the client's side until it logs out, goes away, falls silent or breaks the framing."""
        try:
            while True:
                data = await within(reader.read(CONTROL_READ), REPLAY_IDLE_TIMEOUT_S)
                if not data:
                    return
                for kind, _ in frames.feed(data):
                    if kind == soup.LOGOUT:
                        return
        except ProtocolError as e:
            self.bad_frames += 1
            self.badlog.warn("replay", "bad replay frame, closing: %s", e)
        except asyncio.TimeoutError:
            self.replay_idle_closed += 1
        except ConnectionError:
            pass

