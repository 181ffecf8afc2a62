"""`tape load`: submit generated trades at a target rate through the client
library and report what was acknowledged and how fast."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
import time

from tape.ops.verification.local import run_delay_seconds, scheduled_count
from tape.ops.verification.tradegen import TradeGenerator
from tape.runtime.config import Config
from tape.runtime.memory import tune_memory
from tape.sequencer.client_shell import sharing_listeners

ID_SPACE = 10**12  # each client's generator draws ids from its own range
# Trades built before the clock starts (about 90 bytes each in memory): making up random trades is
# the harness's work, not the cluster's, and is kept out of the measured window up to this many.
PREGENERATED_MAX = 8_000_000
# Sends what is due every 2 ms (clients' batches as a busy trading desk's); at low rates, at the next
# trade due instead (a 2 ms loop was 500 wake-ups a second of an idle load).
SEND_EVERY_S = 0.002
# Trades a client submits in its turn, at most: whole datagrams' worth, so that each datagram goes out
# full (in turns of 200, a 174-trade datagram went with one of 26: ~1.7x the datagrams to sign, send,
# read and check for the same trades).
TURN_TRADES = 200
# Logged once the trades are built, as the first is sent: `tape up` opens its CPU window here (the
# cluster idles while a long run's trades are built, and that idling grew with the run's length).
SENDING = "sending trades"

log = logging.getLogger("tape.load")


class Trades:
    """One client's trades: the first `ready` built ahead, the rest on demand."""

    def __init__(self, gen: TradeGenerator, ready: int):
        self.gen, self.built, self.next = gen, gen.take(ready), 0

    def take(self, n: int) -> list[bytes]:
        out = self.built[self.next:self.next + n]
        self.next += len(out)
        return out + self.gen.take(n - len(out))


def client_trades(seed: int, overfill: float, i: int) -> TradeGenerator:
    """The trades the load's i-th client submits, in client seq order (from 1): the verdict makes
    them again to compare each sequenced trade with what was submitted under its client seq."""
    return TradeGenerator(seed + i, overfill, first_id=i * ID_SPACE + 1)


def turn_trades(per_datagram: int) -> int:
    """The trades a client submits in its turn: TURN_TRADES rounded down to whole datagrams (one
    at least)."""
    return max(1, TURN_TRADES // per_datagram) * per_datagram


def percentile(values: list, q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _latency_ms(clients) -> dict:
    """Submit to seen sequenced over every client's samples: p50, p99 and max in ms."""
    latencies = [c.take_latencies() for c in clients]
    lat = [x / 1e6 for samples in latencies for x in samples.samples]
    return {"p50": round(percentile(lat, 0.5), 3), "p99": round(percentile(lat, 0.99), 3),
            "max": round(max((s.max for s in latencies), default=0) / 1e6, 3)}


async def run_load(cfg: Config, names: list[str], rate: float, total: int, seed: int, drop: float,
                   overfill: float, ack_timeout: float = 60.0, resume: bool = False) -> dict:
    listeners, clients = sharing_listeners(cfg, names, drop, seed)  # the stream read once, not once a client
    gens = [client_trades(seed, overfill, i) for i in range(len(names))]
    quotas = [total // len(names) + (i < total % len(names)) for i in range(len(names))]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for listener in listeners:
        listener.start()
    for c in clients:
        await c.start()
    await asyncio.sleep(0.05)  # joined the group before the first message
    done = [0] * len(clients)  # trades submitted (or, resuming, found sequenced) per client
    if resume:  # a restart: go on after what the log holds; each client seq is the same trade again
        for i, c in enumerate(clients):
            done[i] = min(quotas[i], await c.recover(ack_timeout))
            for _ in range(done[i]):
                next(gens[i])
    resumed = sent = sum(done)
    ahead = max(0, min(total, PREGENERATED_MAX) - resumed) // len(clients)
    trades = [Trades(g, min(ahead, quotas[i] - done[i])) for i, g in enumerate(gens)]
    cpu_before, wait_before = _cpu_seconds(), run_delay_seconds() or 0.0  # the measured window starts here
    scheduled_before = scheduled_count() or 0
    log.info("%s: %d at %.0f/s", SENDING, total - resumed, rate)
    t0 = time.monotonic()
    turn = 0
    chunk = [turn_trades(c.per_batch) for c in clients]
    while sent < total and not stop.is_set():
        due = min(total, resumed + int(rate * (time.monotonic() - t0)) + 1)
        while sent < due:
            i = turn % len(clients)
            turn += 1
            n = min(due - sent, chunk[i], quotas[i] - done[i])
            if n > 0:
                await clients[i].submit(trades[i].take(n))
                sent += n
                done[i] += n
        await asyncio.sleep(max(SEND_EVERY_S, t0 + (sent - resumed) / rate - time.monotonic()))
    send_secs = time.monotonic() - t0
    acked_all = all([await c.wait_acked(c.next_cseq - 1, ack_timeout) for c in clients])
    elapsed = time.monotonic() - t0
    result = {
        "submitted": sent,
        "resumed_at": resumed,
        "acked": sum(c.acked for c in clients),
        "all_acked": acked_all,
        "resends": sum(c.resends for c in clients),
        "backoffs": sum(c.backoffs for c in clients),  # honoured: the leader was overloaded
        "paused_s": round(sum(c.core.paused_ns for c in clients) / 1e9, 3),
        "rejected": sum(len(c.core.rejected) for c in clients),
        "rate_target": rate,
        "rate_sent": round((sent - resumed) / send_secs, 1) if send_secs else 0.0,
        "rate_acked": round((sum(c.acked for c in clients) - resumed) / elapsed, 1),
        "latency_ms": _latency_ms(clients),
        "gap_requests": sum(listener.requests_sent for listener in listeners),
        "cpu_s": round(_cpu_seconds() - cpu_before, 3),  # while submitting and listening (not building trades)
        "wait_s": round((run_delay_seconds() or 0.0) - wait_before, 3),  # ready to run, without a core
        "scheduled": (scheduled_count() or 0) - scheduled_before,  # put on a core (wake-ups, preemptions)
        "build_cpu_s": round(cpu_before, 3),  # start-up and the trades built ahead
        "trades": {"seed": seed, "overfill": overfill, "clients": names},  # what client_trades makes again
    }
    for c in clients:
        await c.close()
    for listener in listeners:
        await listener.close()
    return result


def _cpu_seconds() -> float:
    """User + system CPU of this process so far."""
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])


def main(cfg: Config, names: list[str] | None, rate: float, duration: float | None, messages: int | None,
         seed: int, drop: float, overfill: float, resume: bool = False) -> int:
    tune_memory()
    names = names or [c.name for c in cfg.clients]
    total = messages if messages is not None else int(rate * (duration or 10.0))
    try:
        result = asyncio.run(run_load(cfg, names, rate, total, seed, drop, overfill, resume=resume))
    except TimeoutError as e:
        print(json.dumps({"error": str(e)}))
        return 1
    print(json.dumps(result))
    return 0 if result["all_acked"] else 1
