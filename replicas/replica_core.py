"""A replica's decisions around its audit state machine. Pure.

Events in: in-order runs of committed messages (a listener's Deliver), the emitter's welcome and
acks on the alert channel, the channel's loss, the time, the stream's state.
Actions out, carried out by the shell (replicas/replica_shell.py):

    SendAlerts(alerts)   write them (their records, `Alert.encode`) to the alert channel, in
                         emit-seq order
    SendDigest(fold_seq, chain)  the digest chain at the last fold point crossed,
                         to the alert channel (the emitter compares replicas)
    Snapshot()           save the machine and the outbox to LMDB, atomically
    Exit()               the session's end entry is applied, every alert
                         acknowledged and nothing more known to exist (with
                         --exit-on-end); an end-of-session packet is only a
                         hint (it cannot be sealed)

The outbox holds every alert the emitter has not acknowledged: on each
(re)connection the emitter's welcome says its mark, and what follows it is
sent again, so an alert survives the loss of the channel, the emitter or
this process (the outbox is in every snapshot). An alert raised at or below
the mark it was last told (a replica behind the others) is sent, for the
emitter to judge the copy, but not kept: the emitter recorded it, so no
acknowledgement need follow it. Snapshots are taken every
`snapshot_every` messages or `snapshot_ns`, whichever comes first; the
first one after a start comes early by `phase` of either, so that replicas
started together (given phases 0, 1/3, 2/3) do not all save at once: a save
is a burst of work, and three at once on two cores held up the whole
cluster (docs/performance.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tape.protocol.limits import REPLAY_BEHIND
from tape.protocol.messages import SEQUENCED_BLOCK_SIZE, SESSION_END
from tape.protocol.moldudp64 import HEADER_SIZE
from tape.protocol.receiver import Deliver, StreamReceiver
from tape.replicas.audit_core import ALERT_SIZE, AuditMachine


@dataclass(slots=True)  # (not frozen: made for most packets, and a frozen one's __init__ costs 3x)
class SendAlerts:
    alerts: list


@dataclass(frozen=True)
class SendDigest:
    fold_seq: int
    chain: bytes


@dataclass(frozen=True)
class Snapshot:
    pass


@dataclass(frozen=True)
class Exit:
    pass


ReplicaAction = SendAlerts | SendDigest | Snapshot | Exit


def _record_bound(mark: int) -> bytes:
    """An alert record starts with its emit seq, u64 big-endian: it sorts at or below this bound
    exactly when its emit seq is at or below `mark` (one comparison a record, nothing decoded)."""
    return mark.to_bytes(8, "big") + b"\xff" * (ALERT_SIZE - 8)


class ReplicaCore:
    def __init__(self, machine: AuditMachine, outbox: list[bytes], snapshot_every: int, snapshot_ns: int,
                 exit_on_end: bool, now_ns: int, phase: float = 0.0):
        assert 0.0 <= phase < 1.0, phase
        self.machine = machine
        self.outbox: deque[bytes] = deque(outbox)  # alert records
        self.snapshot_every = snapshot_every
        self.snapshot_ns = snapshot_ns
        self.exit_on_end = exit_on_end
        self.acked = 0  # the emitter's mark
        self._acked_bound = _record_bound(0)
        self.linked = False  # the alert channel is up (welcomed)
        self.session_ended = False  # the session's end entry was applied
        self._since_snapshot = 0
        self._lead = int(phase * snapshot_every)  # counted as applied until the first snapshot
        self._snapshot_at = now_ns - int(phase * snapshot_ns)
        self.last_fold: SendDigest | None = None  # resent on every welcome

    def on_packets(self, runs: list[Deliver]) -> list[ReplicaAction]:
        """Apply delivered packets' messages, each from its number `skip` on (an impossible order
        raises InvariantViolation): what the replica process does with a drain of the stream, and
        the simulator with a packet. The actions are those of each packet in turn, their alerts
        sent together up to each fold point's digest."""
        machine = self.machine
        out: list[ReplicaAction] = []
        before = machine.last_seq
        alerts, folds = machine.apply_runs(runs)
        sent = 0
        for upto, fold_seq, chain in folds:  # each fold's digest after the alerts raised before it
            self._raised(alerts[sent:upto], out)
            sent = upto
            self.last_fold = SendDigest(fold_seq, chain)
            if self.linked:
                out.append(self.last_fold)
        self._raised(alerts[sent:] if sent else alerts, out)
        # The types of the last two messages applied: only its seal may follow the session's end, so
        # that is the drain's last run (no seq follows them; looking at every run cost ~0.4 us a packet).
        if runs:
            packet, skip = runs[-1].packet, runs[-1].skip
            last_two = max(HEADER_SIZE + skip * SEQUENCED_BLOCK_SIZE, len(packet) - 2 * SEQUENCED_BLOCK_SIZE)
            self.session_ended = self.session_ended or SESSION_END in packet[last_two + 2::SEQUENCED_BLOCK_SIZE]
        self._since_snapshot += machine.last_seq - before
        if self._since_snapshot + self._lead >= self.snapshot_every:
            out.append(Snapshot())
        return out

    def _raised(self, alerts: list[bytes], out: list[ReplicaAction]) -> None:
        if alerts:
            bound = self._acked_bound
            self.outbox.extend(alerts if alerts[0] > bound else [a for a in alerts if a > bound])
            if self.linked:
                out.append(SendAlerts(alerts))

    def on_welcome(self, mark: int) -> list[ReplicaAction]:
        """The channel is up: everything after the emitter's mark goes (again), then the last fold's digest.
        The mark is taken as told, even below the last one (an emitter that lost its records)."""
        self.acked = -1
        self.on_ack(mark)
        self.linked = True
        return [SendAlerts(list(self.outbox))] + ([self.last_fold] if self.last_fold else [])

    def on_ack(self, mark: int) -> None:
        if mark > self.acked:
            self.acked, self._acked_bound = mark, _record_bound(mark)
        bound = self._acked_bound
        q = self.outbox
        while q and q[0] <= bound:
            q.popleft()

    def on_link_lost(self) -> None:
        self.linked = False

    def snapshot_taken(self, now_ns: int) -> None:
        self._since_snapshot = self._lead = 0
        self._snapshot_at = now_ns

    def on_timer(self, now_ns: int, rx: StreamReceiver) -> list[ReplicaAction]:
        out: list[ReplicaAction] = []
        if self._since_snapshot and now_ns - self._snapshot_at >= self.snapshot_ns:
            out.append(Snapshot())
        if self.exit_on_end and self.session_ended and not self.outbox and not rx.lag():
            out.append(Exit())  # (a stream that shows more: a next leader ends the session again)
        return out

    @staticmethod
    def far_behind(rx: StreamReceiver, behind: int = REPLAY_BEHIND) -> bool:
        """Missing enough to catch up over a TCP replay rather than by gap fills. What is held
        does not count: one lost packet holds all that follows it until a gap fill brings it,
        and a replay for that sent the whole stream a second time over TCP while the
        multicast went on (with 2% loss at 100,000 msg/s, for seconds on end)."""
        return rx.lag() - rx.held >= behind

    @staticmethod
    def caught_up(rx: StreamReceiver, behind: int = REPLAY_BEHIND) -> bool:
        """Where a TCP replay ends: what is still missing is for gap fills."""
        return rx.lag() - rx.held < behind // 4
