"""Graceful shutdown: stop admitting, let replies finish, end every session with a reason.

On SIGTERM/SIGINT (voicebot/server/http_server.py) the server drains before it stops:

1. ``state.draining``: ``/healthz`` answers 503 "draining" (a load balancer takes the
   instance out) and new sessions are refused with code ``draining``;
2. each session is ended as soon as it is not speaking a reply, and at the latest
   after ``server.drain_timeout_s``: a fatal ``server_shutdown`` error event, which
   every transport turns into its own way of hanging up (WebSocket close, Twilio
   stream end, WebRTC close);
3. once the transports have let go of the sessions (or, after a short grace, the
   drain has closed the sessions itself) the caller stops the HTTP server; the
   lifespan then closes the engines.
"""

from __future__ import annotations

import asyncio
import logging

from voicebot.server.state import ServerState
from voicebot.session.session import Session

log = logging.getLogger(__name__)

SHUTDOWN_CODE = "server_shutdown"
# After a session was told to end: time for its transport to send the error and close.
_HANGUP_GRACE_S = 3.0
_POLL_S = 0.05


def replying(session: Session) -> bool:
    """Whether the session is speaking a reply (released to the caller, not finished)."""
    return session.replying


def end_session(session: Session, message: str) -> None:
    if session.closed_reason is None:
        session.error(SHUTDOWN_CODE, message, fatal=True)


async def drain(state: ServerState, timeout_s: float) -> None:
    """Drain ``state``; returns when no session is left (or the grace after the timeout ran out)."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    log.warning("draining: %d session(s) open, up to %.1f s for replies in progress",
                len(state.sessions), timeout_s)
    while state.sessions:
        late = loop.time() >= deadline
        for session in list(state.sessions.values()):
            if late or not replying(session):
                end_session(session, "the server is shutting down")
        if late:
            break
        await asyncio.sleep(_POLL_S)
    grace = loop.time() + _HANGUP_GRACE_S
    # Polled: sessions leave state.sessions from each transport's own task.
    while state.sessions and loop.time() < grace:  # noqa: ASYNC110
        await asyncio.sleep(_POLL_S)
    if not state.sessions:
        log.info("drained: no session left")
        return
    # A transport that did not let go (a client that stopped reading leaves its sends
    # hanging): end the sessions themselves, so their engine work stops here and now.
    left = list(state.sessions.values())
    log.warning("drain: %d session(s) not closed by their transport; closing them", len(left))
    await asyncio.gather(*(s.aclose(SHUTDOWN_CODE) for s in left), return_exceptions=True)
