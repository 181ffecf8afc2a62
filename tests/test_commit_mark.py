"""The journal's commit mark (protocol/commit_mark.py): what a voter tells readers of its journal
directory is committed, as its node core decides and its journal store writes it."""

from test_rewinder_node import commit, rewinder, trades

from tape.protocol.commit_mark import COMMIT_MARK_FILE, CommitMark, MarkCommitted, decode_mark, encode_mark
from tape.protocol.limits import COMMIT_MARK_EVERY_NS
from tape.runtime.storage.journal_store import Journal

MS = 1_000_000


def test_a_mark_when_the_commit_point_moved_at_most_once_a_period():
    mark = CommitMark()
    assert mark.on_tick(0, 0) == []  # nothing committed: nothing to say
    assert mark.on_tick(5, 1 * MS) == [MarkCommitted(5)]
    assert mark.on_tick(9, 1 * MS + COMMIT_MARK_EVERY_NS - 1) == []  # too soon
    assert mark.on_tick(9, 1 * MS + COMMIT_MARK_EVERY_NS) == [MarkCommitted(9)]
    assert mark.on_tick(9, 10 * COMMIT_MARK_EVERY_NS) == []  # unmoved
    assert mark.on_stop(12) == [MarkCommitted(12)] and mark.on_stop(12) == []


def test_the_mark_never_goes_back_below_what_the_journal_already_says():
    """A restarted voter's commit point starts low (its leader tells it again): the old mark stays."""
    mark = CommitMark(marked=100)
    assert mark.on_tick(40, 0) == [] and mark.on_stop(100) == []
    assert mark.on_tick(101, 1) == [MarkCommitted(101)]


def test_the_marks_bytes_and_what_is_not_one():
    assert decode_mark(encode_mark(12345)) == 12345 and decode_mark(encode_mark(2**64 - 1)) == 2**64 - 1
    assert len({len(encode_mark(seq)) for seq in (0, 9, 10**12, 2**64 - 1)}) == 1  # (one width: written in place)
    assert decode_mark(b"12345\n") == 12345  # (an older Tape's mark)
    for junk in (b"", b"-1\n", b"12x", b"1" * 21, b"\xff"):
        assert decode_mark(junk) is None


def test_a_mark_read_while_it_was_written_is_not_taken_for_one():
    """The store writes each mark over the last in place: a reader may see the first bytes of one
    and the rest of the other. Every such mix either is one of the two or fails its check sum."""
    old, new = encode_mark(99_999), encode_mark(100_000)
    for cut in range(len(old) + 1):
        for torn in (new[:cut] + old[cut:], old[:cut] + new[cut:]):
            assert decode_mark(torn) in (None, 99_999, 100_000)
            assert decode_mark(torn) is None or torn in (old, new)


def test_the_store_writes_the_mark_in_place_and_reads_it_back(tmp_path):
    journal = Journal(tmp_path / "j", b"TEST".ljust(10))
    assert journal.commit_mark() == 0
    (tmp_path / "j" / COMMIT_MARK_FILE).write_bytes(b"5\n")  # (an older Tape's, replaced whole by the first)
    assert journal.commit_mark() == 5
    journal.mark_committed(7)
    inode = (tmp_path / "j" / COMMIT_MARK_FILE).stat().st_ino
    journal.mark_committed(8)
    assert journal.commit_mark() == 8 and (tmp_path / "j" / COMMIT_MARK_FILE).read_bytes() == encode_mark(8)
    assert (tmp_path / "j" / COMMIT_MARK_FILE).stat().st_ino == inode  # (in place: no file made, none renamed)
    assert [p.name for p in (tmp_path / "j").iterdir()] == [COMMIT_MARK_FILE]  # (no temporary left)
    journal.close()
    assert Journal(tmp_path / "j", b"TEST".ljust(10)).commit_mark() == 8
    (tmp_path / "j" / COMMIT_MARK_FILE).write_bytes(b"garbage")
    assert journal.commit_mark() == 0


def test_a_rewinder_marks_its_commit_point_not_its_journals_end():
    """Its journal holds records the leader has not committed yet: the mark stops at the commit point."""
    node = rewinder(trades(10))
    commit(node, 6)
    assert node.on_timer(COMMIT_MARK_EVERY_NS).count(MarkCommitted(6)) == 1
    commit(node, 10, now=COMMIT_MARK_EVERY_NS + 1)
    assert MarkCommitted(10) not in node.on_timer(COMMIT_MARK_EVERY_NS + 2)  # too soon
    assert MarkCommitted(10) in node.on_timer(2 * COMMIT_MARK_EVERY_NS)
    assert node.on_stop(3 * COMMIT_MARK_EVERY_NS) == []  # nothing moved since


def test_a_leader_marks_its_own_commit_point():
    """A leader's commit point is its own (what a majority acknowledged), not its endpoint's."""
    from test_sequencer_node import R1, B, Shell, ack, elect, join, links

    shell = Shell()
    elect(shell)
    t, conns = shell.elected_at, links(shell)
    for f in (B, R1):
        join(shell, conns[f], now=t)
        ack(shell, conns[f], 1, now=t)
    n = shell.node
    assert n.commit_seq == 1 and n.voter.core.commit_seq == 0  # (the endpoint's is a follower's)
    marks = [a for a in n.on_timer(t + COMMIT_MARK_EVERY_NS) if isinstance(a, MarkCommitted)]
    assert marks == [MarkCommitted(1)]
