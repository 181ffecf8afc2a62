"""Every decision of a voter's replication endpoint (sequencers and rewinders). Pure:
the node core that runtime/voter_shell.py's shell and the simulator (ops/verification/sim.py) both drive,
over the replication frames' bytes (protocol/replication.py).

It serves the connections other voters open to it (greet with a hello; answer an
append with an ack once its records are journaled, a vote request with a vote once
the vote is on disk, a fetch with its own log), and opens its own: while the
election state is recovered (a greeting from every other voter), while campaigning
(a vote request to each), and to fetch what a voter that refused its vote holds
beyond its log. VoterCore decides what each frame means; this core decides what is
said on which connection, when a connection has waited too long, and in which order
the shell carries it out. Events and the shared actions: protocol/actions.py. Its
own events:

    on_read(read, records, now)    the journal's records a ReadJournal asked for
    on_log(reload, records, now)   the whole journal, after a Reload
    on_disk_full(conn, now)        a write was refused for want of space: the shell
                                   drops the rest of the list (conn: the event's, or None)
    on_free_space(free, now)       the journal's file system has `free` bytes (looked at
                                   once a period): too few stops the node, enough again resumes

Its own actions, in the order the shell carries them out:

    Dial(conn, peer)               open a connection to a voter (on_connected or on_closed)
    Persist, Truncate, AppendRecords(records, sync)   durably, before what follows
    SyncJournal                    sync what the appends before it wrote, per the policy
    Resume(conn)                   then call on_data(conn, b"", now): the rest of a read,
                                   judged after a step-down or a truncation is carried out
    ReadJournal(conn, first, count), Reload(why)      read the journal, then on_read / on_log
    Lead, StepDown, RequestVotes   the election's, for a sequencer's shell
    Refused                        a peer contradicted this node's state: count, log
    Committed(seq), Voted, LeaderGone, Fetched, Stalled, Recovered, SpaceLow, SpaceBack
                                   for the shell's waiters, logs and metrics
    MarkCommitted(seq)             the journal's commit mark, from the process's node core
                                   (its commit point: a leader's is its own), which keeps `commit_mark`
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable

from tape.protocol import replication as rep
from tape.protocol.actions import Close, Send, checked_after
from tape.protocol.commit_mark import CommitMark, MarkCommitted
from tape.protocol.election import Cause, Lead, Persist, Refused, RequestVotes, Rng, StepDown
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.limits import FETCH_MAX, FETCH_READ_TIMEOUT_NS, STALL_SHARE
from tape.protocol.voter import AppendRecords, Truncate, VoterCore

__all__ = ["AppendRecords", "Cause", "Close", "Committed", "Dial", "Fetched", "Lead", "LeaderGone", "MarkCommitted",
           "Persist", "ReadJournal", "Recovered", "Refused", "Reject", "Reload", "RequestVotes", "Resume", "Send",
           "SpaceBack", "SpaceLow", "Stalled", "StepDown", "SyncJournal", "Truncate", "Voted", "VoterNode"]
# The longest wait between election ticks, a share of the stall threshold (election_ms x
# STALL_SHARE: 50 ms by default, so 20 ms): only a process that did not run for the rest counts a stall.
TICK_SHARE_OF_STALL = 0.4


class Reject(Enum):
    """Why a connection was closed (the shell's bad_frames metric counts them)."""

    BAD_FRAME = "bad_frame"
    UNEXPECTED_FRAME = "unexpected_frame"
    NOT_THE_PEER = "not_the_peer"  # a frame naming another voter than the one at the link's other end


def named(frame) -> bytes | None:
    """The voter a frame speaks for (a Fetch names none): it must be the one at the link's other end."""
    for name_field in ("leader", "candidate", "node", "voter", "follower"):
        if (name := getattr(frame, name_field, None)) is not None:
            return name
    return None


class Why(Enum):
    TRUNCATED = "truncated"
    DISK_FULL = "disk_full"


@dataclass(frozen=True)
class Dial:
    conn: Hashable  # this node's name for the connection, in every event about it
    peer: bytes  # the voter's wire name
    within_ns: int | None = None  # the connection and its handshake (None: an election timeout)


@dataclass(frozen=True)
class SyncJournal:
    pass


@dataclass(frozen=True)
class ReadJournal:
    conn: Hashable
    first: int
    count: int


@dataclass(frozen=True)
class Reload:
    why: Why


@dataclass(frozen=True)
class Resume:
    """Carry out the actions before this one, then call on_data(conn, b"", now): the rest of a
    read waits for them (a step-down, a truncation) before it is judged."""

    conn: Hashable


@dataclass(frozen=True)
class Committed:
    seq: int


@dataclass(frozen=True)
class Voted:
    candidate: bytes
    term: int


@dataclass(frozen=True)
class LeaderGone:
    term: int


@dataclass(frozen=True)
class Fetched:
    peer: bytes
    taken: int
    last_seq: int
    last_term: int


@dataclass(frozen=True)
class Stalled:
    gap_ns: int
    held_ns: int


@dataclass(frozen=True)
class Recovered:
    voters: int
    term: int
    log_floor: tuple[int, int]


@dataclass(frozen=True)
class SpaceLow:  # under the stop threshold: this node takes no part from now (log it, count it)
    free: int
    resume_at: int


@dataclass(frozen=True)
class SpaceBack:  # enough space again: it takes part again
    free: int


@dataclass(frozen=True)
class FreeSpace:
    """When a voter stops for want of space and when it goes on (runtime/tuning.py's)."""
    stop: int  # under this many bytes free it takes no part, before a write is refused
    resume: int  # once stopped, it takes part again from this many: apart, so that it does not flap

    def __post_init__(self):
        assert 0 < self.stop < self.resume, self


SYNC = SyncJournal()


class Purpose(Enum):
    GREET = "greet"  # its hello, while the election state is recovered
    ASK = "ask"  # its vote
    FETCH = "fetch"  # what its log holds beyond ours


GREET, ASK, FETCH = Purpose.GREET, Purpose.ASK, Purpose.FETCH


@dataclass
class Dialed:
    """A connection this node opened, and what it is for."""

    peer: bytes
    purpose: Purpose
    request: RequestVotes | None = None
    deadline: int | None = None  # None: not connected yet (the shell's connect has its own timeout)
    frames: rep.FrameReader = field(default_factory=rep.FrameReader)
    hello: rep.Hello | None = None
    pending: list = field(default_factory=list)  # fetched appends not yet taken (a Reload between)
    taken: int = 0


class VoterNode:
    def __init__(self, name: bytes, voters: list[bytes], can_lead: bool, rng: Rng, election_ns: int,
                 term: int, voted_for: bytes | None, log_floor: tuple[int, int], found: bool, records, now: int,
                 *, free_space: FreeSpace, marked: int = 0):
        """`election_ns`: the shortest election timeout (the longest is twice it); `found`: the
        election state was on disk (else it is recovered from the other voters first); `marked`:
        the journal's commit mark (protocol/commit_mark.py), which the process's node core keeps."""
        self.name = name
        self.commit_mark = CommitMark(marked)
        self.free_space = free_space
        self.others = [v for v in voters if v != name]
        self.election_ns = election_ns
        self.core = VoterCore(name, voters, can_lead, rng, (election_ns, 2 * election_ns), term, voted_for, now,
                              records, recovering=not found, log_floor=log_floor,
                              stall_ns=int(election_ns * STALL_SHARE))
        self.election = self.core.election
        # The first election comes sooner: pre-votes keep a restarted node from disrupting a live leader.
        self.election.deadline = now + rng.randint(election_ns // 4, election_ns // 2)
        self.tick_ns = int(election_ns * STALL_SHARE * TICK_SHARE_OF_STALL)
        self.served: dict[Hashable, rep.FrameReader] = {}  # connections others opened
        self.proven: dict[Hashable, bytes] = {}  # a served connection -> the voter its link proved (with keys)
        self._rest: dict[Hashable, list] = {}  # a read's frames still to judge (Resume)
        self.dialed: dict[Hashable, Dialed] = {}
        self.dials = 0
        self.greet_at = now if self.core.recovering else None  # the next round of greetings
        self.disk_full_conn: Hashable = None
        self._term, self._voted = self.election.term, self.election.voted_for  # as of the last event

    def check(self) -> None:
        """What every event leaves true, whatever the network sent (else InvariantViolation: the
        process stops, exit 4; the simulator fails the seed): a term never goes back, one vote a
        term, the commit point within the log."""
        e, core = self.election, self.core
        if e.term < self._term or (e.term == self._term and self._voted not in (None, e.voted_for)):
            raise InvariantViolation(f"term {self._term} (vote {self._voted!r}) became term {e.term} "
                                     f"(vote {e.voted_for!r})")
        self._term, self._voted = e.term, e.voted_for
        if core.commit_seq > core.last_seq:
            raise InvariantViolation(f"commit point {core.commit_seq} beyond the log's last seq {core.last_seq}")

    # --- the shared events ---------------------------------------------------------------

    def on_connected(self, conn: Hashable, now: int, peer: bytes | None = None) -> list:
        """`peer`: the voter the link's handshake proved is at the other end (None without keys):
        a frame there naming another is refused."""
        d = self.dialed.get(conn)
        if d is None:  # a voter connected to us: greet (all an absent voter gives)
            if self.core.absent:
                return [Send(conn, rep.encode_hello(*self.core.hello())), Close(conn)]
            self.served[conn] = rep.FrameReader()
            if peer is not None:
                self.proven[conn] = peer
            return [Send(conn, rep.encode_hello(*self.core.hello()))]
        d.deadline = now + (FETCH_READ_TIMEOUT_NS if d.purpose == FETCH else self.election_ns)
        if d.purpose == ASK:
            r = d.request
            return [Send(conn, rep.encode_vote_request(r.term, self.name, r.last_seq, r.last_term, r.pre))]
        if d.purpose == FETCH:
            return [Send(conn, rep.encode_fetch(*self.core.fetch_from_seq()))]
        return []

    def on_data(self, conn: Hashable, data: bytes, now: int) -> list:
        if conn in self.served:
            return self._serve(conn, data, now)
        d = self.dialed.get(conn)
        if d is None:
            return []  # (closed by this node: what was in flight)
        try:
            frames = d.frames.feed(data)
        except ProtocolError as e:
            return self._hang_up(conn, Reject.BAD_FRAME, str(e))
        if d.purpose == FETCH:
            d.deadline = now + FETCH_READ_TIMEOUT_NS
            d.pending += [fr for fr in frames if isinstance(fr, rep.Append)]
            return self._take_fetched(conn, d)
        out = []
        for fr in frames:
            if named(fr) not in (None, d.peer):
                return out + self._hang_up(conn, Reject.NOT_THE_PEER, f"{fr!r} from {d.peer!r}")
            if isinstance(fr, rep.Hello):
                d.hello = fr
                if d.purpose == GREET:
                    return out + self.core.on_peer_hello(fr, now) + self._hang_up(conn) + self._recovered()
                out += self.election.on_higher_term(fr.term, fr.node, now)
            elif isinstance(fr, rep.Vote) and d.purpose == ASK:
                return out + self._on_vote(conn, d, fr, now)
        return out

    def on_closed(self, conn: Hashable, now: int, by_peer: bool = True) -> list:
        """`by_peer`: the peer closed it (its process most likely died); False when the shell cut
        it (a drill's partition)."""
        if self.served.pop(conn, None) is not None:
            self._rest.pop(conn, None)
            self.proven.pop(conn, None)
            if self.core.on_closed(conn, by_peer, now):
                return [LeaderGone(self.election.term)]
            return []
        return self._fetched(self.dialed.pop(conn, None))

    def on_timer(self, now: int) -> list:
        out = []
        for conn, d in list(self.dialed.items()):
            if d.deadline is not None and d.deadline <= now:
                out += self._hang_up(conn)
        if self.core.recovering and self.greet_at is not None and now >= self.greet_at:
            out += self._greet_round(now)
        stalls, held = self.election.stalls, self.election.held_ns
        out += self._election(self.election.on_tick(now))
        if self.election.stalls != stalls:
            out.append(Stalled(self.election.held_ns - held + self.election.stall_ns, self.election.held_ns - held))
        return out

    def on_stop(self, now: int) -> list:
        """The process stops (a node core that wraps this one says so with its commit point)."""
        return self.commit_mark.on_stop(self.core.commit_seq)

    def next_deadline(self, now: int) -> int:
        """At the election's deadline, a connection's, the next greeting round, and at least every
        tick_ns (so that a stall is measured)."""
        due = now + self.tick_ns  # (asked after every event: no list built)
        for d in self.dialed.values():
            if d.deadline is not None and d.deadline < due:
                due = d.deadline
        election = self.election.next_deadline_ns()
        if election is not None and election < due:
            due = election
        if self.core.recovering and self.greet_at is not None and self.greet_at < due:
            due = self.greet_at
        return due

    # --- its own events ----------------------------------------------------------------

    def on_read(self, read: ReadJournal, records: list, now: int) -> list:
        """A fetch's answer: our log from its seq (FETCH_MAX at most), then an empty append."""
        e, commit = self.election, self.core.commit_seq
        prev = read.first - 1
        out = rep.encode_runs(e.term, self.name, prev, self.core.term_at(prev), commit, records)
        if records:
            prev = records[-1][0]
        end = rep.encode_append(e.term, self.name, prev, self.core.term_at(prev), commit, e.term, [])
        return [Send(read.conn, out + end)]

    def on_log(self, reload: Reload, records, now: int) -> list:
        if reload.why is Why.DISK_FULL:
            out = self.core.on_disk_full(records)  # (no Persist among them: nothing can be written)
            conn, self.disk_full_conn = self.disk_full_conn, None
            return out + (self._hang_up(conn) if conn is not None else [])
        self.core.rebuild_log(records)
        for conn, d in list(self.dialed.items()):
            if d.purpose == FETCH and d.pending:
                return self._take_fetched(conn, d)  # (one fetch at a time reaches a Truncate)
        return []

    def on_disk_full(self, conn: Hashable, now: int) -> list:
        """Stop leading first (the sequencer's shell hands its client seqs to the log), then, the
        log reloaded, take no part until on_free_space finds enough free."""
        self.disk_full_conn = conn
        return [StepDown("disk full", Cause.DISK_FULL), Reload(Why.DISK_FULL)]

    def on_free_space(self, free: int, now: int) -> list:
        """Under `free_space.stop` it stops as for a refused write, before one is refused: the
        journal's appends may still fit the space it reserved ahead, a vote's file or the next
        segment would not (a disk that fills slowly would otherwise be found full mid-term).
        Stopped either way, it takes part again from `free_space.resume`."""
        limits = self.free_space
        if not self.election.disk_full and free < limits.stop:
            return [SpaceLow(free, limits.resume), *self.on_disk_full(None, now)]
        if self.election.disk_full and free >= limits.resume:
            self.core.on_disk_ok(now)
            return [SpaceBack(free)]
        return []

    def fetch_from(self, peer: bytes) -> list:
        """Take what `peer` holds beyond our log (as when it refuses a vote for our being behind)."""
        return [self._dial(peer, FETCH)]

    # --- serving ------------------------------------------------------------------------

    def _serve(self, conn: Hashable, data: bytes, now: int) -> list:
        """The replies to one read's frames, sent after one sync covers all their appends: a
        leader ahead of this voter has sent many by the time it reads (group commit). A frame
        that makes this node step down or cut its journal ends the read: the rest is judged
        once the shell has done so (Resume)."""
        try:
            frames = self._rest.pop(conn, []) + self.served[conn].feed(data)
        except ProtocolError as e:
            return self._hang_up(conn, Reject.BAD_FRAME, str(e))
        out, replies, commit = [], [], self.core.commit_seq
        proven = self.proven.get(conn)
        for i, fr in enumerate(frames):
            claimed = named(fr)
            if proven is not None and claimed not in (None, proven):
                return out + self._hang_up(conn, Reject.NOT_THE_PEER, f"{type(fr).__name__} names {claimed!r} on "
                                           f"{proven!r}'s link")
            if isinstance(fr, rep.Append):
                ack, actions = self.core.on_append(fr, conn, now)
                replies.append(rep.encode_ack(*ack))
            elif isinstance(fr, rep.VoteRequest):
                vote, actions = self.core.on_vote_request(fr, now)  # the vote is on disk before it is sent
                actions += [Voted(fr.candidate, fr.term)] if vote.granted and not fr.pre else []
                replies.append(rep.encode_vote(*vote))
            elif isinstance(fr, rep.Fetch):
                start = self.core.fetch_start(fr)
                first = fr.from_seq if start is not None else min(max(fr.from_seq, 1), self.core.last_seq + 1)
                actions = [ReadJournal(conn, first, FETCH_MAX if start is not None else 0)]
            else:
                why = f"{type(fr).__name__} frame on a voter's port"
                return out + self._hang_up(conn, Reject.UNEXPECTED_FRAME, why)
            out += self._election(actions)
            if any(isinstance(a, (StepDown, Truncate)) for a in actions):
                if any(isinstance(a, Truncate) for a in actions):
                    out.append(Reload(Why.TRUNCATED))
                if i + 1 < len(frames):
                    self._rest[conn] = frames[i + 1:]
                break
        out.append(SYNC)  # before any reply: none counts unsynced records
        if replies:
            out.append(Send(conn, b"".join(replies)))
        if self.core.commit_seq != commit:
            out.append(Committed(self.core.commit_seq))
        if conn in self._rest:
            out.append(Resume(conn))
        return out

    # --- what this node opens --------------------------------------------------------------

    def _dial(self, peer: bytes, purpose: Purpose, request: RequestVotes | None = None) -> Dial:
        self.dials += 1
        conn = (purpose, peer, self.dials)
        self.dialed[conn] = Dialed(peer, purpose, request)
        return Dial(conn, peer)

    def _hang_up(self, conn: Hashable, reason: Reject | None = None, detail: str = "") -> list:
        self.served.pop(conn, None)
        self._rest.pop(conn, None)
        self.proven.pop(conn, None)
        return self._fetched(self.dialed.pop(conn, None)) + [Close(conn, reason, detail)]

    def _election(self, actions: list) -> list:
        """The election's actions, a campaign's vote requests dialled after them."""
        out = []
        for a in actions:
            out.append(a)
            if isinstance(a, RequestVotes):
                out += [self._dial(peer, ASK, a) for peer in self.others]
        return out

    def _greet_round(self, now: int) -> list:
        """While recovering the election state: a greeting from every voter not yet heard (and not
        being asked), a round per half election timeout."""
        self.greet_at = now + self.election_ns // 2
        asking = {d.peer for d in self.dialed.values() if d.purpose == GREET}
        return [self._dial(p, GREET) for p in self.others if p not in self.election.heard and p not in asking]

    def _recovered(self) -> list:
        if self.core.recovering or self.greet_at is None:
            return []
        self.greet_at = None
        e = self.election
        return [Recovered(len(self.others), e.term, e.log_floor)]

    def _on_vote(self, conn: Hashable, d: Dialed, v: rep.Vote, now: int) -> list:
        out = self._election(self.election.on_vote(v.term, v.voter, v.granted, v.pre, now)) + self._hang_up(conn)
        theirs = d.hello
        if not v.granted and theirs is not None and self.election.leader is None and \
                (theirs.last_term, theirs.last_seq) > (self.core.last_term, self.core.last_seq):
            out.append(self._dial(d.peer, FETCH))  # refused for being behind: catch up for the next round
        return out

    def _take_fetched(self, conn: Hashable, d: Dialed) -> list:
        """A fetch answer's appends, in order: entries the other voter holds beyond our log (what
        its leaders' appends would have brought), until its closing empty append."""
        out = []
        while d.pending:
            a = d.pending.pop(0)
            if not a.count:
                return out + self._hang_up(conn)  # the end
            cut = self.core.fetched_conflict(a)
            if cut is not None:
                d.pending.insert(0, a)
                return out + [Truncate(cut), Reload(Why.TRUNCATED)]  # on_log takes the rest
            records = self.core.take_fetched(a)
            if records is None:
                return out + self._hang_up(conn)  # a leader appeared, or the logs do not line up
            if records:
                out.append(AppendRecords(records, True))
                d.taken += len(records)
        return out

    def _fetched(self, d: Dialed | None) -> list:
        """A fetch that took entries, ended: say so."""
        if d is None or d.purpose is not FETCH or not d.taken:
            return []
        return [Fetched(d.peer, d.taken, self.core.last_seq, self.core.last_term)]


checked_after(VoterNode, ("on_connected", "on_data", "on_closed", "on_timer", "on_read", "on_log", "on_disk_full",
                          "on_free_space", "fetch_from"))
