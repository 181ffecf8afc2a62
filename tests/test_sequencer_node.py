"""SequencerNode (sequencer/sequencer_node_core.py): every decision of the sequencer process -- its voter
endpoint, leading, its followers' links, the order of a batch's steps, the end of the
session -- as its shell and the simulator drive it, over the replication frames' bytes."""

import dataclasses
import random
from collections import defaultdict, deque

import pytest

from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.protocol import replication as rep
from tape.protocol.actions import Close, Send
from tape.protocol.election import Cause
from tape.protocol.errors import InvariantViolation
from tape.protocol.voter_node import AppendRecords, Dial, Persist, ReadJournal, VoterNode
from tape.runtime.tuning import FREE_SPACE
from tape.sequencer import sequencer_node_core as sn
from tape.sequencer.client_core import ClientCore

S = moldudp64.session_bytes("TEST")
A, B, R1, R2 = (n.ljust(10).encode() for n in ("seq-a", "seq-b", "rw-1", "rw-2"))
C0 = b"c0".ljust(10)
MS = 1_000_000
ELECTION_NS = 300 * MS
SETTINGS = sn.LeaderSettings(S, {C0: None}, 1400, tick_ns=1000 * MS, heartbeat_ns=1000 * MS, batch_interval_ns=0,
                             beat_ns=50 * MS, stream_keys=None)


class Shell:
    """Carries the node's actions out as sequencer/sequencer_shell.py and runtime/voter_shell.py do, over an
    in-memory journal; what it sent, published, dialled and closed is kept."""

    def __init__(self, records=(), settings=SETTINGS, term: int = 0, drain_at_once: bool = True):
        voter = VoterNode(A, [A, B, R1, R2], True, random.Random(1), ELECTION_NS, term, None, (0, 0), True,
                          list(records), 0, free_space=FREE_SPACE)
        self.node = sn.SequencerNode(voter, settings, [B, R1, R2])
        self.journal = list(records)
        self.sent: dict = defaultdict(list)
        self.published: list[bytes] = []
        self.dialled: list[Dial] = []
        self.closed: list = []
        self.stamps: list[int] = []
        self.wall = 5_000 * MS  # the host's wall clock, ahead of its monotonic one
        self.done: list = []
        self.elected_at = 0
        self.drain_at_once = drain_at_once  # else the test calls on_drained

    def run(self, actions: list, now: int = 0) -> list:
        queue = deque(actions)
        while queue:
            a = queue.popleft()
            self.done.append(a)
            queue.extendleft(reversed(self.carry(a, now)))
        return self.done

    def carry(self, a, now: int) -> list:
        n = self.node
        if isinstance(a, Send):
            self.sent[a.conn].append(a.data)
        elif isinstance(a, (AppendRecords, sn.Journal)):
            records = list(a.records if isinstance(a, AppendRecords) else a.batch.records())
            assert records[0][0] == len(self.journal) + 1
            self.journal += records
            return n.on_journaled(a.batch, now) if isinstance(a, sn.Journal) else []
        elif isinstance(a, ReadJournal):
            return n.on_read(a, self.journal[a.first - 1:a.first - 1 + a.count], now)
        elif isinstance(a, sn.Replicate):
            for conn in a.conns:
                self.sent[conn].append(a.frame)
            return n.on_replicated(a, [0] * len(a.conns), now)
        elif isinstance(a, sn.StampNow):
            return n.on_stamp(self.wall + now, now)
        elif isinstance(a, sn.Stamp):
            self.stamps.append(a.due)
        elif isinstance(a, sn.Publish):
            self.published += a.packets
        elif isinstance(a, Dial):
            self.dialled.append(a)
        elif isinstance(a, Close):
            self.closed.append(a.conn)
        elif isinstance(a, sn.Drain) and self.drain_at_once:
            return n.on_drained(a.conn, now)
        return []

    def event(self, handler, *args, now: int = 0) -> list:
        self.done = []
        return self.run(handler(*args, now), now)

    def frames(self, conn) -> list:
        return rep.FrameReader().feed(b"".join(self.sent.pop(conn, [])))


def elect(shell: Shell, now: int = 0) -> list:
    """Win a pre-vote and a vote over the wire: every other voter grants both."""
    n = shell.node
    done = []
    while not any(isinstance(a, Dial) for a in done):  # ticks until its election timer fires
        now += n.voter.tick_ns
        done = shell.event(n.on_timer, now=now)
    for pre in (True, False):
        asks, done = [a for a in done if isinstance(a, Dial)], []
        for dial in asks:
            shell.event(n.on_connected, dial.conn, now=now)
            (request,) = shell.frames(dial.conn)
            done += shell.event(n.on_data, dial.conn, rep.encode_vote(request.term, dial.peer, True, pre), now=now)
    assert n.leader is not None
    shell.elected_at = now
    return done


