"""Garbage-collector settings for the long-running processes and benchmarks.

The hot paths allocate many short-lived tuples; the default gen-0 threshold
(700) runs a collection every few packets. Freezing the start-up heap and
raising the thresholds roughly halves per-message cost (see NOTES/perf docs).
"""

import gc


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
