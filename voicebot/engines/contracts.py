"""What each stage offers the call: one contract per engine kind, and the values they carry.

A call sees its engines only through these ``Protocol``s (``registry.Engines`` is typed
with them), so a backend is anything that has their methods: the registry picks it from
``asr.backend``, ``llm.backend`` and ``tts.engine`` / ``tts.backend``, and tests use fakes
of the same shape. Like LiveKit Agents' ``stt.STT`` / ``RecognizeStream``, a shared engine
hands each call its own stream (``Asr.stream()``, ``Vad.stream()``); the LLM and TTS are
stateless per request.

- :class:`Asr` / :class:`AsrStream`: streaming speech recognition (``push`` audio, partial
  hypotheses by ``async for``, ``finalize`` the turn, ``reset``, ``aclose``).
- :class:`Llm`: token-id prompts in, text deltas out, in two priority lanes; ``warm``
  prefills a prompt into the prefix cache, ``complete`` collects a whole reply.
- :class:`Tts`: text in, float32 audio chunks out (one or more per sentence).
- :class:`Vad` / :class:`VadStream`: speech probabilities per 32 ms window.
- :class:`EndOfTurn`: whether a turn's audio sounds finished (Smart Turn).

This module imports no engine: every backend imports it, never the other way round.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

# --- speech recognition ---------------------------------------------------------------

# Tokens Whisper glues to the previous word without a space ("man." "John's" "to-").
_GLUE_START = frozenset(".,?!:;%)]}'\"-…")


def join_text(left: str, right: str) -> str:
    """Join two pieces of transcript, gluing leading punctuation to the left piece."""
    left, right = left.strip(), right.strip()
    if not left or not right:
        return left or right
    if right[0] in _GLUE_START:
        return left + right
    return f"{left} {right}"




@dataclass(frozen=True)
class Transcript:
    """A final: the text of the audio given, its length and the decode time (seconds)."""

    text: str
    audio_s: float
    decode_s: float


@dataclass(frozen=True)
class Partial:
    """A hypothesis while the caller speaks: words confirmed by consecutive decodes (they
    do not change any more), the tentative rest, and how much audio it saw."""

    confirmed: str
    tentative: str
    audio_s: float

    @property
    def text(self) -> str:
        return join_text(self.confirmed, self.tentative)


@dataclass
class AsrStats:
    """An ASR engine's decode counters (the supervisor's health probe reads them)."""

    partial_decodes: int = 0
    final_decodes: int = 0
    dropped_partials: int = 0
    failed_decodes: int = 0
    # Partials stopped while running because the final superseded them (or their
    # utterance or stream ended): the decode's remaining stages were skipped.
    abandoned_partials: int = 0


class AsrStream(Protocol):
    """One call's utterance on the shared ASR engine. Event loop only."""

    @property
    def buffered_s(self) -> float:
        """Seconds of audio held for the open utterance."""
        ...

    def push(self, audio: np.ndarray) -> None:
        """Append 16 kHz mono float32 audio; partial decodes follow on their own."""
        ...

    def request_partial(self, covering_s: float | None = None) -> None:
        """Decode now rather than at the next interval (the caller just went quiet)."""
        ...

    async def finalize(self, covering_s: float | None = None) -> Transcript:
        """The transcript of the whole buffered utterance; ``covering_s``: where speech
        ended, so that a partial that saw that much may serve as the final."""
        ...

    def reset(self) -> None:
        """Drop the utterance (a new turn starts); results of older audio are dropped."""
        ...

    async def aclose(self) -> None:
        """End the stream: its queued decodes fail, its iteration ends."""
        ...

    def __aiter__(self) -> AsyncIterator[Partial]:
        """The partial hypotheses, newest superseding the oldest when nobody reads."""
        ...


class Asr(Protocol):
    """The shared speech recogniser: one per server, a stream per call."""

    stats: AsrStats

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    @property
    def queue_depth(self) -> int:
        """Decodes waiting for a decode slot."""
        ...

    def stream(self, *, language: str | None = None) -> AsrStream:
        """A new per-call stream; ``language=None`` means the configured one."""
        ...

    async def transcribe(self, audio: np.ndarray, *, language: str | None = None) -> Transcript:
        """One-shot decode of a whole clip at final priority."""
        ...


# --- language model -------------------------------------------------------------------


class Lane(enum.Enum):
    """A request's priority class: a live turn, or work the caller never waits for
    (summaries, prefills), which runs at a lower priority and under its own cap."""

    INTERACTIVE = "interactive"
    BACKGROUND = "background"


@dataclass(frozen=True)
class TextDelta:
    """New text of a streamed reply and the token ids that made it."""

    text: str
    token_count: int
    token_ids: tuple[int, ...] = ()


@dataclass
class GenerationStats:
    """What one request cost; filled in while it streams."""

    request_id: str
    lane: Lane
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # The engine has said how many prompt tokens its prefix cache held (in-process: with
    # the first output; a remote tier: in the usage block after the last token).
    cached_known: bool = False
    output_tokens: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    # A prefill of the history (Llm.warm): left out of the engine's totals (the replies'
    # cache hit ratio), and a remote one is tried once and never counts towards the
    # tier's failures.
    best_effort: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at


