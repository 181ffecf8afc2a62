"""The replication endpoint every voter runs (sequencers and rewinders): the
asyncio shell around ElectionCore and FollowerCore.

A leader (or a candidate) connects to a voter's replication port. The voter
greets with a hello (term, log position), then answers each append with an
ack (after the records are in its journal, per the fsync policy) and each
vote request with a vote (after its term and vote are on disk). The term
and the vote live in `DATA/election.json`, written atomically and fsynced,
so that a restarted voter never votes twice in a term.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import os
import random
import struct
import time
import zlib
from pathlib import Path
from typing import Callable

from tape.node.settings import Config, Node
from tape.protocol import messages
from tape.protocol import replication as rep
from tape.protocol.election import ElectionAction, ElectionCore, Persist, RequestVotes
from tape.protocol.errors import InvariantViolation, ProtocolError
from tape.protocol.follower import FollowerCore
from tape.protocol.limits import CONTROL_READ, FETCH_MAX, STREAM_READ

log = logging.getLogger("tape.voter")
_TYPE_ORIGIN_CSEQ = struct.Struct(">B56x10sQ")  # type, origin and client seq of a sequenced message


class VoteStore:
    """(term, voted_for) on disk."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> tuple[int, bytes | None]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0, None
        except ValueError as e:
            raise SystemExit(f"{self.path}: unreadable election state ({e}); refusing to guess a term") from None
        voted = doc.get("voted_for")
        return int(doc["term"]), voted.encode("ascii") if voted is not None else None

    def save(self, term: int, voted_for: bytes | None) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"term": term, "voted_for": voted_for.decode("ascii") if voted_for else None}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class LogState:
    """What a voter needs of its log without reading the journal: the term of
    any seq (the seqs where each term starts; terms change rarely) and the
    highest client seq sequenced per client (so that a node that becomes
    leader dedupes at once). Kept as records reach the journal."""

    def __init__(self):
        self.client_last: dict[bytes, int] = {}
        self.term_starts: list[tuple[int, int]] = []  # (first seq, term), ascending

    def note_term(self, first_seq: int, term: int) -> None:
        """Entries of `term` from `first_seq` on. All a leader notes of its own
        batches: its LeaderCore keeps the client seqs, and hands them over
        when it steps down."""
        if not self.term_starts or term != self.term_starts[-1][1]:
            self.term_starts.append((first_seq, term))

    def note(self, records) -> None:
        last = self.client_last
        unpack = _TYPE_ORIGIN_CSEQ.unpack_from
        for seq, term, raw in records:
            self.note_term(seq, term)
            kind, origin, cseq = unpack(raw)
            if (kind == messages.REQUEST or kind == messages.PURCHASE) and cseq > last.get(origin, 0):
                last[origin] = cseq

    def rebuild(self, journal) -> None:
        self.client_last = {}
        self.term_starts = []
        self.note(journal.read())

    def term_at(self, seq: int) -> int:
        i = bisect.bisect_right(self.term_starts, (seq, 1 << 64)) - 1
        return self.term_starts[i][1] if seq > 0 and i >= 0 else 0