def join(shell: Shell, conn, last_seq: int = 0, term: int | None = None, now: int = 0) -> list:
    """A follower's link connects and says hello."""
    shell.event(shell.node.on_connected, conn, now=now)
    term = shell.node.election.term if term is None else term
    return shell.event(shell.node.on_data, conn, rep.encode_hello(term, conn[1], last_seq, 0), now=now)


def ack(shell: Shell, conn, last_seq: int, success: bool = True, term: int | None = None, now: int = 0) -> list:
    term = shell.node.election.term if term is None else term
    return shell.event(shell.node.on_data, conn, rep.encode_ack(term, conn[1], success, last_seq), now=now)


def links(shell: Shell) -> dict:
    return {d.peer: d.conn for d in shell.dialled if d.conn in shell.node.links}


def trades(n: int, cseq: int = 1) -> bytes:
    from tape.ops.verification.tradegen import TradeGenerator
    client = ClientCore(C0, None, 1400, 10**12)
    client.next_cseq = cseq
    (datagram,) = client.submit(TradeGenerator(seed=cseq).take(n), 0)
    return datagram


def test_elected_it_reads_its_logs_end_dials_every_follower_and_stamps_the_term_start_first():
    shell = Shell()
    done = elect(shell)
    kinds = [type(a).__name__ for a in done]
    assert kinds.index("Lead") < kinds.index("ReadJournal") < kinds.index("Led") < kinds.index("StampNow")
    assert {d.peer for d in shell.dialled if d.conn[0] == sn.FOLLOWER_LINK} == {B, R1, R2}
    assert all(d.within_ns == sn.CONNECT_NS for d in shell.dialled if d.conn[0] == sn.FOLLOWER_LINK)
    (seq, term, first), = shell.journal
    assert M.decode(first)[M.TYPE] == M.TERM_START and term == shell.node.election.term
    assert M.SEQUENCED.unpack(first)[M.STAMP] == shell.wall + shell.elected_at  # the wall clock's
    assert shell.published == []  # not committed: no follower holds it


def test_a_batch_goes_to_live_followers_before_the_own_journal_and_out_once_a_majority_holds_it():
    shell = Shell()
    elect(shell)
    t, n, conns = shell.elected_at, shell.node, links(shell)
    for f in (B, R1, R2):
        join(shell, conns[f], now=t)
    for f in (B, R1):
        ack(shell, conns[f], 1, now=t)
    assert len(shell.published) == 1  # the term start, committed by three of four
    done = shell.event(n.on_inbound, [(trades(3), "c0")], True, shell.wall, now=t + MS)
    assert [type(a) for a in done] == [sn.Stamp] and len(shell.journal) == 1  # stamped later in the turn
    done = shell.event(n.on_stamp, shell.wall, now=t + MS)
    kinds = [type(a) for a in done]
    assert kinds[:2] == [sn.Replicate, sn.Journal] and sn.Publish not in kinds  # (only the leader holds it yet)
    assert set(done[0].conns) == set(conns.values()) and len(shell.journal) == 4
    assert not any(isinstance(a, sn.Publish) for a in ack(shell, conns[B], 4, now=t + MS))
    assert isinstance(ack(shell, conns[R2], 4, now=t + MS)[-1], sn.Publish)


def test_datagrams_from_an_address_no_client_is_at_are_checked_within_a_budget_a_clients_never():
    from tape.protocol.limits import STRANGER_INBOUND_RATE

    shell = Shell(settings=dataclasses.replace(SETTINGS, client_hosts=frozenset({"10.0.0.7"})))
    elect(shell)
    t, n, per_host = shell.elected_at, shell.node, int(STRANGER_INBOUND_RATE)
    junk = moldudp64.encode_packet(b"mallory".ljust(10), 1, [b"x" * 20])  # names no client: checked, refused
    done = shell.event(n.on_inbound, [(junk, ("10.6.6.6", 9))] * (per_host + 5), True, shell.wall, now=t)
    reasons = [a.reason for a in done if isinstance(a, sn.Dropped)]
    assert reasons == ["unknown_client"] * per_host + ["stranger_budget"] * 5  # a burst, then nothing checked
    done = shell.event(n.on_inbound, [(junk, ("10.0.0.7", 9))] * (per_host + 5), True, shell.wall, now=t)
    assert {a.reason for a in done if isinstance(a, sn.Dropped)} == {"unknown_client"}  # a client's address: all
    done = shell.event(n.on_inbound, [(junk, ("10.6.6.6", 9))], True, shell.wall, now=t + 10**9)
    assert [a.reason for a in done if isinstance(a, sn.Dropped)] == ["unknown_client"]  # refilled a second later


