"""Every process's resident memory during a run, sampled every MEMORY_EVERY_S (`tape up` keeps the
series in its report; `make soak` plots it): what shows whether a long run's memory levels off
after warm-up or grows without a bound."""

from __future__ import annotations

from pathlib import Path

MEMORY_EVERY_S = 10.0  # a read of /proc/<pid>/status per process: cheap at this period
WARM_UP_SHARE = 0.2  # the first fifth of a run is warm-up (books filling, caches, the heap's arenas)


def resident_mb(pid: int) -> tuple[float, float] | None:
    """(all, anonymous) resident memory of `pid` in MiB, None once it is gone. Anonymous is the
    process's own (heap, books, buffers); the rest is files mapped in (LMDB's pages, libraries),
    which the kernel takes back under pressure: a growing LMDB grows the first, not the second."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith(("VmRSS:", "RssAnon:")))
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["RssAnon"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


class MemorySamples:
    def __init__(self, every_s: float = MEMORY_EVERY_S):
        self.every_s = every_s
        self.series: dict[str, list[tuple[float, float, float]]] = {}  # process -> [(s into the run, MiB, anon MiB)]
        self._last = None

    def maybe_sample(self, procs: dict, elapsed: float) -> None:
        """At most one sample every `every_s` of the run's clock (`procs`: name -> Popen)."""
        if self._last is not None and elapsed - self._last < self.every_s:
            return
        self._last = elapsed
        for name, proc in procs.items():
            mb = resident_mb(proc.pid) if proc.poll() is None else None
            if mb is not None:
                self.series.setdefault(name, []).append((round(elapsed, 1), round(mb[0], 1), round(mb[1], 1)))

    def summary(self) -> dict[str, dict]:
        """Per process, in MiB: anonymous memory after warm-up, at the end, the growth between, and
        the largest resident (anonymous and mapped files)."""
        out = {}
        for name, points in sorted(self.series.items()):
            end = points[-1][0]
            warm = next((anon for t, _, anon in points if t >= WARM_UP_SHARE * end), points[-1][2])
            out[name] = {"anon_after_warm_up_mb": warm, "anon_last_mb": points[-1][2],
                         "anon_growth_mb": round(points[-1][2] - warm, 1), "max_rss_mb": max(p[1] for p in points)}
        return out

    def report(self, plot: Path, title: str) -> dict:
        """For report.json: the period, each process's summary and its series; plotted to `plot`."""
        if self.series:
            self.plot(plot, title)
        return {"every_s": self.every_s, "summary": self.summary(), "series": self.series}

    def plot(self, path: Path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5))
        for name, points in sorted(self.series.items()):
            line, = ax.plot([p[0] / 60 for p in points], [p[2] for p in points], label=f"{name} (anonymous)")
            ax.plot([p[0] / 60 for p in points], [p[1] for p in points], color=line.get_color(), linestyle=":",
                    linewidth=0.8)
        ax.set_xlabel("minutes into the run")
        ax.set_ylabel("resident memory, MiB (dotted: with mapped files)")
        ax.set_title(title)
        ax.legend(ncol=3, fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
