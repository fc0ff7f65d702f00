"""What a call's parts use of the call that owns them.

The listener (the caller's audio and turns), the speaker (the live reply and its pacing)
and the background work (prefills, summaries) are parts of one call
(:class:`voicebot.session.session.Session`) and act through it: they feed its core, emit
its events and spawn its tasks. :class:`Call` names what they share and each part adds what
only it uses beside itself, so no part imports the session: it is the one module that knows
them all. Members are read-only properties, so the session may hold narrower types.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from voicebot.config import Config
    from voicebot.core import CallCore
    from voicebot.core import events as ce
    from voicebot.engines.registry import Engines
    from voicebot.metrics import Metrics
    from voicebot.session.clock import Clock
    from voicebot.session.events import SessionEvent
    from voicebot.session.observer import AudioTap
    from voicebot.session.settings import SessionSettings


class Call(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def cfg(self) -> Config: ...
    @property
    def settings(self) -> SessionSettings: ...
    @property
    def engines(self) -> Engines: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]: ...
    @property
    def metrics(self) -> Metrics | None: ...
    @property
    def core(self) -> CallCore: ...
    @property
    def audio_tap(self) -> AudioTap | None: ...

    @property
    def started(self) -> bool:
        """Its tasks can be spawned."""

    @property
    def closing(self) -> bool:
        """No new work is taken on."""

    def feed(self, event: ce.Event) -> list[ce.Action]:
        """Tell the core what happened and run what it decides."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, *, guard: bool = True) -> asyncio.Task[Any]:
        """Run ``coro`` as one of the call's tasks, cancelled when it closes."""

    def emit(self, event: SessionEvent) -> None:
        """Send ``event`` to the client."""
