"""Latency samples with bounded memory, summarised as p50 / p99 / max in ms."""

from __future__ import annotations


class LatencySamples:
    """Keeps every `stride`-th sample, doubling the stride whenever `cap` are
    held: an even thinning over the whole run, in at most `cap` numbers."""

    def __init__(self, cap: int = 200_000):
        self.cap = cap
        self.stride = 1
        self._skip = 0
        self.samples: list[int] = []
        self.max = 0
        self.count = 0

    def extend(self, values_ns) -> None:
        for v in values_ns:
            self.count += 1
            if v > self.max:
                self.max = v
            self._skip += 1
            if self._skip >= self.stride:
                self._skip = 0
                self.samples.append(v)
        if len(self.samples) >= self.cap:
            self.samples = self.samples[::2]
            self.stride *= 2

    def summary_ms(self) -> dict:
        s = sorted(self.samples)
        pick = (lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1e6) if s else (lambda q: 0.0)
        return {"p50": round(pick(0.5), 3), "p99": round(pick(0.99), 3), "max": round(self.max / 1e6, 3),
                "count": self.count}
