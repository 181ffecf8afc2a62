"""`tape sequencer`: a voter that can lead; the asyncio shell around
VoterCore (through node/voter.py), LeaderCore and FollowerLinks.

Every sequencer starts as a follower: it serves its replication port (appends
from the leader, vote requests) like a rewinder, and drops inbound batches.
When its election timer fires it campaigns (pre-vote, then vote); elected,
it leads: inbound batches are drained in one go per wake-up (natural
batching under load), each drain is stamped into batches of at most
MAX_BATCH_MESSAGES, each written to the journal with one append, sent to
every live follower in one frame, and published once a majority holds it.
A follower that is behind (new, restarted, slow) is caught up from this
journal before it gets live batches.
A leader that sees a higher term, or has not heard a majority for the
election timeout, steps down at once and follows again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tape.node import authlink
from tape.node.batchio import send_datagrams
from tape.node.diskspace import DiskFull
from tape.node.journal_repair import open_checked
from tape.node.latency import LatencyHistogram, LatencySamples
from tape.node.process import NodeProcess, within
from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config, Node
from tape.node.transport import LossInjector, multicast_sender, udp_socket
from tape.node.voter import Voter
from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol.election import ElectionAction, Lead, RequestVotes, StepDown
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import (
    COMMIT_BEAT_AFTER_NS,
    CONTROL_READ,
    DATAGRAM_BUFFER,
    DRAIN_DATAGRAMS,
    MAX_BATCH_MESSAGES,
    OVERLOAD_NS,
)
from tape.protocol.packets import messages_per_packet
from tape.sequencer.core import Batch, LeaderCore
from tape.sequencer.followers import FollowerLinks

log = logging.getLogger("tape.sequencer")
EOS_REPEATS = 5  # end-of-session packets published at shutdown, 20 ms apart
END_COMMIT_WAIT_S = 5.0  # at shutdown, how long the session's end may take to commit (a loaded host is slow)
TIMER_FLOOR_S = 0.001  # the leader's timer waits at least this long between runs


@dataclass
class Link:
    """A connection to a follower; what to send on it is FollowerLinks' decision."""

    node: Node
    writer: asyncio.StreamWriter
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # its catch-up has work


