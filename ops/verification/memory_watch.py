"""Every process's resident memory during a run, sampled every MEMORY_EVERY_S (`tape up` keeps the
series in its report; `make soak` plots it): what shows whether a long run's memory levels off
after warm-up or grows without a bound."""

from __future__ import annotations

from pathlib import Path

MEMORY_EVERY_S = 10.0  # a read of /proc/<pid>/status per process: cheap at this period
WARM_UP_SHARE = 0.2  # without a warm-up named, the first fifth of a run (caches, the heap's arenas)


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
    def __init__(self, every_s: float = MEMORY_EVERY_S, warm_up_s: float | None = None,
                 bounds_mb: dict[str, float] | None = None):
        """`warm_up_s`: when the run's memory should stop growing (a replica's books grow until
        the first close, book_ttl_s in); `bounds_mb`: the named limits it is held to, for the report."""
        self.every_s = every_s
        self.warm_up_s = warm_up_s
        self.bounds_mb = bounds_mb or {}
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
            warm_up = self.warm_up_s if self.warm_up_s is not None else WARM_UP_SHARE * end
            warm = next((anon for t, _, anon in points if t >= warm_up), points[-1][2])
            out[name] = {"anon_after_warm_up_mb": warm, "anon_last_mb": points[-1][2],
                         "anon_growth_mb": round(points[-1][2] - warm, 1), "max_rss_mb": max(p[1] for p in points)}
        return out

    def report(self, plot: Path, title: str) -> dict:
        """For report.json: the period, each process's summary and its series; plotted to `plot`."""
        if self.series:
            self.plot(plot, title)
        return {"every_s": self.every_s, "warm_up_s": self.warm_up_s, "bounds_mb": self.bounds_mb,
                "summary": self.summary(), "series": self.series}

    def table(self):
        """The summary as a table for the terminal: a run's memory at a glance."""
        from rich.table import Table

        warm = f"{self.warm_up_s:.0f} s" if self.warm_up_s is not None else f"{WARM_UP_SHARE:.0%} of the run"
        table = Table(title=f"anonymous memory, MiB (warm-up: {warm}; "
                            + "; ".join(f"{k}: {v:,.0f} MiB" for k, v in self.bounds_mb.items()) + ")")
        for col in ("process", "after warm-up", "last", "growth", "most resident"):
            table.add_column(col, justify="left" if col == "process" else "right")
        for name, s in self.summary().items():
            table.add_row(name, f"{s['anon_after_warm_up_mb']:,.1f}", f"{s['anon_last_mb']:,.1f}",
                          f"{s['anon_growth_mb']:+,.1f}", f"{s['max_rss_mb']:,.1f}")
        return table

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
