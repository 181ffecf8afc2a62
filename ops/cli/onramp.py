"""`tape onramp`: trades as JSON lines in the original challenge's shape,
submitted through the client library.

    {"id": 1, "# shares": 100, "client": "Sendence", "stock": "AAPL"}
    {"id": 2, "initial order id": 1, "# shares": 90, "client": "Sendence", "stock": "AAPL"}

A malformed line is reported (line number and reason) and left out; only
whole, valid records are ever submitted.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Iterable, TextIO

from tape.protocol import messages
from tape.runtime.config import Config
from tape.sequencer.client_shell import Client


def parse_line(line: str) -> bytes:
    """One JSON line as an inbound message; ValueError says what is wrong."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")

    def field(name, kind):
        if name not in rec:
            raise ValueError(f'missing "{name}"')
        value = rec[name]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f'"{name}" must be an integer, got {value!r}')
        if kind is str and not isinstance(value, str):
            raise ValueError(f'"{name}" must be a string, got {value!r}')
        return value

    rid, shares, client, stock = field("id", int), field("# shares", int), field("client", str), field("stock", str)
    if not 0 < rid < 2**64:
        raise ValueError(f'"id" {rid} is outside 1..2^64-1')
    if not -(2**63) <= shares < 2**63:
        raise ValueError(f'"# shares" {shares} does not fit 64 bits')
    for name, value, width in (("client", client, 16), ("stock", stock, 8)):
        if not value or not value.isascii() or not value.isprintable() or len(value) > width:
            raise ValueError(f'"{name}" must be 1-{width} printable ASCII characters, got {value!r}')
    if "initial order id" in rec:
        order = field("initial order id", int)
        if not 0 < order < 2**64:
            raise ValueError(f'"initial order id" {order} is outside 1..2^64-1')
        return messages.purchase(rid, order, shares, client, stock)
    return messages.purchase_request(rid, shares, client, stock)


def read_records(lines: Iterable[str], errors: TextIO) -> tuple[list[bytes], int]:
    good, bad = [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            good.append(parse_line(line))
        except ValueError as e:
            bad += 1
            print(f"line {number}: {e}", file=errors)
    return good, bad


async def submit_all(cfg: Config, client_name: str, msgs: list[bytes], timeout: float) -> dict:
    client = Client(cfg, client_name)
    await client.start()
    last = await client.submit(msgs) if msgs else 0
    ok = await client.wait_acked(last, timeout)
    await client.close()
    return {"submitted": len(msgs), "acked": client.acked, "all_acked": ok,
            "rejected": [{"client_seq": s, "reason": r} for s, r in client.rejected]}


def main(cfg: Config, client_name: str, path: str, timeout: float) -> int:
    stream = sys.stdin if path == "-" else open(path)
    with stream:
        msgs, bad = read_records(stream, sys.stderr)
    result = asyncio.run(submit_all(cfg, client_name, msgs, timeout))
    result["rejected_lines"] = bad
    print(json.dumps(result))
    if not result["all_acked"]:
        return 1
    return 2 if bad else 0
