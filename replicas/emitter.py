"""`tape emitter`: delivers each alert exactly once.

Replicas connect over TCP and send their alerts in emit-seq order. The
emitter keeps in LMDB the highest emit seq recorded (the mark), an outbox of
alerts in flight and every delivered alert (for divergence checks):

- an alert at or below the mark is a duplicate; if its bytes differ from the
  delivered one, that is a divergence alarm (log, metric, report);
- a new alert is delivered as: record intent (outbox + mark, one
  transaction) -> write to the sink -> record done. Alerts that arrive
  together are delivered as one batch (one transaction, one sink write);
- on start, alerts with intent but no done are in doubt: they are written
  again to the JSON-lines sink, which checks its own tail so that it never
  holds an alert twice, and listed in the log for the operator.

Sinks (`sinks` in the emitter's [[node]]; see replicas/sinks.py): the
JSON-lines file `alerts.jsonl` (default), an HTTP webhook and stdout. Each
alert is delivered to every sink, one batch at a time, in emit-seq order.
Alerts in doubt are resent only to the idempotent sinks (JSON-lines, webhook)
and written to `in_doubt.jsonl` for the operator when a non-idempotent sink
(stdout) may or may not have shown them. `TAPE_EMITTER_CRASH=POINT` (before_intent,
after_intent, after_deliver, after_done) with `TAPE_EMITTER_CRASH_AFTER=N`
makes the process die at that point of its N-th batch: the tests' crash hook.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

import lmdb

from tape.node.process import NodeProcess
from tape.node.settings import Config, Node
from tape.protocol import alertlink
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import CONTROL_READ
from tape.replicas import sinks as sinklib
from tape.replicas.audit import Alert

log = logging.getLogger("tape.emitter")


class Emitter(NodeProcess):
    METRICS_PREFIX = "tape_emitter"

    def __init__(self, cfg: Config, node: Node):
        super().__init__(node.name, log)
        self.cfg = cfg
        self.node = node
        self.data = Path(node.data)
        self.data.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.data / "lmdb"), map_size=4 << 30, max_dbs=4)
        self.meta = self.env.open_db(b"meta")
        self.outbox = self.env.open_db(b"outbox")
        self.delivered_db = self.env.open_db(b"delivered")
        self.stopping = threading.Event()  # tells a sink retrying in its thread to give up
        self.sinks = sinklib.build(node.sinks, self.data, node.webhook_url, node.webhook_timeout_ms / 1000,
                                   self.stopping)
        self.replicas = {n.wire_name for n in cfg.by_role("replica")}
        with self.env.begin() as txn:
            raw = txn.get(b"mark", db=self.meta)
        self.mark = int.from_bytes(raw, "big") if raw else 0
        self.delivered = 0
        self.duplicates = 0
        self.divergences = 0
        self.in_doubt = 0
        self.in_doubt_listed = 0
        self.rejected: dict[str, int] = {}
        self.batches = 0
        self._crash_at = os.environ.get("TAPE_EMITTER_CRASH")
        self._crash_after = int(os.environ.get("TAPE_EMITTER_CRASH_AFTER", "1"))
        self._lock = asyncio.Lock()  # one delivery at a time, whichever replica it came from

    def _crash_point(self, point: str) -> None:
        if self._crash_at == point and self.batches >= self._crash_after:
            log.error("crash hook: dying %s (batch %d)", point, self.batches)
            os._exit(99)

    def _records(self, alerts: list[Alert]) -> list[dict]:
        return [a.to_dict(self.cfg.session) for a in alerts]

    async def _recover(self) -> None:
        """Alerts with intent but no done: resend to idempotent sinks, list for the operator otherwise."""
        with self.env.begin() as txn:
            doubt = [Alert.decode(v) for _, v in txn.cursor(db=self.outbox)]
        if not doubt:
            return
        self.in_doubt = len(doubt)
        records = self._records(doubt)
        ids = ", ".join(r["alert_id"] for r in records[:20])
        log.warning("%d alerts were in doubt after a crash (intent, no done): %s", len(doubt), ids)
        for sink in self.sinks:
            if sink.idempotent:
                written = await asyncio.to_thread(sink.deliver, records)
                log.warning("in doubt -> %s: %d sent again (%d already there)", sink.name, written,
                            len(records) - written)
            else:
                with open(self.data / "in_doubt.jsonl", "a") as f:
                    f.write("".join(json.dumps({**r, "sink": sink.name}) + "\n" for r in records))
                self.in_doubt_listed += len(records)
                log.error("in doubt -> %s may or may not have shown %d alerts; not resent (the sink is not "
                          "idempotent); listed in %s for the operator", sink.name, len(records),
                          self.data / "in_doubt.jsonl")
        self._done(doubt)

    def report(self):
        yield "mark", "gauge", "highest emit seq recorded", self.mark
        yield "alerts_delivered", "counter", "alerts delivered to the sinks", self.delivered
        yield "duplicates", "counter", "alert copies already delivered", self.duplicates
        yield "divergences", "counter", "alert copies differing from the delivered one", self.divergences
        yield "in_doubt", "counter", "alerts in doubt after a crash, resolved at start", self.in_doubt
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
            await self._recover()
            server = await asyncio.start_server(self._on_replica, self.node.host, self.node.alert_port)
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
                for sink in self.sinks:
                    sink.close()
                self.env.close()
        status = {"mark": self.mark, "delivered": self.delivered, "duplicates": self.duplicates,
                  "divergences": self.divergences, "in_doubt": self.in_doubt, "rejected": self.rejected}
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
                for kind, payload in frames.feed(data):
                    if name is None:
                        if kind != alertlink.HELLO or payload not in self.replicas:
                            return self._reject("unknown_replica", f"hello {payload[:16]!r}")
                        name = payload
                        writer.write(alertlink.welcome(self.mark))
                    elif kind == alertlink.ALERT:
                        try:
                            fresh.append(Alert.decode(payload))
                        except Exception as e:
                            return self._reject("malformed_alert", f"from {name!r}: {e}")
                    else:
                        return self._reject("unexpected_frame", f"type {kind!r} from {name!r}")
                if fresh:
                    await self._handle(fresh)
                    writer.write(alertlink.ack(self.mark))
        except ProtocolError as e:
            self._reject("bad_frame", str(e))
        except sinklib.SinkStopped:
            pass
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, alerts: list[Alert]) -> None:
        async with self._lock:
            if self.stopping.is_set():
                raise sinklib.SinkStopped("stopping")
            new = []
            for a in alerts:
                if a.emit_seq <= self.mark or (new and a.emit_seq <= new[-1].emit_seq):
                    self._check_copy(a)
                else:
                    new.append(a)
            if not new:
                return
            self.batches += 1
            self._crash_point("before_intent")
            with self.env.begin(write=True) as txn:
                for a in new:
                    txn.put(a.emit_seq.to_bytes(8, "big"), a.encode(), db=self.outbox)
                txn.put(b"mark", new[-1].emit_seq.to_bytes(8, "big"), db=self.meta)
            self.mark = new[-1].emit_seq
            self._crash_point("after_intent")
            records = self._records(new)
            await asyncio.to_thread(self._deliver_all, records)
            self.delivered += len(new)
            self._crash_point("after_deliver")
            self._done(new)
            self._crash_point("after_done")

    def _deliver_all(self, records: list[dict]) -> None:
        for sink in self.sinks:
            sink.deliver(records)

    def _done(self, alerts: list[Alert]) -> None:
        with self.env.begin(write=True) as txn:
            for a in alerts:
                key = a.emit_seq.to_bytes(8, "big")
                txn.delete(key, db=self.outbox)
                txn.put(key, a.encode(), db=self.delivered_db)

    def _check_copy(self, a: Alert) -> None:
        with self.env.begin() as txn:
            known = txn.get(a.emit_seq.to_bytes(8, "big"), db=self.delivered_db)
            if known is None:
                known = txn.get(a.emit_seq.to_bytes(8, "big"), db=self.outbox)
        if known is None:
            # Channels are ordered and replicas deterministic: another replica
            # would have raised it first. This one alone did.
            self.divergences += 1
            log.error("DIVERGENCE: alert at emit seq %d was raised by no other replica: %s", a.emit_seq, a)
        elif bytes(known) != a.encode():
            self.divergences += 1
            log.error("DIVERGENCE: alert at emit seq %d differs from the one delivered: %s", a.emit_seq, a)
        else:
            self.duplicates += 1

