"""FollowerLinks (sequencer/followers_core.py): what the leader sends each follower next."""

from tape.protocol.limits import COMMIT_BEAT_AFTER_NS
from tape.sequencer.followers_core import FollowerLinks

F, G = b"rw-1      ", b"rw-2      "


def test_a_follower_behind_is_caught_up_in_chunks_then_goes_live():
    links = FollowerLinks(beat_ns=50, catchup_chunk=100)
    links.connected(F, follower_last_seq=10, leader_last_seq=250)
    assert links.live_for(251, 260, 0, 0) == ([], [])  # not live yet: the batch waits in the journal
    assert links.next_chunk(F, 260) == (11, 100)
    links.sent(F, 110)
    assert links.next_chunk(F, 260) == (111, 100)
    links.sent(F, 210)
    assert links.next_chunk(F, 260) == (211, 50)
    links.sent(F, 260)
    assert links.next_chunk(F, 260) is None  # caught up: live
    assert links.live_for(261, 270, 0, 0) == ([F], [])


def test_a_refusal_during_a_catch_up_is_honoured_not_overwritten():
    links = FollowerLinks(beat_ns=50, catchup_chunk=100)
    links.connected(F, 0, 300)
    assert links.next_chunk(F, 300) == (1, 100)
    assert links.refused(F, follower_last_seq=40)  # arrives while chunk 1..100 is being sent
    links.sent(F, 100)
    assert links.next_chunk(F, 300) == (41, 100)


def test_a_live_follower_that_misses_a_batch_drops_out_of_live():
    links = FollowerLinks(beat_ns=50)
    for f in (F, G):
        links.connected(f, 10, 10)
        assert links.next_chunk(f, 10) is None
    assert links.live_for(11, 20, 0, 0) == ([F, G], [])
    links.refused(G, 15)
    assert links.live_for(21, 30, 0, 0) == ([F], [])
    assert links.next_chunk(G, 30) == (16, 15)


def test_a_slow_follower_is_caught_up_from_the_journal_instead_of_queued():
    links = FollowerLinks(beat_ns=50, max_live_buffer=1000)
    links.connected(F, 10, 10)
    links.next_chunk(F, 10)
    assert not links.backlog(F, 999) and links.backlog(F, 1001)
    assert links.live_for(11, 20, 0, 0) == ([], [])


def test_commit_beats_go_when_the_commit_moved_and_no_append_told_it_or_the_beat_is_due():
    after = COMMIT_BEAT_AFTER_NS
    links = FollowerLinks(beat_ns=10 * after)
    links.connected(F, 0, 0)
    links.next_chunk(F, 0)
    assert links.beat(0, 5) == [F]
    assert links.beat(after, 5) == []  # told, and not yet due
    assert links.live_for(1, 10, 5, 2 * after) == ([F], [])  # an append carries commit 5
    assert links.beat(2 * after + 1, 10) == []  # moved, but an append went just now: the next one tells it
    assert links.beat(3 * after, 10) == [F]  # moved, and no append for COMMIT_BEAT_AFTER_NS
    assert links.beat(3 * after + 1, 10) == []
    assert links.live_for(11, 20, 10, 4 * after) == ([F], [])
    assert links.beat(6 * after, 10) == []  # the append told it: nothing moved
    assert links.beat(14 * after + 1, 10) == [F]  # the beat is due (the leader lives)
    assert links.beat(14 * after + 2, 10, force=True) == [F]


def test_the_next_beat_is_due_when_beat_first_sends():
    """The leader's timer sleeps until `beat_due_ns`: a beat must go exactly then, not before."""
    after = COMMIT_BEAT_AFTER_NS
    links = FollowerLinks(beat_ns=10 * after)
    links.connected(F, 0, 0)
    links.next_chunk(F, 0)
    assert links.beat_due_ns(0) == 0 and links.beat(0, 0) == [F]

    def first_beat_at_due(commit):
        due = links.beat_due_ns(commit)
        assert links.beat(due - 1, commit) == [] and links.beat(due, commit) == [F]
        return due

    assert first_beat_at_due(0) == 10 * after + 1  # nothing moved: the heartbeat
    assert first_beat_at_due(7) == 11 * after + 1  # moved: COMMIT_BEAT_AFTER_NS after the last beat
    assert links.live_for(1, 9, 7, 12 * after) == ([F], [])  # an append carries commit 7
    assert first_beat_at_due(9) == 13 * after  # moved since: COMMIT_BEAT_AFTER_NS after the append
