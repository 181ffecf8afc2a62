"""Every process's resident memory during a run, sampled every MEMORY_EVERY_S (`tape up` keeps the
series in its report; `make soak` plots it): what shows whether a long run's memory levels off
after warm-up or grows without a bound."""

from __future__ import annotations

from pathlib import Path

MEMORY_EVERY_S = 10.0  # a read of /proc/<pid>/status per process: cheap at this period
WARM_UP_SHARE = 0.2  # the first fifth of a run is warm-up (books filling, caches, the heap's arenas)


def resident_mb(pid: int) -> float | None:
    """VmRSS of `pid` in MiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class MemorySamples:
    def __init__(self, every_s: float = MEMORY_EVERY_S):
        self.every_s = every_s
        self.series: dict[str, list[tuple[float, float]]] = {}  # process -> [(seconds into the run, MiB)]
        self._last = None

    def maybe_sample(self, procs: dict, elapsed: float) -> None:
        """At most one sample every `every_s` of the run's clock (`procs`: name -> Popen)."""
        if self._last is not None and elapsed - self._last < self.every_s:
            return
        self._last = elapsed
        for name, proc in procs.items():
            mb = resident_mb(proc.pid) if proc.poll() is None else None
            if mb is not None:
                self.series.setdefault(name, []).append((round(elapsed, 1), round(mb, 1)))

    def summary(self) -> dict[str, dict]:
        """Per process: MiB after warm-up, at the end, and the largest; and the growth between."""
        out = {}
        for name, points in sorted(self.series.items()):
            end = points[-1][0]
            warm = next((mb for t, mb in points if t >= WARM_UP_SHARE * end), points[-1][1])
            out[name] = {"after_warm_up_mb": warm, "last_mb": points[-1][1], "max_mb": max(mb for _, mb in points),
                         "growth_mb": round(points[-1][1] - warm, 1)}
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
            ax.plot([t / 60 for t, _ in points], [mb for _, mb in points], label=name)
        ax.set_xlabel("minutes into the run")
        ax.set_ylabel("resident memory, MiB")
        ax.set_title(title)
        ax.legend(ncol=3, fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
