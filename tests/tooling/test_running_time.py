"""The test waits' running-time limit (tests/running_time.py): a stall of the whole
event loop is not counted, the time the loop ran is."""

from __future__ import annotations

import asyncio
import time

import pytest
from running_time import running_clock, until


async def test_a_blocked_loop_is_not_counted_and_a_running_one_is() -> None:
    async with running_clock() as clock:
        await asyncio.sleep(0.2)  # the ticker runs
        time.sleep(1.0)  # noqa: ASYNC251 (on purpose: the loop stands still, as a starved process's does)
        await asyncio.sleep(0.2)
        assert clock.stalled >= 0.9
        assert clock.wall() >= 1.3
        assert clock.elapsed() <= clock.wall() - 0.9


async def test_a_condition_never_met_fails_with_what_was_awaited() -> None:
    with pytest.raises(AssertionError, match="timed out waiting for the reply"):
        await until(lambda: False, 0.2, "the reply")


async def test_a_coroutine_condition_is_awaited_and_its_value_returned() -> None:
    calls = []

    async def ready() -> str | None:
        calls.append(1)
        return "yes" if len(calls) >= 3 else None

    assert await until(ready, 5.0, "ready") == "yes"
