"""`tape tail`: join the public stream, fill gaps, print what is sequenced."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import time

from tape.ops.cli.journal_tool import record_dict
from tape.protocol import messages
from tape.protocol.receiver import Deliver
from tape.runtime import interfaces
from tape.runtime.config import Config
from tape.runtime.process import within
from tape.sequencer.client_shell import StreamListener


async def run_tail(cfg: Config, stats: bool, until: int | None, drop: float, seed: int, summary: bool,
                   idle_exit: float | None = None) -> dict:
    digest = hashlib.blake2b(digest_size=16)
    state = {"count": 0, "first": None, "last": 0, "last_change": time.monotonic(), "ended": False}
    done = asyncio.Event()
    out = sys.stdout
    quiet = stats or summary

    def deliver(first: int, pkt: bytes, skip: int) -> None:
        count = int.from_bytes(pkt[18:20], "big")
        seq = first
        lines = []
        for i in range(skip, count):
            raw = messages.packet_message_bytes(pkt, i)
            digest.update(raw)
            if raw[0] == messages.SESSION_END:
                state["ended"] = True
                done.set()
            if not quiet:
                lines.append(json.dumps(record_dict(seq, 0, raw) | {"term": None}, separators=(",", ":")))
            seq += 1
        if lines:
            out.write("\n".join(lines) + "\n")
        if state["first"] is None:
            state["first"] = first
        state["count"] += count - skip
        state["last"] = seq - 1
        state["last_change"] = time.monotonic()
        if until is not None and state["last"] >= until:
            done.set()

    def deliver_runs(runs: list[Deliver]) -> None:
        for run in runs:
            deliver(run.first_seq, run.packet, run.skip)

    listener = StreamListener(cfg, interfaces.resolve(cfg.interface or "127.0.0.1"), deliver_runs, drop, seed)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    listener.start()
    t0 = last_t = time.monotonic()
    last_n = 0
    while not done.is_set():
        try:
            await within(done.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
        rx = listener.receiver
        if state["ended"]:
            break
        now = time.monotonic()
        if idle_exit is not None and now - state["last_change"] > idle_exit:
            break
        if stats:
            rate = (state["count"] - last_n) / (now - last_t)
            print(
                f"{rate:12,.0f} msg/s  seq {rx.next_seq - 1:>12,}  lag {rx.lag():>8,}  gaps {rx.gaps_detected:,}  "
                f"requests {listener.requests_sent:,}  dropped {listener.loss.dropped:,}",
                file=sys.stderr,
                flush=True,
            )
            last_t, last_n = now, state["count"]
    listener.stop()
    rx = listener.receiver
    return {
        "messages": state["count"], "first_seq": state["first"], "last_seq": state["last"],
        "digest": digest.hexdigest(), "gaps_detected": rx.gaps_detected, "requests_sent": listener.requests_sent,
        "duplicates": rx.duplicates, "injected_loss": listener.loss.dropped, "bad_datagrams": listener.bad,
        "ended": state["ended"], "seconds": round(time.monotonic() - t0, 3),
    }


def main(
    cfg: Config, stats: bool, until: int | None, drop: float, seed: int, summary: bool, idle_exit: float | None
) -> int:
    result = asyncio.run(run_tail(cfg, stats, until, drop, seed, summary, idle_exit))
    if summary or stats:
        print(json.dumps(result))
    return 0
