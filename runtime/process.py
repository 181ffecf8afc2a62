"""Running a node process: the asyncio loop, signals, and fail-stop.

Every role's runtime is a `NodeProcess`. A core that finds its own state
impossible raises `InvariantViolation`; wherever that surfaces in the shell
(a task, a reader callback, a connection handler, the main coroutine), the
process logs one CRITICAL line and stops with exit 4, which systemd does
not restart (`RestartPreventExitStatus=4`): an operator looks first. A
damaged journal record met while serving stops it with exit 5, which
systemd restarts: the start-up cuts the journal at the damage
(runtime/storage/journal_repair.py). Any
other exception that escapes a task or callback is a bug: CRITICAL with its
traceback, exit 1 (systemd restarts it). A silently dead task would leave a
process that looks alive and does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Coroutine, TypeVar

from tape.protocol.errors import InvariantViolation
from tape.protocol.linkauth import ANY_LISTENER
from tape.runtime import links
from tape.runtime.exits import EXIT_INTERNAL_ERROR, EXIT_INVARIANT, EXIT_JOURNAL_DAMAGED, EXIT_OK  # noqa: F401
from tape.runtime.settings import Config, NodeSettings
from tape.runtime.storage.journal_store import JournalCorruption
from tape.runtime.tuning import CONNECT_TIMEOUT_S

T = TypeVar("T")


class NodeProcess:
    """Base of the role runtimes: `main()` runs until `stop` is set."""

    METRICS_PREFIX = "tape_node"  # each role names its own

    def __init__(self, cfg: Config, node: NodeSettings, log: logging.Logger):
        self.cfg = cfg
        self.node = node
        self.name = node.name
        self.log = log
        self.failed: str | None = None
        self.exit_code = EXIT_OK
        self.stop = asyncio.Event()
        self.link_refused: dict[str, int] = {}  # TCP links refused by authentication, by reason

    def report(self):
        """Metric samples (tape.runtime.metrics): (name, kind, help, value[, label])."""
        return iter(())

    async def open_link(self, host: str, port: int, keys, timeout: float = CONNECT_TIMEOUT_S,
                        peer: bytes = ANY_LISTENER):
        """A TCP connection to `peer` (its wire name, or a shared key's holder), authenticated when
        `keys` (runtime/links.py)."""
        return await links.connect(host, port, keys, self.link_refused, timeout, peer)

    async def serve_links(self, handler, keys, host: str, port: int, peers=(), tls=None) -> asyncio.Server:
        """A TCP server that hands `handler` only authenticated connections (runtime/links.py);
        `peers`: the nodes that connect to it, whose addresses have slots of their own. `tls`
        (without keys): an ssl.SSLContext, each handshake done before `handler` is called."""
        addresses = frozenset(n.host for n in peers if n.host not in ("", "0.0.0.0"))
        return await links.start_server(links.serving(handler, keys, self.link_refused, addresses), host, port, tls)

    def metrics(self):
        """The role's report and what every node reports."""
        yield from self.report()
        yield "link_refused", "counter", "TCP links closed by authentication (handshake or record), by reason", \
            self.link_refused

    async def main(self) -> None:
        raise NotImplementedError

    # --- fail-stop ---------------------------------------------------------------------

    def fail(self, why: str, code: int = EXIT_INVARIANT, exc: BaseException | None = None) -> None:
        """Stop the process: its state (or its code) cannot be trusted to go on."""
        if self.failed is None:
            self.failed = why
            self.exit_code = code
            self.log.critical("%s: %s; stopping (exit %d)", self.name, why, code, exc_info=exc)
        self.stop.set()

    def unhandled(self, exc: BaseException) -> None:
        if isinstance(exc, InvariantViolation):
            self.fail(f"impossible state: {exc}")
        elif isinstance(exc, JournalCorruption):
            self.fail(f"{exc}; a restart cuts the journal there and recovers the rest from the other voters",
                      EXIT_JOURNAL_DAMAGED)
        else:
            self.fail(f"internal error: {exc!r}", EXIT_INTERNAL_ERROR, exc)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A background task whose death by an exception stops the process."""
        task = asyncio.ensure_future(coro)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.unhandled(task.exception())

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if exc is None or isinstance(exc, (asyncio.CancelledError, ConnectionError)):
            loop.default_exception_handler(context)
            return
        self.unhandled(exc)

    # --- running -------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped (SIGTERM, SIGINT, or a failure); returns the exit code."""
        asyncio.run(self._run())
        return self.exit_code

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_exception)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        try:
            await self.main()
        except InvariantViolation as e:
            self.fail(f"impossible state: {e}")


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """`await aw`, or TimeoutError after `seconds` (None: no limit). asyncio.timeout, not
    wait_for: Python 3.11's wait_for can swallow a cancellation that arrives as `aw` completes,
    and a task told to stop then goes on (seen: a leader failing as it began to lead hung in its
    shutdown, its link task having connected instead of stopping; uvloop, whose connections
    complete sooner, made it likely, docs/decisions.md)."""
    async with asyncio.timeout(seconds):
        return await aw
