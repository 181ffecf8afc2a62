"""Where the emitter delivers alerts: a JSON-lines file, an HTTP webhook, stdout.

Each sink takes a batch of alerts (AlertLine: the id and the JSON line) and
returns once they are delivered, raising SinkStopped if the emitter is
stopping first. `try_deliver` is one attempt that never waits (True if
delivered; the webhook, which waits on the network, and stdout, which may
be a pipe to a slow reader, never try): the emitter calls it on its own
thread, since a hand-off to a worker thread cost ~100 µs of CPU a batch
here, and hands the batch to `deliver` on a worker thread only if it
fails. `idempotent` says whether delivering the
same alert twice is harmless: after a crash, alerts in doubt are sent
again to idempotent sinks and listed for the operator for the others.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import os
import sys
import threading
import time
import urllib.parse
from operator import itemgetter
from pathlib import Path
from typing import Callable, NamedTuple

import tenacity

from tape.replicas.audit_core import ALERT_RECORD, Alert
from tape.replicas.emitter_node_core import forget_oldest
from tape.runtime.settings import NodeSettings, default_of
from tape.runtime.tuning import IDS_KEPT, SINK_RETRY_FIRST_S, SINK_RETRY_MAX_S, TAIL_BYTES

try:
    from tape.replicas._alertlines import alert_lines as _alert_lines_c
except ImportError:  # built without a C compiler
    _alert_lines_c = None

WEBHOOK_TIMEOUT_S = default_of(NodeSettings, "webhook_timeout_ms") / 1000

log = logging.getLogger("tape.emitter")


class SinkStopped(Exception):
    """The emitter is stopping; the batch was not (known to be) delivered."""


def until_done(attempt: Callable[[], bool], stopping: threading.Event, first_s: float, max_s: float,
               on_retry: Callable[[float], None], what: str) -> None:
    """Call `attempt` until it says it is done: `first_s` after a failure, twice as long after each
    next, at most `max_s` apart. Raises SinkStopped(what) once `stopping` is set after a failure;
    the wait is on `stopping`, so a stop ends it at once, with no attempt after it (a webhook's
    would wait out its timeout). `on_retry(delay)` before each wait."""
    def wait(seconds: float) -> None:
        if stopping.wait(seconds):
            raise SinkStopped(what)

    retrying = tenacity.Retrying(
        wait=tenacity.wait_exponential(multiplier=first_s, max=max_s),
        retry=tenacity.retry_if_result(lambda done: not done),  # an exception is raised, not retried
        stop=lambda state: stopping.is_set(),
        sleep=wait,
        before_sleep=lambda state: on_retry(state.next_action.sleep))
    try:
        retrying(attempt)
    except tenacity.RetryError:
        raise SinkStopped(what) from None


class AlertLine(NamedTuple):
    """An alert as every sink delivers it: its id (the idempotency key) and its JSON line."""
    alert_id: str
    line: str


_ID = itemgetter(0)  # an AlertLine's alert_id


# An alert's line: json.dumps of its Alert.to_dict (these keys in this order), written straight from
# the record's bytes by one format and json's own string escaping: 3.3 -> 2.4 us an alert against
# decoding it, making the dict and formatting that (profiling, a slow host).
_ALERT_KEYS = ("alert_id", "emit_seq", "purchase_seq", "purchase_id", "order_id", "client", "stock", "requested",
               "cumulative", "stamp_ns")
_ALERT_LINE = "{" + ",".join(f'"{k}":' + ("%s" if k in ("alert_id", "client", "stock") else "%d")
                             for k in _ALERT_KEYS) + "}"
_STRING = json.encoder.encode_basestring_ascii  # (what json.dumps quotes and escapes a string with)


def alert_lines_pure(records: list[bytes], session: str) -> list[AlertLine]:
    """The sinks' form of alert records (replicas.audit.Alert.encode's bytes): each line byte for byte
    json.dumps(Alert.decode(record).to_dict(session), separators=(",", ":"))."""
    out = []
    prefix = session + ":"
    for e, p, pid, oid, req, client, stock, cum, stamp, _ in ALERT_RECORD.iter_unpack(Alert.joined(records)):
        alert_id = prefix + str(p)
        out.append(AlertLine(alert_id, _ALERT_LINE % (
            _STRING(alert_id), e, p, pid, oid, _STRING(client.decode("ascii", "replace").rstrip()),
            _STRING(stock.decode("ascii", "replace").rstrip()), req, cum, stamp)))
    return out


def alert_lines(records: list[bytes], session: str) -> list[AlertLine]:
    """alert_lines_pure, in C for a session named in ASCII (every one a config accepts): 3.3 -> 0.67 us
    an alert (profiling, a host at 0.4x its speed), about a tenth of what its three copies cost the
    emitter (docs/decisions.md)."""
    if _alert_lines_c is None or not session.isascii():
        return alert_lines_pure(records, session)
    prefix = session + ":"
    return _alert_lines_c(Alert.joined(records), prefix, _STRING(prefix)[1:-1], AlertLine)


def _text(records: list[AlertLine]) -> str:
    return "".join([r.line + "\n" for r in records])


def _lines(records: list[AlertLine]) -> bytes:
    return _text(records).encode()


class JsonLinesSink:
    """Appends one alert a line; idempotent by alert id against its own tail, which
    it reads (and cuts a torn last line off) on open. A write the disk refuses
    (full) is cut back off and tried again with backoff, the alerts held in order,
    as the webhook holds them while its endpoint fails.

    Durable each batch (`sync_each_batch`), or when `sync` is called: with every
    sink idempotent the emitter records what was delivered only every few dozen
    milliseconds and syncs the file just before, so that the record never covers
    a line the file could lose (one fsync a record, not one a batch: ~0.11 µs of
    CPU a message at 250,000 msg/s, docs/performance.md). A sync the disk refuses
    cuts the file back to what the last one made durable and forgets those ids:
    the emitter's record fails with it, and the alerts come again from the replicas."""

    idempotent = True
    name = "jsonl"
    sync_each_batch = True

    def __init__(self, path: Path, backoff_s: float = SINK_RETRY_FIRST_S, max_backoff_s: float = SINK_RETRY_MAX_S,
                 stopping: threading.Event | None = None):
        self.path = path
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.stopping = stopping or threading.Event()
        self.retries = 0
        self.recent: dict[str, None] = {}  # the newest IDS_KEPT ids written, in order
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
                    self.recent[json.loads(line)["alert_id"]] = None
                except (ValueError, KeyError, TypeError):
                    continue
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._synced_size = os.lseek(self._fd, 0, os.SEEK_END)  # what the last fsync made durable
        self._unsynced: list[str] = []  # ids written since (sync_each_batch False)

    def _fresh(self, records: list[AlertLine]) -> tuple[list[AlertLine], list[str]]:
        """Those not written yet (by their ids: after a crash they come again), and their ids."""
        ids = list(map(_ID, records))
        if self.recent.keys().isdisjoint(ids):  # (the usual case, in one call)
            return records, ids
        fresh = [r for r in records if r.alert_id not in self.recent]
        return fresh, list(map(_ID, fresh))

    def deliver(self, records: list[AlertLine]) -> int:
        fresh, ids = self._fresh(records)
        if fresh:
            data = _lines(fresh)
            until_done(lambda: self._append(data), self.stopping, self.backoff_s, self.max_backoff_s,
                       self._retrying, fresh[0].alert_id)
            self._written(ids)
        return len(fresh)

    def _retrying(self, delay: float) -> None:
        self.retries += 1

    def try_deliver(self, records: list[AlertLine]) -> bool:
        fresh, ids = self._fresh(records)
        if fresh and not self._append(_lines(fresh)):
            return False
        self._written(ids)
        return True

    def _written(self, ids: list[str]) -> None:
        self.recent.update(dict.fromkeys(ids))
        forget_oldest(self.recent, IDS_KEPT)
        if not self.sync_each_batch:
            self._unsynced += ids

    def _append(self, data: bytes) -> bool:
        """Write `data` whole (and fsync it, `sync_each_batch`), or cut back what was written and say False."""
        size = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if self.sync_each_batch:
                os.fdatasync(self._fd)
                self._synced_size = size + len(data)
            return True
        except OSError as e:
            os.ftruncate(self._fd, size)
            log.warning("%s: %d bytes of alerts not written (%s); retrying", self.path, len(data), e)
            return False

    def sync(self) -> None:
        """Make every line written durable. Raises OSError if the disk refuses: the file is cut
        back to what the last sync made durable and those ids are forgotten (written again when
        they come again)."""
        if not self._unsynced:
            return
        try:
            os.fdatasync(self._fd)
        except OSError:
            os.ftruncate(self._fd, self._synced_size)
            for alert_id in self._unsynced:
                self.recent.pop(alert_id, None)
            self._unsynced = []
            raise
        self._synced_size = os.lseek(self._fd, 0, os.SEEK_END)
        self._unsynced = []

    def close(self) -> None:
        try:
            self.sync()
        except OSError as e:  # (not recorded either: the replicas send them again)
            log.warning("%s: the last alerts written were not made durable at close (%s)", self.path, e)
        os.close(self._fd)


