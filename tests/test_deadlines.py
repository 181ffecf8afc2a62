"""Deadlines in the shells (runtime/process.py `within`): they time out and return as
asyncio.wait_for does, and never swallow a cancellation (Python 3.11's wait_for does)."""

import asyncio

import pytest

from tape.runtime.process import within


async def test_a_deadline_never_swallows_a_cancellation_that_comes_as_its_awaitable_completes():
    """wait_for returns the result here and the task goes on as if never told to stop (a process
    stopping as a link connected then waited for that link forever); `within` ends it cancelled."""
    done = asyncio.get_running_loop().create_future()

    async def link_task():
        await within(done, 5.0)
        return "went on"

    task = asyncio.create_task(link_task())
    await asyncio.sleep(0)  # it waits on `done`
    done.set_result("connected")
    task.cancel()  # the process stops as the connection completes
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_deadline_times_out_or_returns_what_it_awaited():
    with pytest.raises(TimeoutError):
        await within(asyncio.sleep(1), 0.01)
    assert await within(asyncio.sleep(0, "ok"), None) == "ok"
    assert await within(asyncio.sleep(0, "in time"), 1.0) == "in time"