class Llm(Protocol):
    """The shared language model. Cancelling a consumer of :meth:`generate` (or closing
    the iterator early) aborts its request and re-raises."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (prompts are token ids built by the caller)."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block: a prefix cache keeps whole blocks only."""
        ...

    @property
    def keeps_prefills(self) -> bool:
        """Whether a prefix cache keeps what a background prefill (:meth:`warm`) computes:
        without one a prefill is thrown away and only costs time."""
        ...

    @property
    def cache_hit_ratio(self) -> float:
        """Prompt tokens served from the prefix cache over all replies' prompt tokens."""
        ...

    @property
    def running(self) -> int:
        """Requests under way."""
        ...

    @property
    def background_waiting(self) -> int:
        """Background requests waiting for a background slot."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve now, or None (the health probe)."""
        ...

    def unfinished_requests(self) -> int:
        """Requests the backend itself still tracks (an abort brings this to 0)."""
        ...

    def generate(
        self,
        prompt_ids: list[int],
        *,
        lane: Lane = Lane.INTERACTIVE,
        max_tokens: int | None = None,
        temperature: float | None = None,
        stop: list[str] | None = None,
        min_tokens: int = 0,
        stats: GenerationStats | None = None,
        request_id: str | None = None,
        structured_outputs: Any = None,
        logit_bias: dict[int, float] | None = None,
        skip_special_tokens: bool = True,
    ) -> AsyncGenerator[TextDelta, None]:
        """Stream text deltas for a tokenised prompt (``stats`` is filled in on the way)."""
        ...

    async def warm(
        self, prompt_ids: list[int], cached: int = 0, on_piece: Callable[[int], None] | None = None
    ) -> None:
        """Prefill ``prompt_ids`` at background priority so the next prompt that starts
        with them finds them cached (best effort)."""
        ...

    async def complete(self, prompt_ids: list[int], **kwargs: Any) -> str:
        """A whole reply (``generate``'s keywords)."""
        ...


# --- speech synthesis -----------------------------------------------------------------


class Tts(Protocol):
    """The shared synthesiser. Iterate :meth:`synthesize` inside
    ``contextlib.aclosing(...)`` (or in a task you cancel): stopping early then drops its
    queued work at once."""

    sample_rate: int
    """Native rate of the produced audio (Hz)."""

    async def start(self) -> None:
        """Load models (in a thread) and start the workers."""
        ...

    async def aclose(self) -> None:
        """Drop queued work, wait for running work, stop the workers."""
        ...

    @property
    def queue_depth(self) -> int:
        """Sentences waiting for a synthesis slot."""
        ...

    @property
    def failure_streak(self) -> int:
        """Syntheses that failed in a row (the health probe)."""
        ...

    @property
    def last_error(self) -> BaseException | None:
        """The latest synthesis failure, if any."""
        ...

    def voices(self) -> list[str]:
        """Voice names accepted by ``synthesize(voice=...)``."""
        ...

    def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        """Float32 mono chunks at ``sample_rate``, at least one per sentence, each as soon
        as it is ready. Raises CapacityError when the engine's queue is full, EngineError
        when synthesis fails. Empty or unspeakable text yields nothing.

        ``ahead_s``: seconds of the reply's audio the caller will hear before this text's
        (0: a reply's first clause, which the caller waits for in silence). An engine that
        queues many sessions' work serves the text whose audio is needed soonest first
        (Kokoro's batcher, through the TTS service too); the others may ignore it."""
        ...


@runtime_checkable
class BatchedTts(Protocol):
    """A :class:`Tts` that puts many calls' clauses into one forward (Kokoro's batcher)."""

    def forward_stats(self) -> dict[str, float]:
        """Its recent forwards: ``forward_ms_p50``, ``forward_ms_p95`` (a batch's wall
        time) and ``forward_rows_mean`` (its clauses), and what else it times (Kokoro: its
        forwards' phases, its clauses' wait in its queue); empty before the first."""
        ...


@runtime_checkable
class SeveralServices(Protocol):
    """A stage whose work goes to several shared services (``tts.remote.urls``): one may be
    left out while the others carry its work, which no failure count shows."""

    def services_down(self) -> list[str]:
        """The services left out of new work now (their connection failed lately)."""
        ...


# --- voice activity and end of turn ---------------------------------------------------


class VadStream(Protocol):
    """One call's voice-activity state."""

    def process(self, audio16k: np.ndarray) -> np.ndarray:
        """Speech probabilities, one per complete window (may be empty)."""
        ...

    def reset(self) -> None: ...


class Vad(Protocol):
    """The shared voice-activity model."""

    def stream(self) -> VadStream: ...


class EndOfTurn(Protocol):
    """The shared end-of-turn model (Smart Turn)."""

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        """P(the turn is finished) for a turn's audio ending now, computed off the caller's thread."""
        ...

    def close(self) -> None: ...
