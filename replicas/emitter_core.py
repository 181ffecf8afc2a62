"""The emitter's decisions: every alert delivered once, in emit-seq order. Pure.

Events in: a replica's hello, a batch of alerts from one replica's ordered
channel, what the store recorded for an alert seen again, and the alerts
found in doubt at start. Actions out, carried out in order by the shell
(replicas/emitter.py):

    RecordIntent(alerts)   the outbox and the new mark, in one durable transaction
    DeliverAlerts(alerts)        to every sink
    Redeliver(alerts)      alerts in doubt after a crash: again to the idempotent
                           sinks, listed for the operator for the others
    RecordDone(alerts)     outbox -> delivered, in one durable transaction
    Crash(point)           fault injection for tests and drills: die here

The mark is the highest emit seq recorded. Replicas are deterministic and
each channel is ordered, so an alert above the mark is new and the first
copy wins; one at or below it was recorded before: the same bytes are a
duplicate, other bytes (or none recorded at all) a divergence alarm.
"""

from __future__ import annotations

from dataclasses import dataclass

from tape.replicas.audit import Alert

CRASH_POINTS = ("before_intent", "after_intent", "after_deliver", "after_done")


@dataclass(frozen=True)
class RecordIntent:
    alerts: list


@dataclass(frozen=True)
class DeliverAlerts:
    alerts: list


@dataclass(frozen=True)
class Redeliver:
    alerts: list


@dataclass(frozen=True)
class RecordDone:
    alerts: list


@dataclass(frozen=True)
class Crash:
    point: str
    batch: int


EmitterAction = RecordIntent | DeliverAlerts | Redeliver | RecordDone | Crash


class EmitterCore:
    def __init__(self, replicas: set[bytes], mark: int = 0, crash_at: str | None = None, crash_after: int = 1):
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash point {crash_at!r}: one of {', '.join(CRASH_POINTS)}")
        self.replicas = replicas
        self.mark = mark
        self.crash_at = crash_at
        self.crash_after = crash_after
        self.batches = 0
        self.delivered = 0
        self.duplicates = 0
        self.divergences = 0
        self.in_doubt = 0

    def on_hello(self, replica: bytes) -> int | None:
        """The mark to welcome a replica with (it resends what follows), or None: not a replica of ours."""
        return self.mark if replica in self.replicas else None

    def on_alerts(self, alerts: list[Alert]) -> tuple[list[Alert], list[Alert]]:
        """(new alerts to deliver, copies of recorded ones to judge) of one channel's batch."""
        new, copies = [], []
        for a in alerts:
            if a.emit_seq <= self.mark or (new and a.emit_seq <= new[-1].emit_seq):
                copies.append(a)
            else:
                new.append(a)
        return new, copies

    def deliver(self, new: list[Alert]) -> list[EmitterAction]:
        """Intent, deliver, done: the steps for new alerts, which move the mark."""
        assert new and new[0].emit_seq > self.mark, "only alerts above the mark are delivered"
        self.batches += 1
        self.mark = new[-1].emit_seq
        self.delivered += len(new)
        steps = [RecordIntent(new), DeliverAlerts(new), RecordDone(new)]
        out = []
        for point, step in zip(CRASH_POINTS, [*steps, None]):
            if point == self.crash_at and self.batches >= self.crash_after:
                out.append(Crash(point, self.batches))
            if step is not None:
                out.append(step)
        return out

    def judge_copy(self, alert: Alert, recorded: bytes | None) -> bool:
        """A copy of an alert at or below the mark, against the bytes recorded for its
        emit seq: True if it is a duplicate (harmless), False if a divergence alarm."""
        if recorded is not None and bytes(recorded) == alert.encode():
            self.duplicates += 1
            return True
        self.divergences += 1
        return False

    def recover(self, in_doubt: list[Alert]) -> list[EmitterAction]:
        """At start: alerts with intent and no done may or may not have reached the sinks."""
        if not in_doubt:
            return []
        self.in_doubt += len(in_doubt)
        return [Redeliver(in_doubt), RecordDone(in_doubt)]
