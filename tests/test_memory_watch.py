"""ops/verification/memory_watch.py: resident memory sampled at its period, summarised after warm-up."""

import os

from tape.ops.verification.memory_watch import MemorySamples, resident_mb


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
