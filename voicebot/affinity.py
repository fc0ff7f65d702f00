"""Which call an LLM request belongs to, so every turn of a call lands where its prefix is cached.

The session core calls ``LlmEngine.generate`` without saying whose call it is (and must
not: it does not know which backend it has). Instead the session binds its id once, in
its main task (:func:`bind_session`); every task it spawns inherits the binding
(asyncio copies the context into each new task), and the engines read it with
:func:`current_session`:

- the remote backend (``voicebot/engines/llm/remote.py``) sends it as ``X-Session-ID``, the header
  vllm-router's session-affinity policies (``consistent_hash``, ``sticky_least_loaded``)
  route by (docs/scaling.md);
- the in-process engine with ``llm.data_parallel_size > 1`` pins the call to one
  data-parallel rank (:func:`rank_for`), the same idea inside one process.

A top-level module, so that the session (which binds) and the LLM backends (which read)
share one context variable without the engines importing anything of the session.
"""

from __future__ import annotations

import contextvars
import hashlib

_SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("voicebot_session_id", default=None)


def bind_session(session_id: str) -> contextvars.Token[str | None]:
    """Bind ``session_id`` to the current context (and the tasks it spawns from now on)."""
    return _SESSION_ID.set(session_id)


def current_session() -> str | None:
    """The session id bound in this context, or None (background work outside a call, tests)."""
    return _SESSION_ID.get()


def rank_for(session_id: str | None, size: int) -> int | None:
    """The data-parallel rank a call is pinned to; None lets vLLM balance (no session, or one rank).

    A stable hash (not ``hash()``, which is salted per process): every request of a
    call, and a call resumed by another frontend process, picks the same rank.
    """
    if size <= 1 or not session_id:
        return None
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % size
