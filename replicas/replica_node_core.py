"""Every decision of a replica process. Pure: the node core that `tape replica`
(replicas/replica_shell.py) and the simulator both drive.

It joins the stream (ListenerCore: order, seals, gap requests), applies what
it delivers (ReplicaCore around the AuditMachine: alerts, digests, snapshot
cadence, the session's end), keeps the alert link to the emitter (hello,
alerts and digests after the emitter's welcome, acknowledgements, a rebuild
order), and catches up over a rewinder's SoupBinTCP replay when far behind
(looked at often while something is missing and just after a (re)start,
rarely else; the replayed entries go through the same listener, as the sealed
ranges the leader published). Events: protocol/actions.py's, and

    on_datagrams(datagrams, now)   what a drain of the stream's sockets read
    on_saved(now)                  the TakeSnapshot's write ended (or was refused)
    on_rebuilt(machine, outbox, now)  the state a Rebuild asked for: fresh, from seq 1

Actions: Send, Close, Dial(conn, peer) (vn.Dial), AskRewinder (ListenerCore's:
a gap request to rewinder `index`), TakeSnapshot (take the machine and outbox
now, write them off the applying thread, then on_saved), Rebuild(fold_seq)
(move the state aside, then on_rebuilt), Applied(runs) (for the shell's
latency figures), Dropped(reason) (a datagram the listener refused), Exit.
A committed message that cannot be applied or decoded is an InvariantViolation:
skipping it would diverge this replica from the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Hashable

from tape.protocol import alertlink
from tape.protocol import soupbintcp as soup
from tape.protocol.actions import Close, Send
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import (
    GAP_TICK_MS,
    REPLAY_BEHIND,
    REPLAY_CLIENT_HEARTBEAT_S,
    REPLAY_POLL_FAST_FOR_S,
    REPLAY_POLL_IDLE_S,
    REPLAY_POLL_S,
)
from tape.protocol.listener import AskRewinder, Deliver, ListenerCore, Undecodable
from tape.protocol.moldudp64 import MAX_BLOCKS
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import StreamKeys, sealed_ranges
from tape.protocol.voter_node import Dial
from tape.replicas.audit_core import AuditMachine
from tape.replicas.replica_core import Exit, ReplicaCore, SendAlerts, SendDigest, Snapshot

__all__ = ["Applied", "AskRewinder", "Close", "Dial", "Dropped", "Exit", "Rebuild", "Reject", "ReplicaNode", "Send",
           "TakeSnapshot"]
S = 1_000_000_000
REDIAL_NS = S // 5  # after a link is lost or refused, before the next try
HOUSEKEEPING_NS = S // 20  # the snapshot timer and the session's end, looked at this often
REPLAY_READ_NS = 5 * S  # a replay that sends nothing this long is given up
POLL_FAST_NS, POLL_IDLE_NS, FAST_FOR_NS = int(REPLAY_POLL_S * S), int(REPLAY_POLL_IDLE_S * S), int(
    REPLAY_POLL_FAST_FOR_S * S)
BEAT_NS = int(REPLAY_CLIENT_HEARTBEAT_S * S)


class Reject(Enum):
    """Why the replica closed a link (its log says so)."""

    BAD_ALERT_FRAME = "bad_alert_frame"
    REPLAY_FAILED = "replay_failed"  # rejected, unsealed, or silent


@dataclass(frozen=True)
class TakeSnapshot:
    pass


@dataclass(frozen=True)
class Rebuild:
    fold_seq: int


@dataclass(slots=True)
class Applied:
    runs: list


@dataclass(frozen=True)
class Dropped:
    reason: str
    detail: str


class Replay:
    """A catch-up over a rewinder's replay: logged in from `start`, entries from `seq` on."""

    def __init__(self, start: int, now: int):
        self.frames = soup.FrameDecoder()
        self.start = start
        self.seq: int | None = None  # None: not accepted yet
        self.batch: list[bytes] = []
        self.deadline = now + REPLAY_READ_NS
        self.beat_at = now + BEAT_NS


