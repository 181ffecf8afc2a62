"""The deterministic simulator (issue 5): thousands of seeds of faults, each
checked against DESIGN.md section 9; and proof that it catches broken rules."""

import os
import re
import time

import pytest

from tape.ops.verification import sim
from tape.protocol import messages, moldudp64
from tape.protocol import messages as M
from tape.protocol.election import ElectionCore
from tape.protocol.listener import ListenerCore
from tape.protocol.voter import VoterCore
from tape.replicas.emitter_core import EmitterCore, RecordDone, RecordIntent
from tape.sequencer.client_core import ClientCore
from tape.sequencer.followers_core import FollowerLinks
from tape.sequencer.leader_core import LeaderCore


def caught(seeds, enough: int, violation: str, others_too: bool = False) -> list[str]:
    """The first `enough` failures of the (mutated) simulator over `seeds` that match `violation`
    (the rule that mutation breaks), in order: a mutation is caught once that many seeds fail on it,
    so the search stops there rather than running every seed. A failure that matches nothing fails
    the test, unless the mutation may break `others_too`."""
    failures = []
    for seed in seeds:
        failure = sim.run_seed(seed)[1]
        if failure and not re.match(violation, failure.splitlines()[0]):
            assert others_too, (seed, failure)
        elif failure:
            failures.append(failure)
            if len(failures) == enough:
                break
    return failures


STALLED = r"Violation: no progress"


@pytest.mark.slow
def test_two_thousand_seeds_hold_every_invariant(capsys):
    assert sim.main(1, 2000, jobs=2) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr().out
    assert "2000 seeds" in out
    assert int(re.search(r"(\d+) back-offs honoured", out)[1]) > 0  # overloaded leaders were among the faults


