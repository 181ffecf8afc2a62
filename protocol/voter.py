"""Every voter's decisions (sequencers and rewinders). Pure.

A voter follows the leader's log and votes. This core holds what it needs
of its log without reading the journal (LogState: the term of every seq, the
highest client seq per client) and combines ElectionCore (who leads) with
FollowerCore (Raft's append rules). Events in: an append, a vote request, a
fetch, the close of a connection, the time. Actions out, carried out by the
shell in order, before it sends the reply the event returns:

    Persist(term, voted_for)       (from the election) durably, first
    Truncate(after_seq)            drop the journal's records after this seq;
                                   once every action of the event is done,
                                   call rebuild_log() with the journal's records
    AppendRecords(records)         append (seq, term, message) to the journal
    StepDown / Lead / RequestVotes (from the election) for the sequencer

A voter never drops a committed entry: a leader asking it to is a broken
election rule, an impossible state (InvariantViolation, exit 4).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable

from tape.protocol import messages
from tape.protocol import replication as rep
from tape.protocol.election import ElectionAction, ElectionCore, Refused, Rng
from tape.protocol.errors import InvariantViolation
from tape.protocol.follower import FollowerCore
from tape.protocol.journal import RecordRun
from tape.protocol.messages import SEQUENCED_SIZE


@dataclass(frozen=True)
class Truncate:
    after_seq: int


@dataclass(frozen=True)
class AppendRecords:
    records: list  # [(seq, term, message)], continuing the journal
    sync: bool = True  # False: synced with the rest of a read's appends (SyncJournal), before any reply


VoterAction = ElectionAction | Truncate | AppendRecords


class LogState:
    """The term of any seq (where each term starts; terms change rarely) and
    the highest client seq sequenced per client (so that a node that becomes
    leader dedupes at once). Kept as records reach the journal."""

    def __init__(self):
        self.client_last: dict[bytes, int] = {}
        self.term_starts: list[tuple[int, int]] = []  # (first seq, term), ascending
        self.last = (0, 0)  # (seq, term) of the last record noted
        self.last_seal = 0  # seq of the last seal (protocol/streamauth.py): what follows is an open range
        self.end_seq = 0  # the seq of the log's last session end (0: none)

    def note_term(self, first_seq: int, term: int) -> None:
        """Entries of `term` from `first_seq` on. All a leader notes of its own
        batches: its LeaderCore keeps the client seqs, and hands them over
        when it steps down."""
        if not self.term_starts or term != self.term_starts[-1][1]:
            self.term_starts.append((first_seq, term))

    def note(self, records) -> None:
        if isinstance(records, RecordRun) and records.size == SEQUENCED_SIZE and len(records):
            self._note_run(records.first_seq, records.term, records.messages)  # an append as it came
        elif isinstance(records, list) and records and records[0][1] == records[-1][1]:
            # an append of one term (terms only grow along a log), as (seq, term, message)
            blob = b"".join([m for _, _, m in records])
            if len(blob) == len(records) * SEQUENCED_SIZE and records[-1][0] == records[0][0] + len(records) - 1:
                self._note_run(records[0][0], records[0][1], blob)
            else:
                self._note_each(records)
        else:
            self._note_each(records)

    def _note_run(self, first: int, term: int, blob: bytes) -> None:
        """note() of records of one term, consecutive seqs, their sequenced messages back to back
        in `blob`: one C-level pass over their bytes."""
        self.note_term(first, term)
        last = self.client_last
        for origin, cseq in messages.client_seq_maxima(blob).items():
            if cseq > last.get(origin, 0):
                last[origin] = cseq
        kinds = blob[::SEQUENCED_SIZE]  # each message's type byte
        seal = kinds.rfind(messages.AUTH)
        if seal >= 0:
            self.last_seal = first + seal
        end = kinds.rfind(messages.SESSION_END)
        if end >= 0:
            self.end_seq = first + end
        self.last = (first + len(blob) // SEQUENCED_SIZE - 1, term)

    def _note_each(self, records) -> None:
        last = self.client_last
        unpack = messages.TYPE_ORIGIN_CSEQ.unpack_from
        seq = None
        for seq, term, raw in records:
            self.note_term(seq, term)
            kind, origin, cseq = unpack(raw)
            if kind in messages.CLIENT_SEQ_TYPES and cseq > last.get(origin, 0):
                last[origin] = cseq
            elif kind == messages.AUTH:
                self.last_seal = seq
            elif kind == messages.SESSION_END:
                self.end_seq = seq
        if seq is not None:
            self.last = (seq, term)

    def rebuild(self, records) -> None:
        self.client_last = {}
        self.term_starts = []
        self.last = (0, 0)
        self.last_seal = 0
        self.end_seq = 0
        self.note(records)

    @property
    def ended(self) -> bool:
        """The log holds the session's end: a term that follows it only ends the session again."""
        return self.end_seq > 0

    def term_at(self, seq: int) -> int:
        i = bisect.bisect_right(self.term_starts, (seq, 1 << 64)) - 1
        return self.term_starts[i][1] if seq > 0 and i >= 0 else 0