class Sequencer(NodeProcess):
    METRICS_PREFIX = "tape_sequencer"

    def __init__(self, cfg: Config, node: Node, drop: float = 0.0, seed: int = 0):
        super().__init__(cfg, node, log)
        self.loss = LossInjector(drop, seed)
        self.badlog = RateLimitedLog(log)
        self.journal, self.voter, self.journal_repaired = open_checked(
            lambda: cfg.open_journal(node), Path(node.data),
            lambda journal: Voter(cfg, node, journal, can_lead=True, on_action=self._on_election, on_fatal=self.fail,
                                  on_partition=self._partition, link_refused=self.link_refused))
        self.followers = [n for n in cfg.voters if n is not node]
        self.core: LeaderCore | None = None  # while leading
        self.followers_core: FollowerLinks | None = None  # while leading
        self.links: dict[bytes, Link] = {}
        self._held: list[asyncio.StreamWriter] = []  # links a partition keeps from closing
        self._leader_tasks: list[asyncio.Task] = []
        self.inbound_datagrams = 0
        self.inbound_bytes = 0
        self.not_leader_drops = 0
        self.send_errors = 0
        self.step_downs: dict[str, int] = {}
        self.terms_led = 0
        self.published_seq = 0  # highest seq this process ever published, in any term
        self.published_terms: dict[int, list[int]] = {}  # term -> [first, last] seq this process published
        self._stamped: deque[tuple[int, int, int]] = deque()  # (last seq, stamped ns, messages) of unpublished batches
        self.commit_latency = LatencySamples()  # stamped to published, one weighted sample a batch
        self.commit_histogram = LatencyHistogram()
        self._timer_woken: asyncio.Future | None = None  # the leader's timer, while it waits longer than a beat
        self._flush_due = False  # a batch's flush is scheduled for after this turn's other callbacks
        self._last = {"published": 0, "accepted": 0, "packets": 0, "backoffs": 0, "resends_asked": 0, "dropped": {}}

    # --- metrics -----------------------------------------------------------------

    def report(self):
        c = self.core
        e = self.voter.election
        yield "inbound_datagrams", "counter", "inbound datagrams received", self.inbound_datagrams
        yield "inbound_bytes", "counter", "inbound bytes received", self.inbound_bytes
        yield "messages_accepted", "counter", "client messages accepted for sequencing", \
            self._last["accepted"] + (c.accepted if c else 0)
        dropped = dict(self._last["dropped"])
        for k, v in (c.dropped.items() if c else ()):
            dropped[k] = dropped.get(k, 0) + v
        yield "dropped_datagrams", "counter", "inbound datagrams dropped, by reason", \
            {**dropped, "injected_loss": self.loss.dropped, "not_leader": self.not_leader_drops}
        yield "overloaded", "gauge", f"1 while no drain emptied the inbound socket for {OVERLOAD_NS // 10**6} ms", \
            1 if c and c.overloaded(time.time_ns()) else 0
        yield "backoffs_sent", "counter", "back-offs sent to clients while overloaded", \
            self._last["backoffs"] + (c.backoffs_sent if c else 0)
        yield "resends_asked", "counter", "clients asked to resend a batch that batches after it overtook", \
            self._last["resends_asked"] + (c.resends_asked if c else 0)
        yield "sequenced_seq", "gauge", "highest seq in this node's log", self.journal.last_seq
        commit = c.commit_seq if c else self.voter.commit_seq
        yield "commit_seq", "gauge", "highest seq known held by a majority", commit
        yield "commit_lag", "gauge", "messages stamped but not yet committed", c.last_seq - c.commit_seq if c else 0
        yield "packets_published", "counter", "packets published on the public stream", \
            self._last["packets"] + (c.published_packets if c else 0)
        yield "messages_published", "counter", "messages published on the public stream", \
            self._last["published"] + (c.published_messages if c else 0)
        yield "publish_errors", "counter", "packets the socket refused", self.send_errors
        yield "published_seq", "gauge", "highest seq this process published, in any term", self.published_seq
        terms = sorted(self.published_terms.items())
        yield "published_first_seq", "gauge", "first seq this process published, by term", \
            {t: span[0] for t, span in terms}, "term"
        yield "published_last_seq", "gauge", "last seq this process published, by term", \
            {t: span[1] for t, span in terms}, "term"
        yield from self.voter.report(self.journal_repaired)
        yield "leader", "gauge", "1 while this node leads", 1 if c else 0
        yield "elections", "counter", "elections this node started (after a won pre-vote)", e.elections
        yield "leader_changes", "counter", "times the leader this node knows changed", e.leader_changes
        yield "terms_led", "counter", "terms this node led", self.terms_led
        yield "step_downs", "counter", "times this node stopped leading, by reason", self.step_downs
        yield "refused", "counter", "peers' messages that contradict this node's log, by reason", \
            dict(self.voter.refused)
        yield "commit_seconds", "histogram", "a batch stamped to published (a majority journaled it), one " \
            "sample a batch", self.commit_histogram
        if c:
            yield "follower_match_seq", "gauge", "highest seq each follower holds", \
                {k.decode().strip(): v for k, v in c.match.items()}, "follower"

    # --- running -------------------------------------------------------------------

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        self.inbound, granted = udp_socket(self.node.host, self.node.inbound_port)
        self.publisher = multicast_sender(self.cfg.interface_of(self.node))
        self.publisher.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.dest = (self.cfg.group, self.cfg.port)
        server = await self.serve_links(self.voter.serve, self.cfg.cluster_link, self.node.host,
                                        self.node.replication_port)
        log.info("%s at seq %d, term %d; replication :%d, inbound %s:%d (rcvbuf %d), publishing %s:%d; %d voters",
                 self.node.name, self.journal.last_seq, self.voter.election.term, self.node.replication_port,
                 self.node.host, self.node.inbound_port, granted, *self.dest, len(self.cfg.voters))
        ticker = self.spawn(self.voter.ticks())
        loop.add_reader(self.inbound, self._on_inbound)
        await self.stop.wait()
        loop.remove_reader(self.inbound)
        ticker.cancel()
        self.voter.close()
        server.close()
        await self._shutdown()

    def _on_election(self, action: ElectionAction) -> None:
        if isinstance(action, RequestVotes):
            log.info("%s: %s for term %d at seq %d (term %d)", self.node.name,
                     "pre-vote" if action.pre else "campaigning", action.term, action.last_seq, action.last_term)
        elif isinstance(action, Lead):
            self._lead(action.term)
        elif isinstance(action, StepDown):
            self._follow(action.reason)

    def _partition(self, cut: bool) -> None:
        """Fault injection: black-hole the links to the followers (no reads,
        no writes, no close: a cut network sends no FIN) until healed."""
        if self.followers_core is not None:
            self.followers_core.cut()
        for link in self.links.values():
            if cut:
                link.writer.transport.pause_reading()
            else:
                link.writer.transport.resume_reading()
                link.wake.set()  # catch up what was not sent
        if not cut:
            for writer in self._held:
                writer.close()
            self._held = []

    def _lead(self, term: int) -> None:
        j = self.journal
        last = next(j.read(j.last_seq), None) if j.last_seq else None
        keys, open_from = self.cfg.stream_auth, self.voter.core.open_range()
        open_range = None
        if keys is not None and open_from is not None:  # read at most a packet's worth: more is refused
            per_packet = messages_per_packet(self.cfg.max_packet)
            open_range = (open_from, [m for _, _, m in j.read_batch(open_from, per_packet)])
        self.core = LeaderCore(
            self.cfg.session_bytes, self.node.wire_name, term, [f.wire_name for f in self.followers],
            {c.name.encode().ljust(10): c.key for c in self.cfg.clients},
            last_seq=j.last_seq, last_term=j.last_term, client_last=dict(self.voter.log.client_last),
            max_packet=self.cfg.max_packet, tick_ns=self.cfg.tick_ms * 1_000_000,
            heartbeat_ns=self.cfg.heartbeat_ms * 1_000_000, batch_interval_ns=self.cfg.batch_interval_ms * 1_000_000,
            last_stamp_ns=M.SEQUENCED.unpack(last[2])[M.STAMP] if last else 0, stream_keys=keys,
            open_range=open_range)
        self.followers_core = FollowerLinks(self.cfg.leader_heartbeat_ms * 1_000_000)
        self.terms_led += 1
        log.warning("%s leading term %d from seq %d", self.node.name, term, j.last_seq + 1)
        self._leader_tasks = [t for t in self._leader_tasks if not t.done()]
        self._leader_tasks += [self.spawn(self._follower_link(f)) for f in self.followers]
        self._leader_tasks.append(self.spawn(self._timer()))
        self._process(self.core.start_term(time.time_ns()))

    def _follow(self, reason: str) -> None:
        c = self.core
        if c is None:
            return  # a candidate giving up: nothing to undo
        log.error("%s stepping down from term %d: %s", self.node.name, c.term, reason)
        key = reason.split(":")[0].split(" (")[0] if "check-quorum" not in reason else "lost_majority"
        key = "higher_term" if "term" in key else key
        self.step_downs[key] = self.step_downs.get(key, 0) + 1
        self.core = None
        for t in self._leader_tasks:
            t.cancel()
        self._leader_tasks = []
        for link in self.links.values():
            if not self.voter.partitioned:
                link.writer.close()  # (a partition holds them open until it heals)
        self.links = {}
        self.followers_core = None
        self._stamped.clear()  # what it did not publish, the next leader may
        self._last["accepted"] += c.accepted
        self._last["published"] += c.published_messages
        self._last["packets"] += c.published_packets
        self._last["backoffs"] += c.backoffs_sent
        self._last["resends_asked"] += c.resends_asked
        for k, v in c.dropped.items():
            self._last["dropped"][k] = self._last["dropped"].get(k, 0) + v
        self.voter.resync(c.commit_seq, c.sequenced_client_last())

    async def _shutdown(self) -> None:
        c = self.core
        if c is not None:
            self._process(c.end_session(time.time_ns()))
            deadline = time.monotonic() + END_COMMIT_WAIT_S
            while self.core is c and c.commit_seq < c.last_seq and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self.core is c:
                # Followers learn the final commit point now (they serve gap fills only up to
                # it): no later append would tell them, and a listener that lost the last
                # packets could never fill them.
                self._send_commit(force=True)
                for link in list(self.links.values()):
                    try:
                        await within(link.writer.drain(), 0.5)
                    except (OSError, asyncio.TimeoutError):
                        pass
                # Repeated, as MoldUDP64 servers do: a listener that loses the one packet
                # would wait forever for a session that has ended.
                for _ in range(EOS_REPEATS):
                    if self.core is not c:
                        break
                    self._publish([c.end_of_session()])
                    await asyncio.sleep(0.02)
        for t in self._leader_tasks:
            t.cancel()
        self.journal.close()
        status = {"name": self.node.name, "term": self.voter.election.term, "last_seq": self.journal.last_seq,
                  "published_terms": {str(t): span for t, span in sorted(self.published_terms.items())},
                  "failed": self.failed, "commit_ms": self.commit_latency.summary_ms()}
        (Path(self.node.data) / "status.json").write_text(json.dumps(status, indent=1))
        log.info("%s stopped at seq %d, term %d", self.node.name, self.journal.last_seq, self.voter.election.term)

    def _on_inbound(self) -> None:
        core, sock, loss = self.core, self.inbound, self.loss
        if core is None:  # following: clients that know no leader (and resends) come here too
            for _ in range(DRAIN_DATAGRAMS):
                try:
                    sock.recv(DATAGRAM_BUFFER)
                except BlockingIOError:
                    return
                self.inbound_datagrams += 1
                self.not_leader_drops += 1
            return
        now = time.time_ns()
        emptied = False
        for _ in range(DRAIN_DATAGRAMS):
            try:
                data, source = sock.recvfrom(DATAGRAM_BUFFER)
            except BlockingIOError:
                emptied = True
                break
            self.inbound_datagrams += 1
            self.inbound_bytes += len(data)
            if loss.drop():
                continue
            reason = core.on_inbound(data, now, source)
            if reason is not None and reason != "duplicate":
                self.badlog.warn(reason, "dropped inbound datagram of %d bytes: %s", len(data), reason)
            if core.pending >= MAX_BATCH_MESSAGES:  # one batch must fit one append frame
                self._process(core.flush(now))
                if self.core is not core:
                    return  # stepped down (disk full): the rest waits in the socket for whoever leads
        core.note_drain(emptied, now)
        for source, datagram in core.take_advice():
            try:
                sock.sendto(datagram, source)
            except OSError:
                pass  # advice: the client's window and resend timer cover its loss
        if core.pending and not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_inbound)

    def _flush_inbound(self) -> None:
        """Stamp and process what the drains read, after the other callbacks of this turn of the
        event loop: the followers' acknowledgements that came during the last fsync (readable
        in the same turn as the inbound socket, which became readable first) commit and publish
        before this batch's own fsync holds the loop. A paced batch (`batch_due_ns`) waits
        for its time, and what the drains read meanwhile joins it."""
        now = time.time_ns()
        if self.core is not None and (due := self.core.batch_due_ns(now)) > now:
            asyncio.get_running_loop().call_later((due - now) / 1e9, self._flush_inbound)
            return
        self._flush_due = False
        batch = self.core.flush(now) if self.core is not None else None
        if batch is not None:
            self._process(batch)

    def _process(self, batch: Batch) -> None:
        """Replicate to live followers, journal, publish what commits.
        Followers get the batch before the leader's own fsync (as Raft
        allows), so the two disk writes overlap instead of adding up."""
        self._stamped.append((batch.last_seq, time.time_ns(), len(batch.messages)))
        commit = self.core.commit_seq
        send, wake = self.followers_core.live_for(batch.first_seq, batch.last_seq, commit, time.monotonic_ns())
        if send:
            frame = rep.encode_append(self.core.term, self.node.wire_name, batch.prev_seq, batch.prev_term,
                                      commit, batch.term, batch.messages)
            authlink.write_each([self.links[f].writer for f in send], frame)
            for f in send:
                if self.followers_core.backlog(f, self.links[f].writer.transport.get_write_buffer_size()):
                    wake.append(f)
        for f in wake:
            self.links[f].wake.set()
        try:
            self.journal.append(batch.records())
        except DiskFull as e:  # not journaled here: step down (the followers may hold it; clients resend)
            self.voter.disk_full(e)
            return
        self.voter.note_own(batch.first_seq, batch.last_seq, batch.term, batch.messages[-1][0] == M.AUTH)
        self._publish(self.core.on_journaled(batch.last_seq))

    def _publish(self, packets: list[bytes]) -> None:
        if not packets:
            return
        self.send_errors += send_datagrams(self.publisher, packets, self.dest)  # refused ones: gap fill
        msgs = 0
        first = 0
        for pkt in packets:
            count = int.from_bytes(pkt[18:20], "big")
            if 0 < count < 0xFFFF:
                msgs += count
                first = first or int.from_bytes(pkt[10:18], "big")
        now = time.time_ns()
        self.core.note_published(len(packets), msgs, now)
        if self._timer_woken is not None:  # the commit point moved: its beat may be due sooner
            _resolve(self._timer_woken)
        self.published_seq = max(self.published_seq, self.core.published_seq)
        while self._stamped and self._stamped[0][0] <= self.core.published_seq:
            _, stamped, count = self._stamped.popleft()
            self.commit_latency.add(now - stamped, count)
            self.commit_histogram.observe(now - stamped)
        if msgs:  # which seqs this process published in which term: drills judge terms by it
            span = self.published_terms.setdefault(self.core.term, [first, 0])
            span[1] = self.core.published_seq

    async def _timer(self) -> None:
        """The stream's heartbeats and time ticks, the followers' commit beats and an interval
        policy's syncs, each when it falls due (a steady 5 ms tick was two hundred wake-ups a
        second of an idle leader). Waiting longer than a commit beat's delay, it is woken when
        the commit point moves (`_publish`)."""
        loop = asyncio.get_running_loop()
        while self.core is not None:
            wait = self._timer_wait_s()
            woken = loop.create_future()
            self._timer_woken = woken if wait > COMMIT_BEAT_AFTER_NS / 1e9 else None
            handle = loop.call_later(wait, _resolve, woken)
            try:
                await woken
            finally:
                handle.cancel()
                self._timer_woken = None
            if self.core is None:
                return
            batch, heartbeat = self.core.on_timer(time.time_ns())
            if batch is not None:
                self._process(batch)
                if self.core is None:
                    return  # stepped down (disk full)
            if heartbeat is not None:
                self._publish([heartbeat])
            self._send_commit()
            self.journal.maybe_sync()  # the "every N ms" policy while idle

    def _timer_wait_s(self) -> float:
        """Until the first of the core's tick or heartbeat, the followers' beat and a sync is due
        (each in its own clock: stamps are wall-clock time, the rest monotonic)."""
        c = self.core
        due_ns = min(c.timer_due_ns() - time.time_ns(),
                     self.followers_core.beat_due_ns(c.commit_seq) - time.monotonic_ns())
        due = due_ns / 1e9
        sync = self.journal.sync_due_s()
        if sync is not None:
            due = min(due, sync - time.monotonic())
        return max(due, TIMER_FLOOR_S)

    def _send_commit(self, force: bool = False) -> None:
        """Empty appends, when due: the followers learn the commit point (to serve
        gap fills) and that this leader lives (their election timers restart)."""
        c = self.core
        beat = self.followers_core.beat(time.monotonic_ns(), c.commit_seq, force)
        if beat:
            frame = rep.encode_append(c.term, self.node.wire_name, c.last_seq, c.last_term, c.commit_seq, c.term, [])
            for f in beat:
                self.links[f].writer.write(frame)

    # --- followers -------------------------------------------------------------------

    async def _follower_link(self, f: Node) -> None:
        while True:
            if self.voter.partitioned:
                await asyncio.sleep(0.05)
                continue
            try:
                reader, writer = await self.open_link(f.host, f.replication_port, self.cfg.cluster_link)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            link = None
            sender = None
            try:
                frames = rep.FrameReader()
                hello = None
                while hello is None:
                    data = await reader.read(CONTROL_READ)
                    if not data:
                        raise ConnectionError("closed before hello")
                    for fr in frames.feed(data):
                        if isinstance(fr, rep.Hello):
                            hello = fr
                self.voter.act(self.voter.election.on_higher_term(hello.term, hello.node, time.monotonic_ns()))
                if self.core is None:
                    return
                link = Link(f, writer)
                self.links[f.wire_name] = link
                self.followers_core.connected(f.wire_name, hello.last_seq, self.core.last_seq)
                log.info("follower %s connected at seq %d", f.name, hello.last_seq)
                sender = self.spawn(self._feed(link))

                def on_acks(data: bytes) -> None:
                    for fr in frames.feed(data):
                        if isinstance(fr, rep.Ack):
                            self._on_ack(link, fr)

                await authlink.read_each(reader, on_acks)
                raise ConnectionError("closed")
            except (ConnectionError, OSError, ProtocolError, DiskFull) as e:
                log.warning("follower %s link lost: %s", f.name, e)
            finally:
                if sender:
                    sender.cancel()
                if link and self.links.get(f.wire_name) is link:
                    del self.links[f.wire_name]
                    if self.followers_core is not None:
                        self.followers_core.disconnected(f.wire_name)
                if self.voter.partitioned:
                    self._held.append(writer)  # closed when the partition heals
                else:
                    writer.close()
            await asyncio.sleep(0.1)

    def _on_ack(self, link: Link, ack: rep.Ack) -> None:
        self.voter.act(self.voter.election.on_ack(link.node.wire_name, ack.term, time.monotonic_ns()))
        if self.core is None:
            return  # it was in a higher term: stepped down
        packets = self.core.on_ack(link.node.wire_name, ack.term, ack.success, ack.last_seq)
        if packets is None:
            return
        if not ack.success and self.followers_core.refused(link.node.wire_name, ack.last_seq):
            link.wake.set()  # its log ends, or disagrees, before what was sent: caught up from its hint
        self._publish(packets)

    async def _feed(self, link: Link) -> None:
        """Catch a follower up from the journal whenever FollowerLinks says so."""
        f = link.node.wire_name
        while True:
            link.wake.clear()
            while (chunk := self.followers_core.next_chunk(f, self.core.last_seq)) is not None:
                while self.voter.partitioned:
                    await asyncio.sleep(0.02)
                records = self.journal.read_batch(*chunk)
                if not records:
                    raise InvariantViolation(f"the journal has no seq {chunk[0]}, which this leader stamped")
                prev = chunk[0] - 1
                link.writer.write(rep.encode_runs(self.core.term, self.node.wire_name, prev, self.voter.term_at(prev),
                                                  self.core.commit_seq, records))
                self.followers_core.sent(f, records[-1][0])
                try:
                    await link.writer.drain()
                except ConnectionError:
                    return  # the follower hung up: _follower_link sees the close and connects again
            await link.wake.wait()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