def test_the_batch_cap_stamps_within_one_drain():
    shell = Shell(settings=dataclasses.replace(SETTINGS, max_batch=5))
    elect(shell)
    t = shell.elected_at + MS
    done = shell.event(shell.node.on_inbound, [(trades(3, 1), "c0"), (trades(3, 4), "c0"), (trades(1, 7), "c0")],
                       True, shell.wall, now=t)
    batches = [a.batch for a in done if isinstance(a, sn.Journal)]
    assert [len(b.messages) for b in batches] == [6]  # stamped as it reached the cap; the seventh waits
    assert isinstance(done[-1], sn.Stamp) and shell.node.leader.pending == 1


def test_a_refusal_rewinds_the_follower_and_catches_it_up_a_chunk_a_drain():
    records = [(s, 1, M.stamp(M.purchase_request(s, 1, "c", "S"), s, C0, s)) for s in range(1, 8)]
    shell = Shell(records, term=1, drain_at_once=False)
    elect(shell)
    t, n = shell.elected_at, shell.node
    n.followers.catchup_chunk = 3
    conn = links(shell)[B]
    done = join(shell, conn, last_seq=8, now=t)  # it says it holds all eight (of another term, as it turns out)
    assert not any(isinstance(a, ReadJournal) for a in done)  # live: nothing to catch up from its word
    done = ack(shell, conn, 2, success=False, now=t)  # its log agrees only through seq 2
    assert [a for a in done if isinstance(a, ReadJournal)] == [ReadJournal(conn, 3, 3)]
    assert isinstance(done[-1], sn.Drain) and rep.FrameReader().feed(shell.sent[conn][-1])[0].prev_seq == 2
    assert [a for a in shell.event(n.on_drained, conn, now=t) if isinstance(a, ReadJournal)] == \
        [ReadJournal(conn, 6, 3)]  # the next chunk (seqs 6-8) only once the last one drained
    assert shell.event(n.on_drained, conn, now=t) == [] and n.followers.links[B].live


def test_an_ack_of_a_later_term_steps_it_down_closing_its_links_and_handing_over_its_client_seqs():
    shell = Shell()
    elect(shell)
    t, n, conns = shell.elected_at, shell.node, links(shell)
    join(shell, conns[B], now=t)
    shell.event(n.on_inbound, [(trades(4), "c0")], True, shell.wall, now=t)
    shell.event(n.on_stamp, shell.wall, now=t)
    term = n.election.term
    done = ack(shell, conns[B], 0, success=False, term=term + 1, now=t)
    down = [a for a in done if isinstance(a, sn.SteppedDown)]
    assert down == [sn.SteppedDown(term, down[0].reason, Cause.HIGHER_TERM)] and n.leader is None
    assert {a.conn for a in done if isinstance(a, Close)} == set(conns.values())
    assert isinstance(done[0], Persist) and done[0].term == term + 1  # the term on disk first
    assert n.core.log.client_last == {C0: 4}  # its own batch's seqs, for whoever leads next


def test_a_lost_follower_is_dialled_again_and_a_silent_one_given_up():
    shell = Shell()
    elect(shell)
    t, n, conns = shell.elected_at, shell.node, links(shell)
    join(shell, conns[B], now=t)
    shell.event(n.on_closed, conns[B], now=t + MS)
    assert n.next_deadline(t + MS) <= t + MS + sn.REDIAL_LOST_NS
    again = [a for a in shell.event(n.on_timer, now=t + MS + sn.REDIAL_LOST_NS) if isinstance(a, Dial)]
    assert [a.peer for a in again] == [B]
    shell.event(n.on_connected, conns[R1], now=t + 2 * MS)  # connected, never says hello
    done = shell.event(n.on_timer, now=t + 2 * MS + ELECTION_NS)
    assert conns[R1] in {a.conn for a in done if isinstance(a, Close)}


def test_the_end_of_the_session_commits_then_tells_the_followers_and_the_stream():
    shell = Shell(settings=dataclasses.replace(SETTINGS, tick_ns=50 * MS))  # (a tick due well within check-quorum)
    elect(shell)
    t, n, conns = shell.elected_at, shell.node, links(shell)
    for f in (B, R1, R2):
        join(shell, conns[f], now=t)
    done = shell.event(n.on_end, shell.wall, now=t)
    (end,) = [a.batch for a in done if isinstance(a, sn.Journal)]
    assert M.decode(end.messages[-1])[M.TYPE] == M.SESSION_END and not n.session_ended()
    assert shell.event(n.on_inbound, [(trades(1), "c0")], True, shell.wall, now=t) == []  # (ending)
    later = t + 60 * MS  # a time tick due: none after the session's end
    assert not any(isinstance(a, sn.Stamp) for a in shell.event(n.on_timer, now=later))
    shell.event(n.on_stamp, shell.wall, now=later)
    assert shell.journal[-1][0] == end.last_seq
    for f in (B, R1):
        ack(shell, conns[f], end.last_seq, now=t)
    assert n.session_ended()
    done = shell.event(n.on_session_ended, now=t + MS)
    assert isinstance(done[0], sn.Replicate) and isinstance(done[-1], sn.EndOfSession)
    assert rep.FrameReader().feed(done[0].frame)[0].commit_seq == end.last_seq  # the final commit point
    assert moldudp64.decode_header(done[-1].packet)[2] == 0xFFFF and done[-1].repeats == sn.EOS_REPEATS


