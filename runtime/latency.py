"""Latency samples with bounded memory, summarised as p50 / p99 / max in ms; and a
histogram of them for Prometheus (histogram_quantile over any window)."""

from __future__ import annotations

import bisect

# A replica samples the latency of one delivered packet in this many: a sample a packet cost a tenth
# of its CPU, and one in 8 still gives ~1,800 samples a second at 250,000 msg/s.
LATENCY_SAMPLE_PACKETS = 8
# Upper bounds of the latency histogram's buckets, in seconds (the requirement is 5 ms).
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class EveryNth:
    """One item in `n` of a stream handed over in lists of any length: the first, the n+1th, ..."""

    def __init__(self, n: int):
        assert n >= 1
        self.n = n
        self._due = 1  # the next pick's place (1-based) in the next list

    def pick(self, items: list) -> list:
        picked = items[self._due - 1::self.n]
        self._due += len(picked) * self.n - len(items)
        return picked


class LatencyHistogram:
    """Counts a bucket per observation: what Prometheus' histogram_quantile reads."""

    def __init__(self, bounds_s: tuple = LATENCY_BUCKETS_S):
        self.bounds_ns = [int(b * 1e9) for b in bounds_s]
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)  # the last: above every bound
        self.sum_seconds = 0.0

    def observe(self, ns: int) -> None:
        self.counts[bisect.bisect_left(self.bounds_ns, ns)] += 1
        self.sum_seconds += ns / 1e9

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, +Inf last."""
        out, total = [], 0
        for bound, count in zip((*(str(b) for b in self.bounds_s), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out


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

    def extend(self, values_ns: list[int]) -> None:
        """As `add` of each, in a few list operations (the emitter's alerts: ~1.5 us an alert one by one)."""
        if not values_ns:
            return
        self.count += len(values_ns)
        self.max = max(self.max, max(values_ns))
        at = 0
        while at < len(values_ns):
            filling = self.stride - self._skip + (self.cap - len(self.samples) - 1) * self.stride  # (as in add)
            chunk = values_ns[at:at + filling]
            self.samples += chunk[self.stride - self._skip - 1::self.stride]
            self._skip = (self._skip + len(chunk)) % self.stride
            at += len(chunk)
            if len(self.samples) >= self.cap:
                self.samples = self.samples[::2]
                self.stride *= 2

    def add(self, value_ns: int, weight: int = 1) -> None:
        """`weight` samples of one value (a packet's trades, stamped together), as if added one by
        one, in a few list operations."""
        self.count += weight
        if value_ns > self.max:
            self.max = value_ns
        while weight:
            # Samples that would fill the list: the next one after stride - skip, then one per stride.
            filling = self.stride - self._skip + (self.cap - len(self.samples) - 1) * self.stride
            take = min(weight, filling)
            kept, self._skip = divmod(self._skip + take, self.stride)
            self.samples += [value_ns] * kept
            weight -= take
            if len(self.samples) >= self.cap:
                self.samples = self.samples[::2]
                self.stride *= 2

    def summary_ms(self) -> dict:
        s = sorted(self.samples)
        pick = (lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1e6) if s else (lambda q: 0.0)
        return {"p50": round(pick(0.5), 3), "p99": round(pick(0.99), 3), "max": round(self.max / 1e6, 3),
                "count": self.count}
