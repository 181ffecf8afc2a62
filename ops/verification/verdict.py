"""The verdict of a run against DESIGN.md section 9.

`read_run` gathers what a run left on disk (journals, the replicas', the
emitter's and the sequencers' status files, the delivered alerts, the load
report); `judge` is a pure function of that: the checks, their figures and
the report. The expected alerts are recomputed from the journal by the
independent reference checker (ops/verification/reference.py), not by the replicas' code.

The journals are read as streams, a few passes each, never held whole: a
run of 250,000 msg/s for 20 s left four journals of 5.3 million records,
which as lists took the verdict to ~8.5 GiB.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tape.ops.verification.load import client_trades
from tape.ops.verification.reference import FOLD_EVERY, REJECT_REASONS, alerts_in, expected_digest
from tape.protocol import messages as M
from tape.protocol import moldudp64
from tape.runtime.storage.journal_store import Journal

ALERT_FIELDS = ("emit_seq", "purchase_id", "order_id", "requested", "cumulative")


@dataclass
class RunFiles:
    session: str
    book_ttl_ns: int
    orphan_ttl_ns: int
    submitted: int  # trades the load was to submit
    journals: dict[str, JournalRecords | list]  # voter -> its (seq, term, message bytes) from seq 1
    replicas: dict[str, dict]  # replica -> its status.json
    alerts: Iterable[dict]  # the JSON-lines sink's rows, in order (read once: JsonLines, or a list)
    emitter: dict = field(default_factory=dict)  # its status.json
    load: dict = field(default_factory=dict)  # tape load's JSON report
    sequencers: dict[str, dict] = field(default_factory=dict)  # sequencer -> its status.json
    plain: bool = False  # no fault was injected that should move leadership: one term expected
    fold_every: int = FOLD_EVERY  # where the replicas' digests fold (the simulator's fold more often)
    # origin (a client's wire name) -> a new iterator of the inbound trades it submitted, in client
    # seq order from 1: each sequenced trade is compared with its own
    submitted_trades: dict[bytes, Callable[[], Iterator[bytes]]] = field(default_factory=dict)
    log_problems: dict[str, list[str]] = field(default_factory=dict)  # node -> unexpected lines of its log


class JournalRecords:
    """A voter's journal as the verdict reads it: its records from disk, read again on each pass."""

    def __init__(self, path: Path):
        self.path = path

    def __iter__(self):
        return Journal(self.path, readonly=True).read()


class JsonLines:
    """A JSON-lines file's rows, read as they are iterated (a long run's alerts do not fit in memory
    as dicts); none if the file is missing."""

    def __init__(self, path: Path):
        self.path = path

    def __iter__(self):
        if not self.path.exists():
            return
        with self.path.open() as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_run(cfg, voters, replicas, sequencers, load_output: str, submitted: int, plain: bool = False,
             logs: dict[str, Path] | None = None, planted: tuple[str, ...] = ()) -> RunFiles:
    """What a local run left in its nodes' data directories (`plain`: no fault injected); `logs`:
    each node's log, searched for lines no run should write but those matching `planted`."""
    try:
        load = json.loads(load_output)
    except ValueError:
        load = {}
    return RunFiles(
        session=cfg.session, book_ttl_ns=int(cfg.book_ttl_s * 1e9), orphan_ttl_ns=int(cfg.orphan_ttl_s * 1e9),
        submitted=submitted,
        journals={n: JournalRecords(Path(cfg.node(n).data) / "journal") for n in voters},
        replicas={r: _read_json(Path(cfg.node(r).data) / "status.json") for r in replicas},
        alerts=JsonLines(Path(cfg.node("emitter").data) / "alerts.jsonl"),
        emitter=_read_json(Path(cfg.node("emitter").data) / "status.json"), load=load,
        sequencers={s: _read_json(Path(cfg.node(s).data) / "status.json") for s in sequencers}, plain=plain,
        submitted_trades=load_trades(load.get("trades")),
        log_problems={n: log_problems(p.read_text(errors="replace"), planted)
                      for n, p in (logs or {}).items() if p.exists()})


