"""`tape emitter`: delivers each alert exactly once; the shell around EmitterNode.

Replicas connect over TCP and send their alerts in emit-seq order. The
emitter keeps in LMDB the highest emit seq recorded (the mark), an outbox of
alerts in flight and every delivered alert (for divergence checks). Every
decision (what a link may carry, what is delivered, when to acknowledge and
record) is the node core's (replicas/emitter_node_core.py, around EmitterCore);
this shell moves the links' bytes, runs its timer and carries out its
actions: LMDB transactions and the sinks. With every sink idempotent
(deliver_first), a new batch is written to every sink, and what was delivered is recorded
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
from collections import deque
from operator import itemgetter
from pathlib import Path

import lmdb

from tape.protocol.actions import Close, Send
from tape.replicas import sinks as sinklib
from tape.replicas.audit_core import ALERT_STAMP, Alert
from tape.replicas.emitter_node_core import (
    Crash,
    DeliverAlerts,
    Divergence,
    EmitterNode,
    LookUp,
    RecordDone,
    RecordIntent,
    Redeliver,
)
from tape.runtime import links
from tape.runtime.config import webhook_secret_bytes
from tape.runtime.latency import LatencySamples
from tape.runtime.process import NodeProcess
from tape.runtime.ratelimited_log import RateLimitedLog
from tape.runtime.settings import Config, NodeSettings
from tape.runtime.tuning import CONTROL_READ, EMITTER_MAP_BYTES

ORIGIN_BYTES = 8  # of the random origin in each webhook Idempotency-Key (sinks.WebhookSink)

log = logging.getLogger("tape.emitter")
_KEY = itemgetter(slice(0, 8))
CRASH_EXIT = 99  # the fault injection's exit code: not a failure of the emitter's own


def _deliver_each(sinks: list, records: list[sinklib.AlertLine]) -> None:
    for sink in sinks:
        sink.deliver(records)


def keyed(records: list[bytes]):
    """(key, record) of each alert record: its first 8 bytes, its emit seq, are its key."""
    return zip(map(_KEY, records), records)


class Emitter(NodeProcess):
    METRICS_PREFIX = "tape_emitter"

    def __init__(self, cfg: Config, node: NodeSettings, crash_at: str | None = None, crash_after: int = 1):
        super().__init__(cfg, node, log)
        self.data = Path(node.data)
        self.data.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.data / "lmdb"), map_size=EMITTER_MAP_BYTES, max_dbs=4)
        self.meta = self.env.open_db(b"meta")
        self.outbox = self.env.open_db(b"outbox")
        self.delivered_db = self.env.open_db(b"delivered")
        self.stopping = threading.Event()  # tells a sink retrying in its thread to give up
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"mark", db=self.meta)
            origin = txn.get(b"origin", db=self.meta)
            if origin is None:  # this emitter's first start: its alerts' keys differ from any other cluster's
                origin = os.urandom(ORIGIN_BYTES).hex().encode()
                txn.put(b"origin", origin, db=self.meta)
        self.sinks = sinklib.build(node.sinks, self.data, node.webhook_url, node.webhook_timeout_ms / 1000,
                                   self.stopping, node.webhook_authorization,
                                   webhook_secret_bytes(node.webhook_secret) or b"", origin.decode())
        self.node_core = EmitterNode(  # every decision; this shell moves bytes and writes
            {n.wire_name for n in cfg.by_role("replica")}, int.from_bytes(raw, "big") if raw else 0, node.delivery,
            all(s.idempotent for s in self.sinks), crash_at, crash_after)
        for sink in self.sinks:  # with deliver_first a record syncs the sinks first (_sync_sinks), not each batch
            sink.sync_each_batch = not self.core.deliver_first
        self.latency = LatencySamples()  # the triggering purchase's stamp to delivered (wall clock: a figure only)
        self.in_doubt_listed = 0
        self._lock = asyncio.Lock()  # one event's actions at a time, whichever replica it came from
        self.record_failures = 0
        self.refusal_log = RateLimitedLog(log)
        self._timer: asyncio.TimerHandle | None = None  # at the node core's next deadline
        self._timer_due: int | None = None

    core = property(lambda self: self.node_core.core)
    mark = property(lambda self: self.node_core.core.mark)

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
        yield "rejected", "counter", "connections or frames refused, by reason", self.node_core.rejected
        yield "sink_retries", "counter", "deliveries retried, by sink", \
            {s.name: getattr(s, "retries", 0) for s in self.sinks}, "sink"
        yield "sink_refused", "counter", "alerts a sink refused for good (webhook 4xx), by sink", \
            {s.name: getattr(s, "refused", 0) for s in self.sinks}, "sink"
        webhook = next((s for s in self.sinks if s.name == "webhook"), None)
        if webhook:
            yield "webhook_config_errors", "counter", "webhook answers that say its configuration is wrong (401/403: " \
                "credentials; 3xx: the URL moved), alerts held and retried, by reason", webhook.config_errors, "reason"

    async def main(self) -> None:
        server = None
        try:
            with self.env.begin() as txn:
                doubt = [v for _, v in txn.cursor(db=self.outbox)]
            await self._carry_out(self.node_core.start(doubt, time.monotonic_ns()))
            server = await self.serve_links(self._on_replica, self.cfg.links_of(self.node), self.node.host,
                                            self.node.alert_port, self.cfg.by_role("replica"))
            log.info("emitter at mark %d, listening on :%d, sinks: %s", self.mark, self.node.alert_port,
                     ", ".join(s.name for s in self.sinks))
            await self.stop.wait()
        except sinklib.SinkStopped:
            log.warning("stopped while delivering; the alerts in flight stay in doubt for the next start")
        finally:
            self.stopping.set()
            if server is not None:
                server.close()
            async with self._lock:  # let a delivery in its thread finish or give up
                await self._carry_out(self.node_core.on_stop(time.monotonic_ns()))
                if self._timer is not None:
                    self._timer.cancel()
                for sink in self.sinks:
                    sink.close()
                self.env.close()
        c = self.core
        status = {"mark": c.mark, "delivered": c.delivered, "duplicates": c.duplicates,
                  "divergences": c.divergences, "in_doubt": c.in_doubt, "rejected": self.node_core.rejected,
                  "delivery": c.delivery, "latency_ms": self.latency.summary_ms()}
        (self.data / "status.json").write_text(json.dumps(status, indent=1))

    async def _on_replica(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.node_core.on_connected(writer, time.monotonic_ns(), links.peer_of(writer))
        try:
            while not writer.is_closing():
                data = await reader.read(CONTROL_READ)
                if not data:
                    return
                async with self._lock:
                    if self.stopping.is_set():
                        return
                    await self._carry_out(self.node_core.on_data(writer, data, time.monotonic_ns()))
        except (sinklib.SinkStopped, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.node_core.on_closed(writer, time.monotonic_ns())
            writer.close()

    # --- carrying out the node core's actions -------------------------------------------

    async def _carry_out(self, actions: list) -> None:
        """In order; what a durable step or a delivery leads to is carried out after the rest of
        its list (a refused record replaces the rest of it)."""
        queue = deque(actions)
        node = self.node_core
        while queue:
            a = queue.popleft()
            if isinstance(a, Send):
                a.conn.write(a.data)
            elif isinstance(a, Close):
                if a.reason is not None:
                    log.warning("alert link: %s (%s); connection closed", a.reason.value.replace("_", " "), a.detail)
                a.conn.close()
            elif isinstance(a, RecordIntent):
                try:
                    self._record(a)
                except (lmdb.Error, OSError) as e:  # (OSError: a sink's sync)
                    self.record_failures += 1
                    self._record_refused(e)
                    queue = deque(node.on_record_failed(a, time.monotonic_ns()))
                    continue
                queue.extend(node.on_recorded(a, time.monotonic_ns()))
            elif isinstance(a, DeliverAlerts):
                await self._deliver(sinklib.alert_lines(a.alerts, self.cfg.session))
                now = time.time_ns()
                self.latency.extend([now - stamp for (stamp,) in ALERT_STAMP.iter_unpack(Alert.joined(a.alerts))])
                queue.extend(node.on_delivered(a, time.monotonic_ns()))
            elif isinstance(a, Redeliver):
                await self._redeliver(a.alerts)
            elif isinstance(a, RecordDone):
                self._done(a.alerts)
            elif isinstance(a, LookUp):
                queue.extend(node.on_looked_up(a, self._look_up(a), time.monotonic_ns()))
            elif isinstance(a, Divergence):
                _log_divergence(a)
            elif isinstance(a, Crash):
                log.error("crash hook: dying %s (batch %d)", a.point, a.batch)
                os._exit(CRASH_EXIT)
        self._rearm()

    def _rearm(self) -> None:
        """The timer at the node core's next deadline (acks, a done alone, a record)."""
        due = self.node_core.next_deadline()
        if due == self._timer_due or self.stopping.is_set():
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = None if due is None else asyncio.get_running_loop().call_later(
            max(due - time.monotonic_ns(), 0) / 1e9, self._fire)

    def _fire(self) -> None:
        self._timer = self._timer_due = None
        self.spawn(self._on_timer())

    async def _on_timer(self) -> None:
        async with self._lock:
            if not self.stopping.is_set():
                await self._carry_out(self.node_core.on_timer(time.monotonic_ns()))

    def _record(self, a: RecordIntent) -> None:
        """The outbox (or, delivered first, the delivered alerts), the new mark and the previous
        batch's done, in one transaction (an alert record's first 8 bytes, its emit seq, are its key)."""
        if a.delivered:
            self._sync_sinks()
        with self.env.begin(write=True) as txn:
            db = self.delivered_db if a.delivered else self.outbox
            txn.cursor(db=db).putmulti(keyed(a.alerts))
            txn.put(b"mark", a.alerts[-1][:8], db=self.meta)
            self._move_done(txn, a.done)

    def _record_refused(self, error: Exception) -> None:
        """The mark is back: every replica sends again from it. Nothing was delivered, or (with
        deliver_first) the sinks, all idempotent, take again what they hold."""
        self.refusal_log.warn("intent", "alerts not recorded (%s; a full or failing disk?): every replica link "
                              "closed, they send again from mark %d (%s)", error, self.core.recorded,
                              "the sinks take again what they hold" if self.core.deliver_first
                              else "none was delivered")

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

    def _look_up(self, lookup: LookUp) -> list[bytes | None]:
        """The bytes recorded for each copy: the node core's, else the store's."""
        with self.env.begin() as txn:
            return [kept if kept is not None else txn.get(raw[:8], db=self.delivered_db)
                    or txn.get(raw[:8], db=self.outbox) for raw, kept in zip(lookup.copies, lookup.recorded)]


def _log_divergence(d: Divergence) -> None:
    if d.replica is not None:
        log.error("DIVERGENCE: %s's %s at fold seq %d; its alerts are ignored until it agrees again",
                  d.replica.decode(errors="replace").strip(), d.why.value, d.fold_seq)
    else:
        log.error("DIVERGENCE: alert at emit seq %d %s: %s", Alert.emit_seq_of(d.alert), d.why.value,
                  Alert.decode(d.alert))