def test_a_fresh_window_of_seeds_holds_every_invariant(capsys):
    """200 seeds in a window no run before chose (TAPE_SIM_FIRST, else from the clock): over many
    runs the seeds explored keep growing. A failure prints its seed and the one command that
    replays it (`tape sim --first SEED --seeds 1 -v`)."""
    first = int(os.environ.get("TAPE_SIM_FIRST") or 10_000 + time.time_ns() // 10**9 % 10**7 * 200)
    assert sim.main(first, 200, jobs=2) == 0, f"window {first}..{first + 199}: " + capsys.readouterr().out[-3000:]


def test_a_run_settles_only_once_every_client_saw_its_trades_acknowledged():
    """Seeds whose clients saw their last trades sequenced ahead of a gap (nothing left to resend)
    but not yet delivered in order: the run once stopped there, and its verdict found trades not
    acknowledged (2,891, 5,815 and 7,479 of seeds 2,001-8,000)."""
    for seed in (2891, 5815, 7479):
        assert sim.run_seed(seed)[1] is None, seed


def test_a_refused_connect_is_told_to_the_process_that_dialled_it_not_to_its_restart():
    """Seed 1,244,100,228 (a fresh window of make test-pure-fast): seq-a dialled a partitioned seq-b,
    crashed, restarted and dialled it again under the same name (a process numbers its connections
    from 1); the old connect's timeout then closed the new one, whose opening the node took for a
    voter connecting to it, and it greeted on its own dial."""
    assert sim.run_seed(1_244_100_228)[1] is None


def test_a_seed_is_reproducible():
    assert sim.run_seed(4711) == sim.run_seed(4711)
    assert sim.run_seed(4711)[2]["terms"] >= 1


@pytest.mark.slow
def test_the_simulator_catches_a_leader_that_commits_alone(monkeypatch):
    monkeypatch.setattr(LeaderCore, "majority", lambda self: 1)
    assert len(caught(range(1, 301), 10, r"Violation: seq-[ab] published a different message at seq \d+")) == 10


def test_the_simulator_catches_a_leader_that_alters_a_trades_shares(monkeypatch):
    """Every other row of the verdict holds (the log agrees with itself, the replicas and the
    alerts follow it): only the comparison with what each client submitted sees it."""
    original = messages.stamp_blocks

    def more_shares(record: bytes) -> bytes:
        kind, order, shares, *rest = M.INBOUND.unpack(record[:M.INBOUND_SIZE])
        return M.INBOUND.pack(kind, order, shares + 1, *rest) + record[M.INBOUND_SIZE:]

    def altered(*args):
        return [more_shares(r) if r[0] == M.PURCHASE else r for r in original(*args)]

    monkeypatch.setattr(messages, "stamp_blocks", altered)
    violation = r"Violation: the run's verdict fails: content: each trade as its client submitted it \(\d+"
    failures = caught(range(1, 4), 3, violation)
    assert len(failures) == 3 and "altered; seq" in failures[0], failures[0][:300]


@pytest.mark.slow
def test_the_simulator_catches_votes_without_the_election_restriction(monkeypatch):
    original = ElectionCore.on_vote_request
    monkeypatch.setattr(
        ElectionCore,
        "on_vote_request",
        lambda self, term, cand, seq, lterm, pre, now: original(self, term, cand, 10**9, 10**9, pre, now),
    )
    # A sequencer elected with a shorter log tells voters to drop what was committed, or publishes over it,
    # or (after a voter's disk was wiped) makes a voter take another message at a committed seq.
    violation = (r"Violation: ([\w-]+ refused: .* sends entries from seq \d+ that differ from those committed"
                 r"|seq-[ab] published a different message at seq \d+"
                 r"|[\w-]+ holds at committed seq \d+ a message other than the one published)")
    assert len(caught(range(1, 501), 6, violation)) == 6


@pytest.mark.slow
def test_the_simulator_catches_a_voter_that_keeps_in_its_log_what_its_full_disk_refused(monkeypatch):
    monkeypatch.setattr(VoterCore, "on_disk_full", lambda self, records: self.election.on_disk_full())
    # It acks the leader's next entries as if it held the refused ones: its journal gets a gap,
    # holds at a committed seq what was not committed there (or a leader it elected sends such
    # entries, or as leader has no entry it must catch a follower up with), or the cluster stops
    # making progress.
    violation = r"Violation: ([\w-]+ appends seq \d+ after \d+|[\w-]+ holds at committed seq \d+ a message other " \
                r"than the one published|[\w-]+ refused: .* sends entries from seq \d+ that differ from those " \
                r"committed|seq-[ab] the journal has no seq \d+, which this leader stamped|no progress)"
    assert len(caught(range(1, 301), 10, violation)) == 10


def test_a_failing_seed_prints_its_reproduction(monkeypatch, capsys):
    monkeypatch.setattr(LeaderCore, "majority", lambda self: 1)
    bad = next(s for s in range(1, 301) if sim.run_seed(s)[1])
    assert sim.main(bad, 1) == 1
    assert f"reproduce: tape sim --first {bad} --seeds 1 -v" in capsys.readouterr().out


def test_without_the_fetch_a_leader_dying_mid_batch_can_stall_elections(monkeypatch):
    # The leader replicates a batch before journaling it; if it dies between the two, only
    # rewinders (which never lead) may hold the batch, and no sequencer can win their votes
    # until it fetches those entries (docs/failover.md#a-standby-behind-the-rewinders).
    monkeypatch.setattr(VoterCore, "take_fetched", lambda self, append: None)
    assert len(caught(range(1, 301), 2, STALLED, others_too=True)) == 2


# The simulator runs the clients' and listeners' own cores (ClientCore, ListenerCore), so a bug
# in the policies the processes run is a bug it finds; the simulator before issue 12 ran copies
# of them and could not (docs/failover.md, "The simulator runs the real code").


@pytest.mark.slow
def test_a_client_that_never_resends_its_oldest_batch_stalls(monkeypatch):
    original = ClientCore.on_timer

    def on_timer(self, now_ns):
        head = self.unacked[0] if self.unacked else None
        due = head is not None and head.due_ns <= now_ns
        out = original(self, now_ns)
        return out[1:] if due else out  # the head is never sent again

    monkeypatch.setattr(ClientCore, "on_timer", on_timer)
    assert len(caught(range(1, 41), 3, STALLED)) == 3


@pytest.mark.slow
def test_a_listener_that_never_asks_twice_for_a_gap_stalls(monkeypatch):
    original = ListenerCore.on_timer

    def on_timer(self, now_ns):
        before = set(self._asked)  # a lost request or answer is never asked for again
        return [a for a in original(self, now_ns) if moldudp64.decode_request(a.request[:20])[1] not in before]

    monkeypatch.setattr(ListenerCore, "on_timer", on_timer)
    assert len(caught(range(1, 41), 3, STALLED)) == 3


@pytest.mark.slow
def test_a_leader_that_ignores_refusals_never_catches_a_follower_up(monkeypatch):
    # FollowerLinks is the leader's per-follower progress the process runs; the simulator
    # before issue 12 modelled it (64 entries per 20 ms) instead.
    monkeypatch.setattr(FollowerLinks, "refused", lambda self, follower, last_seq: False)
    assert len(caught(range(1, 301), 3, STALLED)) == 3  # (refusals follow failovers: a follower's stale suffix)


@pytest.mark.slow
def test_an_emitter_that_forgets_alerts_in_doubt_loses_them(monkeypatch):
    # The emitter crashes at its core's crash points in the simulation; recovery that records
    # alerts in doubt as done without delivering them again loses those whose intent was recorded.
    monkeypatch.setattr(EmitterCore, "recover", lambda self, doubt: [RecordDone(doubt)] if doubt else [])
    violation = r"Violation: exactly-once alerts: \d+ delivered \(0 twice, [1-9]\d* missing\)"
    assert len(caught(range(1, 801), 5, violation)) == 5


def test_the_simulator_catches_a_new_leader_that_stamps_by_its_own_clock(monkeypatch):
    # Hosts' clocks differ (±200 ms in the simulator): a new leader that ignores its log's last stamp
    # stamps earlier than the old leader did, and the replicas' clock would run backwards.
    original = LeaderCore.__init__
    monkeypatch.setattr(LeaderCore, "__init__",
                        lambda self, *a, **kw: original(self, *a, **{**kw, "last_stamp_ns": 0}))
    # (the replicas' clock running backwards may break the digest's recomputation from the log too)
    violation = r"Violation: the run's verdict fails: (.*; )?stamps never go backwards \(\d+ backwards\)$"
    assert len(caught(range(1, 101), 2, violation)) == 2


def test_the_simulator_catches_listeners_that_take_unsealed_packets(monkeypatch):
    # The garbage fault sends every listener well-formed packets at the seqs it needs next, unsealed
    # and sealed with another key: a listener that does not check seals takes them (and may then wait
    # forever for seqs that were never published).
    monkeypatch.setattr(sim.StreamKeys, "verify", lambda self, data: None)
    violation = (r"Violation: ((c\d|replica-[ABC]) delivered (at seq \d+ a message other than the one published"
                 r"|a stream that is not the committed log)"
                 r"|replica-[ABC] and replica-[ABC] applied up to seq \d+ with different digests"
                 r"|no progress: the healed cluster did not finish within 60 s of virtual time .*)$")
    assert len(caught(range(1, 101), 5, violation)) == 5


@pytest.mark.slow
def lose_a_majority_behind_a_lagging_sequencer(self) -> None:
    """A directed schedule: the sequencer that does not lead is down while entries commit
    without it, then the leader crashes and both rewinders lose their disks: the lagging
    sequencer comes back, and no vote of the wiped may elect it (they lost what it lacks)."""
    def cut_off() -> None:
        leader = self.leader()
        if leader is None:
            return
        lagging = next(s for s in sim.SEQUENCERS if s != leader.name)
        self.crash(lagging, self.now + 800 * sim.MS)
        self.at(self.now + 400 * sim.MS, lose_majority, leader.name)

    def lose_majority(leader: str) -> None:
        if self.voters[leader].up:
            self.crash(leader, self.now + 900 * sim.MS)
        for name in sim.REWINDERS:
            if self.voters[name].up:
                self.crash(name, self.now + 20 * sim.MS)
            self.voters[name].lose_disk()
        self.wiped = True

    self.at(600 * sim.MS, cut_off)


@pytest.mark.parametrize("forgetful", [False, True])
def test_the_simulator_catches_voters_that_vote_after_losing_their_disk(monkeypatch, forgetful):
    # A wiped voter that starts voting at once (as before issue 15) elects a candidate that lacks
    # what was committed on the lost disks; one that waits for every other voter's hello does not.
    if forgetful:
        original = VoterCore.__init__
        monkeypatch.setattr(VoterCore, "__init__", lambda self, *args, **kwargs: original(
            self, *args, **{**kwargs, "recovering": False}))
    monkeypatch.setattr(sim.Sim, "_schedule_faults", lose_a_majority_behind_a_lagging_sequencer)
    violation = (r"Violation: (two leaders in term \d+"
                 r"|seq-[ab] published a different message at seq \d+"
                 r"|[\w-]+ refused: .* sends entries from seq \d+ that differ from those committed"
                 r"|[\w-]+ holds at committed seq \d+ a message other than the one published)")
    failures = [sim.run_seed(seed)[1] for seed in range(1, 11)]
    if forgetful:
        assert sum(1 for f in failures if f and re.match(violation, f)) >= 3, failures
    else:
        assert failures == [None] * 10, failures


@pytest.mark.slow
def test_the_simulator_catches_a_client_that_a_back_off_stops_for_good(monkeypatch):
    monkeypatch.setattr(ClientCore, "pause_left_ns", lambda self, now: 1 if self.backoffs else 0)
    assert caught(range(1, 301), 1, STALLED), "no seed noticed clients that never send again after a back-off"


def test_the_simulator_catches_a_new_leader_that_forgets_what_the_log_sequenced(monkeypatch):
    # Dedupe across terms: a new leader takes each client's last sequenced seq from its log. One
    # that starts from none asks clients for trades long sequenced (or sequences them twice).
    original = LeaderCore.__init__

    def forgetful(self, session, name, term, followers, clients, last_seq, last_term, client_last, **kw):
        original(self, session, name, term, followers, clients, last_seq, last_term, {}, **kw)

    monkeypatch.setattr(LeaderCore, "__init__", forgetful)
    assert len(caught(range(1, 41), 3, rf"{STALLED}|Violation: sequenced twice")) == 3


def test_the_simulator_catches_a_leader_that_steps_down_without_handing_over_its_client_seqs(monkeypatch):
    # A leader's own batches are not noted message by message: its LeaderCore holds the clients'
    # seqs and hands them to the log as it steps down (VoterCore.resync). Kept stale, the node
    # dedupes by an old view when it leads again.
    original = VoterCore.resync
    monkeypatch.setattr(VoterCore, "resync", lambda self, commit, client_last: original(
        self, commit, dict(self.log.client_last)))
    assert len(caught(range(1, 201), 3, rf"{STALLED}|Violation: sequenced twice")) == 3


@pytest.mark.slow
def test_the_simulator_catches_an_emitter_that_records_its_intent_as_delivered(monkeypatch):
    # Intent, deliver, done: an intent recorded as if the sinks had the batch already leaves
    # nothing in doubt when the emitter dies before delivering it.
    original = EmitterCore.deliver

    def delivered_at_once(self, new):
        return [RecordIntent(a.alerts, a.done, delivered=True) if isinstance(a, RecordIntent) else a
                for a in original(self, new)]

    monkeypatch.setattr(EmitterCore, "deliver", delivered_at_once)
    violation = r"Violation: exactly-once alerts: \d+ delivered \(0 twice, [1-9]\d* missing\)"
    assert len(caught(range(1, 401), 3, violation)) == 3


def test_the_simulator_catches_a_replica_that_applies_its_replay_past_the_listener(monkeypatch):
    # Replayed entries go through the same listener as the stream (its order, its seals). Applied
    # straight from the replay, they overlap what the stream delivered meanwhile.
    from tape.protocol.receiver import Deliver
    from tape.replicas.replica_node_core import ReplicaNode

    def shortcut(self, seq, batch, now):
        builder = sim.PacketBuilder(self.session, seq, self.max_packet)
        runs = [Deliver(seq + i * builder.per_packet, p, 0) for i, p in enumerate(builder.add_sequenced(batch))]
        return len(batch), self._apply(runs, now)

    monkeypatch.setattr(ReplicaNode, "_replayed", shortcut)
    assert len(caught(range(1, 121), 3, r"Violation: replica-[ABC] applying seq \d+ after \d+")) == 3


def test_the_simulator_catches_a_journal_that_keeps_its_torn_tail(monkeypatch):
    # The voters' journals are the store's own files (runtime/storage/journal_store.py) on the simulator's
    # disk, torn by the crash faults: a store that finds a torn tail and does not cut it writes the
    # next records after the half one, and the next open finds the journal corrupt in its middle.
    from tape.runtime.storage import journal_store
    original = journal_store.Journal._note_torn
    monkeypatch.setattr(journal_store.Journal, "_note_torn", lambda self, seg, offset, nbytes, reason, truncate:
                        original(self, seg, offset, nbytes, reason, False))
    assert len(caught(range(1, 201), 3, r"JournalCorruption: journal corrupt at seq \d+")) == 3


def test_replicated_seeds_lose_unflushed_entries_to_a_power_loss_and_hold(monkeypatch):
    """Durability "replicated": a voter's host loses power with entries it acknowledged but had not
    flushed, and every invariant holds (the others still hold what was committed)."""
    lost = []
    original = sim.Sim.power_loss

    def counted(self, node, until):
        if self.voters[node].up:
            lost.append(self.voters[node].unflushed)
        original(self, node, until)
    monkeypatch.setattr(sim.Sim, "power_loss", counted)
    assert [sim.run_seed(seed)[1] for seed in range(28, 40)] == [None] * 12
    assert len(lost) >= 2 and sum(lost) > 0, lost


def test_the_simulator_catches_three_voters_losing_power_at_once(monkeypatch):
    # What the mode does not claim to survive: a record acknowledged by three voters, none of which
    # flushed it, is gone from a majority, and a leader without it publishes another at its seq.
    original = sim.Sim.power_loss

    def three(self, node, until):
        others = [v for v in sim.VOTERS if v != node and self.voters[v].up][:2]
        for name in (node, *others):
            original(self, name, until)
    monkeypatch.setattr(sim.Sim, "power_loss", three)
    assert caught(range(28, 40), 1, r"Violation: .* published a different message at seq \d+", others_too=True)


def test_the_simulator_catches_an_emitter_that_never_orders_a_rebuild(monkeypatch):
    # Three replicas; one's state corrupted (a bit flipped): the others outvote its digest at the
    # next fold point (the session's end is one) and the emitter tells it to apply again from seq 1.
    original = EmitterCore.on_digest
    monkeypatch.setattr(EmitterCore, "on_digest", lambda self, replica, fold_seq, chain:
                        ([], *original(self, replica, fold_seq, chain)[1:]))
    monkeypatch.setattr(sim, "FAULT_KINDS", ("corrupt-replica", "crash", "partition"))
    assert len(caught(range(1, 61), 2, STALLED + r".*replica-[ABC] corrupt")) == 2


def test_the_simulator_catches_a_replica_that_ignores_a_rebuild_order(monkeypatch):
    from tape.protocol import alertlink
    from tape.replicas.replica_node_core import ReplicaNode
    original = ReplicaNode._alert_frames
    monkeypatch.setattr(ReplicaNode, "_alert_frames", lambda self, frames, now: original(
        self, [(kind, p) for kind, p in frames if kind != alertlink.REBUILD], now))
    monkeypatch.setattr(sim, "FAULT_KINDS", ("corrupt-replica", "crash", "partition"))
    assert len(caught(range(1, 61), 2, STALLED + r".*replica-[ABC] corrupt")) == 2


def test_the_simulator_catches_gap_fill_budgets_that_never_refill(monkeypatch):
    # A fifth of the seeds' rewinders answer few gap requests (SIM_GAPFILL_BUDGETS): a refused
    # listener asks again later, and gets its answer once its host's budget has refilled.
    from tape.protocol.budgets import TokenBucket

    def take(self, now):
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    monkeypatch.setattr(TokenBucket, "take", take)
    assert len(caught(range(2, 202, 5), 2, STALLED + r".*(behind|unacknowledged)")) == 2
