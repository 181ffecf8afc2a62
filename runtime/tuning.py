"""How the shells tune their processes, named once: socket buffers and reads, drains per
wake-up, journal caches, heap and collector settings, connection caps and timeouts of the
links, LMDB map sizes, the shutdown's waits. None of it is protocol: a peer never sees a
different value, so each may be changed for a host without touching another node (the
protocol's own limits, which every node must agree on, are protocol/limits.py).
Relations between them are asserted at import."""

from __future__ import annotations

from tape.protocol import moldudp64
from tape.protocol.voter_node import FreeSpace

# --- datagrams ---------------------------------------------------------------------------
DATAGRAM_BUFFER = 65536  # bytes read per recv(): any UDP payload fits
DRAIN_DATAGRAMS = 512  # datagrams one wake-up of a data-plane socket reads before yielding
GAP_REQUEST_DRAIN = 256  # gap-fill requests one wake-up of a rewinder answers
GAP_REQUEST_BUFFER = 65_536  # bytes read per gap-fill request (padded to the answer's size without keys)
RECEIVE_BUFFER = 32 << 20  # each UDP socket's kernel receive buffer (forced where we are root)
SEND_BUFFER = 8 << 20  # the leader's multicast socket: a paced batch's packets in one go

# --- TCP links ---------------------------------------------------------------------------
CONTROL_READ = 65536  # bytes per read() on a low-rate connection (hellos, acks, alerts)
# Bytes one recv() of a TCP link's socket asks for. asyncio reads into a new bytes object of its
# own 256 KiB each time, above glibc's mmap threshold (128 KiB), so every read, however small the
# frame, cost an mmap, an mremap, a munmap and a page fault (~15 µs against ~3 µs here); a larger
# frame takes more reads.
SOCKET_RECV = 64 << 10
# What one recv() asks for on a voter's inbound link (runtime/links.py `large_reads`): a paced
# batch's append (200-300 KB at 250,000 msg/s) in one read, and a leader ahead of its follower has
# sent several by the time it reads (one fsync and one acknowledgement for all of them).
BEHIND_RECV = 1 << 20
HANDSHAKE_TIMEOUT_S = 2.0  # a peer that sends no hello in this time is dropped
# The metrics endpoint (runtime/metrics_server.py): requests at once, the time to read one, and
# answers a second (Prometheus scrapes every few seconds; `tape status` and the test harness poll).
METRICS_CONNECTIONS = 8
METRICS_READ_TIMEOUT_S = 2.0
METRICS_SCRAPES_PER_S = 50
METRICS_ACCEPTS_PER_S = 2 * METRICS_SCRAPES_PER_S  # connections given a thread: beyond, closed unread
METRICS_HANDSHAKES_PER_S = 50  # with TLS: each costs an ECDHE and a signature, so a stranger's are budgeted too
CONNECT_TIMEOUT_S = 2.0  # a connection and its handshake, where the caller has no tighter limit

# --- threads, heap, collector --------------------------------------------------------------
# How long a replica's snapshot thread may run Python before the thread that applies gets the GIL
# back (Python's default is 5 ms: the stream waited that long while a save was written).
GIL_SWITCH_S = 0.001
HEAP_MAPPED_FROM = 16 << 20  # buffers this large or larger are still mapped (and unmapped) apart
HEAP_KEPT_BYTES = 64 << 20  # free memory at the heap's top kept rather than given back
GC_THRESHOLDS = (100_000, 50, 100)  # the collector's generations, after start-up's objects are frozen

# --- journals and disks ------------------------------------------------------------------
# The newest records a journal keeps in memory as they were appended, for gap fills and catch-ups
# of the log's tail (65 ms at 250,000 msg/s; ~2 MB): older reads, and any after a restart, go to
# the files, whose damage is met there (docs/runbook.md).
JOURNAL_RECENT_RECORDS = 16_384
# A journal's synced bytes kept in the page cache behind its end (~260 ms at 250,000 msg/s);
# older pages are given back after each fsync (docs/decisions.md).
JOURNAL_CACHED_BYTES = 4 << 20
# Finished segments whose sparse index a journal holds in memory (read from its .idx when a read
# needs it; ~40 KiB each): the rest are on disk only, so a journal's memory does not grow with it.
SEALED_INDEXES_KEPT = 16
RESERVE_AHEAD_BYTES = 1 << 20  # disk space reserved past the tail's end for its next appends
SLOW_FSYNC_S = 0.1  # an fsync longer than this is counted and logged: a disk that stalls the node
MAX_UNFLUSHED_BYTES = 64 << 20  # durability "replicated": appends wait for the disk beyond this much unflushed
SLOW_FSYNC_LOG_S = 5.0  # at most one log line of slow fsyncs this often
# Under 4 MiB free a voter takes no part, before a write is refused; stopped (or refused), it takes
# part again from 16 MiB. It looks at its free space this often.
FREE_SPACE = FreeSpace(stop=4 << 20, resume=16 << 20)
DISK_CHECK_EVERY_S = 1.0
REPLICA_MAP_BYTES = 8 << 30  # a replica's LMDB map: its books and outbox fit (sparse: only what is used)
# The emitter's LMDB map: its outbox, and every alert delivered in the session, kept to compare late
# copies with (the soak's file: 890 MB for 8.0 M alerts, ~111 bytes each; 4 GiB would have filled
# after ~2.5 h at its 4,200 alerts/s). Sparse: the file grows with use; the map only reserves addresses.
EMITTER_MAP_BYTES = 256 << 30

# --- the emitter's sinks ------------------------------------------------------------------
SINK_RETRY_FIRST_S = 0.05  # a sink that failed is tried again after this, then twice as long each time
SINK_RETRY_MAX_S = 5.0  # ... up to this apart
TAIL_BYTES = 4 << 20  # how much of the JSON-lines file's tail is checked for ids on start
# Ids the JSON-lines sink remembers: what is in doubt, or delivered and not recorded, is far fewer
# (two batches, or what came in the emitter's RECORD_AFTER_NS).
IDS_KEPT = 65_536

# --- shutdown ----------------------------------------------------------------------------
END_COMMIT_WAIT_S = 5.0  # at shutdown, how long the session's end may take to commit (a loaded host is slow)
END_POLL_S = 0.01  # how often the shutdown looks whether the end committed
FINAL_DRAIN_S = 0.5  # at shutdown, how long each follower's queue may take to drain before the end is published


def _check() -> None:
    assert DATAGRAM_BUFFER >= moldudp64.MAX_UDP_PAYLOAD, "a recv() must hold any datagram"
    assert GAP_REQUEST_BUFFER >= moldudp64.MAX_UDP_PAYLOAD, "a padded request must fit the request buffer"
    assert SOCKET_RECV <= BEHIND_RECV and CONTROL_READ <= BEHIND_RECV
    assert HEAP_MAPPED_FROM <= HEAP_KEPT_BYTES


_check()
