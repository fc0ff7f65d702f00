"""A stand-in TTS for replies that are text only (Realtime ``output_modalities: ["text"]``).

A text-only reply must not pay for speech: no synthesis on the shared TTS workers, and
no real-time playout pacing before ``response.done``. The session gives such a reply
this engine instead of the real one; the reply's clauses go nowhere and its playout
stays empty, so it ends as soon as the LLM does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import numpy as np


class TextOnlyTts:
    """Satisfies :class:`voicebot.engines.tts.TtsEngine` and synthesises nothing."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    @property
    def queue_depth(self) -> int:
        return 0

    @property
    def failure_streak(self) -> int:
        return 0

    @property
    def last_error(self) -> BaseException | None:
        return None

    def voices(self) -> list[str]:
        return []

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        return
        yield  # an async generator that yields nothing
