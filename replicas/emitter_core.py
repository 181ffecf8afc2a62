"""The emitter's decisions: every alert delivered once, in emit-seq order. Pure.

Events in: a replica's hello, a batch of alerts from one replica's ordered
channel, what the store recorded for an alert seen again, and the alerts
found in doubt at start. Alerts are their records' bytes as replicas send
them (replicas.audit.Alert.encode), read only for their emit seq: copies
are judged and votes counted by bytes, and the shell decodes only what it
delivers. Actions out, carried out in order by the shell
(replicas/emitter_shell.py):

    RecordIntent(alerts, done)  the outbox and the new mark, and the previous
                           batch's done, in one durable transaction (delivered=True:
                           the alerts went to the sinks first, straight to delivered)
    DeliverAlerts(alerts)  to every sink
    Redeliver(alerts)      alerts in doubt after a crash: again to the idempotent
                           sinks, listed for the operator for the others
    RecordDone(alerts)     outbox -> delivered, in one durable transaction
    Crash(point)           fault injection for tests and drills: die here

A batch's done rides in the next batch's intent, or goes alone when the
shell finds no next batch soon (`done_due`): one durable transaction a
batch, not two. A crash between leaves one more batch in doubt, which the
idempotent sinks take again harmlessly.

When every sink is idempotent (`deliver_first`: the JSON-lines file and the
webhook; not stdout), a batch goes to the sinks first, and the batches
delivered since the last record are recorded as delivered with the new
mark in one transaction when the shell's timer asks (`done_due`, at most
RECORD_AFTER_NS after the first of them): no intent is needed, since what a
crash leaves unrecorded comes again from the replicas (they resend from the
mark they were told, which is only ever a recorded one) and the sinks take
it again harmlessly. An alert then waits for the sinks alone, and the disk
syncs LMDB a few dozen times a second, not once a batch.

The mark is the highest emit seq taken for delivery (recorded with its
intent, or once delivered with deliver_first). Replicas are deterministic and
each channel is ordered. Two delivery modes:

- `first` (lowest latency): an alert above the mark is new and the first
  copy wins, so one faulty or compromised replica can forge or change an
  alert that it sends first.
- `quorum`: an alert is delivered once `quorum` replicas (two of three) sent
  identical bytes, in emit-seq order. The lowest pending emit seq waits
  while it may still reach a quorum: while the copies agreeing on it and
  the replicas not yet past it in their ordered channels (they may still
  send it) are enough. Once it cannot, it is dropped with a divergence alarm
  (an alert one replica made up, or one only a minority raised), and what
  follows it may go. Copies outvoted at delivery are alarms too. A replica
  votes once per emit seq. What awaits a quorum is bounded per replica (a
  share of MAX_PENDING_ALERTS, so a compromised one fills only its own): a
  replica that would exceed its share is refused (its link closed; it
  resends from the mark when it is back).

Acknowledgements: each replica is told the recorded mark (`recorded`: the
highest emit seq whose record committed, `on_recorded`; a replica drops
its alerts up to it) when it says hello and whenever that mark moved past
what it was last told (`acks_due`), not after every batch it sends: a copy
it raises at or below the mark it was told it does not keep (the record
covers it), so repeating a mark tells it nothing. The shell asks at most
every ACK_EVERY_NS: one answer covers every record meanwhile.

An alert at or below the mark was recorded before: the same bytes are a
duplicate, other bytes (or none recorded at all) a divergence alarm.

Replicas also send their digest chain at each fold point. Where a quorum
agrees on one and a replica shows another, that replica diverged: it is told
to rebuild from seq 1, and until it agrees with the quorum at a later fold
point its alerts are ignored in both modes (its votes pending a quorum are
withdrawn). Under `first`, what it sent first before its digest showed the
divergence was delivered: `quorum` is the mode that never delivers a
minority's alert.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, field
from operator import itemgetter

from tape.protocol.alertlink import DELIVERY
from tape.protocol.limits import MAX_PENDING_ALERTS
from tape.replicas.audit_core import ALERT_SIZE, Alert

emit_seq_of = Alert.emit_seq_of
_EMIT_SEQ = struct.Struct(f">Q{ALERT_SIZE - 8}x")  # a record's emit seq alone
_FIRST = itemgetter(0)


def emit_seqs(alerts: list[bytes]) -> list[int]:
    """The emit seq of each alert record, in one call."""
    return list(map(_FIRST, _EMIT_SEQ.iter_unpack(Alert.joined(alerts))))

CRASH_POINTS = ("before_intent", "after_intent", "after_deliver", "after_done")
FOLDS_KEPT = 64  # fold points whose replica digests are remembered (64 x 4096 seqs)


@dataclass(frozen=True)
class RecordIntent:
    alerts: list
    done: list = field(default_factory=list)  # the batch delivered before: done in the same transaction
    delivered: bool = False  # the sinks have them already (deliver_first): recorded as delivered, not outbox


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


class TooFarAhead(Exception):
    """A replica's alerts would hold more than MAX_PENDING_ALERTS awaiting a quorum."""


