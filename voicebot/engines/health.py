"""Whether each engine works: its health record and the probes that decide it.

Existence is not health: a vLLM engine whose engine-core process died still exists,
and so does a TTS engine whose every synthesis raises. The probes look at what each
engine really does:

- LLM: vLLM's ``errored`` flag (its engine-core process exited, or its output
  handler stopped).
- ASR and TTS: consecutive failed calls. One bad sentence or decode is that call's
  error; ``threshold`` failures in a row, with no success in between, is the engine's.

Probes are cheap reads (no model call), so the supervisor can run them often.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

State = Literal["ok", "failed", "restarting", "gave_up"]


@dataclass
class EngineHealth:
    name: str
    state: State = "ok"
    reason: str | None = None
    attempt: int = 0  # restart attempt in progress (or the last one made)
    restarts: int = 0  # successful restarts since the server started
    since: float = field(default_factory=time.monotonic)

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def set(self, state: State, reason: str | None = None) -> None:
        self.state, self.since = state, time.monotonic()
        if reason is not None or state == "ok":
            self.reason = reason

    def describe(self) -> str:
        what = {"failed": "failed", "restarting": f"restarting, attempt {self.attempt}", "gave_up": "not restarted"}
        return f"{self.name}: {self.reason} ({what.get(self.state, self.state)})"

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "state": self.state,
            "reason": self.reason,
            "restarts": self.restarts,
            "for_s": round(time.monotonic() - self.since, 1),
        }


def llm_failure(llm: Any) -> str | None:
    """Why the vLLM engine cannot serve, or None (LlmEngine.dead_reason: vLLM's errored flag)."""
    return llm.dead_reason  # type: ignore[no-any-return]


class FailureStreak:
    """Failed calls in a row, from an engine's cumulative ok / failed counters."""

    def __init__(self) -> None:
        self._ok: int | None = None
        self._base = 0

    def update(self, ok: int, failed: int) -> int:
        if ok != self._ok:  # a success since the last look: the streak starts over
            self._ok, self._base = ok, failed
        return failed - self._base


def asr_counts(asr: Any) -> tuple[int, int]:
    s = asr.stats
    return s.partial_decodes + s.final_decodes, s.failed_decodes


def streak_failure(name: str, streak: int, threshold: int, last_error: object = None) -> str | None:
    if streak < threshold:
        return None
    tail = f" (last: {last_error})" if last_error else ""
    return f"{streak} {name} calls failed in a row{tail}"
