"""Every decision of the rewinder process. Pure: the node core that `tape rewinder`
(rewinder/rewinder_shell.py, through runtime/voter_shell.py's shell) and the simulator both drive.

A rewinder is a voter (VoterNode: its replication endpoint, which it hands every
event on a connection it does not serve itself), a gap-fill server (GapFillCore:
which requests are answered, when, with what) and a replay server (SoupBinTCP:
the rules of rewinder/replay_core.py, the login and idle deadlines, heartbeats while
caught up). Events: VoterNode's, and

    on_datagram(addr, data, now)       a gap-fill request from addr (host, port)
    on_gap_read(read, messages, now)   the journal's messages a ReadGap asked for
    on_replay_connected(conn, now)     a replay client connected (its data and close
                                       come as on_data / on_closed)
    on_replayed(replay, now)           a ReplayRecords is written and drained

Actions: VoterNode's, and SendDatagram(addr, data), ReadGap(addr, first, count,
final), ReplayRecords(conn, first, count) (send them as SoupBinTCP sequenced
frames, then on_replayed), DroppedRequest(addr, reason) (for the log; the
counts are GapFillCore's).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Hashable

from tape.protocol import soupbintcp as soup
from tape.protocol.actions import Close, Send
from tape.protocol.budgets import TokenBucket
from tape.protocol.errors import ProtocolError
from tape.protocol.limits import (
    REPLAY_BUDGET_RETRY_NS,
    REPLAY_BURST,
    REPLAY_HEARTBEAT_NS,
    REPLAY_IDLE_TIMEOUT_S,
    REPLAY_LISTENER,
    REPLAY_LOGIN_FRAME,
    REPLAY_LOGIN_TIMEOUT_S,
    REPLAY_RATE,
    REPLAY_WRITE_TIMEOUT_S,
)
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import StreamKeys, seal_covers
from tape.protocol.voter_node import Committed, VoterNode
from tape.rewinder import replay_core
from tape.rewinder.gapfill_core import Answer, GapFillCore, Refuse

# Gap requests refused so are floods: counted, not logged.
FLOOD_REASONS = frozenset(("rate_limited", "server_busy", "parked_full"))
LOGIN_NS = int(REPLAY_LOGIN_TIMEOUT_S * 1e9)
IDLE_NS = int(REPLAY_IDLE_TIMEOUT_S * 1e9)
WRITE_NS = int(REPLAY_WRITE_TIMEOUT_S * 1e9)


class Reject(Enum):
    """Why a replay connection was closed (the rewinder's metrics)."""

    BAD_FRAME = "bad_frame"
    IDLE = "idle"  # the client fell silent (it heartbeats every second)
    NO_LOGIN = "no_login"  # none within REPLAY_LOGIN_TIMEOUT_S
    NOT_READING = "not_reading"  # a chunk not taken within REPLAY_WRITE_TIMEOUT_S


@dataclass(frozen=True)
class SendDatagram:
    addr: tuple
    data: bytes


@dataclass(frozen=True)
class ReadGap:
    """Read `count` messages from seq `first` for an answer to `addr`, then on_gap_read;
    `final`: send them as they are (else the answer is the sealed range they fall in)."""

    addr: tuple
    first: int
    count: int
    final: bool


@dataclass(frozen=True)
class ReplayRecords:
    conn: Hashable
    first: int
    count: int


@dataclass(frozen=True)
class DroppedRequest:
    addr: tuple
    reason: str


class Replay:
    """One replay session: before its login, then streaming from `seq`."""

    def __init__(self, now: int, budgeted: bool, users: dict[bytes, bytes] | None):
        self.budgeted = budgeted  # a listener's: its chunks come out of the replay budget
        self.users = users  # a standard client's: the logins it may give (else its link proved it)
        self.frames = soup.FrameDecoder(max_frame=REPLAY_LOGIN_FRAME)
        self.seq: int | None = None  # None: no login yet
        self.deadline = now + LOGIN_NS  # the login's, then the client's silence
        self.sent_at = now  # the last frame this server sent: a heartbeat a second after it
        self.writing = False  # a ReplayRecords not yet drained
        self.write_deadline = 0  # while writing: the client must have taken the chunk by then
        self.wants = False  # its next chunk waits its turn in the replay budget


class RewinderNode:
    def __init__(self, voter: VoterNode, session: bytes, max_packet: int, stream_keys: StreamKeys | None,
                 park_ns: int, budgets: dict | None = None):
        """`park_ns`: how long a gap request for what is not yet known committed waits (as long
        as its listener waits for an answer before asking again). `budgets`: GapFillCore's
        (rate_per_s, burst, total_rate_per_s, total_burst), if not the limits'."""
        self.voter = voter
        self.core, self.election = voter.core, voter.election  # (what the shell and metrics read)
        self.session = session
        self.max_packet = max_packet
        self.sealed = stream_keys is not None  # the log's packets are sealed ranges
        self.gapfill = GapFillCore(session, max_packet, stream_keys, park_s=park_ns / 1e9, **(budgets or {}))
        self.replays: dict[Hashable, Replay] = {}  # in the order they are next served (the last served last)
        self.replay_budget = TokenBucket(REPLAY_RATE, REPLAY_BURST, 0.0)
        self.replay_held_back = 0  # chunks the budget deferred
        self.replay_sessions = 0
        self.replay_idle_closed = 0
        self.replay_stalled_closed = 0
        self.replayed = 0
        self.gap_messages_sent = 0

    @property
    def commit_seq(self) -> int:
        return self.core.commit_seq

    # --- the shared events: replay connections here, the rest to the voter ------------------

    def on_connected(self, conn: Hashable, now: int, peer: bytes | None = None) -> list:
        return self._after(self.voter.on_connected(conn, now, peer), now)

    def on_data(self, conn: Hashable, data: bytes, now: int) -> list:
        if conn in self.replays:
            return self._replay_data(conn, data, now)
        return self._after(self.voter.on_data(conn, data, now), now)

    def on_closed(self, conn: Hashable, now: int, by_peer: bool = True) -> list:
        if self.replays.pop(conn, None) is not None:
            return []
        return self._after(self.voter.on_closed(conn, now, by_peer), now)

    def on_timer(self, now: int) -> list:
        out = self._after(self.voter.on_timer(now), now) + self.voter.commit_mark.on_tick(self.commit_seq, now)
        for conn, r in list(self.replays.items()):
            if r.writing and r.write_deadline <= now:
                self.replay_stalled_closed += 1
                out += self._close(conn, Reject.NOT_READING)
            elif r.deadline <= now:
                if r.seq is not None:
                    self.replay_idle_closed += 1
                out += self._close(conn, Reject.IDLE if r.seq is not None else Reject.NO_LOGIN)
            elif r.seq is not None and not r.writing and r.sent_at + REPLAY_HEARTBEAT_NS <= now:
                r.sent_at = now
                out.append(Send(conn, soup.heartbeat()))
        return out + self._serve(now)

    def on_stop(self, now: int) -> list:
        """The process stops: the journal's commit mark where the commit point is."""
        return self.voter.commit_mark.on_stop(self.commit_seq)

    def next_deadline(self, now: int) -> int:
        due = [self.voter.next_deadline(now)]
        for r in self.replays.values():
            due.append(r.deadline)
            if r.writing:
                due.append(r.write_deadline)
            if r.seq is not None and not r.writing:
                due.append(now + REPLAY_BUDGET_RETRY_NS if r.wants else r.sent_at + REPLAY_HEARTBEAT_NS)
        return min(due)

    # VoterNode's own events, and what a commit they bring leads to.
    def on_read(self, read, records: list, now: int) -> list:
        return self._after(self.voter.on_read(read, records, now), now)

    def on_log(self, reload, records, now: int) -> list:
        return self._after(self.voter.on_log(reload, records, now), now)

    def on_disk_full(self, conn: Hashable, now: int) -> list:
        return self.voter.on_disk_full(conn, now)

    def on_free_space(self, free: int, now: int) -> list:
        return self.voter.on_free_space(free, now)

    def _after(self, actions: list, now: int) -> list:
        """The voter's actions; once the commit point moved (after the ack that moved it), what
        waited for it: parked gap requests, replay sessions caught up."""
        if not any(isinstance(a, Committed) for a in actions):
            return actions
        out = list(actions)
        for answer, addr in self.gapfill.due(self.commit_seq, now / 1e9):
            out += self._answer(answer, addr)
        for r in self.replays.values():
            r.wants = r.seq is not None
        return out + self._serve(now)

    # --- gap fill --------------------------------------------------------------------------

    def on_datagram(self, addr: tuple, data: bytes, now: int) -> list:
        action = self.gapfill.on_request(data, addr, now / 1e9, self.commit_seq)
        if isinstance(action, Answer):
            return self._answer(action, addr)
        if isinstance(action, Refuse) and action.reason not in FLOOD_REASONS:
            return [DroppedRequest(addr, action.reason)]
        return []

    def _answer(self, answer: Answer, addr: tuple) -> list:
        return [ReadGap(addr, answer.seq, answer.count, not self.sealed)]

    def on_gap_read(self, read: ReadGap, messages: list, now: int) -> list:
        """With a sealed stream the answer is the whole sealed range that holds the seq asked for
        (it verifies as it is), or nothing while that range is open or not all committed."""
        if not read.final:
            cover = next(filter(None, map(seal_covers, messages)), None)
            if cover is None or cover[0] + cover[1] > self.commit_seq:
                return []
            return [ReadGap(read.addr, cover[0], cover[1] + 1, True)]
        self.gap_messages_sent += len(messages)
        packets = PacketBuilder(self.session, read.first, self.max_packet).add_sequenced(messages)
        return [SendDatagram(read.addr, p) for p in packets]

    # --- replay ------------------------------------------------------------------------------

    def on_replay_connected(self, conn: Hashable, now: int, peer: bytes | None = None,
                            users: dict[bytes, bytes] | None = None) -> list:
        """`peer`: the class its link's key proved (REPLAY_LISTENER: budgeted); None without keys,
        where no session can be told from another and none is budgeted. `users`: a standard
        SoupBinTCP client's connection (the soup_port, budgeted), whose login must be one of them."""
        self.replays[conn] = Replay(now, peer == REPLAY_LISTENER or users is not None, users)
        return []

    def _replay_data(self, conn: Hashable, data: bytes, now: int) -> list:
        r = self.replays[conn]
        try:
            frames = r.frames.feed(data)
            if r.seq is not None:
                r.deadline = now + IDLE_NS  # anything from the client: it is there
            out = []
            for kind, payload in frames:
                if kind == soup.LOGOUT and r.seq is not None:
                    return out + self._close(conn)
                if kind == soup.LOGIN and r.seq is None:
                    out += self._login(conn, r, payload, now)
                    if conn not in self.replays:
                        return out
            return out
        except ProtocolError as e:
            return self._close(conn, Reject.BAD_FRAME, str(e))

    def _login(self, conn: Hashable, r: Replay, payload: bytes, now: int) -> list:
        login = replay_core.on_login(payload, self.session, self.commit_seq, r.users)
        if isinstance(login, replay_core.Reject):
            return [Send(conn, soup.login_rejected(login.reason))] + self._close(conn)
        r.seq, r.deadline, r.sent_at, r.wants = login.seq, now + IDLE_NS, now, True
        self.replay_sessions += 1
        return [Send(conn, soup.login_accepted(self.session, login.seq))] + self._serve(now)

    def _serve(self, now: int) -> list:
        """The next chunk of each session that wants one, in turn (the one served longest ago
        first): a listener's while the replay budget has it (the listeners behind one it could
        not serve wait too, REPLAY_BUDGET_RETRY_NS), a replica's always."""
        out, starved = [], False
        for conn, r in list(self.replays.items()):
            if not r.wants or r.writing or (starved and r.budgeted):
                continue
            chunk = replay_core.next_chunk(r.seq, self.commit_seq)
            if chunk is None:
                r.wants = False  # caught up: a commit wakes it
                continue
            if r.budgeted and not self.replay_budget.take(now / 1e9, chunk[1]):
                self.replay_held_back += 1
                starved = True
                continue
            self.replays[conn] = self.replays.pop(conn)  # served: last in turn
            r.wants, r.writing, r.write_deadline = False, True, now + WRITE_NS
            out.append(ReplayRecords(conn, *chunk))
        return out

    def on_replayed(self, sent: ReplayRecords, now: int) -> list:
        r = self.replays.get(sent.conn)
        if r is None:
            return []  # (closed meanwhile)
        r.writing, r.seq, r.sent_at, r.wants = False, sent.first + sent.count, now, True
        self.replayed += sent.count
        return self._serve(now)

    def _close(self, conn: Hashable, reason: Reject | None = None, detail: str = "") -> list:
        del self.replays[conn]
        return [Close(conn, reason, detail)]