def test_a_time_tick_runs_on_the_monotonic_clock_whatever_the_wall_clock_does():
    shell = Shell()
    elect(shell)
    t, n = shell.elected_at, shell.node
    due = t + SETTINGS.tick_ns
    assert n.next_deadline(t) <= due
    assert sn.Stamp(due) in shell.event(n.on_timer, now=due)
    shell.event(n.on_stamp, -10**12, now=due)  # the wall clock stepped far back: the stamps hold
    tick = shell.journal[-1][2]
    assert M.decode(tick)[M.TYPE] == M.TIME_TICK
    assert M.SEQUENCED.unpack(tick)[M.STAMP] == M.SEQUENCED.unpack(shell.journal[0][2])[M.STAMP]  # never back


def test_inbound_while_following_is_counted_and_dropped():
    shell = Shell()
    assert shell.event(shell.node.on_inbound, [(trades(2), "c0")] * 3, True, 0) == []
    assert shell.node.not_leader_drops == 3


def test_a_journal_missing_what_this_leader_stamped_is_an_impossible_state():
    shell = Shell()
    elect(shell)
    conn = links(shell)[B]
    join(shell, conn, now=shell.elected_at)
    with pytest.raises(InvariantViolation):
        shell.node.on_read(ReadJournal(conn, 1, 1), [], shell.elected_at)


def test_a_new_leader_whose_clock_is_behind_stamps_from_its_logs_last_stamp():
    late = 10**15  # the old leader's clock was far ahead of this host's
    records = [(s, 1, M.stamp(M.purchase_request(s, 1, "c", "S"), late + s, C0, s)) for s in range(1, 4)]
    shell = Shell(records, term=1)
    elect(shell)
    assert M.SEQUENCED.unpack(shell.journal[-1][2])[M.STAMP] == late + 3  # the term start: not before seq 3's


def ended_log() -> list:
    """A log whose leader (seq-b, term 1) stamped the session's end and died before it committed."""
    msgs = [M.term_start(10, B, 1, B), M.time_tick(20, B), M.session_end(30, B)]
    return [(seq, 1, m) for seq, m in enumerate(msgs, 1)]


def test_a_log_holding_an_end_not_known_committed_leads_once_more_to_end_the_session_again():
    # Without it, no sequencer could lead after a leader that died with its end replicated: the
    # end would stay uncommitted for good (found by the simulator: a leader's disk full at the end).
    shell = Shell(ended_log(), settings=dataclasses.replace(SETTINGS, tick_ns=50 * MS), term=1)
    n = shell.node
    assert n.election.can_lead  # the commit point is not known: it may be uncommitted
    elect(shell)
    t, conns = shell.elected_at, links(shell)
    assert n.ending and [M.decode(m)[M.TYPE] for _, _, m in shell.journal[3:]] == [M.TERM_START, M.SESSION_END]
    assert shell.event(n.on_inbound, [(trades(1), "c0")], True, shell.wall, now=t) == []  # nothing follows the end
    for f in (B, R1, R2):
        join(shell, conns[f], last_seq=3, term=1, now=t)
    ack(shell, conns[B], 5, now=t)
    done = ack(shell, conns[R1], 5, now=t)  # committed: it tells the followers and the stream by itself
    assert n.session_ended() and isinstance(done[-1], sn.EndOfSession)
    assert shell.event(n.on_end, shell.wall, now=t) == [] and shell.event(n.on_session_ended, now=t) == []
    assert len([p for p in shell.published if moldudp64.decode_header(p)[2] not in (0, 0xFFFF)]) >= 1


def test_a_follower_that_knows_its_logs_end_committed_campaigns_no_more():
    shell = Shell(ended_log(), term=1)
    n = shell.node
    beat = rep.encode_append(1, B, 3, 1, 3, 1, [])  # the leader's final beat: committed through the end
    shell.event(n.on_connected, ("in", 1))
    shell.event(n.on_data, ("in", 1), beat)
    assert n.core.commit_seq == 3 and not n.election.can_lead
