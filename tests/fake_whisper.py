"""A scripted Whisper behind our own ``WhisperRunner`` seam (voicebot/engines/asr/vllm_whisper.py),
shared by the vLLM-backend tests and the ASR-service tests: no GPU, no model."""

from __future__ import annotations

import asyncio

import numpy as np

from voicebot.audio import ASR_RATE

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
WAIT = 5.0


class FakeWhisper:
    """Scripted Whisper: the text for N seconds of audio is WORDS[: 2N]."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []
        self.started = asyncio.Event()  # a decode began
        self.hold: asyncio.Event | None = None  # set: decodes wait for it
        self.aborted: list[str] = []
        self.closed = False

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True

    def prompt_ids(self, language: str | None, prefix: str) -> list[int]:
        # 4 task tokens, then one "token" per prefix word (the word's index + 100).
        return [1, 2, 3, 4] + [100 + WORDS.index(w) for w in prefix.split()]

    async def decode(
        self,
        request_id: str,
        audio: np.ndarray,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int,
        priority: int,
        temperature: float = 0.0,
    ) -> str:
        self.calls.append(
            {"rid": request_id, "audio_s": audio.size / ASR_RATE, "prompt": prompt_ids,
             "priority": priority, "max_tokens": max_tokens, "temperature": temperature}
        )
        self.started.set()
        try:
            if self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        words = WORDS[: int(audio.size / ASR_RATE * 2)]
        done = len(prompt_ids) - 4
        return "".join(" " + w for w in words[done:])


def audio(seconds: float) -> np.ndarray:
    return np.full(int(seconds * ASR_RATE), 0.01, dtype=np.float32)


class LoopingWhisper(FakeWhisper):
    """Falls into Whisper's repetition loop when greedy: after the words the audio holds,
    it repeats its last three until its token budget ends (one word a token). With
    ``loops_when_sampling`` it loops at every temperature."""

    def __init__(self, loops_when_sampling: bool = False) -> None:
        super().__init__()
        self.loops_when_sampling = loops_when_sampling

    async def decode(self, request_id: str, audio: np.ndarray, prompt_ids: list[int], **kw: object) -> str:
        text = await super().decode(request_id, audio, prompt_ids, **kw)  # type: ignore[arg-type]
        if kw.get("temperature", 0.0) and not self.loops_when_sampling:
            return text
        words = text.split()
        loop = words[-3:]
        while len(words) < int(kw["max_tokens"]):  # type: ignore[call-overload]
            words += loop
        return "".join(" " + w for w in words[: int(kw["max_tokens"])])  # type: ignore[call-overload]
