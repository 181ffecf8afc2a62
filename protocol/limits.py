"""The protocol's limits, named once: the sizes, counts, rates and times that bound what a core
holds or sends, and that the nodes of a cluster must agree on. Their relations are asserted at
import: a change that breaks one (say, a drain that could build an append larger than a follower
accepts) fails on the first import, not in production. How a process is tuned (buffers, reads,
caches, timeouts of its own) is runtime/tuning.py's: no peer sees it.
"""

from __future__ import annotations

from tape.protocol import messages, moldudp64, replication, soupbintcp

# --- gap fill and the emitter's holdings -------------------------------------------------
# Gap-fill budgets (requests answered per second): per requesting host (all its ports together)
# and for the whole server. An answer costs ~0.1 ms of a rewinder's loop (docs/stream.md), so the
# total bounds gap fill to about a third of one core whatever the number of hosts asking.
GAPFILL_HOST_RATE, GAPFILL_HOST_BURST = 2_000.0, 400.0
GAPFILL_TOTAL_RATE, GAPFILL_TOTAL_BURST = 3_000.0, 600.0
GAP_PARKED_MAX = 1024  # gap-fill requests one rewinder holds at once for the commit point to reach them
GAPFILL_MAX_HOSTS = 10_000  # hosts whose buckets are remembered (the least recent forgotten first)
# --- inbound from an address no client is configured at: datagrams a second the leader checks
# (a MAC each) from one such host and from all of them; beyond, dropped before any check
STRANGER_INBOUND_RATE = 2_000.0
STRANGER_INBOUND_TOTAL_RATE = 10_000.0
STRANGER_MAX_HOSTS = 10_000
# The emitter's quorum delivery: alerts held awaiting a quorum (a replica that would exceed it is
# refused until it reconnects), about 100 bytes each.
MAX_PENDING_ALERTS = 100_000
# The emitter judges a replica's copy of a recorded alert against the bytes it recorded: the newest
# this many are kept in memory too (~100 bytes each), so that copies arriving close behind the
# first need no LMDB read.
RECENT_ALERTS = 65_536
# A delivered batch's done is recorded in the next batch's intent transaction, or on its own once
# no next batch came for this long. Either way only the last batch or two can be in doubt after a
# crash; this bounds only how long an idle emitter's last batch stays so. (At 10 ms, a gap between
# deliveries under load fired it for ~40% of the commits: two more fdatasyncs each, profiling.)
DONE_ALONE_AFTER_NS = 100_000_000
# With every sink idempotent the emitter delivers first and records what it delivered at most this
# long after the first batch not yet recorded, in one transaction: the replicas keep their alerts
# (and resend them after a crash) until then, and LMDB syncs ~50 times a second, not once a batch.
RECORD_AFTER_NS = 20_000_000
# The emitter tells each replica the recorded mark at most this often, one acknowledgement covering
# every record since: each is a sealed write and a replica woken to trim its outbox. At 5 ms (every
# record, 20 ms apart) the replicas' CPU was 4-11% and the emitter's 4-15% above what it is at 100 ms
# (docs/performance.md); a replica keeps ~0.1 s more alerts meanwhile.
ACK_EVERY_NS = 100_000_000

# A voter writes its commit point beside its journal for the journal's readers (protocol/commit_mark.py)
# at most this often: a streaming reader of the directory lags the log by up to this much more.
COMMIT_MARK_EVERY_NS = 50_000_000

# --- the leader's batches ----------------------------------------------------------------
# A batch is one journal append and one replication frame: the leader cuts a drain
# into batches of at most this many messages.
MAX_BATCH_MESSAGES = 65_536
# A batch this large says messages come fast: the leader paces the next one (stream.batch_interval_ms;
# sequencer/leader_core.py batch_due_ns). Below it (at 25,000 msg/s a batch held 76-84) each is stamped at once.
PACE_FROM_MESSAGES = 256
CATCHUP_CHUNK = 2_000  # journal entries per catch-up append to a follower behind
FETCH_MAX = 100_000  # entries one fetch answer carries at most
FETCH_READ_TIMEOUT_NS = 2_000_000_000  # a fetch answer that stalls this long between reads is given up
MAX_LIVE_BUFFER = 32 << 20  # bytes queued to a follower before it is caught up from the journal instead
MAX_HELD_BATCHES = 4096  # per client: batches held that arrived ahead of a lost one
# A commit point that moved goes to the followers in an empty append only once no append (which
# carries it) went for this long: the leader's timer period (sequencer/sequencer_shell.py).
COMMIT_BEAT_AFTER_NS = 5_000_000

# Client keys whose padded HMAC-SHA256 states are kept (protocol/clientmac.py, ~0.5 KB each): a
# cluster with more clients than this recomputes them (slower, not wrong).
MAX_CLIENT_KEYS = 1024

# --- overload: the leader asks clients to back off (protocol/backoff.py) -------------------
OVERLOAD_NS = 50_000_000  # the inbound socket not emptied by any drain this long: overloaded
BACKOFF_INTERVAL_NS = 100_000_000  # one back-off per client at most this often
BACKOFF_RETRY_MS = 50  # the pause a back-off asks for
# A batch ahead of a lost one: the leader asks its client to resend the missing one at once, again
# for the same one at most this often; a client resends a batch asked for only if it did not send
# it in the last RESEND_ASK_FLOOR_NS (a replayed request costs one duplicate batch at most).
RESEND_ASK_INTERVAL_NS = 10_000_000
RESEND_ASK_FLOOR_NS = 5_000_000
MAX_RETRY_MS = 1_000  # the longest pause a client honours, whatever a back-off says