class ReplicaNode:
    def __init__(self, name: bytes, machine: AuditMachine, outbox: list[bytes], session: bytes, rewinders: list[bytes],
                 emitter: bytes | None, gap_request_ns: int, keys: StreamKeys | None, max_packet: int,
                 snapshot_every: int, snapshot_ns: int, exit_on_end: bool, phase: float, now: int,
                 replay_behind: int = REPLAY_BEHIND):
        """`rewinders`, `emitter`: their wire names (Dial's peers; a gap request names a rewinder by
        its place here); `phase`: this replica's share of the snapshot cadence (ReplicaCore);
        `replay_behind`: missing this many, it catches up over a replay (ReplicaCore.far_behind)."""
        self.name, self.session, self.keys, self.max_packet = name, session, keys, max_packet
        self.rewinders, self.emitter = rewinders, emitter
        self.gap_request_ns = gap_request_ns
        self.replay_behind = replay_behind
        self.snapshot_every, self.snapshot_ns, self.exit_on_end, self.phase = snapshot_every, snapshot_ns, \
            exit_on_end, phase
        self.conns = 0
        self.alert_conn: Hashable = None  # the alert link: dialled, then welcomed (core.linked)
        self.replay_conn: Hashable = None
        self.replay: Replay | None = None
        self.replays = 0  # catch-ups begun: the next asks the next rewinder
        self.replayed = 0
        self.rebuilt_for = 0  # the fold seq of the last rebuild order carried out
        self.rebuilding = False
        self.saving = False
        self.reply_address: tuple[str, int] | None = None
        self.listener: ListenerCore | None = None
        self._start(machine, outbox, now)

    def _start(self, machine: AuditMachine, outbox: list[bytes], now: int) -> None:
        self.machine = machine
        self.core = ReplicaCore(machine, outbox, self.snapshot_every, self.snapshot_ns, self.exit_on_end, now,
                                self.phase)
        nonce = self.listener.nonce if self.listener else 0
        self.listener = ListenerCore(self.session, len(self.rewinders), self.gap_request_ns, machine.last_seq + 1,
                                     self.keys, self.max_packet)
        self.receiver = self.listener.receiver
        if self.reply_address is not None:  # (a rebuild's new listener asks from the same socket, nonces on)
            self.listener.reply_at(*self.reply_address, nonce)
        self.dial_alert_at = now if self.emitter else None
        self.poll_at, self.fast_until = now, now + FAST_FOR_NS
        self.housekeeping_at = now + HOUSEKEEPING_NS
        self.ask_at: int | None = None

    def reply_at(self, host: str, port: int, nonce: int) -> None:
        """Where the rewinders' answers come back (signed into requests), for every listener, and
        the nonce they count up from (ListenerCore.reply_at)."""
        self.reply_address = (host, port)
        self.listener.reply_at(host, port, nonce)

    # --- the stream ----------------------------------------------------------------------

    def on_datagrams(self, datagrams: list[bytes], now: int) -> list:
        out = self._take(self.listener.on_datagrams(datagrams), now)
        if self.receiver.missing() is not None or self.listener.asking:  # ask at once, not at the next tick
            out += self.listener.on_timer(now)
        if self.listener.waiting and self.ask_at is None:
            self.ask_at = now + max(self.gap_request_ns, GAP_TICK_MS * 1_000_000) // 2
        return out

    def _take(self, actions: list, now: int) -> list:
        """The listener's actions: runs applied together, the rest in their place."""
        out, runs = [], []
        for a in actions:
            if type(a) is Deliver:
                runs.append(a)
                continue
            if runs:
                out += self._apply(runs, now)
                runs = []
            if isinstance(a, Undecodable):
                raise InvariantViolation(f"the committed message at seq {a.seq} cannot be decoded ({a.error}); "
                                         "skipping it would diverge")
            if isinstance(a, ProtocolError):
                out.append(Dropped(a.reason, str(a)))
        return out + (self._apply(runs, now) if runs else [])

    def _apply(self, runs: list[Deliver], now: int) -> list:
        try:
            actions = self.core.on_packets(runs)
        except ProtocolError as e:
            raise InvariantViolation(f"cannot apply from seq {runs[0].first_seq}: {e}") from None
        return [Applied(runs)] + self._replica(actions, now)

    def _replica(self, actions: list, now: int) -> list:
        """ReplicaCore's actions: alerts and digests as one write to the alert link."""
        out, frames = [], []
        for a in actions:
            if isinstance(a, SendAlerts):
                if a.alerts:
                    frames.append(alertlink.alerts(a.alerts))
            elif isinstance(a, SendDigest):
                frames.append(alertlink.digest(a.fold_seq, a.chain))
            elif isinstance(a, Snapshot):
                out += self._snapshot(now)
            elif isinstance(a, Exit):
                out.append(a)
        if frames and self.core.linked:
            out.insert(0, Send(self.alert_conn, b"".join(frames)))
        return out

    def _snapshot(self, now: int) -> list:
        if self.saving:
            return []  # one save at a time: one due meanwhile waits for it
        self.saving = True
        self.core.snapshot_taken(now)
        return [TakeSnapshot()]

    def on_saved(self, now: int) -> list:
        self.saving = False
        return []

    # --- the shared events -----------------------------------------------------------------

    def on_connected(self, conn: Hashable, now: int) -> list:
        if conn == self.alert_conn:
            return [Send(conn, alertlink.hello(self.name))]
        if conn == self.replay_conn:
            self.replay.deadline = now + REPLAY_READ_NS
            return [Send(conn, soup.login(self.name.decode().strip()[:6], "", "", self.replay.start))]
        return []

    def on_data(self, conn: Hashable, data: bytes, now: int) -> list:
        try:
            if conn == self.alert_conn:
                return self._alert_frames(self._alert_reader.feed(data), now)
            if conn == self.replay_conn:
                return self._replay_data(data, now)
        except ProtocolError as e:
            why = Reject.BAD_ALERT_FRAME if conn == self.alert_conn else Reject.REPLAY_FAILED
            return self._lost(conn, now) + [Close(conn, why, str(e))]
        return []

    def on_closed(self, conn: Hashable, now: int) -> list:
        return self._lost(conn, now)

    def _lost(self, conn: Hashable, now: int) -> list:
        if conn == self.alert_conn:
            self.alert_conn = None
            self.core.on_link_lost()
            self.dial_alert_at = now + REDIAL_NS
        elif conn == self.replay_conn:
            self.replay_conn, self.replay = None, None
            self.poll_at = now + REDIAL_NS
        return []

    def _dial(self, kind: str, peer: bytes) -> tuple[Hashable, Dial]:
        self.conns += 1
        conn = (kind, self.conns)
        return conn, Dial(conn, peer)

    # --- the alert link --------------------------------------------------------------------

    def _alert_frames(self, frames: list, now: int) -> list:
        out = []
        for kind, payload in frames:
            mark = alertlink.MARK.unpack(payload)[0] if len(payload) == 8 else 0
            if kind == alertlink.WELCOME:  # everything after the emitter's mark goes (again)
                out += self._replica(self.core.on_welcome(mark), now)
            elif kind == alertlink.REBUILD:
                if mark > self.rebuilt_for and not self.rebuilding:
                    self.rebuilt_for, self.rebuilding = mark, True
                    return out + [Rebuild(mark)]
            else:
                self.core.on_ack(mark)
        return out

    def on_rebuilt(self, machine: AuditMachine, outbox: list[bytes], now: int) -> list:
        """The state moved aside, a fresh one from seq 1: its links anew."""
        out = [Close(c) for c in (self.alert_conn, self.replay_conn) if c is not None]
        self.alert_conn, self.replay_conn, self.replay, self.rebuilding = None, None, None, False
        self._start(machine, outbox, now)
        return out

    # --- catching up over TCP ----------------------------------------------------------------

    def _replay_data(self, data: bytes, now: int) -> list:
        r = self.replay
        r.deadline = now + REPLAY_READ_NS
        for kind, payload in r.frames.feed(data):
            if kind == soup.LOGIN_ACCEPTED:
                r.seq = soup.parse_login_accepted(payload)[1]
            elif kind == soup.LOGIN_REJECTED:
                raise ProtocolError("rejected", f"replay login rejected ({payload!r})", 0)
            elif kind == soup.SEQUENCED and r.seq is not None:
                r.batch.append(payload)
        out = []
        if r.batch:
            used, out = self._replayed(r.seq, r.batch, now)
            if not used and len(r.batch) > MAX_BLOCKS:  # no range ends: not the sealed log
                raise ProtocolError("unsealed", f"{len(r.batch):,} replayed entries and no seal", 0)
            r.seq += used
            self.replayed += used
            r.batch = r.batch[used:]
        if self.core.caught_up(self.receiver, self.replay_behind):
            conn = self.replay_conn
            return out + [Send(conn, soup.logout()), Close(conn)] + self._lost(conn, now)
        return out

    def _replayed(self, seq: int, batch: list[bytes], now: int) -> tuple[int, list]:
        """Replayed entries from `seq` as packets through the listener, as the live stream: with
        stream keys the sealed ranges the leader published (a packet that is not one whole range
        does not verify), a range cut by the end of a read waiting for the next one."""
        if self.keys is not None:
            ranges, used = sealed_ranges(batch, seq)
        else:
            ranges, used = [(seq, batch)], len(batch)
        packets = [p for first, entries in ranges
                   for p in PacketBuilder(self.session, first, self.max_packet).add_sequenced(entries)]
        return used, self._take(self.listener.on_datagrams(packets), now)

    # --- time ------------------------------------------------------------------------------

    def on_timer(self, now: int) -> list:
        out = []
        if self.ask_at is not None and now >= self.ask_at:
            out += self.listener.on_timer(now)  # ask again what stays unanswered
            self.ask_at = now + max(self.gap_request_ns, GAP_TICK_MS * 1_000_000) // 2 \
                if self.listener.waiting else None
        if now >= self.housekeeping_at:
            self.housekeeping_at = now + HOUSEKEEPING_NS
            out += self._replica(self.core.on_timer(now, self.receiver), now)
        if self.dial_alert_at is not None and now >= self.dial_alert_at and not self.rebuilding:
            self.dial_alert_at = None
            self.alert_conn, dial = self._dial("alert", self.emitter)
            self._alert_reader = alertlink.Reader()
            out.append(dial)
        out += self._replay_timer(now)
        return out

    def _replay_timer(self, now: int) -> list:
        r = self.replay
        if r is not None:
            if now >= r.deadline:
                conn = self.replay_conn
                return self._lost(conn, now) + [Close(conn, Reject.REPLAY_FAILED, "the replay sent nothing")]
            if r.seq is not None and now >= r.beat_at:  # the server drops a silent client
                r.beat_at = now + BEAT_NS
                return [Send(self.replay_conn, soup.heartbeat(server=False))]
            return []
        if now < self.poll_at or self.rebuilding or not self.rewinders:
            return []
        rx = self.receiver
        missing = rx.lag() > rx.held
        self.poll_at = now + (POLL_FAST_NS if missing or now < self.fast_until else POLL_IDLE_NS)
        if not self.core.far_behind(rx, self.replay_behind):
            return []
        peer = self.rewinders[self.replays % len(self.rewinders)]
        self.replays += 1
        self.replay = Replay(rx.next_seq, now)
        self.replay_conn, dial = self._dial("replay", peer)
        return [dial]

    def next_deadline(self, now: int) -> int:
        due = [self.housekeeping_at, self.poll_at]
        if self.ask_at is not None:
            due.append(self.ask_at)
        if self.dial_alert_at is not None:
            due.append(self.dial_alert_at)
        if self.replay is not None:
            due += [self.replay.deadline, self.replay.beat_at]
        return max(min(due), now)
