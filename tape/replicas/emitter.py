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

The JSON-lines sink writes one delivered alert a line, with its `alert_id`
(`SESSION:SEQ`), and fsyncs each batch. `TAPE_EMITTER_CRASH=POINT` (before_intent,
after_intent, after_deliver, after_done) with `TAPE_EMITTER_CRASH_AFTER=N`
makes the process die at that point of its N-th batch: the tests' crash hook.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

import lmdb

from tape.gctune import tune_gc
from tape.ops import metrics
from tape.ops.config import Config, Node
from tape.protocol import alertlink
from tape.protocol.errors import ProtocolError
from tape.replicas.audit import Alert

log = logging.getLogger("tape.emitter")
TAIL_BYTES = 4 << 20  # how much of the sink's tail is checked for ids on start


class JsonLinesSink:
    """Appends alerts as JSON lines; idempotent by alert id against its tail."""

    def __init__(self, path: Path, session: str):
        self.path = path
        self.session = session
        self.recent: set[str] = set()
        if path.exists():
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - TAIL_BYTES))
                tail = f.read()
            lines = tail.split(b"\n")
            if not tail.endswith(b"\n") and lines:  # a torn last line: cut it off
                torn = lines.pop()
                with open(path, "r+b") as f:
                    f.truncate(path.stat().st_size - len(torn))
            for line in lines:
                try:
                    self.recent.add(json.loads(line)["alert_id"])
                except (ValueError, KeyError, TypeError):
                    continue
        self._file = open(path, "ab")

    def write(self, alerts: list[Alert]) -> int:
        lines = []
        for a in alerts:
            record = a.to_dict(self.session)
            if record["alert_id"] in self.recent:
                continue
            self.recent.add(record["alert_id"])
            lines.append(json.dumps(record, separators=(",", ":")))
        if lines:
            self._file.write(("\n".join(lines) + "\n").encode())
            self._file.flush()
            os.fsync(self._file.fileno())
        return len(lines)

    def close(self) -> None:
        self._file.close()


class Emitter:
    def __init__(self, cfg: Config, node: Node):
        self.cfg = cfg
        self.node = node
        data = Path(node.data)
        data.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(data / "lmdb"), map_size=4 << 30, max_dbs=4)
        self.meta = self.env.open_db(b"meta")
        self.outbox = self.env.open_db(b"outbox")
        self.delivered_db = self.env.open_db(b"delivered")
        self.sink = JsonLinesSink(data / "alerts.jsonl", cfg.session)
        self.replicas = {n.wire_name for n in cfg.by_role("replica")}
        with self.env.begin() as txn:
            raw = txn.get(b"mark", db=self.meta)
        self.mark = int.from_bytes(raw, "big") if raw else 0
        self.delivered = 0
        self.duplicates = 0
        self.divergences = 0
        self.in_doubt = 0
        self.rejected: dict[str, int] = {}
        self.batches = 0
        self._crash_at = os.environ.get("TAPE_EMITTER_CRASH")
        self._crash_after = int(os.environ.get("TAPE_EMITTER_CRASH_AFTER", "1"))
        self._stop = asyncio.Event()
        self._recover()

    def _crash_point(self, point: str) -> None:
        if self._crash_at == point and self.batches >= self._crash_after:
            log.error("crash hook: dying %s (batch %d)", point, self.batches)
            os._exit(99)

    def _recover(self) -> None:
        with self.env.begin() as txn:
            doubt = [Alert.decode(v) for _, v in txn.cursor(db=self.outbox)]
        if not doubt:
            return
        self.in_doubt = len(doubt)
        written = self.sink.write(doubt)  # the sink skips what it already holds
        log.warning("%d alerts were in doubt after a crash (intent, no done): %d written now, %d were already "
                    "in %s; ids: %s", len(doubt), written, len(doubt) - written, self.sink.path,
                    ", ".join(a.to_dict(self.cfg.session)["alert_id"] for a in doubt[:20]))
        self._done(doubt)

    def report(self):
        yield "mark", "gauge", "highest emit seq recorded", self.mark
        yield "alerts_delivered", "counter", "alerts delivered to the sink", self.delivered
        yield "duplicates", "counter", "alert copies already delivered", self.duplicates
        yield "divergences", "counter", "alert copies differing from the delivered one", self.divergences
        yield "in_doubt", "counter", "alerts in doubt after a crash, resolved at start", self.in_doubt
        yield "rejected", "counter", "connections or frames refused, by reason", self.rejected

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        metrics.serve(self.node.metrics_port, "tape_emitter", self.node.name, self.report, self.node.host)
        server = await asyncio.start_server(self._on_replica, self.node.host, self.node.alert_port)
        log.info("emitter at mark %d, listening on :%d, sink %s", self.mark, self.node.alert_port, self.sink.path)
        await self._stop.wait()
        server.close()
        self.sink.close()
        self.env.close()
        status = {"mark": self.mark, "delivered": self.delivered, "duplicates": self.duplicates,
                  "divergences": self.divergences, "in_doubt": self.in_doubt}
        (Path(self.node.data) / "status.json").write_text(json.dumps(status, indent=1))

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    async def _on_replica(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = alertlink.Reader()
        name = None
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                fresh = []
                for kind, payload in frames.feed(data):
                    if name is None:
                        if kind != alertlink.HELLO or payload not in self.replicas:
                            self._reject("unknown_replica")
                            log.warning("refused alert connection from unknown replica %r", payload)
                            return
                        name = payload
                        writer.write(alertlink.welcome(self.mark))
                    elif kind == alertlink.ALERT:
                        try:
                            fresh.append(Alert.decode(payload))
                        except Exception:
                            self._reject("malformed_alert")
                            return
                if fresh:
                    self._handle(fresh)
                    writer.write(alertlink.ack(self.mark))
        except ProtocolError:
            self._reject("bad_frame")
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def _handle(self, alerts: list[Alert]) -> None:
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
        self.delivered += self.sink.write(new)
        self._crash_point("after_deliver")
        self._done(new)
        self._crash_point("after_done")

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


def run(cfg: Config, node_name: str) -> int:
    node = cfg.node(node_name)
    if node.role != "emitter":
        raise SystemExit(f"node {node_name} is a {node.role}, not an emitter")
    tune_gc()
    asyncio.run(Emitter(cfg, node).run())
    return 0
