"""ops/verification/memory_watch.py: resident memory sampled at its period, summarised after warm-up;
and what `tape up` refuses before it starts: a run whose journals or books this host cannot hold."""

import os
from types import SimpleNamespace

import pytest

from tape.ops.verification import up
from tape.ops.verification.memory_watch import MemorySamples, resident_mb
from tape.replicas.audit_core import BookTable, compiled_books_bytes


class Proc:
    def __init__(self, pid: int, alive: bool = True):
        self.pid, self.alive = pid, alive

    def poll(self):
        return None if self.alive else 0


def test_a_sample_a_period_of_every_live_process():
    samples = MemorySamples(every_s=10)
    procs = {"me": Proc(os.getpid()), "gone": Proc(os.getpid(), alive=False)}
    for t in (0.0, 4.0, 10.0, 19.0, 20.5):
        samples.maybe_sample(procs, t)
    assert [p[0] for p in samples.series["me"]] == [0.0, 10.0, 20.5] and "gone" not in samples.series
    assert all(rss >= anon > 1 for _, rss, anon in samples.series["me"]) and resident_mb(2**22 + 7) is None


def test_growth_is_measured_from_the_end_of_warm_up(tmp_path):
    samples = MemorySamples()
    samples.series = {"replica-A": [(0, 50.0, 40.0), (10, 300.0, 290.0), (20, 320.0, 300.0), (90, 400.0, 305.0),
                                    (100, 420.0, 306.0)]}  # (its LMDB's pages mapped in grow: not its own)
    assert samples.summary() == {"replica-A": {"anon_after_warm_up_mb": 300.0, "anon_last_mb": 306.0,
                                               "anon_growth_mb": 6.0, "max_rss_mb": 420.0}}
    report = samples.report(tmp_path / "memory.png", "a run")
    assert report["every_s"] == 10.0 and (tmp_path / "memory.png").stat().st_size > 1000


def test_warm_up_named_by_the_run():
    samples = MemorySamples(warm_up_s=60, bounds_mb={"books": 200.0})
    samples.series = {"replica-A": [(0, 50.0, 40.0), (20, 300.0, 290.0), (60, 320.0, 300.0), (100, 420.0, 301.0)]}
    assert samples.summary()["replica-A"]["anon_growth_mb"] == 1.0


@pytest.mark.skipif(BookTable is None, reason="the compiled books (C) are not built")
@pytest.mark.parametrize("books", [0, 1, 512, 513, 100_000])
def test_books_bytes_are_the_tables_slots_and_an_expiry_entry_each(books):
    assert compiled_books_bytes(books) == BookTable(books).capacity * 72 + 24 * books  # a slot, an entry


def test_a_run_the_disk_cannot_hold_is_refused_saying_what_it_needs(tmp_path, monkeypatch):
    free = 10 * 2**30
    monkeypatch.setattr(up.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    fits = free // up.JOURNAL_BYTES_A_TRADE
    assert up.short_of_room(tmp_path / "not-yet" / "run", fits, 1000) is None
    said = up.short_of_room(tmp_path / "not-yet" / "run", fits + 1, 1000)
    assert "journals need 10.0 GiB (4 voters, 99 bytes a trade each)" in said and "10.0 GiB free" in said


@pytest.mark.skipif(BookTable is None, reason="the compiled books (C) are not built")
def test_a_run_whose_books_memory_cannot_hold_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "_memory_available", lambda: 4 * 2**30)
    assert up.short_of_room(tmp_path, 1000, 1_000_000) is None  # 3 x 167 MiB + 1 GiB
    said = up.short_of_room(tmp_path, 1000, 10_000_000)  # 3 x (2^25 slots, 2.5 GiB) + 1 GiB
    assert said.startswith("it needs 8.4 GiB of memory (3 replicas' 10,000,000 open books") and "4.0 GiB" in said