class StdoutSink:
    """One alert a line on standard output. Not idempotent: alerts in doubt
    after a crash are listed for the operator rather than printed again."""

    idempotent = False
    name = "stdout"

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def deliver(self, records: list[AlertLine]) -> int:
        self.stream.write(_text(records))
        self.stream.flush()
        return len(records)

    def try_deliver(self, records: list[AlertLine]) -> bool:
        return False  # a pipe to a slow reader waits: only on a worker thread

    def sync(self) -> None:
        pass  # what it printed is the reader's

    def close(self) -> None:
        pass


def redacted(url: str) -> str:
    """The URL as logs show it: scheme, host and port; a path, query or user (where tokens live) as …."""
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}" + ("/…" if parts.path.strip("/") or parts.query else "")


class WebhookSink:
    """POSTs each alert as JSON with an `Idempotency-Key` header of its alert id
    and this emitter's `origin` (`TAPE:42/<16 hex>`: random, made at the
    emitter's first start and kept in its LMDB), so that a receiver can drop
    the second copy of an alert resent after a crash, and two clusters of one
    session name posting to one receiver never share a key; with a secret,
    signed as Standard Webhooks specifies
    (`webhook-id`, `webhook-timestamp`, `webhook-signature`). Retries network
    errors, 5xx, 408, 425 and 429 with exponential back-off (capped) until
    delivered or the emitter stops: alerts are delivered in order, so a down
    endpoint holds the emitter back rather than losing alerts. 401, 403 and
    3xx say the sink's configuration is wrong (credentials; a URL that
    moved, not followed: a redirect could send alerts elsewhere): held and
    retried too, counted in `config_errors` by reason and logged as such.
    Any other 4xx is a refusal: logged, counted, not retried. Logs show the
    URL redacted (`redacted`)."""

    idempotent = True
    name = "webhook"
    RETRY_STATUS = {408, 425, 429}
    CONFIG_STATUS = {401: "unauthorized", 403: "unauthorized"}  # and every 3xx: "redirect"

    def __init__(self, url: str, timeout_s: float = WEBHOOK_TIMEOUT_S, backoff_s: float = SINK_RETRY_FIRST_S,
                 max_backoff_s: float = SINK_RETRY_MAX_S, stopping: threading.Event | None = None,
                 authorization: str = "", secret: bytes = b"", origin: str = "",
                 clock: Callable[[], float] = time.time):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("webhook_url: expected http(s)://host[:port]/path")
        self.url = url
        self.shown = redacted(url)
        self.parts = parts
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stopping = stopping or threading.Event()
        self.authorization = authorization
        self.secret = secret
        self.origin = origin
        self.clock = clock  # the signature's timestamp (a receiver refuses one too old: replay)
        self.retries = 0
        self.refused = 0
        self.config_errors = {"unauthorized": 0, "redirect": 0}
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.parts.scheme == "https" else http.client.HTTPConnection
            self._conn = cls(self.parts.hostname, self.parts.port, timeout=self.timeout_s)
        return self._conn

    def headers(self, record: AlertLine, body: bytes) -> dict[str, str]:
        key = f"{record.alert_id}/{self.origin}" if self.origin else record.alert_id
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if self.authorization:
            headers["Authorization"] = self.authorization
        if self.secret:
            stamp = str(int(self.clock()))
            signed = f"{key}.{stamp}.".encode() + body
            mac = base64.b64encode(hmac.new(self.secret, signed, hashlib.sha256).digest()).decode()
            headers.update({"webhook-id": key, "webhook-timestamp": stamp,
                            "webhook-signature": f"v1,{mac}"})
        return headers

    def _post(self, record: AlertLine) -> tuple[int, str]:
        """(the answer's status, its Location header or "")."""
        path = self.parts.path or "/"
        if self.parts.query:
            path += "?" + self.parts.query
        conn = self._connection()
        body = record.line.encode()
        try:
            conn.request("POST", path, body=body, headers=self.headers(record, body))
            response = conn.getresponse()
            response.read()
            return response.status, response.getheader("Location", "")
        except (OSError, http.client.HTTPException):
            conn.close()
            self._conn = None
            raise

    def try_deliver(self, records: list[AlertLine]) -> bool:
        return False  # it waits on the network: only on a worker thread

    def sync(self) -> None:
        pass  # delivered means the receiver answered 2xx

    def deliver(self, records: list[AlertLine]) -> int:
        for record in records:
            if self.stopping.is_set():
                raise SinkStopped(record.alert_id)
            until_done(lambda: self._attempt(record), self.stopping, self.backoff_s, self.max_backoff_s,
                       lambda delay: self._retrying(record, delay), record.alert_id)
        return len(records)

    def _attempt(self, record: AlertLine) -> bool:
        """One POST: True once the receiver took the alert or refused it for good."""
        try:
            status, location = self._post(record)
        except (OSError, http.client.HTTPException) as e:
            self._problem = type(e).__name__  # (its text may name the URL's host and path)
            return False
        if 200 <= status < 300:
            return True
        reason = "redirect" if 300 <= status < 400 else self.CONFIG_STATUS.get(status)
        if reason:
            self.config_errors[reason] += 1
            self._problem = (f"HTTP {status}: check webhook_authorization and webhook_secret" if reason ==
                             "unauthorized" else f"HTTP {status}: webhook_url moved to "
                             f"{redacted(location) if location else 'an address not given'}; set it there "
                             f"(redirects are not followed)")
            return False
        if 400 <= status < 500 and status not in self.RETRY_STATUS:
            self.refused += 1
            log.error("webhook %s refused alert %s with HTTP %d; not retrying", self.shown, record.alert_id, status)
            return True
        self._problem = f"HTTP {status}"
        return False

    def _retrying(self, record: AlertLine, delay: float) -> None:
        self.retries += 1
        log.warning("webhook %s: alert %s not delivered (%s); retrying in %.2f s", self.shown, record.alert_id,
                    self._problem, delay)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def build(kinds: list[str], data: Path, webhook_url: str = "", webhook_timeout_s: float = WEBHOOK_TIMEOUT_S,
          stopping: threading.Event | None = None, authorization: str = "", secret: bytes = b"",
          origin: str = "") -> list:
    sinks = []
    for kind in kinds:
        if kind == "jsonl":
            sinks.append(JsonLinesSink(data / "alerts.jsonl", stopping=stopping))
        elif kind == "stdout":
            sinks.append(StdoutSink())
        elif kind == "webhook":
            sinks.append(WebhookSink(webhook_url, webhook_timeout_s, stopping=stopping, authorization=authorization,
                                     secret=secret, origin=origin))
        else:
            raise ValueError(f"unknown sink {kind!r} (jsonl, webhook, stdout)")
    return sinks
