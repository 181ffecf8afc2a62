"""The 'batch' fsync policy off the event loop: group commit.

An fdatasync takes a millisecond to hundreds of them, and the event loop that waits for it
reads no datagram, sends no heartbeat and answers no vote meanwhile. With a BackgroundSync the
journal's append only writes; one fdatasync at a time runs on a thread of its own and covers
every record written before it began, and `on_durable(seq)` runs on the loop when it returns.
Appends that arrive meanwhile are covered by the next one, so the fsyncs per second stay
bounded by the disk, not by the message rate. The node sends what promises durability (an ack,
its own count towards a commit) from `on_durable`, never before.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


class BackgroundSync:
    def __init__(self, journal, on_durable: Callable[[int], None], on_error: Callable[[OSError], None]):
        self.journal = journal
        self.on_durable = on_durable
        self.on_error = on_error
        self.loop = asyncio.get_running_loop()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self.running = False
        self.wanted = False  # written while one ran: another is due when it returns
        journal.background = self

    def kick(self) -> None:
        """Records were written: make them durable as soon as the disk allows."""
        if self.running:
            self.wanted = True
            return
        self.running, self.wanted = True, False
        self.loop.run_in_executor(self.pool, self.journal.sync).add_done_callback(self._done)

    def _done(self, future: asyncio.Future) -> None:
        self.running = False
        if self.journal.background is not self:
            return  # closed: the node is stopping
        error = future.exception()
        if error is not None:
            self.on_error(error)  # the journal's durability is unknown: the node stops
            return
        self.on_durable(self.journal.durable_seq)
        if self.wanted:
            self.kick()

    def close(self) -> None:
        """Detach (the journal syncs inline again) once the running fsync is done."""
        self.journal.background = None
        self.pool.shutdown(wait=True)
