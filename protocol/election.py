"""Who leads: Raft's elections for the voters (sequencers and rewinders). Pure.

Events in: timer ticks, appends heard from a leader, the close of the
connection that carried them, vote requests and votes, acks (a leader's
proof that followers still follow). Actions out, which the shell carries
out in order:

    Persist(term, voted_for)              write durably before anything else
    RequestVotes(pre, term, last_seq, last_term)   to every other voter
    Lead(term)                            become leader of this term
    StepDown(reason, cause)               stop leading (or campaigning) now

Rules (DESIGN.md section 5):
- Only a node that `can_lead` (a sequencer) campaigns; rewinders vote only.
- Election timeout with jitter from the `rng` the shell seeds.
- Pre-vote first: a would-be candidate asks whether voters would elect it
  at term + 1, changing no one's term; a voter says yes only if it has not
  heard from a leader for the minimum election timeout and the candidate's
  log is at least as up to date. So a node cut off by a partition does not
  inflate terms and depose a healthy leader when it comes back.
- A leader's connection closing (a crash, or a step-down) brings the next
  campaign forward to a tenth to a fifth of the timeout and lets this voter
  grant pre-votes at once: a crashed leader is replaced in tens of ms,
  while a paused or cut-off one still takes the timeout.
- One vote per term, only for a candidate whose log is at least as up to
  date (last term, then last seq); a vote resets the granter's timer.
- A leader steps down at once on seeing a higher term, and when it has not
  heard from a majority (itself included) for the minimum election timeout
  (check-quorum): a leader cut off from its followers stops within the
  timeout, before a new leader can be elected.
- A voter that starts without its election state (a new or wiped disk) is
  *recovering*: it neither votes, campaigns nor follows until it has heard
  every other voter's hello. Then its term is the highest term heard, in
  which it votes for no one, and it grants votes only to logs at least as
  up to date as the most up to date log heard (its log floor, kept on disk
  with the term). docs/failover.md gives the reasoning: every term in which
  it may have voted is at most its candidate's term, and every committed
  entry is in some log it heard, as long as fewer than a majority of voters
  lost their disks.
- Silence a node could not hear is not silence: when the gap between two
  ticks exceeds `stall_ns` (the process was not scheduled, blocked in a disk
  write, or stopped), every timer is held by the gap beyond `stall_ns`, so
  a node judges its peers (check-quorum, pre-votes, its own campaign) only
  on time it was listening; the replies that arrived meanwhile are read
  before the next tick. Time still advances by at least `stall_ns` a tick,
  so a node starved for good still times out. Liveness only: a held timer
  never changes what terms and votes decide.
- A voter whose disk is full (a journal or vote write refused for want of
  space) steps down if it leads or campaigns, and neither votes, campaigns
  nor follows until the shell says there is space again: it cannot make
  durable what a vote or an ack would promise.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

FOLLOWER, PRE_CANDIDATE, CANDIDATE, LEADER = "follower", "pre-candidate", "candidate", "leader"
# The vote of a recovered voter in the term it recovered in: it may have voted in that term
# before it lost its disk, so it votes for no one (no wire name is one byte long).
VOTE_LOST = b"?"


@dataclass(frozen=True)
class Persist:
    """Write (term, voted_for) durably before any message that follows is sent."""

    term: int
    voted_for: bytes | None
    log_floor: tuple[int, int] = (0, 0)  # (last_term, last_seq) a candidate's log must reach


@dataclass(frozen=True)
class RequestVotes:
    pre: bool
    term: int
    last_seq: int
    last_term: int


@dataclass(frozen=True)
class Lead:
    term: int


class Cause(Enum):
    """Why a node stopped leading or campaigning (the step_downs metric's `reason` label)."""

    HIGHER_TERM = "higher_term"  # another voter is in a later term
    LOST_MAJORITY = "lost_majority"  # check-quorum: no majority heard for the timeout
    DISK_FULL = "disk full"
    OUTVOTED = "outvoted"  # a candidate heard the winner of its term


@dataclass(frozen=True)
class StepDown:
    reason: str  # for the log
    cause: Cause = Cause.HIGHER_TERM


@dataclass(frozen=True)
class Refused:
    """A peer's message that contradicts this node's own state (two leaders in a term, an
    append that would drop a committed entry): what the network sends is input, never a reason
    to stop. The shell counts it by reason and logs it; the simulator, whose peers are honest,
    fails the seed."""

    reason: str
    detail: str


ElectionAction = Persist | RequestVotes | Lead | StepDown | Refused


class Rng(Protocol):
    """The seeded random source the shell passes in (random.Random)."""

    def randint(self, a: int, b: int) -> int: ...


class ElectionCore:
    def __init__(self, name: bytes, voters: list[bytes], can_lead: bool, log_position: Callable[[], tuple[int, int]],
                 rng: Rng, timeout_ns: tuple[int, int] = (300_000_000, 600_000_000), term: int = 0,
                 voted_for: bytes | None = None, now_ns: int = 0, recovering: bool = False,
                 log_floor: tuple[int, int] = (0, 0), stall_ns: int | None = None):
        if name not in voters:
            raise ValueError(f"{name!r} is not one of the voters")
        self.name = name
        self.voters = list(voters)
        self.can_lead = can_lead
        self.log_position = log_position  # () -> (last_seq, last_term) of this node's log
        self.rng = rng
        self.timeout_lo, self.timeout_hi = timeout_ns
        self.term = term
        self.voted_for = voted_for
        self.role = FOLLOWER
        self.leader: bytes | None = None
        self.votes: set[bytes] = set()
        self.heard_ns = now_ns  # last time a leader of the current term was heard
        self.acked: dict[bytes, int] = {}  # leader: follower -> last ack time
        self.leader_gone = False  # its connection closed: campaign in short rounds until someone leads
        self.elections = 0
        self.leader_changes = 0
        self.deadline = now_ns + self._timeout()
        self.recovering = recovering and len(voters) > 1  # no election state: waiting for every other voter's hello
        self.heard: dict[bytes, tuple[int, int, int]] = {}  # while recovering: voter -> (term, last_term, last_seq)
        self.log_floor = log_floor
        self.disk_full = False  # a write was refused for want of space: absent until space returns
        self.stall_ns = stall_ns  # a longer gap between ticks holds the timers (None: never)
        self.last_tick_ns = now_ns
        self.stalls = 0
        self.held_ns = 0  # total time the timers were held over stalls

    @property
    def majority(self) -> int:
        return len(self.voters) // 2 + 1

    def _timeout(self, pre_vote: bool = False) -> int:
        # Only pre-vote rounds are shortened: answers to an earlier pre-vote
        # still count (no term moves), while a real election needs its votes
        # on disk, which may take longer than a short round.
        if pre_vote and self.leader_gone:
            return self.rng.randint(self.timeout_lo // 10, self.timeout_lo // 5)
        return self.rng.randint(self.timeout_lo, self.timeout_hi)

    def _adopt(self, term: int, now_ns: int, reason: str) -> list[ElectionAction]:
        """A higher term: follow it (stepping down if leading or campaigning)."""
        was = self.role
        self.leader_gone = False
        self.term = term
        self.voted_for = None
        self.role = FOLLOWER
        self.leader = None
        self.votes = set()
        self.deadline = now_ns + self._timeout()
        out = [self._persist()]
        if was in (LEADER, CANDIDATE, PRE_CANDIDATE):
            out.append(StepDown(reason))
        return out

    def _persist(self) -> Persist:
        return Persist(self.term, self.voted_for, self.log_floor)

    # --- recovery ----------------------------------------------------------------------

    def on_peer_hello(self, voter: bytes, term: int, last_seq: int, last_term: int,
                      now_ns: int) -> list[ElectionAction]:
        """While recovering: another voter's hello. Once every other voter's is in, take the
        highest term heard (voting in it for no one) and the most up to date log heard."""
        if not self.recovering or voter == self.name or voter not in self.voters:
            return []
        self.heard[voter] = (term, last_term, last_seq)
        if len(self.heard) < len(self.voters) - 1:
            return []
        self.recovering = False
        self.term = max(self.term, *(t for t, _, _ in self.heard.values()))
        self.voted_for = VOTE_LOST
        self.log_floor = max((lt, ls) for _, lt, ls in self.heard.values())
        self.deadline = now_ns + self._timeout()
        return [self._persist()]

    def _up_to_date(self, last_seq: int, last_term: int) -> bool:
        my_seq, my_term = self.log_position()
        return (last_term, last_seq) >= max((my_term, my_seq), self.log_floor)

    @property
    def absent(self) -> bool:
        """Recovering its election state or waiting for disk space: it takes no part."""
        return self.recovering or self.disk_full

    # --- the disk ----------------------------------------------------------------------

    def on_disk_full(self) -> list[ElectionAction]:
        """A write was refused for want of space: stop leading or campaigning, take no part."""
        self.disk_full = True
        was, self.role, self.votes = self.role, FOLLOWER, set()
        if was == FOLLOWER:
            return []
        self.leader = None
        return [StepDown("disk full", Cause.DISK_FULL)]

    def on_disk_ok(self, now_ns: int) -> None:
        """Space is back: take part again, after a whole timeout in which to hear a leader."""
        self.disk_full = False
        self.deadline = now_ns + self._timeout()

    # --- time ------------------------------------------------------------------------

    def on_tick(self, now_ns: int) -> list[ElectionAction]:
        self._hold_over_stall(now_ns)
        if self.absent:
            return []
        if self.role == LEADER:
            recent = 1 + sum(
                1 for v in self.voters if v != self.name and now_ns - self.acked.get(v, -1 << 62) < self.timeout_lo
            )
            if recent < self.majority:
                self.role = FOLLOWER
                self.leader = None
                self.deadline = now_ns + self._timeout()
                return [StepDown(f"no majority heard for {self.timeout_lo / 1e6:.0f} ms (check-quorum)",
                                 Cause.LOST_MAJORITY)]
            return []
        if not self.can_lead or now_ns < self.deadline:
            return []
        # Time to campaign: a pre-vote first (or a fresh one, if the last round stalled).
        self.role = PRE_CANDIDATE
        self.leader = None  # not heard for a whole timeout
        self.votes = {self.name}
        self.deadline = now_ns + self._timeout(pre_vote=True)
        last_seq, last_term = self.log_position()
        if len(self.votes) >= self.majority:
            return self._campaign(now_ns)
        return [RequestVotes(True, self.term + 1, last_seq, last_term)]

    def next_deadline_ns(self) -> int | None:
        """When `on_tick` next decides something if no message comes first: the campaign
        deadline of a voter that may lead and does not (None: a leader's check-quorum and a
        voter that never campaigns are judged at whatever ticks come)."""
        if self.role == LEADER or not self.can_lead or self.absent:
            return None
        return self.deadline

    def _hold_over_stall(self, now_ns: int) -> None:
        gap = now_ns - self.last_tick_ns
        self.last_tick_ns = now_ns
        if self.stall_ns is None or gap <= self.stall_ns:
            return
        held = gap - self.stall_ns
        self.stalls += 1
        self.held_ns += held
        self.heard_ns = min(self.heard_ns + held, now_ns)
        self.acked = {v: min(t + held, now_ns) for v, t in self.acked.items()}
        self.deadline = min(self.deadline + held, now_ns + self.timeout_hi)

    def _campaign(self, now_ns: int) -> list[ElectionAction]:
        self.role = CANDIDATE
        self.term += 1
        self.voted_for = self.name
        self.votes = {self.name}
        self.leader = None
        self.elections += 1
        self.deadline = now_ns + self._timeout()
        last_seq, last_term = self.log_position()
        out = [self._persist()]
        if len(self.votes) >= self.majority:
            return out + self._win(now_ns)
        return out + [RequestVotes(False, self.term, last_seq, last_term)]

    def _win(self, now_ns: int) -> list[ElectionAction]:
        self.role = LEADER
        self.leader = self.name
        self.leader_gone = False
        self.leader_changes += 1
        self.acked = {v: now_ns for v in self.voters}  # a fresh leader gets one timeout to hear its followers
        return [Lead(self.term)]

    # --- messages --------------------------------------------------------------------

    def on_append(self, term: int, leader: bytes, now_ns: int) -> tuple[bool, list]:
        """An append (or heartbeat) from `leader`: (accept it?, actions)."""
        if term < self.term or self.absent:
            return False, []
        out = []
        if term > self.term:
            out = self._adopt(term, now_ns, f"{leader.decode(errors='replace').strip()} leads term {term}")
        elif self.role == LEADER:
            return False, [Refused("two_leaders", f"two leaders in term {term}: this node and {leader!r}")]
        elif self.role in (CANDIDATE, PRE_CANDIDATE):
            self.role = FOLLOWER
            out.append(StepDown(f"{leader.decode(errors='replace').strip()} won term {term}", Cause.OUTVOTED))
        if self.leader != leader:
            self.leader = leader
            self.leader_changes += 1
        self.leader_gone = False
        self.heard_ns = now_ns
        self.deadline = now_ns + self._timeout()
        return True, out

    def on_vote_request(self, term: int, candidate: bytes, last_seq: int, last_term: int, pre: bool,
                        now_ns: int) -> tuple[bool, list]:
        """(grant?, actions). The reply carries self.term after the actions."""
        if self.absent:
            return False, []
        up_to_date = self._up_to_date(last_seq, last_term)
        leader_alive = self.role == LEADER or (self.leader is not None and now_ns - self.heard_ns < self.timeout_lo)
        if pre:
            return term > self.term and up_to_date and not leader_alive and candidate != self.name, []
        if term < self.term or leader_alive and term > self.term and self.role != LEADER:
            return False, []  # stale, or disruptive while our leader is alive
        out = []
        if term > self.term:
            out = self._adopt(term, now_ns, f"{candidate.decode(errors='replace').strip()} campaigns in term {term}")
        grant = up_to_date and self.voted_for in (None, candidate)
        if grant:
            self.voted_for = candidate
            self.deadline = now_ns + self._timeout()
            out.append(self._persist())
        return grant, out

    def on_vote(self, term: int, voter: bytes, granted: bool, pre: bool, now_ns: int) -> list[ElectionAction]:
        """A vote. A granted pre-vote carries the term asked for; any other
        answer carries the voter's own term, which is adopted if higher."""
        if voter not in self.voters or self.absent:
            return []
        if pre and granted:
            if self.role == PRE_CANDIDATE and term == self.term + 1:
                self.votes.add(voter)
                if len(self.votes) >= self.majority:
                    return self._campaign(now_ns)
            return []
        if term > self.term:
            return self._adopt(term, now_ns, f"{voter.decode(errors='replace').strip()} is in term {term}")
        if granted and self.role == CANDIDATE and term == self.term:
            self.votes.add(voter)
            if len(self.votes) >= self.majority:
                return self._win(now_ns)
        return []

    def on_leader_lost(self, leader: bytes, term: int, now_ns: int) -> list[ElectionAction]:
        """The connection that carried `leader`'s appends in `term` closed:
        its process most likely died (the OS closes a killed process's
        sockets at once) or it stepped down. Stop counting it as alive, and
        a node that can lead campaigns within a tenth to a fifth of the
        timeout instead of a whole one, and keeps to such short rounds
        until a leader is heard or elected (a voter that had not yet seen
        its own connection close refuses the first pre-vote). Pre-votes
        still decide: a voter that still hears the leader refuses, so one
        lost connection cannot depose a live leader."""
        if term != self.term or self.leader != leader or self.role != FOLLOWER:
            return []
        self.heard_ns = min(self.heard_ns, now_ns - self.timeout_lo)
        if self.can_lead:
            self.leader_gone = True
            self.deadline = min(self.deadline, now_ns + self._timeout(pre_vote=True))
        return []

    def reply_term(self, request_term: int, granted: bool, pre: bool) -> int:
        return request_term if pre and granted else self.term

    def on_ack(self, follower: bytes, term: int, now_ns: int) -> list[ElectionAction]:
        """A follower answered this leader (any answer proves it is reachable)."""
        if self.absent:
            return []
        if term > self.term:
            return self._adopt(term, now_ns, f"{follower.decode(errors='replace').strip()} is in term {term}")
        if self.role == LEADER and term == self.term:
            self.acked[follower] = now_ns
        return []

    def on_higher_term(self, term: int, who: bytes, now_ns: int) -> list[ElectionAction]:
        return (
            self._adopt(term, now_ns, f"{who.decode(errors='replace').strip()} is in term {term}")
            if term > self.term and not self.absent
            else []
        )