class EmitterCore:
    def __init__(self, replicas: set[bytes], mark: int = 0, crash_at: str | None = None, crash_after: int = 1,
                 delivery: str = "first", max_pending: int = MAX_PENDING_ALERTS, deliver_first: bool = False):
        """`deliver_first`: every sink is idempotent (module docstring)."""
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash point {crash_at!r}: one of {', '.join(CRASH_POINTS)}")
        if delivery not in DELIVERY:
            raise ValueError(f"delivery {delivery!r}: one of {', '.join(DELIVERY)}")
        self.replicas = replicas
        self.delivery = delivery
        self.deliver_first = deliver_first
        self.quorum = len(replicas) // 2 + 1
        self.max_pending = max_pending
        self.pending: dict[int, dict[bytes, set[bytes]]] = {}  # quorum: emit seq -> alert record -> senders
        self._pending_order: list[int] = []  # a heap of the pending emit seqs
        self.frontier: dict[bytes, int] = {}  # quorum: the highest emit seq each replica has sent
        self.held: dict[bytes, int] = {}  # quorum: pending emit seqs each replica has voted on
        self.folds: dict[int, dict[bytes, bytes]] = {}  # fold seq -> replica -> its digest chain there
        self.diverged: dict[bytes, int] = {}  # replica -> the fold seq where a quorum outvoted it
        self.rebuilds_ordered = 0
        self.ignored = 0  # alerts of a diverged replica
        self.mark = mark  # the highest emit seq taken for delivery: above it an alert is new
        self.recorded = mark  # the highest whose record committed: what replicas are told (they drop up to it)
        self.crash_at = crash_at
        self.crash_after = crash_after
        self.batches = 0
        self.delivered = 0
        self.duplicates = 0
        self.divergences = 0
        self.in_doubt = 0
        self.undone: list[bytes] = []  # the last batch delivered, its done not yet recorded (deliver_first:
        #                               every batch delivered since the last record)
        self._undone_batch = 0
        self.told: dict[bytes, int] = {}  # replica -> the mark it was last told (welcome or ack)

    def on_hello(self, replica: bytes) -> int | None:
        """The recorded mark to welcome a replica with (it resends what follows), or None: not a
        replica of ours."""
        if replica not in self.replicas:
            return None
        # The least any of its connections was told: another may be open (a reconnection before the
        # old one is seen closed, or without keys a stranger's hello naming it).
        self.told[replica] = min(self.told.get(replica, self.recorded), self.recorded)
        return self.recorded

    def acks_due(self, linked) -> dict[bytes, int]:
        """Of the `linked` replicas (those the shell can write to), the ones to acknowledge now,
        each with the mark to tell it (the recorded one: a replica drops its alerts up to it):
        those told less."""
        due = {r: self.recorded for r in linked if self.told.get(r, -1) < self.recorded}
        self.told.update(due)
        return due

    def on_alerts(self, replica: bytes, alerts: list[bytes]) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """(new alerts to deliver, copies of recorded ones to judge, alarms: alerts dropped as no quorum's)
        of one batch of `replica`'s ordered channel. Raises TooFarAhead (nothing taken) in quorum mode."""
        if replica in self.diverged:
            self.ignored += len(alerts)
            return [], [], []
        if self.delivery == "quorum":
            return self._vote(alerts, replica)
        seqs = emit_seqs(alerts)
        if not seqs or max(seqs) <= self.mark:  # (the common cases in one test each)
            return [], alerts, []
        if seqs[0] > self.mark and seqs == sorted(set(seqs)):  # (strictly rising: as a channel sends them)
            return alerts, [], []
        new, copies = [], []
        last = self.mark
        for seq, raw in zip(seqs, alerts):
            if seq <= last:
                copies.append(raw)
            else:
                new.append(raw)
                last = seq
        return new, copies, []

    def _vote(self, alerts: list[bytes], replica: bytes) -> tuple[list[bytes], list[bytes], list[bytes]]:
        share = self.max_pending // len(self.replicas)
        seqs = emit_seqs(alerts)
        votes = {seq for seq in seqs if seq > self.mark and not self._voted(seq, replica)}
        if self.held.get(replica, 0) + len(votes) > share:
            raise TooFarAhead(f"{self.held.get(replica, 0):,} of its alerts await a quorum (at most {share:,})")
        copies = []
        for seq, raw in zip(seqs, alerts):
            if seq <= self.mark:
                copies.append(raw)
                continue
            if seq not in self.pending:
                self.pending[seq] = {}
                heapq.heappush(self._pending_order, seq)
            if not self._voted(seq, replica):
                self.pending[seq].setdefault(raw, set()).add(replica)
                self.held[replica] = self.held.get(replica, 0) + 1
            self.frontier[replica] = max(self.frontier.get(replica, 0), seq)
        ready, alarms = self._settle()
        return ready, copies, alarms

    def _voted(self, seq: int, replica: bytes) -> bool:
        return any(replica in senders for senders in self.pending.get(seq, {}).values())

    def _settle(self) -> tuple[list[bytes], list[bytes]]:
        """Pending alerts decided, lowest emit seq first: (delivered by a quorum, alarms)."""
        ready, alarms = [], []
        while self._pending_order:
            seq = self._pending_order[0]
            versions = self.pending[seq]
            best = max(versions.values(), key=len)
            if len(best) < self.quorum:
                may_still_send = sum(1 for r in self.replicas
                                     if r not in self.diverged and self.frontier.get(r, 0) < seq)
                if len(best) + may_still_send >= self.quorum:
                    break  # it may still reach a quorum: everything after it waits
                best = set()  # it cannot: every version is an alarm
            heapq.heappop(self._pending_order)
            del self.pending[seq]
            for raw, senders in versions.items():
                (ready if senders is best else alarms).append(raw)
                for r in senders:
                    self.held[r] -= 1
        self.divergences += len(alarms)
        return ready, alarms

    def on_digest(self, replica: bytes, fold_seq: int, chain: bytes) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """A replica's digest chain at a fold point: (replicas to tell to rebuild, alerts a quorum
        now delivers, alarms), the last two only under quorum, once a diverged replica's votes
        are withdrawn."""
        if replica not in self.replicas:
            return [], [], []
        seen = self.folds.setdefault(fold_seq, {})
        seen[replica] = chain
        while len(self.folds) > FOLDS_KEPT:
            del self.folds[min(self.folds)]
        agreed = next((c for c in sorted(set(seen.values())) if list(seen.values()).count(c) >= self.quorum), None)
        if agreed is None:
            return [], [], []
        rebuild = []
        for r, c in sorted(seen.items()):
            if c != agreed and r not in self.diverged:
                self.diverged[r] = fold_seq
                rebuild.append(r)
                self._withdraw(r)
            elif c == agreed and self.diverged.get(r, fold_seq + 1) <= fold_seq:
                del self.diverged[r]  # rebuilt: it agrees again, at or past the point where it diverged
        self.rebuilds_ordered += len(rebuild)
        ready, alarms = self._settle() if rebuild and self.delivery == "quorum" else ([], [])
        return rebuild, ready, alarms

    def _withdraw(self, replica: bytes) -> None:
        """A diverged replica's votes no longer count."""
        for seq in list(self.pending):
            versions = self.pending[seq]
            for raw in [raw for raw, senders in versions.items() if replica in senders]:
                versions[raw].discard(replica)
                if not versions[raw]:
                    del versions[raw]
            if not versions:
                del self.pending[seq]
        self.held[replica] = 0
        self._pending_order = sorted(self.pending)  # (a sorted list is a heap)

    def deliver(self, new: list[bytes]) -> list[EmitterAction]:
        """Intent (with the previous batch's done), deliver: the steps for new alerts, which move
        the mark. Their own done comes with the next batch's intent, or from `done_due`. With
        `deliver_first`: deliver; `done_due` records them (crash points: before_intent is before
        the sinks, after_deliver after them, after_intent and after_done after the record)."""
        assert new and emit_seq_of(new[0]) > self.mark, "only alerts above the mark are delivered"
        self.batches += 1
        self.mark = emit_seq_of(new[-1])
        self.delivered += len(new)
        if self.deliver_first:  # recorded later, with the batches that follow it soon (done_due)
            self.undone, self._undone_batch = self.undone + new, self.batches
            return [*self._crash("before_intent", self.batches), DeliverAlerts(new),
                    *self._crash("after_deliver", self.batches)]
        done, done_batch = self.undone, self._undone_batch
        self.undone, self._undone_batch = new, self.batches
        out = [*self._crash("before_intent", self.batches), RecordIntent(new, done)]
        if done:
            out += self._crash("after_done", done_batch)
        return [*out, *self._crash("after_intent", self.batches), DeliverAlerts(new),
                *self._crash("after_deliver", self.batches)]

    def done_due(self) -> list[EmitterAction]:
        """The last batch's done on its own: the shell found no next batch to carry it. With
        deliver_first: the record of every batch delivered since the last one."""
        if not self.undone:
            return []
        done, self.undone = self.undone, []
        if self.deliver_first:
            b = self._undone_batch
            return [RecordIntent(done, delivered=True), *self._crash("after_intent", b), *self._crash("after_done", b)]
        return [RecordDone(done), *self._crash("after_done", self._undone_batch)]

    def _crash(self, point: str, batch: int) -> list[Crash]:
        return [Crash(point, batch)] if point == self.crash_at and batch >= self.crash_after else []

    def on_recorded(self, record: RecordIntent) -> None:
        """The record's transaction committed: replicas may now be told its mark (and drop its
        alerts). Not before: with deliver_first the mark moves before the sinks have the batch,
        and a replica told it then would not send the batch again after a crash."""
        self.recorded = max(self.recorded, emit_seq_of(record.alerts[-1]))

    def on_intent_failed(self, intent: RecordIntent) -> None:
        """The intent of the last delivery was not recorded (a full or failing disk): nothing of it
        happened (with deliver_first: the record of what was delivered since the last one; the
        sinks take it again). The mark goes back to the one recorded, and everything heard above
        it is forgotten: the shell closes every replica's link, and each sends again from the mark
        when it is welcomed back. The done it carried is still to record."""
        self.mark = self.recorded
        self.delivered -= len(intent.alerts)
        self.undone, self._undone_batch = intent.done, self.batches - 1  # the batch delivered before it
        self.pending, self._pending_order, self.held, self.frontier = {}, [], {}, {}

    def judge_copies(self, alerts: list[bytes], recorded: list[bytes | None]) -> list[int]:
        """Copies of alerts at or below the mark, each against the bytes recorded for its emit seq
        (None: none): the places of those that are divergence alarms; the others are duplicates
        (harmless)."""
        assert len(alerts) == len(recorded), "a recorded record (or None) for each copy"
        alarms = [] if alerts == recorded else [i for i, (a, kept) in enumerate(zip(alerts, recorded)) if a != kept]
        self.duplicates += len(alerts) - len(alarms)
        self.divergences += len(alarms)
        return alarms

    def recover(self, in_doubt: list[bytes]) -> list[EmitterAction]:
        """At start: alerts with intent and no done may or may not have reached the sinks."""
        if not in_doubt:
            return []
        self.in_doubt += len(in_doubt)
        return [Redeliver(in_doubt), RecordDone(in_doubt)]
