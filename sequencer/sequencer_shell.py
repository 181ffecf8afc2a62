"""`tape sequencer`: the asyncio shell around SequencerNode (sequencer/sequencer_node_core.py), which
decides everything the process does, through runtime/voter_shell.py's shell (journal, vote file,
replication connections, the timer). This module moves the rest of the bytes: the
inbound socket's drains, the stream's packets, the clients' advice, the own journal's
writes, the end of the session at shutdown, and the metrics.

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
from pathlib import Path

from tape.protocol.election import Cause, RequestVotes
from tape.protocol.limits import OVERLOAD_NS
from tape.runtime import links
from tape.runtime.latency import LatencyHistogram, LatencySamples
from tape.runtime.loss import LossInjector
from tape.runtime.mmsg import send_datagrams
from tape.runtime.process import NodeProcess, within
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.settings import Config, NodeSettings
from tape.runtime.storage.journal_repair import open_checked
from tape.runtime.tuning import (
    DATAGRAM_BUFFER,
    DRAIN_DATAGRAMS,
    END_COMMIT_WAIT_S,
    END_POLL_S,
    FINAL_DRAIN_S,
    SEND_BUFFER,
)
from tape.runtime.udp import multicast_sender, udp_socket
from tape.runtime.voter_shell import VoterShell
from tape.sequencer import sequencer_node_core as sn

log = logging.getLogger("tape.sequencer")
# Reported at 0 from the start: a counter that first appears at 1 shows Prometheus no increase,
# so the first unauthenticated sender would not count towards TapeBadInput.
DROP_REASONS_FROM_START = ("unauthenticated", "unknown_client", "bad_batch", "duplicate")


class Sequencer(NodeProcess):
    METRICS_PREFIX = "tape_sequencer"

    def __init__(self, cfg: Config, node: NodeSettings, drop: float = 0.0, seed: int = 0):
        super().__init__(cfg, node, log)
        self.loss = LossInjector(drop, seed)
        self.badlog = RateLimitedLog(log)
        followers = [n.wire_name for n in cfg.voters if n is not node]
        settings = sn.LeaderSettings(
            cfg.session_bytes, {c.name.encode().ljust(10): c.key for c in cfg.clients}, cfg.max_packet,
            cfg.tick_ms * 1_000_000, cfg.heartbeat_ms * 1_000_000, cfg.batch_interval_ms * 1_000_000,
            cfg.leader_heartbeat_ms * 1_000_000, cfg.stream_auth, client_hosts=cfg.client_addresses)
        self.journal, self.voter, self.journal_repaired = open_checked(
            lambda: cfg.open_journal(node), Path(node.data),
            lambda journal: VoterShell(cfg, node, journal, can_lead=True, on_action=self._on_election,
                                       on_fatal=self.fail, on_partition=self._partition, link_refused=self.link_refused,
                                  wrap=lambda endpoint: sn.SequencerNode(endpoint, settings, followers),
                                  on_other=self._carry_out))
        self.seq_node: sn.SequencerNode = self.voter.node_core
        self._carriers = self._carrier_table()
        self._held: list[asyncio.StreamWriter] = []  # links a partition keeps from closing
        self._tasks: set[asyncio.Task] = set()  # drains under way
        self._stamp_handle: asyncio.Handle | None = None
        self.inbound_datagrams = 0
        self.inbound_bytes = 0
        self.send_errors = 0
        self.step_downs = {c.value: 0 for c in Cause}  # at 0 from the start: Prometheus sees the first
        self._stamped: deque[tuple[int, int, int]] = deque()  # (last seq, stamped ns, messages) of unpublished batches
        self.commit_latency = LatencySamples()  # stamped to published, one weighted sample a batch
        self.commit_histogram = LatencyHistogram()
        self._end: asyncio.Task | None = None  # the end-of-session packets going out

    # --- metrics -----------------------------------------------------------------

    def report(self):
        n = self.seq_node
        c, t, e = n.leader, n.totals, self.voter.election
        yield "inbound_datagrams", "counter", "inbound datagrams received", self.inbound_datagrams
        yield "inbound_bytes", "counter", "inbound bytes received", self.inbound_bytes
        yield "messages_accepted", "counter", "client messages accepted for sequencing", \
            t.accepted + (c.accepted if c else 0)
        dropped = dict.fromkeys(DROP_REASONS_FROM_START, 0) | t.dropped
        for k, v in (c.dropped.items() if c else ()):
            dropped[k] = dropped.get(k, 0) + v
        yield "dropped_datagrams", "counter", "inbound datagrams dropped, by reason", \
            {**dropped, "injected_loss": self.loss.dropped, "not_leader": n.not_leader_drops}
        yield "overloaded", "gauge", f"1 while no drain emptied the inbound socket for {OVERLOAD_NS // 10**6} ms", \
            1 if c and c.overloaded(time.monotonic_ns()) else 0
        yield "backoffs_sent", "counter", "back-offs sent to clients while overloaded", \
            t.backoffs_sent + (c.backoffs_sent if c else 0)
        yield "resends_asked", "counter", "clients asked to resend a batch that batches after it overtook", \
            t.resends_asked + (c.resends_asked if c else 0)
        yield "sequenced_seq", "gauge", "highest seq in this node's log", self.journal.last_seq
        yield "commit_seq", "gauge", "highest seq known held by a majority", n.commit_seq
        yield "commit_lag", "gauge", "messages stamped but not yet committed", c.last_seq - c.commit_seq if c else 0
        yield "packets_published", "counter", "packets published on the public stream", \
            t.published_packets + (c.published_packets if c else 0)
        yield "messages_published", "counter", "messages published on the public stream", \
            t.published_messages + (c.published_messages if c else 0)
        yield "publish_errors", "counter", "packets the socket refused", self.send_errors
        yield "published_seq", "gauge", "highest seq this process published, in any term", n.published_seq
        terms = sorted(n.published_terms.items())
        yield "published_first_seq", "gauge", "first seq this process published, by term", \
            {t: span[0] for t, span in terms}, "term"
        yield "published_last_seq", "gauge", "last seq this process published, by term", \
            {t: span[1] for t, span in terms}, "term"
        yield from self.voter.report(self.journal_repaired)
        yield "leader", "gauge", "1 while this node leads", 1 if c else 0
        yield "elections", "counter", "elections this node started (after a won pre-vote)", e.elections
        yield "leader_changes", "counter", "times the leader this node knows changed", e.leader_changes
        yield "terms_led", "counter", "terms this node led", n.terms_led
        yield "batches", "counter", "batches this node stamped, each one append to every voter", n.batches
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
        self.publisher.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self.dest = (self.cfg.group, self.cfg.port)
        server = await self.serve_links(self.voter.serve, self.voter.link_keys, self.node.host,
                                        self.node.replication_port,
                                        [v for v in self.cfg.voters if v.name != self.node.name])
        log.info("%s at seq %d, term %d; replication :%d, inbound %s:%d (rcvbuf %d), publishing %s:%d; %d voters",
                 self.node.name, self.journal.last_seq, self.voter.election.term, self.node.replication_port,
                 self.node.host, self.node.inbound_port, granted, *self.dest, len(self.cfg.voters))
        ticker = self.spawn(self.voter.ticks())
        loop.add_reader(self.inbound, self._on_inbound)
        await self.stop.wait()
        loop.remove_reader(self.inbound)
        await self._end_session()  # (the timer still runs: beats and heartbeats while the end commits)
        ticker.cancel()
        self.voter.close()
        server.close()
        self._shutdown()

    def _on_election(self, action) -> None:
        if isinstance(action, RequestVotes):
            log.info("%s: %s for term %d at seq %d (term %d)", self.node.name,
                     "pre-vote" if action.pre else "campaigning", action.term, action.last_seq, action.last_term)

    def _partition(self, cut: bool) -> None:
        """Fault injection: black-hole the links to the followers (no reads, no writes, no close:
        a cut network sends no FIN) until healed; to the node, they are gone."""
        if cut:
            for conn in list(self.seq_node.links):
                writer = self.voter._writers.pop(conn, None)
                if writer is not None:
                    writer.transport.pause_reading()
                    self._held.append(writer)  # closed when the partition heals
                self.voter.event(None, self.seq_node.on_closed, conn, False)
        else:
            for writer in self._held:
                writer.close()
            self._held = []

    def _carry_out(self, a) -> list:
        """One of the sequencer node's own actions (runtime/voter_shell.py carries out the endpoint's)."""
        return self._carriers[type(a)](a) or []

    def _carrier_table(self) -> dict:
        n = self.seq_node
        return {
            sn.Replicate: self._replicate,
            sn.Journal: self._journal,
            sn.Publish: self._publish,
            sn.Stamp: lambda a: self._schedule_stamp(a.due),
            sn.StampNow: lambda a: n.on_stamp(time.time_ns(), time.monotonic_ns()),
            sn.Advise: self._advise,
            sn.Drain: lambda a: self._drain(a.conn),
            sn.Dropped: lambda a: self.badlog.warn(a.reason, "dropped inbound datagram of %d bytes: %s", a.size,
                                                   a.reason),
            sn.Led: lambda a: log.warning("%s leading term %d from seq %d", self.node.name, a.term, a.from_seq),
            sn.SteppedDown: self._stepped_down,
            sn.FollowerJoined: lambda a: log.info("follower %s connected at seq %d",
                                                  a.peer.decode(errors="replace").strip(), a.last_seq),
            sn.EndOfSession: lambda a: setattr(self, "_end", self.spawn(self._announce_end(a))),
        }

    def _replicate(self, a: sn.Replicate) -> list:
        writers = [w for conn in a.conns if (w := self.voter.writer(conn)) is not None]
        links.write_each(writers, a.frame)
        return self.seq_node.on_replicated(a, [w.transport.get_write_buffer_size() for w in writers],
                                           time.monotonic_ns())

    def _journal(self, a: sn.Journal) -> list:
        b = a.batch
        self._stamped.append((b.last_seq, time.monotonic_ns(), len(b.messages)))
        self.journal.append(b.records())  # a refused write raises DiskFull: the voter's disk-full path
        return self.seq_node.on_journaled(b, time.monotonic_ns())

    def _advise(self, a: sn.Advise) -> None:
        try:
            self.inbound.sendto(a.data, a.source)
        except OSError:
            pass  # advice: the client's window and resend timer cover its loss

    def _stepped_down(self, a: sn.SteppedDown) -> None:
        log.error("%s stepping down from term %d: %s", self.node.name, a.term, a.reason)
        self.step_downs[a.cause.value] = self.step_downs.get(a.cause.value, 0) + 1
        self._stamped.clear()  # what it did not publish, the next leader may

    def _schedule_stamp(self, due: int) -> None:
        loop = asyncio.get_running_loop()
        wait = (due - time.monotonic_ns()) / 1e9
        # After the other callbacks of this turn of the event loop: the followers' acknowledgements
        # that came during the last fsync (readable in the same turn as the inbound socket, which
        # became readable first) commit and publish before this batch's own fsync holds the loop.
        stamp = (self.voter.event, None, self._stamp_now)
        self._stamp_handle = loop.call_soon(*stamp) if wait <= 0 else loop.call_later(wait, *stamp)

    def _stamp_now(self, now: int) -> list:
        return self.seq_node.on_stamp(time.time_ns(), now)

    def _drain(self, conn) -> None:
        async def drained():
            writer = self.voter.writer(conn)
            try:
                if writer is not None:
                    await writer.drain()
            except ConnectionError:
                return  # the follower hung up: the node hears the close
            self.voter.event(None, self.seq_node.on_drained, conn)
        task = asyncio.ensure_future(drained())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_inbound(self) -> None:
        sock, loss = self.inbound, self.loss
        datagrams = []
        emptied = False
        for _ in range(DRAIN_DATAGRAMS):
            try:
                data, source = sock.recvfrom(DATAGRAM_BUFFER)
            except BlockingIOError:
                emptied = True
                break
            self.inbound_datagrams += 1
            self.inbound_bytes += len(data)
            if not loss.drop():
                datagrams.append((data, source))
        self.voter.event(None, self.seq_node.on_inbound, datagrams, emptied, time.time_ns())

    def _publish(self, a: sn.Publish) -> None:
        self.send_errors += send_datagrams(self.publisher, a.packets, self.dest)  # refused ones: gap fill
        now = time.monotonic_ns()
        while self._stamped and self._stamped[0][0] <= a.through_seq:
            _, stamped, count = self._stamped.popleft()
            self.commit_latency.add(now - stamped, count)
            self.commit_histogram.observe(now - stamped)

    async def _end_session(self) -> None:
        """At shutdown, a leader ends the session: its last entry committed (or END_COMMIT_WAIT_S
        passed), the followers told the final commit point, the end-of-session packets."""
        n = self.seq_node
        if n.leader is None:
            return
        self.voter.event(None, n.on_end, time.time_ns())
        deadline = time.monotonic() + END_COMMIT_WAIT_S
        while not n.session_ended() and time.monotonic() < deadline:
            await asyncio.sleep(END_POLL_S)
        self.voter.event(None, n.on_session_ended)
        if self._end is not None:
            await self._end

    async def _announce_end(self, end: sn.EndOfSession) -> None:
        """The final commit point to the followers first, then the end-of-session packets."""
        n = self.seq_node
        for conn in list(n.joined.values()):
            if (writer := self.voter.writer(conn)) is not None:
                try:
                    await within(writer.drain(), FINAL_DRAIN_S)
                except (OSError, asyncio.TimeoutError):
                    pass
        for _ in range(end.repeats):
            if n.leader is None:
                break
            self._publish(sn.Publish([end.packet], n.leader.published_seq))
            await asyncio.sleep(end.interval_ns / 1e9)

    def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._stamp_handle is not None:
            self._stamp_handle.cancel()
        self.journal.close()
        n = self.seq_node
        status = {"name": self.node.name, "term": self.voter.election.term, "last_seq": self.journal.last_seq,
                  "published_terms": {str(t): span for t, span in sorted(n.published_terms.items())},
                  "failed": self.failed, "commit_ms": self.commit_latency.summary_ms()}
        (Path(self.node.data) / "status.json").write_text(json.dumps(status, indent=1))
        log.info("%s stopped at seq %d, term %d", self.node.name, self.journal.last_seq, self.voter.election.term)