class VoterCore:
    def __init__(self, name: bytes, voters: list[bytes], can_lead: bool, rng: Rng, timeout_ns: tuple[int, int],
                 term: int, voted_for: bytes | None, now_ns: int, records=(), recovering: bool = False,
                 log_floor: tuple[int, int] = (0, 0), stall_ns: int | None = None):
        """`records`: the journal as it is, (seq, term, message) in order. `recovering`: the election
        state is missing (ElectionCore: no vote until every other voter's hello is in). `stall_ns`:
        a longer gap between ticks holds the election's timers (ElectionCore)."""
        self.name = name
        self.can_lead = can_lead
        self.log = LogState()
        self.log.rebuild(records)
        self.last_seq, self.last_term = self.log.last
        self.election = ElectionCore(name, voters, can_lead, self.position, rng, timeout_ns,  # (commit unknown yet)
                                     max(term, self.last_term), voted_for, now_ns,
                                     recovering, log_floor, stall_ns)
        self.follower = FollowerCore(name, self.last_seq, self.last_term, self.term_at, term=self.election.term)
        self._leader_conns: dict[Hashable, tuple[bytes, int]] = {}  # connections that carried the leader's appends
        self.appended = 0
        self.truncations = 0

    # --- the log -------------------------------------------------------------------------

    def position(self) -> tuple[int, int]:
        return self.last_seq, self.last_term

    def term_at(self, seq: int) -> int:
        if seq > self.last_seq:
            raise InvariantViolation(f"the log has no seq {seq} (it ends at {self.last_seq})")
        return self.log.term_at(seq)

    def rebuild_log(self, records) -> None:
        """At start, and after a Truncate: the journal's records, in order (any iterable)."""
        self.log.rebuild(records)
        self.last_seq, self.last_term = self.log.last
        self._may_lead()

    def _noted(self, records: list) -> None:
        self.log.note(records)
        self.last_seq, self.last_term = self.log.last
        self._may_lead()

    def _may_lead(self) -> None:
        """A sequencer whose log holds the session's end campaigns only while it does not know that
        end committed: a leader that died with it replicated, not committed, leaves logs whose
        next leader ends the session again (its term start, then the end), which commits the first."""
        self.election.can_lead = self.can_lead and not (self.log.ended and self.commit_seq >= self.log.end_seq)

    @property
    def commit_seq(self) -> int:
        return self.follower.commit_seq

    def note_own(self, first_seq: int, last_seq: int, term: int, sealed: bool = False, end_seq: int = 0) -> None:
        """The leader appended its own batch (`sealed`: it ends with a seal; `end_seq`: the
        session's end in it): the log moves without a per-message look."""
        self.log.note_term(first_seq, term)
        self.log.end_seq = end_seq or self.log.end_seq
        self.last_seq, self.last_term = last_seq, term
        # The follower's view of the log too: an append of a later leader that reaches this one
        # before its step-down is carried out is judged against the log as it is.
        self.follower.last_seq, self.follower.last_term = last_seq, term
        if sealed:
            self.log.last_seal = last_seq

    def open_range(self) -> int | None:
        """The first seq after the last seal, if entries follow it (a range cut short)."""
        return self.log.last_seal + 1 if self.log.last_seal < self.last_seq else None

    def resync(self, commit_seq: int, client_last: dict[bytes, int]) -> None:
        """After leading: follow again from the log as it is."""
        self.log.client_last = client_last
        self.follower = FollowerCore(self.name, self.last_seq, self.last_term, self.term_at, term=self.election.term)
        self.follower.commit_seq = commit_seq
        self._may_lead()

    # --- events ----------------------------------------------------------------------------

    def on_append(self, a: rep.Append, conn: Hashable, now_ns: int) -> tuple[rep.Ack, list[VoterAction]]:
        """(the ack to send once the actions are done, actions)."""
        ok, out = self.election.on_append(a.term, a.leader, now_ns)
        if ok and self._drops_committed(a):
            ok = False
            out.append(Refused("drop_committed", f"{a.leader!r} (term {a.term}) sends entries from seq "
                                                 f"{a.prev_seq + 1} that differ from those committed through "
                                                 f"{self.follower.commit_seq}"))
        if not ok:
            return rep.Ack(self.election.term, self.name, False, self.last_seq), out
        before = self.follower.commit_seq
        self.follower.term = self.election.term
        res = self.follower.on_append(a)
        if res.truncate_after is not None:
            if res.truncate_after < before:  # _drops_committed refused these: this log is impossible
                raise InvariantViolation(f"truncating committed seq {res.truncate_after + 1} (committed "
                                         f"through {before})")
            out.append(Truncate(res.truncate_after))
            self.truncations += 1
            self.last_seq = res.truncate_after
            self.last_term = self.log.term_at(res.truncate_after)
        if res.records:
            out.append(AppendRecords(res.records, False))
            self._noted(res.records)
            self.appended += len(res.records)
        elif self.follower.commit_seq != before:
            self._may_lead()  # (the end may be known committed now)
        if self.election.leader == a.leader and self.election.term == a.term:
            self._leader_conns[conn] = (a.leader, a.term)
        return rep.Ack(self.election.term, self.name, res.success, res.last_seq), out

    def _drops_committed(self, a: rep.Append) -> bool:
        """Would `a` replace a committed entry? Terms only grow along a log, so comparing the
        overlap's two ends with the entries' term is enough."""
        first = a.prev_seq + 1
        last = min(self.follower.commit_seq, self.last_seq, a.prev_seq + a.count)
        if a.term < self.election.term or a.prev_seq > self.last_seq or first > last:
            return False
        return self.log.term_at(first) != a.entries_term or self.log.term_at(last) != a.entries_term

    def on_vote_request(self, v: rep.VoteRequest, now_ns: int) -> tuple[rep.Vote, list[VoterAction]]:
        """(the vote to send once the actions, its persistence first, are done; actions)."""
        granted, out = self.election.on_vote_request(v.term, v.candidate, v.last_seq, v.last_term, v.pre, now_ns)
        return rep.Vote(self.election.reply_term(v.term, granted, v.pre), self.name, granted, v.pre), out

    @property
    def recovering(self) -> bool:
        return self.election.recovering

    @property
    def absent(self) -> bool:
        """Recovering or waiting for disk space: the shell greets every connection and hangs up."""
        return self.election.absent

    def on_disk_full(self, records) -> list[VoterAction]:
        """A journal or vote write was refused for want of space (and undone): the log is the
        journal's `records` again, the commit point no further than them; take no part until
        on_disk_ok. A leader's shell steps down before this (its client seqs are the log's)."""
        out = self.election.on_disk_full()
        commit = self.follower.commit_seq
        self.rebuild_log(records)
        self.follower = FollowerCore(self.name, self.last_seq, self.last_term, self.term_at, term=self.election.term)
        self.follower.commit_seq = min(commit, self.last_seq)
        return out

    def on_disk_ok(self, now_ns: int) -> None:
        self.election.on_disk_ok(now_ns)

    def on_peer_hello(self, h: rep.Hello, now_ns: int) -> list[VoterAction]:
        """While recovering: another voter's greeting (term and log position)."""
        out = self.election.on_peer_hello(h.node, h.term, h.last_seq, h.last_term, now_ns)
        self.follower.term = self.election.term
        return out

    def hello(self) -> rep.Hello:
        return rep.Hello(self.election.term, self.name, self.last_seq, self.last_term)

    def on_closed(self, conn: Hashable, by_peer: bool, now_ns: int) -> bool:
        """A connection closed. If it carried the current leader's appends and the
        peer closed it (its process most likely died), take the leader for gone
        (and say so: True)."""
        carried = self._leader_conns.pop(conn, None)
        e = self.election
        if by_peer and carried == (e.leader, e.term) and carried not in self._leader_conns.values():
            e.on_leader_lost(carried[0], carried[1], now_ns)
            return True
        return False

    def fetch_start(self, f: rep.Fetch) -> tuple[int, int] | None:
        """A fetch is answered from seq f.from_seq if our entry before it has the asker's
        term there (our log continues theirs): (prev seq, its term), else None."""
        prev = f.from_seq - 1
        if 0 <= prev <= self.last_seq and self.term_at(prev) == f.prev_term:
            return prev, f.prev_term
        return None

    def fetch_from_seq(self) -> tuple[int, int]:
        """(from seq, the term before it) of a fetch: from our commit point, which every log more up
        to date than ours holds, so that the answer shows where ours differs."""
        prev = min(self.follower.commit_seq, self.last_seq)
        return prev + 1, self.term_at(prev)

    def fetched_conflict(self, a: rep.Append) -> int | None:
        """The seq after which our log must be cut for a fetch answer's append `a` to continue it:
        before the first entry of ours it overlaps with a higher term. Such an entry of ours was
        never committed (the later term's leader would hold it), so it goes, as a leader's append
        would make it go."""
        if self.election.leader is not None or a.prev_seq > self.last_seq or self.term_at(a.prev_seq) != a.prev_term:
            return None
        for seq in range(a.prev_seq + 1, min(a.prev_seq + a.count, self.last_seq) + 1):
            if self.log.term_at(seq) != a.entries_term:  # the higher term is the later leader's: ours is not committed
                return seq - 1 if a.entries_term > self.log.term_at(seq) and seq > self.follower.commit_seq else None
        return None

    def take_fetched(self, a: rep.Append) -> RecordRun | list | None:
        """Entries another voter's fetch answer holds beyond our log, to append
        (what its leaders' appends would have brought; [] if we hold them all), or None
        to stop: a leader appeared, or the logs do not line up (fetched_conflict first)."""
        if self.election.leader is not None or a.prev_seq > self.last_seq or self.term_at(a.prev_seq) != a.prev_term \
                or a.entries_term > self.election.term:
            return None
        held = min(self.last_seq - a.prev_seq, a.count)  # entries we have: the same seq and term, the same entry
        held_term = self.log.term_at(a.prev_seq + held)
        if (held and held_term != a.entries_term) or a.entries_term < held_term:
            return None
        if held == a.count:
            return []
        records = RecordRun(a.prev_seq + 1 + held, a.entries_term, a.entries[held * SEQUENCED_SIZE:], SEQUENCED_SIZE)
        self._noted(records)
        self.follower = FollowerCore(self.name, self.last_seq, self.last_term, self.term_at, term=self.election.term)
        return records
