"""What a session tells its transport. Transports translate these to their wire format.

Every event is a small frozen dataclass; a transport matches on the type. Audio
travels as float32 numpy arrays at ``sample_rate``; each transport resamples once to
its wire rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from voicebot.tools.spec import ToolCall


@dataclass(frozen=True)
class SpeechStarted:
    audio_ms: int  # position in the session's input audio
    item_id: str


@dataclass(frozen=True)
class SpeechStopped:
    audio_ms: int
    item_id: str


@dataclass(frozen=True)
class TranscriptPartial:
    item_id: str
    confirmed: str  # never changes once sent
    tentative: str

    @property
    def text(self) -> str:
        return " ".join(p for p in (self.confirmed, self.tentative) if p)


@dataclass(frozen=True)
class TranscriptFinal:
    item_id: str
    text: str


@dataclass(frozen=True)
class ResponseStarted:
    response_id: str
    item_id: str


@dataclass(frozen=True)
class ResponseTextDelta:
    response_id: str
    item_id: str
    text: str


@dataclass(frozen=True, eq=False)
class ResponseAudio:
    response_id: str
    item_id: str
    audio: np.ndarray
    sample_rate: int


@dataclass(frozen=True)
class ResponseAudioStarted:
    response_id: str
    item_id: str


@dataclass(frozen=True)
class ResponseDone:
    response_id: str
    item_id: str
    status: Literal["completed", "cancelled", "interrupted", "failed"]
    text: str  # what the caller heard: the whole reply, or the part played before a cut
    full_text: str  # everything the model generated
    played_ms: int
    # The LLM's finish reason ("length": cut at max_tokens) and token counts; protocols
    # that report them (OpenAI Realtime: status "incomplete", usage) read these.
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: tuple[ToolCall, ...] = ()  # the function calls the reply made (after its speech)
    cached_tokens: int = 0  # prompt tokens vLLM's prefix cache already held


@dataclass(frozen=True)
class ToolCallStarted:
    """The model began a function call (its name is known; arguments follow)."""

    response_id: str
    item_id: str  # the call's own item, after the reply's message item
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    response_id: str
    item_id: str
    call_id: str
    delta: str


@dataclass(frozen=True)
class ToolCallDone:
    response_id: str
    call: ToolCall


@dataclass(frozen=True)
class ToolResult:
    """A server-side tool answered (or failed: ``output`` is then an error object)."""

    call_id: str
    name: str
    output: str


@dataclass(frozen=True)
class BargeIn:
    response_id: str
    played_ms: int
    heard_text: str


@dataclass(frozen=True)
class ReplyTruncated:
    """A client said how much of a reply its caller heard (Realtime
    ``conversation.item.truncate``), often after the reply ended on the server's side:
    told to the call's observer only, the client already knows."""

    response_id: str
    item_id: str
    played_ms: int
    heard_text: str


@dataclass(frozen=True)
class TurnTimings:
    """Per-turn stage latencies in milliseconds (None where a stage did not happen)."""

    response_id: str
    endpointing_ms: float | None = None  # end of speech -> end-of-turn decision
    asr_final_ms: float | None = None  # finalize() call -> final transcript
    llm_ttft_ms: float | None = None
    first_clause_ms: float | None = None  # LLM request -> first clause cut
    tts_first_audio_ms: float | None = None  # first clause -> its first audio
    voice_to_voice_ms: float | None = None  # end of user speech -> first reply audio sent
    # Known at the first audio only where the engine said so by then (in-process vLLM);
    # a remote tier reports them with its last chunk: None here, the counts in response.done.
    cached_prompt_tokens: int | None = None
    prompt_tokens: int | None = None
    speculative: bool = False


@dataclass(frozen=True)
class Dtmf:
    digit: str


@dataclass(frozen=True)
class ErrorEvent:
    code: str
    message: str
    event_id: str | None = None
    fatal: bool = False


SessionEvent = (
    SpeechStarted
    | SpeechStopped
    | TranscriptPartial
    | TranscriptFinal
    | ResponseStarted
    | ResponseTextDelta
    | ResponseAudioStarted
    | ResponseAudio
    | ResponseDone
    | ToolCallStarted
    | ToolCallArgumentsDelta
    | ToolCallDone
    | ToolResult
    | BargeIn
    | ReplyTruncated
    | TurnTimings
    | Dtmf
    | ErrorEvent
)