# --- TCP reads and frames ----------------------------------------------------------------
REPLICATION_FRAME = replication.MAX_FRAME
# TCP listeners (replication, alerts, replay; protocol/slots.py): a configured peer's address has its
# own slots, which no stranger takes; every other address shares a small pool, a few each.
PEER_SLOTS_PER_HOST = 64
STRANGER_SLOTS = 128
STRANGER_SLOTS_PER_HOST = 8
REPLAY_CHUNK = 1_000  # committed messages per replay write
# Messages a second a rewinder replays over all its listeners' sessions, and a burst of a chunk for
# each of a few: replay shares the loop that acknowledges appends, so however many read from seq 1,
# appends come first (issue 63). A session the budget holds back is served again in turn.
REPLAY_RATE = 100_000.0
REPLAY_BURST = 8 * REPLAY_CHUNK
REPLAY_BUDGET_RETRY_NS = 5_000_000  # a session held back by the budget asks it again this soon
# Who a replay session is, by the key it logged in with: the stream key's holders (replicas: never
# budgeted, they must outrun the live stream to catch up) or the listener key's (budgeted).
REPLAY_MEMBER, REPLAY_LISTENER = b"member", b"listener"
REPLAY_LOGIN_FRAME = 1024  # largest frame a replay server accepts before the login
REPLAY_LOGIN_TIMEOUT_S = 5.0
REPLAY_IDLE_TIMEOUT_S = 15.0  # a replay client silent this long is gone (SoupBinTCP: it heartbeats every second)
REPLAY_CLIENT_HEARTBEAT_S = 1.0
REPLAY_WRITE_TIMEOUT_S = 15.0  # a replay client that has not taken a chunk (1,000 messages) in this long has
# stopped reading: closed, so that it holds no slot and no buffer (its heartbeats alone do not keep it)
REPLAY_HEARTBEAT_NS = 1_000_000_000  # a replay server's heartbeat after this long without sending

# --- listeners ---------------------------------------------------------------------------
REPLAY_BEHIND = 2_000  # messages a replica misses (known to exist, not held) before it catches up over TCP
REPLAY_POLL_S = 0.02  # how often a replica looks whether it is that far behind: while something is missing,
REPLAY_POLL_FAST_FOR_S = 1.0  # and this long after it (re)starts applying; else every REPLAY_POLL_IDLE_S
REPLAY_POLL_IDLE_S = 0.2
RECEIVER_MAX_HELD = 1_000_000  # out-of-order messages a receiver holds before dropping the furthest
GAPS_ASKED_AT_ONCE = 8  # missing runs a listener has requests out for at once
GAP_ASKED_OF = 2  # rewinders a missing run is first asked of at once: the first answer fills it
# A listener's timer asks again what stays unanswered while no datagram arrives to drain (each
# drain asks too), every half of this or of gap_request_ms, whichever is longer: a timer at half
# of a short answer timeout would wake every listener of an idle stream that much more often.
GAP_TICK_MS = 20
MAX_GAP_TIMEOUT_NS = 500_000_000  # the most a listener's measured gap-request timeout grows to
MAX_HELD_SCANNED = 4_096  # held packets a listener looks through for missing runs, per tick
MAX_HINT_AHEAD = 1 << 24  # a heartbeat further ahead of the stream than this is far-fetched
HINT_TRIES = 8  # with keys: gap requests a heartbeat's hint is worth while the stream does not move
RESENDS_PER_ROUND = 16  # unacknowledged batches a client resends per round
MAX_RESEND_TIMEOUT_NS = 1_000_000_000  # the most a client's measured resend timeout grows to

# --- replicas ----------------------------------------------------------------------------
# The most books `[audit] books_expected` sizes a replica's table for at start (replicas/_audit.c's
# MAX_EXPECTED): 2^29 slots of 72 bytes, 36 GiB.
MAX_BOOKS_EXPECTED = 1 << 28

# A gap between a voter's election ticks longer than this share of the minimum election timeout
# is a stall of its process (not scheduled, blocked in a disk write, stopped): it holds the
# election's timers (protocol/election.py).
STALL_SHARE = 1 / 6


def _check() -> None:
    append_overhead = replication.FRAME.size + replication.APPEND.size
    per_datagram = (moldudp64.MAX_UDP_PAYLOAD - moldudp64.HEADER_SIZE) // messages.INBOUND_BLOCK_SIZE
    # The leader flushes once a batch reaches MAX_BATCH_MESSAGES: one datagram may take it past.
    largest_batch = MAX_BATCH_MESSAGES + per_datagram
    assert largest_batch * messages.SEQUENCED_SIZE + append_overhead <= REPLICATION_FRAME, \
        "a batch must fit one append frame"
    assert CATCHUP_CHUNK <= MAX_BATCH_MESSAGES and FETCH_MAX * messages.SEQUENCED_SIZE <= REPLICATION_FRAME, \
        "catch-up and fetch answers must fit one append frame"
    assert GAPFILL_HOST_RATE <= GAPFILL_TOTAL_RATE and GAPFILL_HOST_BURST <= GAPFILL_TOTAL_BURST
    assert STRANGER_INBOUND_RATE <= STRANGER_INBOUND_TOTAL_RATE
    assert soupbintcp.FRAME_LEN.size + 1 + 46 <= REPLAY_LOGIN_FRAME <= soupbintcp.MAX_FRAME, "a login must fit"
    assert REPLAY_BEHIND < RECEIVER_MAX_HELD
    assert REPLAY_CHUNK <= REPLAY_BURST, "a whole chunk must fit the replay budget"
    assert BACKOFF_RETRY_MS <= MAX_RETRY_MS and BACKOFF_RETRY_MS * 1_000_000 <= BACKOFF_INTERVAL_NS, \
        "a client paused by one back-off sends again before the next may come"


_check()
