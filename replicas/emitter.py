"""`tape emitter`: delivers each alert exactly once; the shell around EmitterCore.

Replicas connect over TCP and send their alerts in emit-seq order. The
emitter keeps in LMDB the highest emit seq recorded (the mark), an outbox of
alerts in flight and every delivered alert (for divergence checks). What to
do with each alert is EmitterCore's decision (replicas/emitter_core.py);
this shell carries it out. With every sink idempotent (deliver_first), a
new batch is written to every sink, and what was delivered is recorded
(delivered + mark, one transaction) RECORD_AFTER_NS after the first batch
not yet recorded. Otherwise a new batch is recorded as intent (outbox +
mark, and the previous batch's done, one transaction), written to every
sink, and recorded as done with the next intent (or alone after
DONE_ALONE_AFTER_NS without one). A copy is judged against the delivered
bytes; at start, alerts with intent and no done are in doubt: they go
again to the idempotent sinks (the JSON-lines file checks its own tail,
the webhook carries an Idempotency-Key) and are listed in
`in_doubt.jsonl` for the operator for the others.

Sinks (`sinks` in the emitter's [[node]]; see replicas/sinks.py): the
JSON-lines file `alerts.jsonl` (default), an HTTP webhook and stdout. Each
alert is delivered to every sink, one batch at a time, in emit-seq order.
`--crash-at POINT --crash-after N` (tests and drills) makes the process die
at that point of its N-th batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from operator import itemgetter
from pathlib import Path

import lmdb

from tape.node.latency import LatencySamples
from tape.node.process import NodeProcess
from tape.node.ratelog import RateLimitedLog
from tape.node.settings import Config, Node
from tape.protocol import alertlink
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import ACK_EVERY_NS, CONTROL_READ, DONE_ALONE_AFTER_NS, RECENT_ALERTS, RECORD_AFTER_NS
from tape.replicas import sinks as sinklib
from tape.replicas.audit import ALERT_SIZE, ALERT_STAMP, Alert
from tape.replicas.emitter_core import (
    Crash,
    DeliverAlerts,
    EmitterCore,
    RecordDone,
    RecordIntent,
    Redeliver,
    TooFarAhead,
)

log = logging.getLogger("tape.emitter")


class IntentNotRecorded(Exception):
    """The disk refused the transaction that records a batch (its intent, or with deliver_first its
    delivery): the mark is back."""


_KEY = itemgetter(slice(0, 8))
CRASH_EXIT = 99  # the fault injection's exit code: not a failure of the emitter's own


def _deliver_each(sinks: list, records: list[sinklib.AlertLine]) -> None:
    for sink in sinks:
        sink.deliver(records)


def keyed(records: list[bytes]):
    """(key, record) of each alert record: its first 8 bytes, its emit seq, are its key."""
    return zip(map(_KEY, records), records)


def keep_newest(recent: dict, records: list, limit: int) -> None:
    """Add alert records (keyed by their first 8 bytes, the emit seq), in rising emit seq, and
    forget the oldest beyond `limit` (sinks.forget_oldest: in bulk)."""
    recent.update(keyed(records))
    sinklib.forget_oldest(recent, limit)


class Emitter(NodeProcess):
    METRICS_PREFIX = "tape_emitter"

    def __init__(self, cfg: Config, node: Node, crash_at: str | None = None, crash_after: int = 1):
        super().__init__(cfg, node, log)
        self.data = Path(node.data)
        self.data.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.data / "lmdb"), map_size=4 << 30, max_dbs=4)
        self.meta = self.env.open_db(b"meta")
        self.outbox = self.env.open_db(b"outbox")
        self.delivered_db = self.env.open_db(b"delivered")
        self.stopping = threading.Event()  # tells a sink retrying in its thread to give up
        self.sinks = sinklib.build(node.sinks, self.data, node.webhook_url, node.webhook_timeout_ms / 1000,
                                   self.stopping)
        with self.env.begin() as txn:
            raw = txn.get(b"mark", db=self.meta)
        self.core = EmitterCore({n.wire_name for n in cfg.by_role("replica")}, int.from_bytes(raw, "big") if raw
                                else 0, crash_at, crash_after, node.delivery,
                                deliver_first=all(sink.idempotent for sink in self.sinks))
        for sink in self.sinks:  # with deliver_first a record syncs the sinks first (_sync_sinks), not each batch
            sink.sync_each_batch = not self.core.deliver_first
        self.latency = LatencySamples()  # the triggering purchase's stamp to delivered (wall clock: a figure only)
        self.in_doubt_listed = 0
        self.rejected: dict[str, int] = {}
        self._lock = asyncio.Lock()  # one delivery at a time, whichever replica it came from
        self.links: dict = {}  # every welcomed replica connection -> the replica it named
        self.record_failures = 0
        self.refusal_log = RateLimitedLog(log)
        self.by_replica: dict[bytes, asyncio.StreamWriter] = {}  # its latest connection: where a rebuild order goes
        self.recent: dict[bytes, bytes] = {}  # emit seq (its key) -> the bytes recorded, the newest RECENT_ALERTS
        self._done_timer: asyncio.TimerHandle | None = None
        self._ack_timer: asyncio.TimerHandle | None = None
        self._delivering = False  # a batch is on its way to the sinks (stopped there: it stays in doubt)

    @property
    def mark(self) -> int:
        return self.core.mark

    def report(self):
        c = self.core
        yield "mark", "gauge", "highest emit seq recorded", c.recorded
        yield "alerts_delivered", "counter", "alerts delivered to the sinks", c.delivered
        yield "delivery_batches", "counter", "deliveries (one write to each sink)", c.batches
        yield "duplicates", "counter", "alert copies already delivered", c.duplicates
        yield "divergences", "counter", "alert copies differing from the delivered one", c.divergences
        yield "in_doubt", "counter", "alerts in doubt after a crash, resolved at start", c.in_doubt
        yield "pending", "gauge", "alerts awaiting a quorum (delivery = quorum)", len(c.pending)
        yield "replicas_diverged", "gauge", "replicas outvoted on their digest, rebuilding (their alerts ignored)", \
            len(c.diverged)
        yield "rebuilds_ordered", "counter", "replicas told to rebuild: a quorum agreed on another digest", \
            c.rebuilds_ordered
        yield "ignored_alerts", "counter", "alerts of a diverged replica, ignored", c.ignored
        yield "record_failures", "counter", "LMDB transactions the disk refused (intent: nothing delivered)", \
            self.record_failures
        yield "in_doubt_listed", "counter", "alerts in doubt listed for the operator (non-idempotent sink)", \
            self.in_doubt_listed
        yield "rejected", "counter", "connections or frames refused, by reason", self.rejected
        yield "sink_retries", "counter", "deliveries retried, by sink", \
            {s.name: getattr(s, "retries", 0) for s in self.sinks}, "sink"
        yield "sink_refused", "counter", "alerts a sink refused for good (webhook 4xx), by sink", \
            {s.name: getattr(s, "refused", 0) for s in self.sinks}, "sink"

    async def main(self) -> None:
        server = None
        try:
            with self.env.begin() as txn:
                doubt = [v for _, v in txn.cursor(db=self.outbox)]
            await self._carry_out(self.core.recover(doubt))
            server = await self.serve_links(self._on_replica, self.cfg.cluster_link, self.node.host,
                                            self.node.alert_port)
            log.info("emitter at mark %d, listening on :%d, sinks: %s", self.mark, self.node.alert_port,
                     ", ".join(s.name for s in self.sinks))
            await self.stop.wait()
        except sinklib.SinkStopped:
            log.warning("stopped while delivering; the alerts in flight stay in doubt for the next start")
        finally:
            self.stopping.set()
            if server is not None:
                server.close()
            for timer in (self._done_timer, self._ack_timer):
                if timer is not None:
                    timer.cancel()
            async with self._lock:  # let a delivery in its thread finish or give up
                if not self._delivering:  # the last batch reached every sink: its done is due, not a doubt
                    try:
                        await self._carry_out(self.core.done_due())
                    except IntentNotRecorded as e:  # (sent again from the mark at the next start)
                        log.error("alerts delivered and not recorded at the stop (%s)", e)
                for sink in self.sinks:
                    sink.close()
                self.env.close()
        c = self.core
        status = {"mark": c.mark, "delivered": c.delivered, "duplicates": c.duplicates,
                  "divergences": c.divergences, "in_doubt": c.in_doubt, "rejected": self.rejected,
                  "delivery": c.delivery, "latency_ms": self.latency.summary_ms()}
        (self.data / "status.json").write_text(json.dumps(status, indent=1))

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("alert link: %s (%s); connection closed", reason.replace("_", " "), detail)

    async def _on_replica(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = alertlink.Reader()
        name = None
        try:
            while True:
                data = await reader.read(CONTROL_READ)
                if not data:
                    return
                fresh = []
                for kind, payloads in frames.runs(data):
                    if name is None:  # the first frame: the replica's hello
                        mark = self.core.on_hello(payloads[0]) if kind == alertlink.HELLO else None
                        if mark is None:
                            return self._reject("unknown_replica", f"hello {payloads[0][:16]!r}")
                        name, payloads = payloads[0], payloads[1:]
                        self.links[writer] = name
                        self.by_replica[name] = writer
                        writer.write(alertlink.welcome(mark))
                        if name in self.core.diverged:  # (one that already rebuilds for it ignores this)
                            writer.write(alertlink.rebuild(self.core.diverged[name]))
                    if not payloads:
                        continue
                    if kind == alertlink.ALERT:
                        if not set(map(len, payloads)) <= {ALERT_SIZE}:
                            size = next(len(p) for p in payloads if len(p) != ALERT_SIZE)
                            return self._reject("malformed_alert", f"from {name!r}: {size} bytes, not {ALERT_SIZE}")
                        fresh += payloads
                    elif kind == alertlink.DIGEST and set(map(len, payloads)) == {alertlink.FOLD.size}:
                        for payload in payloads:
                            try:
                                await self._on_digest(name, *alertlink.FOLD.unpack(payload))
                            except IntentNotRecorded as e:
                                return self._intent_failed(str(e))
                    else:
                        return self._reject("unexpected_frame", f"type {kind!r} from {name!r}")
                if fresh:
                    try:
                        await self._handle(fresh, name)
                    except TooFarAhead as e:
                        return self._reject("too_far_ahead", f"{name!r}: {e}")
                    except IntentNotRecorded as e:
                        return self._intent_failed(str(e))
        except ProtocolError as e:
            self._reject("bad_frame", str(e))
        except sinklib.SinkStopped:
            pass
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.links.pop(writer, None)
            if name is not None and self.by_replica.get(name) is writer:
                del self.by_replica[name]
            writer.close()

    def _acknowledge(self) -> None:
        """The recorded mark, within ACK_EVERY_NS, to each replica told less."""
        if self._ack_timer is None:
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_EVERY_NS / 1e9, self._send_acks)

    def _send_acks(self) -> None:
        self._ack_timer = None
        due = self.core.acks_due(sorted(set(self.links.values())))
        for writer, replica in self.links.items():  # every connection naming it (without keys, a
            if replica in due:                       # stranger's hello may name a real replica)
                writer.write(alertlink.ack(due[replica]))

    def _intent_failed(self, error: str) -> None:
        """The mark is back: every replica sends again from it. Nothing was delivered, or (with
        deliver_first) the sinks, all idempotent, take again what they hold."""
        self.refusal_log.warn("intent", "alerts not recorded (%s; a full or failing disk?): every replica link "
                              "closed, they send again from mark %d (%s)", error, self.mark,
                              "the sinks take again what they hold" if self.core.deliver_first
                              else "none was delivered")
        for link in list(self.links):
            link.close()

    async def _on_digest(self, replica: bytes, fold_seq: int, chain: bytes) -> None:
        async with self._lock:
            rebuild, ready, alarms = self.core.on_digest(replica, fold_seq, chain)
            for r in rebuild:
                log.error("DIVERGENCE: %s's digest at fold seq %d differs from the one a quorum of replicas agree "
                          "on: told to rebuild from seq 1; its alerts are ignored until it agrees again",
                          r.decode(errors="replace").strip(), fold_seq)
                if r in self.by_replica:
                    self.by_replica[r].write(alertlink.rebuild(fold_seq))
            await self._settled(ready, alarms)

    async def _handle(self, alerts: list[bytes], replica: bytes) -> None:
        async with self._lock:
            if self.stopping.is_set():
                raise sinklib.SinkStopped("stopping")
            new, copies, alarms = self.core.on_alerts(replica, alerts)
            if copies:
                self._judge(copies)
            await self._settled(new, alarms)

    async def _settled(self, new: list[bytes], alarms: list[bytes]) -> None:
        for raw in alarms:
            a = Alert.decode(raw)
            log.error("DIVERGENCE: alert at emit seq %d reached no quorum of replicas; not delivered: %s",
                      a.emit_seq, a)
        if new:
            await self._carry_out(self.core.deliver(new))

    async def _carry_out(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, RecordIntent):
                try:  # (an alert record's first 8 bytes are its emit seq, u64 big-endian: its key)
                    if action.delivered:
                        self._sync_sinks()
                    with self.env.begin(write=True) as txn:
                        db = self.delivered_db if action.delivered else self.outbox
                        txn.cursor(db=db).putmulti(keyed(action.alerts))
                        txn.put(b"mark", action.alerts[-1][:8], db=self.meta)
                        self._move_done(txn, action.done)
                except (lmdb.Error, OSError) as e:  # (OSError: a sink's sync)
                    self.core.on_intent_failed(action)
                    self.record_failures += 1
                    raise IntentNotRecorded(str(e)) from None
                self.core.on_recorded(action)
                self._acknowledge()
                if not action.delivered:  # (delivered first: kept in `recent` as they were delivered)
                    keep_newest(self.recent, action.alerts, RECENT_ALERTS)  # copies are judged by these bytes
                    self._arm_done_timer()
            elif isinstance(action, DeliverAlerts):
                self._delivering = True
                await self._deliver(sinklib.alert_lines(action.alerts, self.cfg.session))
                self._delivering = False
                now = time.time_ns()
                self.latency.extend([now - stamp for (stamp,) in ALERT_STAMP.iter_unpack(Alert.joined(action.alerts))])
                if self.core.deliver_first:
                    keep_newest(self.recent, action.alerts, RECENT_ALERTS)
                    self._arm_record_timer()
            elif isinstance(action, Redeliver):
                await self._redeliver(action.alerts)
            elif isinstance(action, RecordDone):
                self._done(action.alerts)
            elif isinstance(action, Crash):
                log.error("crash hook: dying %s (batch %d)", action.point, action.batch)
                os._exit(CRASH_EXIT)

    async def _redeliver(self, doubt: list[bytes]) -> None:
        """Alerts with intent but no done: again to idempotent sinks, listed for the operator otherwise."""
        records = sinklib.alert_lines(doubt, self.cfg.session)
        ids = ", ".join(r.alert_id for r in records[:20])
        log.warning("%d alerts were in doubt after a crash (intent, no done): %s", len(doubt), ids)
        for sink in self.sinks:
            if sink.idempotent:
                written = await asyncio.to_thread(sink.deliver, records)
                log.warning("in doubt -> %s: %d sent again (%d already there)", sink.name, written,
                            len(records) - written)
            else:
                with open(self.data / "in_doubt.jsonl", "a") as f:
                    f.write("".join(json.dumps({**json.loads(r.line), "sink": sink.name}) + "\n" for r in records))
                self.in_doubt_listed += len(records)
                log.error("in doubt -> %s may or may not have shown %d alerts; not resent (the sink is not "
                          "idempotent); listed in %s for the operator", sink.name, len(records),
                          self.data / "in_doubt.jsonl")

    async def _deliver(self, records: list[sinklib.AlertLine]) -> None:
        """To every sink: here, for one that can deliver without waiting (the JSON-lines file: a
        hand-off to a worker thread cost ~100 µs of CPU a batch); on a worker thread, so that the
        connections are still read meanwhile, for the others and for one whose try failed (a
        full disk: it retries there with backoff)."""
        waiting = [sink for sink in self.sinks if not sink.try_deliver(records)]
        if waiting:
            await asyncio.to_thread(_deliver_each, waiting, records)

    def _done(self, alerts: list[bytes]) -> None:
        """Outbox to delivered, on its own (no next batch carried it). Refused by the disk, the
        alerts stay in the outbox: delivered, and in doubt at the next start (sent again to the
        idempotent sinks), never lost."""
        try:
            self._sync_sinks()
            with self.env.begin(write=True) as txn:
                self._move_done(txn, alerts)
        except (lmdb.Error, OSError) as e:
            self.record_failures += 1
            log.error("delivered alerts %d-%d not recorded as done (%s; a full or failing disk?): they stay in "
                      "the outbox, in doubt at the next start", Alert.emit_seq_of(alerts[0]),
                      Alert.emit_seq_of(alerts[-1]), e)

    def _sync_sinks(self) -> None:
        """What a record says was delivered must be durable in every sink first."""
        for sink in self.sinks:
            sink.sync()

    def _move_done(self, txn, alerts: list[bytes]) -> None:
        outbox = txn.cursor(db=self.outbox)
        for raw in alerts:
            if outbox.set_key(raw[:8]):
                outbox.delete()
        txn.cursor(db=self.delivered_db).putmulti(keyed(alerts))

    def _arm_done_timer(self) -> None:
        """Record the last batch's done on its own if no next batch's intent carries it soon."""
        if self._done_timer is not None:
            self._done_timer.cancel()
        self._done_timer = asyncio.get_running_loop().call_later(DONE_ALONE_AFTER_NS / 1e9, self._done_alone)

    def _arm_record_timer(self) -> None:
        """With deliver_first: record what was delivered, at most RECORD_AFTER_NS after the first
        batch not yet recorded (never put off further: the replicas hold their alerts until then)."""
        if self._done_timer is None:
            self._done_timer = asyncio.get_running_loop().call_later(RECORD_AFTER_NS / 1e9, self._done_alone)

    def _done_alone(self) -> None:
        self._done_timer = None
        self.spawn(self._record_done())

    async def _record_done(self) -> None:
        async with self._lock:
            if not self.stopping.is_set():
                try:
                    await self._carry_out(self.core.done_due())
                except IntentNotRecorded as e:  # (deliver_first's record: a done alone only logs)
                    self._intent_failed(str(e))

    def _judge(self, copies: list[bytes]) -> None:
        recorded = list(map(self.recent.get, map(_KEY, copies)))
        if None in recorded:  # older than the recent ones, or recorded before this process started
            with self.env.begin() as txn:
                recorded = [kept if kept is not None else txn.get(raw[:8], db=self.delivered_db)
                            or txn.get(raw[:8], db=self.outbox) for raw, kept in zip(copies, recorded)]
        for i in self.core.judge_copies(copies, recorded):
            what = "was raised by no other replica" if recorded[i] is None else "differs from the one delivered"
            a = Alert.decode(copies[i])
            log.error("DIVERGENCE: alert at emit seq %d %s: %s", a.emit_seq, what, a)
