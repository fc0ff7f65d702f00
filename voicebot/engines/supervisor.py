"""Engine supervision: notice an engine that stopped working and bring it back.

Every ``poll_s`` the supervisor probes each engine (voicebot/engines/health.py). When
one fails:

1. its health turns ``failed`` with the reason (``/healthz`` answers 503 with it and
   new sessions are refused with it);
2. ``on_failure`` is called: the server ends every open session with an error event
   (each session uses every engine, and a call whose LLM or TTS is gone cannot go on);
3. the engine is closed and rebuilt from its specs, in place, without restarting the
   process: up to ``max_attempts`` tries with exponential backoff, each logged. Only
   when a new engine has started is it swapped in and the health set back to ``ok``;
   after the last failed try the health stays ``gave_up`` (an operator must act).

The policy is not in the YAML config yet: the defaults below suit both the CPU and
the GPU set-up (a vLLM restart takes seconds; five tries span about a minute).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voicebot.engines.health import FailureStreak, asr_counts, llm_failure, streak_failure
from voicebot.engines.registry import ENGINE_NAMES, Engines
from voicebot.engines.startup import reap_children, start_all

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    poll_s: float = 0.5
    """How often each engine is probed (the probes read flags and counters: cheap)."""
    failure_threshold: int = 5
    """ASR decodes / TTS sentences failed in a row that mark the engine as failed."""
    max_attempts: int = 5
    """Restarts tried before giving up."""
    backoff_s: float = 1.0
    """Wait after the first failed restart; doubled after each further one."""
    max_backoff_s: float = 30.0
    """Longest wait between two restarts."""

    def __post_init__(self) -> None:
        if not (self.poll_s > 0 and self.failure_threshold >= 1 and self.max_attempts >= 1):
            raise ValueError(f"invalid restart policy {self}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"invalid restart policy {self}")

    def delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class Supervisor:
    def __init__(
        self,
        engines: Engines,
        *,
        policy: RestartPolicy | None = None,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        self.engines = engines
        self.policy = policy or RestartPolicy()
        self.on_failure = on_failure or (lambda name, reason: None)
        self._streaks: dict[str, tuple[Any, FailureStreak]] = {}
        self._restarts: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ probes
    def probe(self, name: str) -> str | None:
        """Why engine ``name`` does not work, or None."""
        engine = getattr(self.engines, name)
        if name == "llm":
            return llm_failure(engine)
        threshold = self.policy.failure_threshold
        if name == "asr":
            return streak_failure("ASR decode", self._streak(name, engine, *asr_counts(engine)), threshold)
        streak = getattr(engine, "failure_streak", 0)
        return streak_failure("TTS synthesis", streak, threshold, getattr(engine, "last_error", None))

    def _streak(self, name: str, engine: Any, ok: int, failed: int) -> int:
        seen = self._streaks.get(name)
        if seen is None or seen[0] is not engine:  # a restarted engine counts afresh
            seen = self._streaks[name] = (engine, FailureStreak())
        return seen[1].update(ok, failed)

    def check(self) -> None:
        """Probe every healthy engine once; start the restart of any that failed."""
        for name in ENGINE_NAMES:
            if not self.engines.health[name].ok:
                continue  # already being restarted (or given up)
            reason = self.probe(name)
            if reason is not None:
                self._failed(name, reason)

    def _failed(self, name: str, reason: str) -> None:
        health = self.engines.health[name]
        health.set("failed", reason)
        log.error("engine %s failed: %s", name, reason)
        try:
            self.on_failure(name, health.describe())
        except Exception:
            log.exception("on_failure(%s)", name)
        if self.engines.specs is None:
            health.set("gave_up", f"{reason}; cannot be rebuilt (engines built without specs)")
            return
        self._restarts[name] = asyncio.create_task(self._restart(name), name=f"restart-{name}")

    # ---------------------------------------------------------------- restarts
    async def _restart(self, name: str) -> None:
        assert self.engines.specs is not None
        health, policy = self.engines.health[name], self.policy
        old = getattr(self.engines, name)
        try:
            await old.aclose()  # frees its memory and threads before a new one loads
        except Exception as exc:
            log.warning("closing the failed %s engine: %s", name, exc)
        await reap_children(1.0)  # a killed engine-core process is a zombie until someone waits for it
        last: BaseException | None = None
        for attempt in range(1, policy.max_attempts + 1):
            health.attempt = attempt
            health.set("restarting")
            log.warning("restarting engine %s (attempt %d/%d)", name, attempt, policy.max_attempts)
            new = getattr(self.engines.specs, name)()
            try:
                await start_all({name: new})  # closes `new` itself if it fails
            except Exception as exc:
                last = exc
                delay = policy.delay(attempt)
                log.error("restart of %s failed (attempt %d/%d): %s; next in %.1f s",
                          name, attempt, policy.max_attempts, exc, delay)
                if attempt < policy.max_attempts:
                    await asyncio.sleep(delay)
                continue
            setattr(self.engines, name, new)
            health.restarts += 1
            health.set("ok")
            log.warning("engine %s restarted (attempt %d)", name, attempt)
            return
        health.set("gave_up", f"{health.reason}; {policy.max_attempts} restarts failed, last: {last}")
        log.error("engine %s not restarted after %d attempts: giving up", name, policy.max_attempts)

    async def wait_restarts(self) -> None:
        """Wait for the restarts in progress (tests)."""
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)

    # ---------------------------------------------------------------- running
    async def run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(self.policy.poll_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="engine-supervisor")

    async def aclose(self) -> None:
        """Stop probing and cancel restarts in progress (a restart being built is aborted)."""
        tasks = [t for t in (self._task, *self._restarts.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._restarts.clear()
