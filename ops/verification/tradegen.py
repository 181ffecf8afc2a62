"""A seeded generator of trade streams: orders with 1-6 purchases, a share of
them overfilled, several clients and stocks. The same seed gives the same
stream, so that load runs and benchmarks are reproducible."""

from __future__ import annotations

import random
from typing import Iterator

from tape.protocol import messages

PURCHASES = (1, 6)  # the fewest and most purchases of an order, uniformly
CLIENTS = ("Sendence", "Acme", "Globex", "Initech", "Umbrella", "Hooli", "Stark", "Wayne")
STOCKS = ("AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "META", "IBM")


class TradeGenerator:
    def __init__(self, seed: int = 1, overfill_share: float = 0.2, open_orders: int = 64, first_id: int = 1):
        self._rng = random.Random(seed)
        self.overfill_share = overfill_share
        self._open_target = open_orders
        self._next_id = first_id
        self._open: list[list] = []  # [order_id, client, stock, [remaining purchase shares...]]

    def _new_order(self) -> bytes:
        rng = self._rng
        order_id = self._next_id
        self._next_id += 1
        client, stock = rng.choice(CLIENTS), rng.choice(STOCKS)
        requested = rng.randrange(100, 1001, 10)
        n = rng.randint(*PURCHASES)
        if rng.random() < self.overfill_share:
            total = requested + rng.randrange(1, requested // 2 + 2)
        else:
            total = rng.randrange(n, requested + 1)
        cuts = sorted(rng.sample(range(1, total), n - 1)) if n > 1 and total > n else []
        parts = [b - a for a, b in zip([0] + cuts, cuts + [total])] if cuts else [total]
        self._open.append([order_id, client, stock, parts])
        return messages.purchase_request(order_id, requested, client, stock)

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        rng = self._rng
        if len(self._open) < self._open_target and (not self._open or rng.random() < 0.3):
            return self._new_order()
        i = rng.randrange(len(self._open))
        order = self._open[i]
        shares = order[3].pop()
        if not order[3]:
            self._open[i] = self._open[-1]
            self._open.pop()
        pid = self._next_id
        self._next_id += 1
        return messages.purchase(pid, order[0], shares, order[1], order[2])

    def take(self, n: int) -> list[bytes]:
        return [next(self) for _ in range(n)]


def orders_in(trades: int) -> int:
    """About how many orders (requests, each a book) `trades` of a generator's stream open: one in
    1 + the mean purchases of an order."""
    return round(trades / (1 + sum(PURCHASES) / 2))
