"""Memory settings for the long-running processes and benchmarks: the garbage collector's and
the C heap's.

The hot paths allocate many short-lived tuples; the default gen-0 threshold
(700) runs a collection every few packets. Freezing the start-up heap and
raising the thresholds roughly halves per-message cost (see NOTES/perf docs).

A link's reads, frames and encoded records are buffers of 64 KiB to a few MiB, made and freed
hundreds of times a second. glibc maps a buffer above its threshold (128 KiB at first) fresh from
the kernel and unmaps it when freed, and gives the heap's free top back above another: each such
buffer's pages are faulted in and zeroed again (a follower at 250,000 msg/s: ~4,000 page faults a
second, each a wait where the host took the memory back; docs/decisions.md). Kept, the heap's
chunks are reused warm; a process holds at most its peak heap plus HEAP_KEPT_BYTES.
"""

import ctypes
import gc
import logging

from tape.runtime.tuning import GC_THRESHOLDS, HEAP_KEPT_BYTES, HEAP_MAPPED_FROM

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

log = logging.getLogger("tape.memory")


def tune_memory() -> None:
    tune_gc()
    keep_heap()


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def keep_heap() -> bool:
    """Set glibc's thresholds (mallopt); False where the C library has none (another libc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, HEAP_MAPPED_FROM)
                               and mallopt(M_TRIM_THRESHOLD, HEAP_KEPT_BYTES)):
        log.info("the C library takes no heap thresholds: large buffers are mapped fresh each time")
        return False
    return True
