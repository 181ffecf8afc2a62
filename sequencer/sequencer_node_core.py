"""Every decision of the sequencer process. Pure: the node core that `tape sequencer`
(sequencer/sequencer_shell.py, through runtime/voter_shell.py's shell) and the simulator both drive.

A sequencer is a voter (VoterNode: its replication endpoint, which gets every event on
a connection this node did not open to lead) that leads when elected: LeaderCore
stamps, seals and commits, FollowerLinks says what each follower gets next, and this
core combines them: a connection to every follower (dialled again after a loss), the
order replicate / own journal write / commit / publish, a follower behind caught up
from the journal a chunk per drain, commit beats, the batch cap, the step-down and the
hand-over of its client seqs to the log, the end of the session. Events: VoterNode's,
and

    on_inbound(datagrams, emptied, wall, now)   a drain of the inbound socket:
                                     [(bytes, source)], and whether it was read empty
    on_stamp(wall, now)              a Stamp came due: stamp what is pending (a batch,
                                     a term's start, a time tick), with the wall clock
    on_replicated(replicate, queued, now)  a Replicate written: each connection's queued bytes
    on_journaled(batch, now)         a Journal's batch is in this node's journal
    on_drained(conn, now)            a Drain's connection has sent what it queued
    on_end(wall, now)                the process is stopping: end the session
    on_session_ended(now)            the end committed (or the shell stopped waiting)

Actions: VoterNode's, and, in the order the shell carries them out:

    Stamp(due)                       call on_stamp once `due` (monotonic) has come, after
                                     the events already waiting (at most one outstanding)
    StampNow()                       call on_stamp before the rest (a term's start)
    Replicate(conns, frame)          the same frame to each follower, then on_replicated
    Journal(batch)                   append to this node's journal (a refused write is the
                                     voter's disk-full path), then on_journaled
    Publish(packets, through_seq)    on the stream; through_seq: published so far
    Advise(source, data)             a back-off or resend request to a client's address
    Drain(conn)                      wait until conn's queue drained, then on_drained
    Dropped(reason, size)            an inbound datagram refused (for the log)
    Led(term, from_seq), SteppedDown(term, reason, cause), FollowerJoined(peer, last_seq)
                                     for the shell's logs and metrics
    EndOfSession(packet, repeats, interval_ns)   once the followers' queues drained, publish
                                     it that many times, that far apart

Two clocks: `now` (monotonic) for every timer, `wall` only for stamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from tape.protocol import messages as M
from tape.protocol import replication as rep
from tape.protocol.actions import Close, Send, checked_after
from tape.protocol.budgets import StrangerBudget
from tape.protocol.election import LEADER, Cause, Lead, StepDown
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import (
    MAX_BATCH_MESSAGES,
    PACE_FROM_MESSAGES,
    STRANGER_INBOUND_RATE,
    STRANGER_INBOUND_TOTAL_RATE,
    STRANGER_MAX_HOSTS,
)
from tape.protocol.stamping import messages_per_packet
from tape.protocol.streamauth import StreamKeys
from tape.protocol.voter_node import Dial, ReadJournal, Reject, VoterNode
from tape.sequencer.followers_core import FollowerLinks
from tape.sequencer.leader_core import Batch, LeaderCore

CONNECT_NS = 2_000_000_000  # a follower's connection and handshake (a loaded follower answers late)
REDIAL_LOST_NS = 100_000_000  # a follower's connection lost: dial it again after this
REDIAL_FAILED_NS = 200_000_000  # a dial that failed: again after this
EOS_REPEATS = 5  # end-of-session packets published at shutdown, 20 ms apart
EOS_INTERVAL_NS = 20_000_000
FOLLOWER_LINK = "follower"  # the first element of the name of a connection to a follower
LEAD_TAIL = ("lead", "tail")  # the ReadJournal a new leader reads its log's end with


@dataclass(frozen=True)
class LeaderSettings:
    session: bytes
    clients: dict  # client id (10 bytes) -> HMAC key or None
    max_packet: int
    tick_ns: int  # a time tick after this long without a batch
    heartbeat_ns: int  # a stream heartbeat after this long without a packet
    batch_interval_ns: int  # the pacing of batches while messages come fast (0: none)
    beat_ns: int  # the followers' commit beats at least this often
    stream_keys: StreamKeys | None
    pace_from: int = PACE_FROM_MESSAGES
    max_batch: int = MAX_BATCH_MESSAGES  # a batch is stamped once this many are pending: one append frame
    client_hosts: frozenset = frozenset()  # the configured clients' addresses: never budgeted before the MAC


@dataclass(frozen=True)
class Stamp:
    due: int


@dataclass(frozen=True)
class StampNow:
    pass


@dataclass(frozen=True)
class Replicate:
    conns: tuple
    frame: bytes


@dataclass(frozen=True)
class Journal:
    batch: Batch


@dataclass(frozen=True)
class Publish:
    packets: list
    through_seq: int


@dataclass(frozen=True)
class Advise:
    source: object
    data: bytes


@dataclass(frozen=True)
class Drain:
    conn: Hashable


@dataclass(frozen=True)
class Dropped:
    reason: str
    size: int


@dataclass(frozen=True)
class Led:
    term: int
    from_seq: int


@dataclass(frozen=True)
class SteppedDown:
    term: int
    reason: str
    cause: Cause


@dataclass(frozen=True)
class FollowerJoined:
    peer: bytes
    last_seq: int


@dataclass(frozen=True)
class EndOfSession:
    packet: bytes
    repeats: int
    interval_ns: int


@dataclass
class Link:
    """A connection this leader opened to a follower."""

    peer: bytes
    deadline: int | None = None  # its hello's (None: not connected yet, or greeted)
    frames: rep.FrameReader = field(default_factory=rep.FrameReader)
    joined: bool = False  # its hello came: FollowerLinks knows it
    feeding: bool = False  # a catch-up chunk is being read or sent


@dataclass
class Totals:
    """Counters over every term this process led (a term's LeaderCore starts at zero)."""

    accepted: int = 0
    published_messages: int = 0
    published_packets: int = 0
    backoffs_sent: int = 0
    resends_asked: int = 0
    dropped: dict = field(default_factory=dict)

    def add(self, c: LeaderCore) -> None:
        self.accepted += c.accepted
        self.published_messages += c.published_messages
        self.published_packets += c.published_packets
        self.backoffs_sent += c.backoffs_sent
        self.resends_asked += c.resends_asked
        for k, v in c.dropped.items():
            self.dropped[k] = self.dropped.get(k, 0) + v


class SequencerNode:
    def __init__(self, voter: VoterNode, settings: LeaderSettings, followers: list[bytes]):
        self.voter = voter
        self.core, self.election = voter.core, voter.election  # (what the shell and metrics read)
        self.name = voter.name
        self.settings = settings
        self.follower_names = list(followers)
        self.leader: LeaderCore | None = None  # while leading
        self.followers: FollowerLinks | None = None
        self.links: dict[Hashable, Link] = {}  # the connections this leader opened
        self.joined: dict[bytes, Hashable] = {}  # follower -> its connection, once its hello came
        self.redial_at: dict[bytes, int] = {}  # follower -> when to dial it (none open)
        self.dials = 0
        self.stamp_due: int | None = None  # the outstanding Stamp
        self._woken: set[Hashable] = set()  # followers' links to catch up once the batch in hand is journaled
        self.not_leader_drops = 0
        self.strangers = StrangerBudget(settings.client_hosts, STRANGER_INBOUND_RATE, STRANGER_INBOUND_TOTAL_RATE,
                                        STRANGER_MAX_HOSTS)
        self.terms_led = 0
        self.batches = 0  # stamped, each replicated and journaled as one append (in every term)
        self.totals = Totals()
        self.published_seq = 0  # highest seq this process published, in any term
        self.published_terms: dict[int, list[int]] = {}  # term -> [first, last] seq this process published
        self.ending = False  # the session's end stamped: no trade, no time tick follows it
        self.ending_again = False  # leading a log that held the end: it announces it once it commits
        self.end_told = False  # EndOfSession given
        self._starting = False  # elected, the term's first entry not yet stamped

    @property
    def commit_seq(self) -> int:
        return self.leader.commit_seq if self.leader else self.core.commit_seq

    def check(self) -> None:
        """What every event leaves true (else InvariantViolation: exit 4, or the seed fails): the
        endpoint's (VoterNode.check), the leader's (LeaderCore.check), and nothing of this term
        published that is not committed."""
        self.voter.check()
        c = self.leader
        if c is not None:
            c.check()
            if c.published_seq > max(c.commit_seq, c.term_start_seq - 1, 0) and not self._starting:
                raise InvariantViolation(f"published through {c.published_seq}, committed through {c.commit_seq}")

    # --- the shared events: the leader's links here, the rest to the voter ------------------

    def on_connected(self, conn: Hashable, now: int, peer: bytes | None = None) -> list:
        """`peer`: the voter the link's handshake proved (VoterNode.on_connected)."""
        link = self.links.get(conn)
        if link is None:
            return self._after(self.voter.on_connected(conn, now, peer))
        link.deadline = now + self.voter.election_ns  # its hello
        return []

    def on_data(self, conn: Hashable, data: bytes, now: int) -> list:
        link = self.links.get(conn)
        if link is None:
            return self._after(self.voter.on_data(conn, data, now))
        try:
            frames = link.frames.feed(data)
        except ProtocolError as e:
            return self._lose(conn, now) + [Close(conn, Reject.BAD_FRAME, f"follower {link.peer!r}: {e}")]
        out = []
        for fr in frames:
            if self.links.get(conn) is not link:
                break  # it stepped down (its links closed)
            if isinstance(fr, rep.Ack) and link.joined:
                out += self._on_ack(link, fr, now)
            elif isinstance(fr, rep.Hello) and not link.joined:
                out += self._on_hello(conn, link, fr, now)
        return out

    def on_closed(self, conn: Hashable, now: int, by_peer: bool = True) -> list:
        if conn not in self.links:
            return self._after(self.voter.on_closed(conn, now, by_peer))
        return self._lose(conn, now)

    def on_timer(self, now: int) -> list:
        out = self._after(self.voter.on_timer(now)) + self.voter.commit_mark.on_tick(self.commit_seq, now)
        if self.leader is None:
            return out
        for conn, link in list(self.links.items()):
            if link.deadline is not None and link.deadline <= now:
                out += self._lose(conn, now) + [Close(conn)]  # no hello: connect again
        out += self._redial(now)
        out += self._beat(now)
        if self.stamp_due is None and not self._starting and self.leader.timer_due_ns(not self.ending) <= now:
            out.append(self._stamp_at(now))  # a time tick or a heartbeat
        return out

    def on_stop(self, now: int) -> list:
        """The process stops: the journal's commit mark where the commit point is."""
        return self.voter.commit_mark.on_stop(self.commit_seq)

    def next_deadline(self, now: int) -> int:
        """The endpoint's, and while leading: a tick or heartbeat (unless a Stamp is outstanding,
        which runs them), a commit beat, a redial, a hello's deadline."""
        due = self.voter.next_deadline(now)
        c = self.leader
        if c is None:
            return due
        due = min(due, self.followers.beat_due_ns(c.commit_seq))
        if self.redial_at:
            due = min(due, *self.redial_at.values())
        for link in self.links.values():
            if link.deadline is not None and link.deadline < due:
                due = link.deadline
        return due if self.stamp_due is not None or self._starting else min(due, c.timer_due_ns(not self.ending))

    def on_read(self, read: ReadJournal, records: list, now: int) -> list:
        if read.conn == LEAD_TAIL:
            return self._start_term(read, records, now)
        link = self.links.get(read.conn)
        if link is None:
            return [] if _is_follower_link(read.conn) else self._after(self.voter.on_read(read, records, now))
        if self.leader is None:
            return []
        if not records:
            raise InvariantViolation(f"the journal has no seq {read.first}, which this leader stamped")
        c, prev = self.leader, read.first - 1
        frames = rep.encode_runs(c.term, self.name, prev, self.core.term_at(prev), c.commit_seq, records)
        self.followers.sent(link.peer, records[-1][0])
        return [Send(read.conn, frames), Drain(read.conn)]

    def on_log(self, reload, records, now: int) -> list:
        return self._after(self.voter.on_log(reload, records, now))

    def on_disk_full(self, conn: Hashable, now: int) -> list:
        return self._after(self.voter.on_disk_full(conn, now))

    def on_free_space(self, free: int, now: int) -> list:
        return self._after(self.voter.on_free_space(free, now))

    # --- its own events ------------------------------------------------------------------

    def on_inbound(self, datagrams: list, emptied: bool, wall: int, now: int) -> list:
        """One drain of the inbound socket. A batch is stamped whenever `max_batch` messages are
        pending (one batch must fit one append frame); the rest when a Stamp comes due."""
        c = self.leader
        if c is None or self.ending or self._starting:  # (following: clients that know no leader, and resends)
            self.not_leader_drops += len(datagrams)
            return []
        out, cap = [], self.settings.max_batch
        for data, source in datagrams:
            host = source[0] if isinstance(source, tuple) else source  # (host, port) from a socket
            if not self.strangers.allow(host, now / 1e9):  # before any MAC is checked
                out.append(Dropped("stranger_budget", len(data)))
                continue
            reason = c.on_inbound(data, now, source)
            if reason is not None and reason != "duplicate":
                out.append(Dropped(reason, len(data)))
            if c.pending >= cap:
                out += self._process(c.flush(now, wall), now)
        c.note_drain(emptied, now)
        out += [Advise(source, data) for source, data in c.take_advice()]
        if c.pending and self.stamp_due is None:
            out.append(self._stamp_at(c.batch_due_ns(now)))
        return out

    def on_stamp(self, wall: int, now: int) -> list:
        self.stamp_due = None
        c = self.leader
        if c is None:
            return []
        if c.pending and (due := c.batch_due_ns(now)) > now:
            return [self._stamp_at(due)]  # a paced batch: what comes meanwhile joins it
        out = []
        if self._starting:
            self._starting = False
            out += self._process(c.start_term(now, wall, ended=self.ending), now)
        batch = c.flush(now, wall)
        if batch is not None:
            out += self._process(batch, now)
        batch, heartbeat = c.on_timer(now, wall, tick=not self.ending)  # (the session's end is its last entry)
        if batch is not None:
            out += self._process(batch, now)
        if heartbeat is not None:
            out.append(Publish([heartbeat], c.published_seq))
            c.note_published(1, 0, now)
        return out

    def on_replicated(self, replicate: Replicate, queued: list[int], now: int) -> list:
        """What each connection has queued: a follower too far behind is caught up from the
        journal instead (once the batch is journaled), so the leader's memory stays bounded."""
        if self.leader is not None:
            for conn, size in zip(replicate.conns, queued):
                link = self.links.get(conn)
                if link is not None and self.followers.backlog(link.peer, size):
                    self._woken.add(conn)
        return []

    def on_journaled(self, batch: Batch, now: int) -> list:
        c = self.leader
        if c is None:
            return []
        tail = [m[0] for m in batch.messages[-2:]] if self.ending else []  # (the end: last, or before its seal)
        end_seq = batch.first_seq + len(batch.messages) - len(tail) + tail.index(M.SESSION_END) \
            if M.SESSION_END in tail else 0
        self.core.note_own(batch.first_seq, batch.last_seq, batch.term, batch.messages[-1][0] == M.AUTH, end_seq)
        out = self._publish(c.on_journaled(batch.last_seq), now)
        woken, self._woken = self._woken, set()
        for conn in sorted(woken, key=str):
            out += self._feed(conn)
        return out

    def on_drained(self, conn: Hashable, now: int) -> list:
        link = self.links.get(conn)
        if link is None or self.leader is None:
            return []
        link.feeding = False
        return self._feed(conn)

    def on_end(self, wall: int, now: int) -> list:
        """The process stops: what is pending, then the session's last entry."""
        c = self.leader
        if c is None or self.ending:
            return []
        self.ending = True
        return self._process(c.end_session(now, wall), now)

    def session_ended(self) -> bool:
        """The end committed (or this node no longer leads): the shell may stop waiting."""
        return self.leader is None or self.leader.commit_seq >= self.leader.last_seq

    def on_session_ended(self, now: int) -> list:
        """The followers learn the final commit point now (they serve gap fills only up to it, and
        no later append would tell them), then the end-of-session packet, repeated as MoldUDP64
        servers do: a listener that lost the one packet would wait for a session that ended."""
        c = self.leader
        if c is None or self.end_told:
            return []
        self.end_told = True
        return self._beat(now, force=True) + [EndOfSession(c.end_of_session(), EOS_REPEATS, EOS_INTERVAL_NS)]

    # --- leading -------------------------------------------------------------------------

    def _after(self, actions: list) -> list:
        """The endpoint's actions, with what this node does on a Lead or a StepDown."""
        out = []
        for a in actions:
            out.append(a)
            if isinstance(a, Lead):
                out += self._lead(a.term)
            elif isinstance(a, StepDown):
                out += self._step_down(a)
        return out

    def _lead(self, term: int) -> list:
        """Elected: read the log's end (its last stamp, and a range cut short that this term seals
        first), then start the term (on_read)."""
        last_seq = self.core.last_seq
        first = (self.core.open_range() if self.settings.stream_keys is not None else None) or last_seq
        count = min(last_seq - first + 1, messages_per_packet(self.settings.max_packet)) if last_seq else 0
        return [ReadJournal(LEAD_TAIL, max(first, 1), count)]

    def _start_term(self, read: ReadJournal, records: list, now: int) -> list:
        e, s = self.election, self.settings
        if e.role != LEADER or self.leader is not None:
            return []  # stepped down before the journal was read
        last_seq, last_term = self.core.position()
        open_from = self.core.open_range()
        open_range = None
        if s.stream_keys is not None and open_from is not None:
            open_range = (open_from, [m for seq, _, m in records if seq >= open_from])
        last = records[-1] if records and records[-1][0] == last_seq else None
        self.leader = LeaderCore(
            s.session, self.name, e.term, self.follower_names, s.clients, last_seq=last_seq, last_term=last_term,
            client_last=dict(self.core.log.client_last), max_packet=s.max_packet, tick_ns=s.tick_ns,
            heartbeat_ns=s.heartbeat_ns, batch_interval_ns=s.batch_interval_ns, pace_from=s.pace_from,
            last_stamp_ns=M.SEQUENCED.unpack(last[2])[M.STAMP] if last else 0, stream_keys=s.stream_keys,
            open_range=open_range)
        self.followers = FollowerLinks(s.beat_ns)
        self.terms_led += 1
        self.redial_at = dict.fromkeys(self.follower_names, now)
        self.ending = self.ending_again = self.core.log.ended  # (its term only ends the session again)
        self.end_told = False
        self._starting = True
        return [Led(e.term, last_seq + 1)] + self._redial(now) + [StampNow()]

    def _step_down(self, a: StepDown) -> list:
        c = self.leader
        if c is None:
            return []  # a candidate giving up: nothing to undo
        out = [SteppedDown(c.term, a.reason, a.cause)]
        out += [Close(conn) for conn in self.links]
        self.links, self.joined, self.redial_at, self._woken = {}, {}, {}, set()
        self.totals.add(c)
        self.core.resync(c.commit_seq, c.sequenced_client_last())  # what it did not publish, the next leader may
        self.leader = self.followers = None
        self.stamp_due = None
        self._starting = False
        return out

    def _stamp_at(self, due: int) -> Stamp:
        self.stamp_due = due
        return Stamp(due)

    def _process(self, batch: Batch, now: int) -> list:
        """Replicate to the live followers, then journal (followers get the batch before the
        leader's own fsync, as Raft allows, so the two disk writes overlap), then publish what
        commits (on_journaled)."""
        c = self.leader
        self.batches += 1
        send, wake = self.followers.live_for(batch.first_seq, batch.last_seq, c.commit_seq, now)
        self._woken.update(self.joined[f] for f in wake)
        out = []
        if send:
            frame = rep.encode_append(c.term, self.name, batch.prev_seq, batch.prev_term, c.commit_seq, batch.term,
                                      batch.messages)
            out.append(Replicate(tuple(self.joined[f] for f in send), frame))
        out.append(Journal(batch))
        return out

    def _publish(self, packets: list[bytes], now: int) -> list:
        if not packets:
            return []
        c = self.leader
        msgs = first = 0
        for pkt in packets:
            count = int.from_bytes(pkt[18:20], "big")
            if 0 < count < 0xFFFF:
                msgs += count
                first = first or int.from_bytes(pkt[10:18], "big")
        c.note_published(len(packets), msgs, now)
        self.published_seq = max(self.published_seq, c.published_seq)
        if msgs:  # which seqs this process published in which term: drills judge terms by it
            span = self.published_terms.setdefault(c.term, [first, 0])
            span[1] = c.published_seq
        out = [Publish(packets, c.published_seq)]
        if self.ending_again and self.session_ended():  # no stop asked for it: no shell waits to tell it
            out += self.on_session_ended(now)
        return out

    # --- the followers -----------------------------------------------------------------

    def _redial(self, now: int) -> list:
        out = []
        for peer, at in list(self.redial_at.items()):
            if at <= now:
                del self.redial_at[peer]
                self.dials += 1
                conn = (FOLLOWER_LINK, peer, self.dials)
                self.links[conn] = Link(peer)
                out.append(Dial(conn, peer, CONNECT_NS))
        return out

    def _on_hello(self, conn: Hashable, link: Link, hello: rep.Hello, now: int) -> list:
        out = self._after(self.election.on_higher_term(hello.term, hello.node, now))
        if self.leader is None:
            return out
        link.joined, link.deadline = True, None
        self.joined[link.peer] = conn
        self.followers.connected(link.peer, hello.last_seq, self.leader.last_seq)
        return out + [FollowerJoined(link.peer, hello.last_seq)] + self._feed(conn)

    def _on_ack(self, link: Link, ack: rep.Ack, now: int) -> list:
        out = self._after(self.election.on_ack(link.peer, ack.term, now))
        c = self.leader
        if c is None:
            return out  # it was in a higher term: stepped down
        out += self._publish(c.on_ack(link.peer, ack.term, ack.success, ack.last_seq), now)
        if not ack.success and self.followers.refused(link.peer, ack.last_seq):
            out += self._feed(self.joined[link.peer])  # its log ends, or disagrees, before what was sent
        return out

    def _feed(self, conn: Hashable) -> list:
        """The next catch-up chunk from the journal (what it holds: the batch in hand may not be
        journaled yet), unless one is on its way; none: the follower is live."""
        link = self.links.get(conn)
        if link is None or link.feeding or not link.joined:
            return []
        chunk = self.followers.next_chunk(link.peer, self.leader.journaled_seq)
        if chunk is None:
            return []
        link.feeding = True
        return [ReadJournal(conn, *chunk)]

    def _lose(self, conn: Hashable, now: int) -> list:
        link = self.links.pop(conn)
        self._woken.discard(conn)
        if self.leader is None:
            return []
        if link.joined:
            self.followers.disconnected(link.peer)
            del self.joined[link.peer]
        self.redial_at[link.peer] = now + (REDIAL_LOST_NS if link.joined else REDIAL_FAILED_NS)
        return []

    def _beat(self, now: int, force: bool = False) -> list:
        """Empty appends, when due: the followers learn the commit point (to serve gap fills)
        and that this leader lives (their election timers restart)."""
        c = self.leader
        beat = self.followers.beat(now, c.commit_seq, force)
        if not beat:
            return []
        frame = rep.encode_append(c.term, self.name, c.last_seq, c.last_term, c.commit_seq, c.term, [])
        return [Replicate(tuple(self.joined[f] for f in beat), frame)]


def _is_follower_link(conn: Hashable) -> bool:
    return isinstance(conn, tuple) and len(conn) == 3 and conn[0] == FOLLOWER_LINK


checked_after(SequencerNode, ("on_connected", "on_data", "on_closed", "on_timer", "on_read", "on_log", "on_disk_full",
                              "on_free_space", "on_inbound", "on_stamp", "on_replicated", "on_journaled", "on_drained",
                              "on_end", "on_session_ended"))
