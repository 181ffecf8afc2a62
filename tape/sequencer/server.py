"""`tape sequencer`: the asyncio shell around LeaderCore.

Inbound batches arrive on a UDP socket and are drained in one go per wake-up
(natural batching under load); each drain is stamped into one batch, written
to the journal with one append, sent to every live follower in one frame,
and published once a majority holds it. A follower that is behind (new,
restarted, slow) is caught up from this journal before it gets live batches.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from dataclasses import dataclass, field

from tape.gctune import tune_gc
from tape.ops import metrics
from tape.ops.config import Config, Node
from tape.ops.ratelog import RateLimitedLog
from tape.protocol import replication as rep
from tape.protocol.errors import ProtocolError
from tape.sequencer.core import Batch, LeaderCore, rebuild_client_state
from tape.transport import LossInjector, multicast_sender, udp_socket

log = logging.getLogger("tape.sequencer")
CATCHUP_CHUNK = 2000
MAX_LIVE_BUFFER = 32 << 20  # a follower whose socket buffer exceeds this is caught up from the journal


@dataclass
class Link:
    node: Node
    writer: asyncio.StreamWriter
    next_seq: int
    live: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Sequencer:
    def __init__(self, cfg: Config, node: Node, drop: float = 0.0, seed: int = 0):
        self.cfg = cfg
        self.node = node
        self.loss = LossInjector(drop, seed)
        self.badlog = RateLimitedLog(log)
        self.journal = cfg.open_journal(node)
        client_last, last_seq, last_term = rebuild_client_state(self.journal.read())
        followers = [n for n in cfg.voters if n is not node]
        self.core = LeaderCore(
            cfg.session_bytes, node.wire_name, last_term + 1, [f.wire_name for f in followers],
            {c.name.encode().ljust(10): c.key for c in cfg.clients},
            last_seq=last_seq, last_term=last_term, client_last=client_last, max_packet=cfg.max_packet,
            tick_ns=cfg.tick_ms * 1_000_000, heartbeat_ns=cfg.heartbeat_ms * 1_000_000)
        self.followers = followers
        self.links: dict[bytes, Link] = {}
        self.inbound_datagrams = 0
        self.inbound_bytes = 0
        self.send_errors = 0
        self.stepped_down = False
        self._commit_sent = -1
        self._stop = asyncio.Event()

    # --- metrics -----------------------------------------------------------------

    def report(self):
        c = self.core
        yield "inbound_datagrams", "counter", "inbound datagrams received", self.inbound_datagrams
        yield "inbound_bytes", "counter", "inbound bytes received", self.inbound_bytes
        yield "messages_accepted", "counter", "client messages accepted for sequencing", c.accepted
        yield "dropped_datagrams", "counter", "inbound datagrams dropped, by reason", {**c.dropped, "injected_loss": self.loss.dropped}
        yield "sequenced_seq", "gauge", "highest seq stamped", c.last_seq
        yield "commit_seq", "gauge", "highest seq held by a majority", c.commit_seq
        yield "commit_lag", "gauge", "messages stamped but not yet committed", c.last_seq - c.commit_seq
        yield "packets_published", "counter", "packets published on the public stream", c.published_packets
        yield "messages_published", "counter", "messages published on the public stream", c.published_messages
        yield "publish_errors", "counter", "packets the socket refused", self.send_errors
        yield "journal_fsyncs", "counter", "journal fsync calls", self.journal.fsyncs
        yield "journal_fsync_seconds", "counter", "time spent in journal fsync", self.journal.fsync_seconds
        yield "term", "gauge", "current term", c.term
        yield "follower_match_seq", "gauge", "highest seq each follower holds", {k.decode().strip(): v for k, v in c.match.items()}, "follower"

    # --- running -------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        metrics.serve(self.node.metrics_port, "tape_sequencer", self.node.name, self.report, self.node.host)
        self.inbound, granted = udp_socket(self.node.host, self.node.inbound_port)
        self.publisher = multicast_sender(self.cfg.interface)
        self.publisher.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.dest = (self.cfg.group, self.cfg.port)
        log.info("%s leading term %d from seq %d; inbound %s:%d (rcvbuf %d), publishing %s:%d, %d followers",
                 self.node.name, self.core.term, self.core.last_seq + 1, self.node.host, self.node.inbound_port,
                 granted, *self.dest, len(self.followers))
        tasks = [asyncio.create_task(self._follower_link(f)) for f in self.followers]
        tasks.append(asyncio.create_task(self._timer()))
        self._process(self.core.start_term(time.time_ns()))
        loop.add_reader(self.inbound, self._on_inbound)
        await self._stop.wait()
        loop.remove_reader(self.inbound)
        await self._shutdown(tasks)

    async def _shutdown(self, tasks) -> None:
        batch = self.core.flush(time.time_ns())
        if batch:
            self._process(batch)
        deadline = time.monotonic() + 1.0
        while self.core.commit_seq < self.core.last_seq and time.monotonic() < deadline and not self.stepped_down:
            await asyncio.sleep(0.01)
        if not self.stepped_down:
            self._publish([self.core.end_of_session()])
        for t in tasks:
            t.cancel()
        self.journal.close()
        log.info("%s stopped at seq %d, committed %d", self.node.name, self.core.last_seq, self.core.commit_seq)

    def _on_inbound(self) -> None:
        core, sock, loss = self.core, self.inbound, self.loss
        now = time.time_ns()
        for _ in range(512):
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                break
            self.inbound_datagrams += 1
            self.inbound_bytes += len(data)
            if loss.drop():
                continue
            reason = core.on_inbound(data, now)
            if reason is not None and reason != "duplicate":
                self.badlog.warn(reason, "dropped inbound datagram of %d bytes: %s", len(data), reason)
        batch = core.flush(now)
        if batch is not None:
            self._process(batch)

    def _process(self, batch: Batch) -> None:
        """Replicate to live followers, journal, publish what commits.
        Followers get the batch before the leader's own fsync (as Raft
        allows), so the two disk writes overlap instead of adding up."""
        frame = None
        for link in self.links.values():
            if link.live and link.next_seq == batch.first_seq:
                if frame is None:
                    frame = rep.encode_append(self.core.term, self.node.wire_name, batch.prev_seq, batch.prev_term,
                                              self.core.commit_seq, batch.term, batch.messages)
                link.writer.write(frame)
                link.next_seq = batch.last_seq + 1
                if link.writer.transport.get_write_buffer_size() > MAX_LIVE_BUFFER:
                    link.live = False
                    link.wake.set()
            elif link.live:
                link.live = False
                link.wake.set()
        self.journal.append(batch.records())
        self._publish(self.core.on_journaled(batch.last_seq))

    def _publish(self, packets: list[bytes]) -> None:
        if not packets:
            return
        msgs = 0
        for pkt in packets:
            try:
                self.publisher.sendto(pkt, self.dest)
            except (BlockingIOError, OSError):
                self.send_errors += 1  # listeners will fill the gap from the rewinders
            count = int.from_bytes(pkt[18:20], "big")
            msgs += count if count != 0xFFFF else 0
        self.core.note_published(len(packets), msgs, time.time_ns())

    async def _timer(self) -> None:
        period = 0.005
        last_commit_beat = 0.0
        while True:
            await asyncio.sleep(period)
            batch, heartbeat = self.core.on_timer(time.time_ns())
            if batch is not None:
                self._process(batch)
            if heartbeat is not None:
                self._publish([heartbeat])
            now = time.monotonic()
            if self.core.commit_seq != self._commit_sent or now - last_commit_beat > 0.1:
                self._send_commit()
                last_commit_beat = now
            self.journal.maybe_sync()  # the "every N ms" policy while idle

    def _send_commit(self) -> None:
        """Empty appends: the followers learn the commit point (to serve gap fills)."""
        self._commit_sent = self.core.commit_seq
        for link in self.links.values():
            if link.live:
                link.writer.write(rep.encode_append(self.core.term, self.node.wire_name, self.core.last_seq,
                                                    self.core.last_term, self.core.commit_seq, self.core.term, []))

    # --- followers -------------------------------------------------------------------

    async def _follower_link(self, f: Node) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(f.host, f.replication_port)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            link = None
            sender = None
            try:
                frames = rep.FrameReader()
                hello = None
                while hello is None:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed before hello")
                    for fr in frames.feed(data):
                        if isinstance(fr, rep.Hello):
                            hello = fr
                if hello.term > self.core.term:
                    self._step_down(f"{f.name} is in term {hello.term}")
                    return
                link = Link(f, writer, min(hello.last_seq, self.core.last_seq) + 1)
                self.links[f.wire_name] = link
                log.info("follower %s connected at seq %d", f.name, hello.last_seq)
                sender = asyncio.create_task(self._feed(link))
                while True:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed")
                    for fr in frames.feed(data):
                        if isinstance(fr, rep.Ack):
                            self._on_ack(link, fr)
            except (ConnectionError, OSError, ProtocolError) as e:
                log.warning("follower %s link lost: %s", f.name, e)
            finally:
                if sender:
                    sender.cancel()
                if link and self.links.get(f.wire_name) is link:
                    del self.links[f.wire_name]
                writer.close()
            await asyncio.sleep(0.1)

    def _on_ack(self, link: Link, ack: rep.Ack) -> None:
        packets = self.core.on_ack(link.node.wire_name, ack.term, ack.success, ack.last_seq)
        if packets is None:
            self._step_down(f"{link.node.name} acked in term {ack.term}")
            return
        if not ack.success:
            link.next_seq = min(link.next_seq, ack.last_seq + 1)
            link.live = False
            link.wake.set()
        self._publish(packets)

    def _step_down(self, why: str) -> None:
        log.error("stepping down: %s (this is term %d)", why, self.core.term)
        self.stepped_down = True
        self._stop.set()

    async def _feed(self, link: Link) -> None:
        """Catch a follower up from the journal, then let it go live."""
        while True:
            while link.next_seq <= self.core.last_seq:
                records = self.journal.read_batch(link.next_seq, CATCHUP_CHUNK)
                if not records:
                    break
                prev = link.next_seq - 1
                prev_term = self._term_at(prev)
                # One append per run of equal terms.
                start = 0
                while start < len(records):
                    term = records[start][1]
                    end = start
                    while end < len(records) and records[end][1] == term:
                        end += 1
                    chunk = [m for _, _, m in records[start:end]]
                    link.writer.write(rep.encode_append(self.core.term, self.node.wire_name, prev, prev_term,
                                                        self.core.commit_seq, term, chunk))
                    prev, prev_term = records[end - 1][0], term
                    start = end
                link.next_seq = prev + 1
                await link.writer.drain()
            link.live = True
            link.wake.clear()
            await link.wake.wait()

    def _term_at(self, seq: int) -> int:
        if seq == 0:
            return 0
        for s, term, _ in self.journal.read(seq, seq):
            return term
        raise RuntimeError(f"journal has no seq {seq}")


def run(cfg: Config, node_name: str, drop: float = 0.0, seed: int = 0) -> int:
    node = cfg.node(node_name)
    if node.role != "sequencer":
        raise SystemExit(f"node {node_name} is a {node.role}, not a sequencer")
    tune_gc()
    seq = Sequencer(cfg, node, drop, seed)
    asyncio.run(seq.run())
    return 3 if seq.stepped_down else 0