class Voter:
    def __init__(self, cfg: Config, node: Node, journal, can_lead: bool,
                 on_action: Callable[[ElectionAction], None] | None = None, on_fatal: Callable[[str], None] = None,
                 on_partition: Callable[[bool], None] | None = None):
        self.cfg = cfg
        self.node = node
        self.journal = journal
        self.on_action = on_action or (lambda action: None)  # what the election decided, but Persist
        self.on_partition = on_partition or (lambda cut: None)  # drills' fault injection
        self.on_fatal = on_fatal or (lambda why: None)  # the node's state is impossible: it must stop
        self.store = VoteStore(Path(node.data) / "election.json")
        term, voted_for = self.store.load()
        term = max(term, journal.last_term)
        self.log = LogState()
        self.log.rebuild(journal)
        self.follower = FollowerCore(node.wire_name, journal.last_seq, journal.last_term, self.term_at, term=term)
        lo = cfg.election_ms * 1_000_000
        # Seeded by the node's name: each voter has its own jitter, the same on every run.
        rng = random.Random(zlib.crc32(node.name.encode()))
        self.election = ElectionCore(node.wire_name, [v.wire_name for v in cfg.voters], can_lead,
                                     lambda: (journal.last_seq, journal.last_term), rng, (lo, 2 * lo), term, voted_for,
                                     time.monotonic_ns())
        # The first election comes sooner: pre-votes keep a restarted node from disrupting a live leader.
        self.election.deadline = time.monotonic_ns() + rng.randint(lo // 4, lo // 2)
        self.committed = asyncio.Event()  # set and cleared whenever the commit point moves
        # Fault injection for drills: while DATA/partitioned exists, this node
        # neither accepts nor makes replication connections (both directions cut).
        self.partition_flag = Path(node.data) / "partitioned"
        self.partitioned = False
        self._conns: set[asyncio.StreamWriter] = set()
        self._leader_conns: dict[asyncio.StreamWriter, tuple[bytes, int]] = {}  # which carried the leader's appends
        self.appended = 0
        self.bad_frames = 0
        self.truncations = 0

    def term_at(self, seq: int) -> int:
        if seq > self.journal.last_seq:
            raise InvariantViolation(f"journal has no seq {seq}")
        return self.log.term_at(seq)

    @property
    def commit_seq(self) -> int:
        return self.follower.commit_seq

    def act(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Persist):
                self.store.save(action.term, action.voted_for)
            else:
                self.on_action(action)

    def tick(self) -> None:
        cut = self.partition_flag.exists()
        if cut != self.partitioned:
            self.partitioned = cut
            log.warning("FAULT INJECTION: %s is %s", self.node.name,
                        "cut off from every voter" if cut else "reconnected to the voters")
            if cut:
                for w in list(self._conns):
                    w.close()
            self.on_partition(cut)
        self.act(self.election.on_tick(time.monotonic_ns()))

    def resync(self, commit_seq: int) -> None:
        """After leading: follow again from what the journal holds."""
        self.follower = FollowerCore(self.node.wire_name, self.journal.last_seq, self.journal.last_term, self.term_at,
                                     term=self.election.term)
        self.follower.commit_seq = commit_seq

    # --- the replication port -------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Connections are independent: a stray one cannot displace the leader's,
        # and every append and vote request is judged by its term.
        if self.partitioned:
            writer.close()
            return
        self._conns.add(writer)
        writer.write(rep.encode_hello(self.election.term, self.node.wire_name, self.journal.last_seq,
                                      self.journal.last_term))
        frames = rep.FrameReader()
        closed_by_peer = False
        try:
            while True:
                data = await reader.read(STREAM_READ)
                if not data:
                    closed_by_peer = True
                    break
                for fr in frames.feed(data):
                    if isinstance(fr, rep.Append):
                        writer.write(self.on_append(fr))
                        if self.election.leader == fr.leader and self.election.term == fr.term:
                            self._leader_conns[writer] = (fr.leader, fr.term)
                    elif isinstance(fr, rep.VoteRequest):
                        writer.write(self.on_vote_request(fr))
                    elif isinstance(fr, rep.Fetch):
                        writer.write(self.on_fetch(fr))
                    else:
                        raise ProtocolError("unexpected", f"{type(fr).__name__} frame on a voter's port", 0)
        except ProtocolError as e:
            self.bad_frames += 1
            log.warning("bad replication frame, closing: %s", e)
        except InvariantViolation as e:
            self.on_fatal(str(e))
        except ConnectionError:
            closed_by_peer = True
        except asyncio.CancelledError:
            pass  # shutting down
        finally:
            self._conns.discard(writer)
            carried = self._leader_conns.pop(writer, None)
            writer.close()
            if closed_by_peer and carried == (self.election.leader, self.election.term) and not self.partitioned \
                    and carried not in self._leader_conns.values():
                log.warning("leader %s closed its connection in term %d: taking it for gone",
                            carried[0].decode(errors="replace").strip(), carried[1])
                self.act(self.election.on_leader_lost(*carried, time.monotonic_ns()))

    def on_append(self, a: rep.Append) -> bytes:
        ok, actions = self.election.on_append(a.term, a.leader, time.monotonic_ns())
        self.act(actions)  # a leader seeing a higher term steps down here, before following
        if not ok:
            return rep.encode_ack(self.election.term, self.node.wire_name, False, self.journal.last_seq)
        before = self.follower.commit_seq
        self.follower.term = self.election.term
        res = self.follower.on_append(a)
        if res.truncate_after is not None:
            if res.truncate_after < before:
                raise InvariantViolation(f"asked to drop committed seq {res.truncate_after + 1}: refusing")
            log.warning(
                "dropping uncommitted suffix after seq %d (conflicts with the leader's log)", res.truncate_after
            )
            self.journal.truncate_after(res.truncate_after)
            self.log.rebuild(self.journal)
            self.truncations += 1
        if res.records:
            self.journal.append(res.records)  # durable before the ack, per the fsync policy
            self.log.note(res.records)
            self.appended += len(res.records)
        if self.follower.commit_seq != before:
            self.committed.set()
            self.committed.clear()
        return rep.encode_ack(self.election.term, self.node.wire_name, res.success, res.last_seq)

    def on_vote_request(self, v: rep.VoteRequest) -> bytes:
        granted, actions = self.election.on_vote_request(v.term, v.candidate, v.last_seq, v.last_term, v.pre,
                                                         time.monotonic_ns())
        self.act(actions)  # the vote is on disk before it is sent
        if granted and not v.pre:
            log.info("voted for %s in term %d", v.candidate.decode(errors="replace").strip(), v.term)
        return rep.encode_vote(self.election.reply_term(v.term, granted, v.pre), self.node.wire_name, granted, v.pre)

    def on_fetch(self, f: rep.Fetch) -> bytes:
        """Our own log from f.from_seq, if it continues the asker's (its entry
        before from_seq has our term there); ends with an empty append."""
        out = []
        prev = f.from_seq - 1
        if 0 <= prev <= self.journal.last_seq and self.term_at(prev) == f.prev_term:
            records = self.journal.read_batch(f.from_seq, FETCH_MAX)
            out.append(rep.encode_runs(self.election.term, self.node.wire_name, prev, f.prev_term, self.commit_seq,
                                       records))
            prev = records[-1][0] if records else prev
        out.append(rep.encode_append(self.election.term, self.node.wire_name, prev, self.term_at(prev),
                                     self.commit_seq, self.election.term, []))
        return b"".join(out)

    async def fetch_from(self, voter: Node) -> int:
        """Extend our log with what `voter` holds beyond it (entries its
        leaders wrote: taking them is what their appends would have done).
        A sequencer behind a voter that cannot lead needs this to become
        electable when the leader died after replicating its last batch
        only to the rewinders. Returns how many entries were taken."""
        taken = 0
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(voter.host, voter.replication_port), 0.2)
        except (OSError, asyncio.TimeoutError):
            return 0
        try:
            writer.write(rep.encode_fetch(self.journal.last_seq + 1, self.journal.last_term))
            frames = rep.FrameReader()
            while True:
                data = await asyncio.wait_for(reader.read(STREAM_READ), 2.0)
                if not data:
                    return taken
                for fr in frames.feed(data):
                    if not isinstance(fr, rep.Append):
                        continue
                    if fr.count == 0:
                        return taken
                    if self.election.leader is not None or fr.prev_seq != self.journal.last_seq \
                            or self.term_at(fr.prev_seq) != fr.prev_term or fr.entries_term > self.election.term:
                        return taken  # a leader appeared, or the logs do not line up: stop
                    records = [(fr.prev_seq + 1 + i, fr.entries_term, m) for i, m in enumerate(fr.messages())]
                    self.journal.append(records)
                    self.log.note(records)
                    self.follower = FollowerCore(self.node.wire_name, self.journal.last_seq, self.journal.last_term,
                                                 self.term_at, term=self.election.term)
                    taken += len(records)
        except (OSError, asyncio.TimeoutError, ProtocolError):
            return taken
        finally:
            writer.close()
            if taken:
                log.warning("took %d entries from %s to catch up (log now ends at seq %d, term %d)", taken,
                            voter.name, self.journal.last_seq, self.journal.last_term)

    # --- campaigning -------------------------------------------------------------------

    async def request_votes(self, r: RequestVotes) -> None:
        """Ask every other voter, each over a connection of its own; votes feed the election as they come."""
        if self.partitioned:
            return
        others = [n for n in self.cfg.voters if n.name != self.node.name]
        await asyncio.gather(*(self._ask(n, r.pre, r.term, r.last_seq, r.last_term) for n in others))

    async def _ask(self, voter: Node, pre: bool, term: int, last_seq: int, last_term: int) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(voter.host, voter.replication_port), 0.2)
        except (OSError, asyncio.TimeoutError):
            return
        try:
            writer.write(rep.encode_vote_request(term, self.node.wire_name, last_seq, last_term, pre))
            frames = rep.FrameReader()
            hello = None
            deadline = time.monotonic() + self.cfg.election_ms / 1000
            while time.monotonic() < deadline:
                data = await asyncio.wait_for(reader.read(CONTROL_READ), deadline - time.monotonic())
                if not data:
                    return
                for fr in frames.feed(data):
                    if isinstance(fr, rep.Vote):
                        self.act(self.election.on_vote(fr.term, fr.voter, fr.granted, fr.pre, time.monotonic_ns()))
                        if not fr.granted and hello is not None and self.election.leader is None and \
                                (hello.last_term, hello.last_seq) > (self.journal.last_term, self.journal.last_seq):
                            await self.fetch_from(voter)  # refused for being behind: catch up for the next round
                        return
                    if isinstance(fr, rep.Hello):
                        hello = fr
                        self.act(self.election.on_higher_term(fr.term, fr.node, time.monotonic_ns()))
        except (OSError, asyncio.TimeoutError, ProtocolError):
            pass
        finally:
            writer.close()
