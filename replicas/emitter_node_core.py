"""Every decision of the emitter process. Pure: the node core that `tape emitter`
(replicas/emitter_shell.py) and the simulator (ops/verification/sim.py) both drive.

It reads the replicas' alert links (protocol/alertlink.py) byte by byte,
welcomes each replica with the recorded mark, hands their alerts and digests
to EmitterCore (which decides what is delivered, once), acknowledges the
recorded mark within ACK_EVERY_NS, records a batch's done alone
DONE_ALONE_AFTER_NS after its intent (or, every sink idempotent, what was
delivered RECORD_AFTER_NS after the first batch not yet recorded), judges
copies against the bytes recorded for them, and refuses what a link must not
carry. Events and the shared actions: protocol/actions.py. Its own events:

    start(in_doubt, now)           the outbox found at start (intent, no done)
    on_recorded(record, now)       a RecordIntent's transaction committed
    on_record_failed(record, now)  the disk refused it: the shell drops the rest of the list
    on_delivered(deliver, now)     every sink took a DeliverAlerts
    on_looked_up(lookup, recorded, now)  the store's bytes for a LookUp's copies
    on_stop(now)                   the process stops

Its own actions: EmitterCore's (RecordIntent, DeliverAlerts, Redeliver,
RecordDone, Crash), LookUp and Divergence. A read's alerts and digests are
taken in channel order, at most one delivery's actions at a time: what
follows a delivery is returned by on_delivered, so that a record the disk
refuses leaves nothing of the read half-done.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from itertools import islice
from operator import itemgetter
from typing import Hashable

from tape.protocol import alertlink
from tape.protocol.actions import Close, Send
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import ACK_EVERY_NS, DONE_ALONE_AFTER_NS, RECENT_ALERTS, RECORD_AFTER_NS
from tape.replicas.audit_core import ALERT_SIZE
from tape.replicas.emitter_core import (
    Crash,
    DeliverAlerts,
    EmitterCore,
    RecordDone,
    RecordIntent,
    Redeliver,
    TooFarAhead,
)

__all__ = ["Crash", "DeliverAlerts", "Divergence", "EmitterNode", "LookUp", "RecordDone", "RecordIntent", "Redeliver",
           "Reject", "Why", "keep_newest"]

_KEY = itemgetter(slice(0, 8))  # an alert record's first 8 bytes, its emit seq: its key


class Reject(Enum):
    """Why a replica's link was closed (the emitter's `rejected` metric, by value)."""

    UNKNOWN_REPLICA = "unknown_replica"
    NOT_THE_PEER = "not_the_peer"  # a hello naming another replica than the link's handshake proved
    MALFORMED_ALERT = "malformed_alert"
    UNEXPECTED_FRAME = "unexpected_frame"
    BAD_FRAME = "bad_frame"
    TOO_FAR_AHEAD = "too_far_ahead"


class Why(Enum):
    NO_QUORUM = "reached no quorum of replicas; not delivered"
    COPY_DIFFERS = "differs from the one delivered"
    COPY_UNRAISED = "was raised by no other replica"
    DIGEST_OUTVOTED = "digest differs from the one a quorum of replicas agree on: told to rebuild from seq 1"


@dataclass(frozen=True)
class LookUp:
    """Find in the store the bytes recorded for these copies (`recorded`: those known, None where
    not), then call on_looked_up."""

    copies: list
    recorded: list


@dataclass(frozen=True)
class Divergence:
    """For the operator, loudly: an alert (`alert`) or a replica (`replica`, at `fold_seq`)."""

    why: Why
    alert: bytes | None = None
    replica: bytes | None = None
    fold_seq: int = 0


def forget_oldest(kept: dict, limit: int) -> None:
    """Keep the newest `limit` entries (insertion order) of `kept` and at most an eighth more: the
    oldest are forgotten in bulk. A dict iterated from its oldest entry steps over every entry
    deleted before it (until the dict is next resized), so forgetting them one call at a time cost
    ~12 us an alert at 65,536 kept (in bulk under 1; profiling, a slow host)."""
    over = len(kept) - limit
    if over > limit >> 3:
        for key in list(islice(kept, over)):
            del kept[key]


def keep_newest(recent: dict, records: list, limit: int) -> None:
    """Add alert records (keyed by their first 8 bytes, the emit seq), in rising emit seq, and
    forget the oldest beyond `limit` (in bulk)."""
    recent.update(zip(map(_KEY, records), records))
    forget_oldest(recent, limit)


class EmitterNode:
    def __init__(self, replicas: set[bytes], mark: int = 0, delivery: str = "first", deliver_first: bool = False,
                 crash_at: str | None = None, crash_after: int = 1):
        """`mark`: the recorded one; `deliver_first`: every sink is idempotent; `crash_at`,
        `crash_after`: fault injection (EmitterCore)."""
        self.core = EmitterCore(replicas, mark, crash_at, crash_after, delivery, deliver_first=deliver_first)
        self.links: dict[Hashable, bytes | None] = {}  # connection -> the replica it named (None: no hello yet)
        self.proven: dict[Hashable, bytes | None] = {}  # connection -> the node its link proved (None: no keys)
        self.readers: dict[Hashable, alertlink.Reader] = {}
        self.by_replica: dict[bytes, Hashable] = {}  # its latest connection: where a rebuild order goes
        self.recent: dict[bytes, bytes] = {}  # key -> the bytes recorded, the newest RECENT_ALERTS
        self.rejected: dict[str, int] = {}
        self.ack_at: int | None = None  # when the recorded mark is next told
        self.done_at: int | None = None  # when what was delivered is next recorded
        self.delivering = False  # a DeliverAlerts is out, on_delivered not yet called
        self._backlog: deque = deque()  # the rest of a read, behind a delivery: (conn, kind, payloads)

    def start(self, in_doubt: list[bytes], now: int) -> list:
        return self.core.recover(in_doubt)

    def next_deadline(self) -> int | None:
        due = [t for t in (self.ack_at, self.done_at) if t is not None]
        return min(due) if due else None

    # --- the links ---------------------------------------------------------------------

    def on_connected(self, conn: Hashable, now: int, peer: bytes | None = None) -> list:
        """`peer`: the node the link's handshake proved it is (None on a link without keys)."""
        self.links[conn] = None
        self.proven[conn] = peer
        self.readers[conn] = alertlink.Reader()
        return []

    def on_closed(self, conn: Hashable, now: int) -> list:
        name = self.links.pop(conn, None)
        self.proven.pop(conn, None)
        self.readers.pop(conn, None)
        if name is not None and self.by_replica.get(name) == conn:
            del self.by_replica[name]
        self._backlog = deque(item for item in self._backlog if item[0] != conn)
        return []

    def on_data(self, conn: Hashable, data: bytes, now: int) -> list:
        """A read's frames: the hello first, then alerts and digests. A read holding anything else
        is refused whole (nothing of it taken: the link closes)."""
        reader = self.readers.get(conn)
        if reader is None:
            return []  # closed already: what was in flight on it counts for nothing
        try:
            runs = reader.runs(data)
        except ProtocolError as e:
            return self._reject(conn, Reject.BAD_FRAME, str(e))
        out = []
        if runs and self.links[conn] is None:  # the first frame: the replica's hello
            kind, payloads = runs[0]
            out += self._hello(conn, kind, payloads[0])
            if self.links.get(conn) is None:
                return out
            runs[0] = (kind, payloads[1:])
        refusal = self._refusal(conn, [run for run in runs if run[1]])
        if refusal:
            return out + refusal
        self._backlog.extend((conn, kind, payloads) for kind, payloads in runs if payloads)
        return out + self._take_backlog(now)

    def _refusal(self, conn: Hashable, runs: list) -> list:
        name = self.links[conn]
        for kind, payloads in runs:
            if kind == alertlink.ALERT and not set(map(len, payloads)) <= {ALERT_SIZE}:
                size = next(len(p) for p in payloads if len(p) != ALERT_SIZE)
                return self._reject(conn, Reject.MALFORMED_ALERT, f"from {name!r}: {size} bytes, not {ALERT_SIZE}")
            if kind not in (alertlink.ALERT, alertlink.DIGEST) or \
                    (kind == alertlink.DIGEST and set(map(len, payloads)) != {alertlink.FOLD.size}):
                return self._reject(conn, Reject.UNEXPECTED_FRAME, f"type {kind!r} from {name!r}")
        return []

    def _hello(self, conn: Hashable, kind: int, name: bytes) -> list:
        proven = self.proven.get(conn)
        if kind == alertlink.HELLO and proven is not None and name != proven:
            return self._reject(conn, Reject.NOT_THE_PEER, f"hello {name[:16]!r} on {proven!r}'s link")
        mark = self.core.on_hello(name) if kind == alertlink.HELLO else None
        if mark is None:
            return self._reject(conn, Reject.UNKNOWN_REPLICA, f"hello {name[:16]!r}")
        self.links[conn] = name
        self.by_replica[name] = conn
        out = [Send(conn, alertlink.welcome(mark))]
        if name in self.core.diverged:  # (one that already rebuilds for it ignores this)
            out.append(Send(conn, alertlink.rebuild(self.core.diverged[name])))
        return out

    def _reject(self, conn: Hashable, reason: Reject, detail: str) -> list:
        self.rejected[reason.value] = self.rejected.get(reason.value, 0) + 1
        self.on_closed(conn, 0)
        return [Close(conn, reason, detail)]

    def _take_backlog(self, now: int) -> list:
        """The read's runs in order, until one starts a delivery (the rest waits for on_delivered)."""
        out = []
        while self._backlog and not self.delivering:
            conn, kind, payloads = self._backlog.popleft()
            if kind == alertlink.ALERT:
                out += self._alerts(conn, self.links[conn], payloads)
            else:
                for payload in payloads:
                    out += self._digest(self.links[conn], *alertlink.FOLD.unpack(payload))
        return out

    def _alerts(self, conn: Hashable, name: bytes, alerts: list[bytes]) -> list:
        try:
            new, copies, alarms = self.core.on_alerts(name, alerts)
        except TooFarAhead as e:
            return self._reject(conn, Reject.TOO_FAR_AHEAD, f"{name!r}: {e}")
        return self._judge(copies) + self._settled(new, alarms)

    def _digest(self, name: bytes, fold_seq: int, chain: bytes) -> list:
        rebuild, ready, alarms = self.core.on_digest(name, fold_seq, chain)
        out = []
        for r in rebuild:
            out.append(Divergence(Why.DIGEST_OUTVOTED, replica=r, fold_seq=fold_seq))
            if r in self.by_replica:
                out.append(Send(self.by_replica[r], alertlink.rebuild(fold_seq)))
        return out + self._settled(ready, alarms)

    def _settled(self, new: list[bytes], alarms: list[bytes]) -> list:
        out = [Divergence(Why.NO_QUORUM, alert=raw) for raw in alarms]
        if new:
            self.delivering = True
            out += self.core.deliver(new)
        return out

    # --- copies --------------------------------------------------------------------------

    def _judge(self, copies: list[bytes]) -> list:
        if not copies:
            return []
        recorded = list(map(self.recent.get, map(_KEY, copies)))
        if None in recorded:  # older than the recent ones, or recorded before this process started
            return [LookUp(copies, recorded)]
        return self.on_looked_up(LookUp(copies, recorded), recorded, 0)

    def on_looked_up(self, lookup: LookUp, recorded: list[bytes | None], now: int) -> list:
        return [Divergence(Why.COPY_UNRAISED if recorded[i] is None else Why.COPY_DIFFERS, alert=lookup.copies[i])
                for i in self.core.judge_copies(lookup.copies, recorded)]

    # --- what the shell carried out ---------------------------------------------------------

    def on_recorded(self, record: RecordIntent, now: int) -> list:
        self.core.on_recorded(record)
        if self.ack_at is None:
            self.ack_at = now + ACK_EVERY_NS
        if not record.delivered:  # (delivered first: kept as they were delivered)
            keep_newest(self.recent, record.alerts, RECENT_ALERTS)  # copies are judged by these bytes
            self.done_at = now + DONE_ALONE_AFTER_NS  # its done alone, unless the next intent carries it
        return []

    def on_record_failed(self, record: RecordIntent, now: int) -> list:
        """The mark is back: every link closes, and each replica sends again from it."""
        self.core.on_intent_failed(record)
        self.delivering = False
        out = [Close(conn) for conn in self.links]
        for conn in list(self.links):
            self.on_closed(conn, now)
        return out

    def on_delivered(self, deliver: DeliverAlerts, now: int) -> list:
        self.delivering = False
        if self.core.deliver_first:
            keep_newest(self.recent, deliver.alerts, RECENT_ALERTS)
            if self.done_at is None:  # never put off: the replicas hold their alerts until it is recorded
                self.done_at = now + RECORD_AFTER_NS
        return self._take_backlog(now)

    def on_timer(self, now: int) -> list:
        out = []
        if self.ack_at is not None and now >= self.ack_at:
            self.ack_at = None
            due = self.core.acks_due(sorted({r for r in self.links.values() if r is not None}))
            out += [Send(conn, alertlink.ack(due[r])) for conn, r in self.links.items() if r in due]
            # (every connection naming it: without keys, a stranger's hello may name a real replica)
        if self.done_at is not None and now >= self.done_at and not self.delivering:
            self.done_at = None
            out += self.core.done_due()
        return out

    def on_stop(self, now: int) -> list:
        """The last batch reached every sink: its done is due, not a doubt (one stopped on its
        way to the sinks stays in doubt for the next start)."""
        self.ack_at = self.done_at = None
        return [] if self.delivering else self.core.done_due()