def load_trades(how: dict | None) -> dict[bytes, Callable[[], Iterator[bytes]]]:
    """What `tape load` submitted, made again from its report's seed (load.client_trades)."""
    if not how:
        return {}
    return {moldudp64.session_bytes(name): (lambda i=i: client_trades(how["seed"], how["overfill"], i))
            for i, name in enumerate(how["clients"])}


# A line no run writes unless a test planted its cause: an exception's trace, or a fail-stop.
UNEXPECTED_LOG = re.compile(r"Traceback \(most recent call last\)| CRITICAL ")


def log_problems(text: str, planted: tuple[str, ...] = ()) -> list[str]:
    """The lines of a node's log that say something went wrong that no fault of the run explains
    (`planted`: patterns of the lines the run's fault causes)."""
    return [line for line in text.splitlines() if UNEXPECTED_LOG.search(line)
            and not any(re.search(p, line) for p in planted)]


def judge(run: RunFiles) -> tuple[dict, dict, dict]:
    """(checks: name -> passed, figures: name -> text, report) of a run."""
    lengths, agreed = _agreement(run.journals)
    longest = run.journals[max(lengths, key=lengths.get)]
    # The committed log: what a majority of the voters hold. A leader stopped before its last
    # batch committed holds more (never acknowledged, never published): agreement still holds.
    log_length = sorted(lengths.values(), reverse=True)[len(lengths) // 2]

    def committed():  # the log decoded, read again for each pass
        return ((seq, M.SEQUENCED.unpack(raw)) for seq, _, raw in itertools.islice(longest, log_length))

    # Every client seq sequenced: trades, and those the sequencer rejected at ingress (in their place).
    scan = _LogScan(run.submitted_trades)
    terms = term_changes(scan.watch(itertools.islice(longest, log_length)))
    applied = {r: s.get("last_seq", 0) for r, s in run.replicas.items()}
    digests = {r: s.get("digest", "") for r, s in run.replicas.items()}
    alerts, rejects = _alerts(run, committed(), log_length)
    journal_digest = expected_digest(committed(), run.book_ttl_ns, run.orphan_ttl_ns, run.fold_every)
    published = {s: st.get("published_terms", {}) for s, st in run.sequencers.items()}
    term_issues = term_problems(terms, published)
    acked = run.load.get("acked", 0)
    missing_status = [n for n, st in (*run.replicas.items(), *run.sequencers.items(), ("emitter", run.emitter))
                      if not st]
    divergences = run.emitter.get("divergences", 0)
    checks = {
        "all trades acknowledged": (run.load.get("acked") == run.submitted, f"{acked:,} / {run.submitted:,}"),
        "no loss: every trade sequenced": (scan.trades == run.submitted, f"{scan.trades:,}"),
        "no duplicates: no (client, client seq) twice": (scan.duplicates == 0, f"{scan.duplicates}"),
        "content: each trade as its client submitted it": (scan.contents.ok, scan.contents.figure()),
        "every node wrote its status file": (not missing_status, ", ".join(missing_status) or "all"),
        "no traceback or unexpected CRITICAL in a log": (not any(run.log_problems.values()), _log_figure(run)),
        "agreement: every journal a prefix of the log": (agreed, " ".join(f"{n:,}" for n in lengths.values())),
        "replicas applied the whole log": (all(v == log_length for v in applied.values()),
                                           " ".join(f"{v:,}" for v in applied.values())),
        "replica identity: digests equal": (len(set(digests.values())) == 1 and "" not in digests.values(),
                                            next(iter(digests.values()), "")[:16]),
        "replicas' digest is the journal's": (set(digests.values()) == {journal_digest}, journal_digest[:16]),
        "stamps never go backwards": (scan.backwards == 0, f"{scan.backwards} backwards"),
        "exactly-once alerts": (alerts["ok"], alerts["figure"]),
        "no divergence alarms": (divergences == 0, f"{divergences}"),
        "each term published only by its winner": (not term_issues,
                                                   term_issues[0] if term_issues else f"{len(terms)} terms"),
    }
    report = {
        "submitted": run.load.get("submitted", 0), "resumed_at": run.load.get("resumed_at", 0),
        "acknowledged": acked, "sequenced": scan.trades,
        "log_length": log_length, "applied": applied, "digests": digests,
        **{k: v for k, v in alerts.items() if k not in ("ok", "figure")},
        "divergences": divergences, "rejects": rejects, "terms": terms, "published_terms": published,
        "term_problems": term_issues, "altered_trades": scan.contents.altered,
        "log_problems": {n: lines[:5] for n, lines in run.log_problems.items() if lines},
    }
    if run.plain:
        checks["no fault, one term: no spurious election"] = (len(terms) == 1, f"{len(terms)} terms")
    return {k: ok for k, (ok, _) in checks.items()}, {k: f for k, (_, f) in checks.items()}, report


AGREEMENT_CHUNK = 65_536  # records of each journal compared at a time


def _agreement(journals: dict) -> tuple[dict[str, int], bool]:
    """Each journal's length, and whether each is a prefix of the longest: read side by side, a
    chunk at a time, each chunk compared with the longest one's records at its seqs."""
    readers = {v: iter(j) for v, j in journals.items()}
    lengths = dict.fromkeys(journals, 0)
    agreed = True
    while readers:
        chunks = {v: list(itertools.islice(r, AGREEMENT_CHUNK)) for v, r in readers.items()}
        longest = max(chunks.values(), key=len)
        agreed = agreed and all(c == longest[:len(c)] for c in chunks.values())
        for v, chunk in chunks.items():
            lengths[v] += len(chunk)
            if len(chunk) < AGREEMENT_CHUNK:
                del readers[v]  # ended: a later record of another voter is past its end
    return lengths, agreed


def _log_figure(run: RunFiles) -> str:
    bad = {n: lines for n, lines in run.log_problems.items() if lines}
    if not bad:
        return f"{len(run.log_problems)} logs clean"
    node, lines = next(iter(bad.items()))
    return f"{sum(map(len, bad.values()))} lines, first {node}: {lines[0][:200]}"


class _LogScan:
    """Counts over the committed log as a pass over it goes by: trades (every client seq
    sequenced), the (client, client seq) pairs held twice, stamps that went backwards, and each
    trade's content against what its client submitted. Takes (seq, term, bytes), yields (seq,
    decoded)."""

    def __init__(self, submitted_trades: dict | None = None):
        self.trades = self.duplicates = self.backwards = 0
        self.contents = _Contents(submitted_trades or {})
        self._held: dict[bytes, _SeqRuns] = {}
        self._stamp = None

    def watch(self, records):
        for seq, _, raw in records:
            m = M.SEQUENCED.unpack(raw)
            if m[M.TYPE] in M.CLIENT_SEQ_TYPES:
                self.trades += 1
                runs = self._held.setdefault(m[M.ORIGIN], _SeqRuns())
                self.duplicates += not runs.add(m[M.CLIENT_SEQ])
                self.contents.check(seq, raw, m)
            if self._stamp is not None and m[M.STAMP] < self._stamp:
                self.backwards += 1
            self._stamp = m[M.STAMP]
            yield seq, m


class _Contents:
    """Each sequenced trade, byte for byte in its client's fields, against the trade its client
    submitted under its client seq (made again as the pass goes: a client's seqs come in order, so
    its stream is read once). A rejected entry of the load's clients is wrong too: they submit
    valid trades only. Clients the run names no trades of are not judged (`judged` says)."""

    def __init__(self, submitted: dict[bytes, Callable[[], Iterator[bytes]]]):
        self.submitted = submitted
        self._streams: dict[bytes, tuple[Iterator[bytes], int]] = {}  # origin -> (its trades, seqs read)
        self.judged = self.altered_count = 0
        self.altered: list[str] = []  # the first few, described

    @property
    def ok(self) -> bool:
        return not self.submitted or (self.judged > 0 and self.altered_count == 0)

    def figure(self) -> str:
        if not self.submitted:
            return "not judged: the run names no submitted trades"
        first = f"; {self.altered[0]}" if self.altered else ""
        return f"{self.judged:,} judged, {self.altered_count:,} altered{first}"

    def check(self, seq: int, raw: bytes, m: tuple) -> None:
        make = self.submitted.get(m[M.ORIGIN])
        if make is None:
            return
        self.judged += 1
        cseq = m[M.CLIENT_SEQ]
        trades, read = self._streams.get(m[M.ORIGIN], (None, 0))
        if trades is None or cseq <= read:  # (out of order: from the start again)
            trades, read = make(), 0
        want = next(itertools.islice(trades, cseq - read - 1, None), b"")
        self._streams[m[M.ORIGIN]] = (trades, cseq)
        if raw[:M.INBOUND.size] == want:
            return
        self.altered_count += 1
        if len(self.altered) < 20:
            who = m[M.ORIGIN].decode(errors="replace").strip()
            self.altered.append(f"seq {seq} ({who} #{cseq}): {M.TYPE_NAMES.get(m[M.TYPE], m[M.TYPE])} "
                                f"{raw[:M.INBOUND.size].hex()}, submitted {want.hex()}")


class _SeqRuns:
    """The client seqs of one client held so far, as sorted disjoint runs [starts[i], ends[i]]: a
    client's seqs come in order, so this stays a run or a few whatever the log's length."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, seq: int) -> bool:
        """Hold `seq`; False if it was held already."""
        i = bisect.bisect_right(self.starts, seq) - 1
        if i >= 0 and seq <= self.ends[i]:
            return False
        after_prev = i >= 0 and self.ends[i] == seq - 1
        before_next = i + 1 < len(self.starts) and self.starts[i + 1] == seq + 1
        if after_prev and before_next:  # fills the gap between two runs: one run
            self.ends[i] = self.ends.pop(i + 1)
            del self.starts[i + 1]
        elif after_prev:
            self.ends[i] = seq
        elif before_next:
            self.starts[i + 1] = seq
        else:
            self.starts.insert(i + 1, seq)
            self.ends.insert(i + 1, seq)
        return True


def _alerts(run: RunFiles, decoded, log_length: int) -> tuple[dict, dict]:
    """Delivered alerts against those recomputed from the journal: missing, unexpected, mismatched,
    twice. Both come in emit order (the emitter delivers so), and are matched as they go by: what
    waits for its match is only what came out of order, so a long run's alerts are never all held."""
    rejects = dict.fromkeys(REJECT_REASONS, 0)
    match = _AlertMatch(run.session, log_length)
    expected = alerts_in(decoded, run.book_ttl_ns, run.orphan_ttl_ns, rejects)
    delivered = iter(run.alerts)
    e, d = next(expected, None), next(delivered, None)
    while e is not None or d is not None:
        if d is None or (e is not None and e["emit_seq"] <= _int(d.get("emit_seq"))):
            match.expected(e)
            e = next(expected, None)
        else:
            match.delivered(d)
            d = next(delivered, None)
    return match.result(), rejects


def _int(value) -> int:
    return value if isinstance(value, int) else -1


SHOWN = 20  # ids of each kind of problem the report lists


class _AlertMatch:
    """Expected and delivered alerts met by alert id (`SESSION:purchase seq`), in any order; a
    delivered id is marked in a bitmap of the log's seqs, so a second delivery is found whenever
    it comes."""

    def __init__(self, session: str, log_length: int):
        self.prefix = f"{session}:"
        self.seen = bytearray(log_length // 8 + 1)
        self.waiting_expected: dict[str, dict] = {}
        self.waiting_delivered: dict[str, dict] = {}
        self.delivered_count = self.expected_count = self.duplicates = 0
        self.unexpected: list[str] = []  # ids of no alert of this log (the first SHOWN), and how many
        self.unexpected_count = 0
        self.mismatched: list[str] = []
        self.mismatched_count = 0

    def expected(self, alert: dict) -> None:
        self.expected_count += 1
        key = f"{self.prefix}{alert['purchase_seq']}"
        row = self.waiting_delivered.pop(key, None)
        if row is None:
            self.waiting_expected[key] = alert
        else:
            self._compare(key, row, alert)

    def delivered(self, row: dict) -> None:
        self.delivered_count += 1
        key = row.get("alert_id")
        seq = self._seq_of(key)
        if seq is None:
            self._note(self.unexpected, str(key), "unexpected_count")
            return
        if self.seen[seq >> 3] & (1 << (seq & 7)):
            self.duplicates += 1
            return
        self.seen[seq >> 3] |= 1 << (seq & 7)
        alert = self.waiting_expected.pop(key, None)
        if alert is None:
            self.waiting_delivered[key] = row
        else:
            self._compare(key, row, alert)

    def _seq_of(self, key) -> int | None:
        """The purchase seq an alert id of this session and log names, else None."""
        if not isinstance(key, str) or not key.startswith(self.prefix) or not key[len(self.prefix):].isdigit():
            return None
        seq = int(key[len(self.prefix):])
        return seq if 0 < seq < len(self.seen) * 8 else None

    def _compare(self, key: str, row: dict, alert: dict) -> None:
        if any(row.get(f) != alert[f] for f in ALERT_FIELDS):
            self._note(self.mismatched, key, "mismatched_count")

    def _note(self, shown: list, key: str, counter: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(shown) < SHOWN:
            shown.append(key)

    def result(self) -> dict:
        missing = sorted(self.waiting_expected, key=self._seq_of)
        unexpected_count = self.unexpected_count + len(self.waiting_delivered)
        unexpected = sorted([*self.unexpected, *self.waiting_delivered])[:SHOWN]
        ok = not missing and not unexpected_count and not self.mismatched_count and not self.duplicates
        figure = (f"{self.delivered_count:,} delivered, {self.expected_count:,} expected, {len(missing)} missing, "
                  f"{unexpected_count} unexpected, {self.mismatched_count} mismatched, {self.duplicates} dup.")
        return {"ok": ok, "figure": figure, "alerts_delivered": self.delivered_count,
                "alerts_expected": self.expected_count, "duplicates": self.duplicates, "missing": missing[:SHOWN],
                "unexpected": unexpected, "mismatched": sorted(self.mismatched)}


def term_changes(decoded: list) -> list[dict]:
    """Each term start in the log: its seq, term, leader, and the time since
    the previous term's last stamp (the failover time, for a change of leader)."""
    out = []
    last_stamp = None
    for seq, m in decoded:
        if m[M.TYPE] == M.TERM_START:
            gap = (m[M.STAMP] - last_stamp) / 1e6 if last_stamp is not None else None
            out.append({"seq": seq, "term": m[M.TERM], "leader": m[M.LEADER].decode(errors="replace").strip(),
                        "ms_since_previous_stamp": round(gap, 1) if gap is not None else None})
        last_stamp = m[M.STAMP]
    return out


def term_problems(terms: list[dict], published: dict[str, dict]) -> list[str]:
    """Who published in which term, judged against the log: in every term at most one
    sequencer published, none published in a term it did not win, and what it published
    lies within that term's seqs. `terms` is term_changes() of the log; `published` maps
    each sequencer to {term: [first seq, last seq]} of what it published."""
    starts = {t["term"]: t for t in terms}
    ends = {t["term"]: (nxt["seq"] - 1 if nxt else None) for t, nxt in zip(terms, [*terms[1:], None])}
    problems = []
    for name, spans in sorted(published.items()):
        for term, (first, last) in sorted((int(t), s) for t, s in spans.items()):
            won = starts.get(term)
            if won is None or won["leader"] != name:
                problems.append(f"{name} published seqs {first}-{last} in term {term}, which "
                                f"{'no one' if won is None else won['leader']} won")
            elif first < won["seq"] or (ends[term] is not None and last > ends[term]):
                problems.append(f"{name} published seqs {first}-{last} outside term {term}'s "
                                f"{won['seq']}-{ends[term] or 'end'}")
    return problems
