"""The one way a transport runs its connection's tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from voicebot.session.session import Session


async def run_until_first_ends(
    session: Session, coros: dict[str, Coroutine[Any, Any, None]], *, reason: str
) -> None:
    """Run a connection's tasks (reader, writer, ...) until any one ends.

    The rest are cancelled and awaited (nothing outlives the connection), a task's
    error is raised, and the session learns why it is closing unless it already knows.
    """
    tasks = {asyncio.create_task(coro, name=f"{session.id}-{name}") for name, coro in coros.items()}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # surface a transport error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        if session.closed_reason is None:
            session.closed_reason = reason
