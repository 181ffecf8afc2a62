"""Seeded loss injection on received datagrams, for tests, demos and drills (`--drop`)."""

from __future__ import annotations

import random


class LossInjector:
    """Drops a seeded fraction of received datagrams (0 = none)."""

    def __init__(self, fraction: float = 0.0, seed: int = 0):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"drop fraction {fraction} must be in [0, 1)")
        self.fraction = fraction
        self._rng = random.Random(seed)
        self.dropped = 0

    def drop(self) -> bool:
        if self.fraction and self._rng.random() < self.fraction:
            self.dropped += 1
            return True
        return False
