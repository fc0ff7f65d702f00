"""The one way a transport runs its connection's tasks, and closes its socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from voicebot.errors import VoicebotError
from voicebot.server.connection import Connection

# What a send or receive raises once the client is gone: WebSocketDisconnect (the
# server's ClientDisconnected, or the peer's close frame) for the first call to find
# it gone, WebSocketDisconnected (a RuntimeError) for every call after that one.
CLIENT_GONE = (WebSocketDisconnect, WebSocketDisconnected)


async def run_until_first_ends(
    conn: Connection, coros: dict[str, Coroutine[Any, Any, None]], *, reason: str
) -> None:
    """Run a connection's tasks (reader, writer, ...) until any one ends.

    The rest are cancelled and awaited (nothing outlives the connection), a task's
    error is raised, and the connection ends with ``reason`` unless a task gave another.
    A task that found the client gone (a send after it closed) ends the connection as
    a hang-up does: the client may close whenever it likes, so that is no error. Two
    tasks can find it in one step (the second gets WebSocketDisconnected), hence every
    done task is looked at, whichever comes first.
    """
    prefix = conn.call.id if conn.call is not None else conn.transport
    tasks = {asyncio.create_task(coro, name=f"{prefix}-{name}") for name, coro in coros.items()}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            with contextlib.suppress(*CLIENT_GONE):
                task.result()  # surface a transport error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        conn.end(reason)


async def refused_origin(ws: WebSocket, conn: Connection) -> bool:
    """A WebSocket from a browser page we do not serve is refused at the handshake (a
    close before accept: HTTP 403), counted; True when it was."""
    try:
        conn.check_origin()
    except VoicebotError as exc:
        await close_quietly(ws, conn.refuse(exc))
        return True
    return False


async def close_quietly(ws: WebSocket, code: int = 1000, reason: str = "") -> None:
    """Close a WebSocket that the client may already have closed.

    Starlette raises WebSocketDisconnect (the server's ClientDisconnected, an OSError)
    when the peer is gone and RuntimeError when we closed it already: a hang-up is the
    normal end of a call, never a traceback."""
    with contextlib.suppress(*CLIENT_GONE, RuntimeError, OSError):
        await ws.close(code, reason.encode()[:120].decode(errors="ignore"))  # at most 123 bytes
