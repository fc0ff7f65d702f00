"""OpenAI Realtime wire format: client events as pydantic models, server events as builders.

Pure and synchronous: :func:`load_json` + :func:`validate_client_event` turn a text frame
into a typed event (or raise :class:`RealtimeRequestError`); the builders return server
event dicts without ``event_id`` (the translator stamps one on each).

Two naming families share one set of builders (:data:`GA`, :data:`BETA`): the GA API
says ``response.output_audio.delta`` / ``conversation.item.added`` where the beta said
``response.audio.delta`` / ``conversation.item.created``. Client event names are the same
in both; the session *fields* differ (GA nests ``audio.input.format``, beta has flat
``input_audio_format``), and both are accepted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from voicebot.errors import BadMessage
from voicebot.server import edge

AudioFormat = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
PCM_RATE = 24_000  # the only PCM rate the Realtime API defines
# OpenAI takes up to 15 MiB of audio in one input_audio_buffer.append: base64 makes that
# 20 MiB of text, plus the event's own fields. A frame up to this size reaches the
# handler, which answers one over server.max_message_bytes with an error event.
MAX_FRAME_BYTES = (20 << 20) + (64 << 10)
# OpenAI's voice names: accepted and mapped to our TTS's default voice.
OPENAI_VOICES = frozenset(
    ["alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar", "fable", "onyx", "nova"]
)
_BETA_FORMATS: dict[str, AudioFormat] = {
    "pcm16": "audio/pcm",
    "g711_ulaw": "audio/pcmu",
    "g711_alaw": "audio/pcma",
}
# Flat session fields only beta clients send; seeing one switches a session to beta names.
BETA_SESSION_FIELDS = frozenset(
    {"input_audio_format", "output_audio_format", "turn_detection", "input_audio_transcription",
     "modalities", "voice", "max_response_output_tokens"}
)


class RealtimeRequestError(BadMessage):
    """A client event we cannot accept. ``param`` names the offending field, as OpenAI's
    ``error.param`` does (a BadMessage, so the shared error hierarchy still covers it)."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message, code=code)
        self.param = param


# ------------------------------------------------------------------ client events
# Lenient (extra="ignore"): clients send fields we do not implement (tools, tracing,
# noise_reduction...); rejecting them would break clients none of us wrote.
_LENIENT = ConfigDict(extra="ignore")


class FormatIn(BaseModel):
    model_config = _LENIENT
    type: str = "audio/pcm"
    rate: int | None = None


Eagerness = Literal["low", "medium", "high", "auto"]


class TurnDetectionIn(BaseModel):
    model_config = _LENIENT
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    prefix_padding_ms: int | None = Field(None, ge=0, le=5000)
    silence_duration_ms: int | None = Field(None, ge=0, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    eagerness: Eagerness | None = None  # semantic_vad
    # server_vad: reply on its own after this long without speech (null: never).
    idle_timeout_ms: int | None = Field(None, ge=0, le=3_600_000)


class AudioInputIn(BaseModel):
    model_config = _LENIENT
    format: FormatIn | None = None
    turn_detection: TurnDetectionIn | None = None
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None  # accepted and echoed; no denoiser runs


class AudioOutputIn(BaseModel):
    model_config = _LENIENT
    format: FormatIn | None = None
    voice: str | dict[str, Any] | None = None
    speed: float | None = Field(None, ge=0.25, le=4.0)


class AudioIn(BaseModel):
    model_config = _LENIENT
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class SessionIn(BaseModel):
    """GA fields and the beta's flat ones; ``model_fields_set`` tells absent from null."""

    model_config = _LENIENT
    # "transcription": ASR only (transcription events, never a reply).
    type: Literal["realtime", "transcription"] | None = None
    instructions: str | None = Field(None, max_length=20_000)
    output_modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioIn | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    # Function tools, GA and beta alike (TOOLS: parsed in realtime_tools.py).
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    # beta
    modalities: list[Literal["text", "audio"]] | None = None
    input_audio_format: str | None = None
    output_audio_format: str | None = None
    turn_detection: TurnDetectionIn | None = None
    input_audio_transcription: dict[str, Any] | None = None
    input_audio_noise_reduction: dict[str, Any] | None = None
    voice: str | dict[str, Any] | None = None
    speed: float | None = Field(None, ge=0.25, le=4.0)
    max_response_output_tokens: int | Literal["inf"] | None = None


class _ClientEvent(BaseModel):
    model_config = _LENIENT
    event_id: str | None = Field(None, max_length=512)


class SessionUpdate(_ClientEvent):
    type: Literal["session.update"]
    session: SessionIn


class AudioAppend(_ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(_ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class ContentIn(BaseModel):
    model_config = _LENIENT
    type: str = "input_text"
    text: str | None = None
    transcript: str | None = None
    audio: str | None = None


class ItemIn(BaseModel):
    model_config = _LENIENT
    id: str | None = Field(None, max_length=64)
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system"] | None = None  # required for a message (checked below)
    content: list[ContentIn] = Field(default_factory=list, max_length=64)
    # function_call / function_call_output items (TOOLS: realtime_tools.py)
    call_id: str | None = Field(None, max_length=64)
    name: str | None = Field(None, max_length=64)
    arguments: str | None = Field(None, max_length=100_000)
    output: str | None = Field(None, max_length=200_000)

    @model_validator(mode="after")
    def _message_has_role(self) -> ItemIn:
        if self.type == "message" and self.role is None:
            raise ValueError("a message item needs a role (user, assistant or system)")
        return self


class ItemCreate(_ClientEvent):
    type: Literal["conversation.item.create"]
    item: ItemIn
    previous_item_id: str | None = None


class ItemTruncate(_ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(0, ge=0)
    audio_end_ms: int = Field(..., ge=0)


class ItemDelete(_ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class OutputAudioClear(_ClientEvent):
    """WebRTC/SIP in OpenAI's docs; accepted on the WebSocket too (see docs/realtime.md)."""

    type: Literal["output_audio_buffer.clear"]


class ResponseCreate(_ClientEvent):
    type: Literal["response.create"]
    response: dict[str, Any] | None = None  # per-response overrides: accepted, not applied


class ResponseCancel(_ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Annotated[
    SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ItemTruncate
    | ItemDelete | ItemRetrieve | OutputAudioClear | ResponseCreate | ResponseCancel,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
CLIENT_EVENT_TYPES = frozenset(
    m.model_fields["type"].annotation.__args__[0]  # type: ignore[union-attr]
    for m in (SessionUpdate, AudioAppend, AudioCommit, AudioClear, ItemCreate, ItemTruncate,
              ItemDelete, ItemRetrieve, OutputAudioClear, ResponseCreate, ResponseCancel)
)


def load_json(text: str) -> dict[str, Any]:
    try:
        data = edge.load_json(text)  # bounded in depth
    except BadMessage as exc:
        raise RealtimeRequestError(str(exc)) from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise RealtimeRequestError("an event must be a JSON object with a string 'type'", param="type")
    return data


# The session fields OpenAI's session.update takes, GA and beta (as in the openai SDK's
# types), and the read-only ones a client may echo back from session.created (id,
# object, expires_at). The models above ignore what they do not use; a name outside
# these is refused as OpenAI refuses it, so that a typo is not acknowledged with a
# session.updated that changed nothing. Objects passed through or ignored (tools,
# tracing, prompt, reasoning ...) are not looked into.
_TURN_DETECTION = frozenset({"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                             "interrupt_response", "idle_timeout_ms", "eagerness"})
_TRANSCRIPTION = frozenset({"model", "language", "prompt", "delay", "keywords", "languages"})
_NOISE_REDUCTION = frozenset({"type", "strength"})
_FORMAT = frozenset({"type", "rate"})
_SESSION_FIELDS: dict[str, frozenset[str]] = {
    "session": frozenset({
        # GA
        "type", "model", "instructions", "output_modalities", "audio", "include", "max_output_tokens",
        "parallel_tool_calls", "prompt", "reasoning", "tool_choice", "tools", "tracing", "truncation",
        # beta
        "modalities", "voice", "speed", "temperature", "input_audio_format", "output_audio_format",
        "input_audio_transcription", "input_audio_noise_reduction", "turn_detection",
        "max_response_output_tokens", "client_secret",
        # read-only, echoed back by some clients
        "id", "object", "expires_at"}),
    "session.audio": frozenset({"input", "output"}),
    "session.audio.input": frozenset({"format", "noise_reduction", "transcription", "turn_detection"}),
    "session.audio.output": frozenset({"format", "voice", "speed"}),
    "session.audio.input.format": _FORMAT,
    "session.audio.output.format": _FORMAT,
    "session.audio.input.turn_detection": _TURN_DETECTION,
    "session.turn_detection": _TURN_DETECTION,
    "session.audio.input.transcription": _TRANSCRIPTION,
    "session.input_audio_transcription": _TRANSCRIPTION,
    "session.audio.input.noise_reduction": _NOISE_REDUCTION,
    "session.input_audio_noise_reduction": _NOISE_REDUCTION,
}


def unknown_session_fields(session: object) -> list[str]:
    """The fields of a session.update's ``session`` that OpenAI's API does not have, as
    paths (``session.audio.input.turn_detection.silence_ms``), in the order sent."""
    found: list[str] = []

    def walk(path: str, value: object) -> None:
        known = _SESSION_FIELDS.get(path)
        if known is None or not isinstance(value, dict):
            return
        for key, inner in value.items():
            name = f"{path}.{key}"
            if key in known:
                walk(name, inner)
            else:
                found.append(name)

    walk("session", session)
    return found


def validate_client_event(data: dict[str, Any]) -> ClientEvent:
    kind = data["type"]
    if kind not in CLIENT_EVENT_TYPES:
        raise RealtimeRequestError(
            f"unsupported event type {edge.clip(kind)}; supported: {', '.join(sorted(CLIENT_EVENT_TYPES))}",
            code="unknown_event", param="type",
        )
    if kind == "session.update" and (unknown := unknown_session_fields(data.get("session"))):
        # As OpenAI: the whole update is refused (nothing of it applies), with its code,
        # and ``param`` naming the first unknown field; the message names all of them.
        names = ", ".join(edge.clip(n, 128) for n in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        first = unknown[0] if len(unknown[0]) <= 128 else unknown[0][:128] + "..."  # a client's key, bounded
        raise RealtimeRequestError(f"Unknown parameter{'s' if len(unknown) > 1 else ''}: {names}.",
                                   code="unknown_parameter", param=first)
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"][1:]]  # [0] is the discriminator tag
        # Union members add their class name to the path; OpenAI's param is the field path.
        param = ".".join(p for p in loc if not p[:1].isupper() and p not in ("str", "int", "dict[str,any]"))
        raise RealtimeRequestError(f"{kind}: {param or 'event'}: {err['msg']}", param=param or None) from None


def format_from_ga(fmt: FormatIn, param: str) -> AudioFormat:
    if fmt.type == "audio/pcm" and fmt.rate in (None, PCM_RATE):
        return "audio/pcm"
    if fmt.type in ("audio/pcmu", "audio/pcma"):
        return fmt.type  # type: ignore[return-value]
    raise RealtimeRequestError(
        f"unsupported audio format {fmt.type}@{fmt.rate}; use audio/pcm (24000 Hz), audio/pcmu or audio/pcma",
        code="unsupported_format", param=param,
    )


def format_from_beta(name: str, param: str) -> AudioFormat:
    try:
        return _BETA_FORMATS[name]
    except KeyError:
        raise RealtimeRequestError(
            f"unsupported audio format {edge.clip(name)}; use pcm16, g711_ulaw or g711_alaw",
            code="unsupported_format", param=param,
        ) from None


def format_rate(fmt: AudioFormat) -> int:
    return PCM_RATE if fmt == "audio/pcm" else 8000


# ------------------------------------------------------------------ server events
@dataclass(frozen=True)
class Family:
    beta: bool
    item_added: str
    item_done: str | None
    audio_delta: str
    audio_done: str
    transcript_delta: str
    transcript_done: str
    text_delta: str
    text_done: str
    audio_content: str
    text_content: str


GA = Family(False, "conversation.item.added", "conversation.item.done",
            "response.output_audio.delta", "response.output_audio.done",
            "response.output_audio_transcript.delta", "response.output_audio_transcript.done",
            "response.output_text.delta", "response.output_text.done", "output_audio", "output_text")
BETA = Family(True, "conversation.item.created", None,
              "response.audio.delta", "response.audio.done",
              "response.audio_transcript.delta", "response.audio_transcript.done",
              "response.text.delta", "response.text.done", "audio", "text")


def error(code: str, message: str, *, client_event_id: str | None = None, param: str | None = None,
          kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message,
                                       "param": param, "event_id": client_event_id}}


def ga_format(fmt: AudioFormat) -> dict[str, Any]:
    return {"type": fmt, "rate": PCM_RATE} if fmt == "audio/pcm" else {"type": fmt}


def beta_format(fmt: AudioFormat) -> str:
    return next(k for k, v in _BETA_FORMATS.items() if v == fmt)


def item(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status,
            "role": role, "content": content}


def user_audio_item(item_id: str, transcript: str | None) -> dict[str, Any]:
    return item(item_id, "user", [{"type": "input_audio", "transcript": transcript}])


def text_item(fam: Family, item_id: str, role: str, text: str) -> dict[str, Any]:
    kind = fam.text_content if role == "assistant" else "input_text"
    return item(item_id, role, [{"type": kind, "text": text}])


def reply_item(fam: Family, item_id: str, transcript: str | None, status: str, text_only: bool) -> dict[str, Any]:
    if transcript is None:
        return item(item_id, "assistant", [], status)
    part = ({"type": fam.text_content, "text": transcript} if text_only
            else {"type": fam.audio_content, "transcript": transcript})
    return item(item_id, "assistant", [part], status)


@dataclass(frozen=True)
class SessionView:
    """What ``session.created`` / ``session.updated`` report, in wire terms."""

    id: str
    model: str
    instructions: str
    voice: str
    speed: float | None
    in_fmt: AudioFormat
    out_fmt: AudioFormat
    turn_detection: dict[str, Any] | None
    transcription: dict[str, Any] | None
    text_only: bool
    max_tokens: int
    transcription_only: bool = False  # a ``type: "transcription"`` session
    noise_reduction: dict[str, Any] | None = None  # echoed as set
    tools: tuple[dict[str, Any], ...] = ()  # session.tools, Realtime shape (TOOLS)
    tool_choice: str | dict[str, Any] = "auto"


def transcription_session_object(v: SessionView) -> dict[str, Any]:
    """GA ``type: "transcription"``: input settings only (no model, voice or replies)."""
    return {"type": "transcription", "id": v.id, "object": "realtime.transcription_session",
            "expires_at": 0, "include": None,
            "audio": {"input": {"format": ga_format(v.in_fmt), "transcription": v.transcription,
                                "noise_reduction": v.noise_reduction, "turn_detection": v.turn_detection}}}


def session_object(fam: Family, v: SessionView) -> dict[str, Any]:
    if v.transcription_only and not fam.beta:
        return transcription_session_object(v)
    modalities = ["text"] if v.text_only else ["audio"]
    common = {"id": v.id, "object": "realtime.session", "model": v.model,
              "instructions": v.instructions, "tools": list(v.tools), "tool_choice": v.tool_choice}
    if fam.beta:
        return {**common, "modalities": modalities if v.text_only else ["audio", "text"],
                "voice": v.voice, "speed": v.speed,
                "input_audio_format": beta_format(v.in_fmt), "output_audio_format": beta_format(v.out_fmt),
                "input_audio_transcription": v.transcription, "turn_detection": v.turn_detection,
                "input_audio_noise_reduction": v.noise_reduction, "max_response_output_tokens": v.max_tokens}
    return {"type": "realtime", **common, "output_modalities": modalities,
            "max_output_tokens": v.max_tokens,
            "audio": {"input": {"format": ga_format(v.in_fmt), "transcription": v.transcription,
                                "noise_reduction": v.noise_reduction, "turn_detection": v.turn_detection},
                      "output": {"format": ga_format(v.out_fmt), "voice": v.voice, "speed": v.speed}}}


def response_object(fam: Family, v: SessionView, response_id: str, status: str, *,
                    details: dict[str, Any] | None = None, output: list[dict[str, Any]] | None = None,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": response_id, "object": "realtime.response", "status": status,
                            "status_details": details, "output": output or [],
                            "conversation_id": f"conv_{v.id}", "usage": usage, "metadata": None,
                            "max_output_tokens": v.max_tokens}
    if fam.beta:
        body.update(modalities=["text"] if v.text_only else ["audio", "text"], voice=v.voice,
                    output_audio_format=beta_format(v.out_fmt))
    else:
        body.update(output_modalities=["text"] if v.text_only else ["audio"],
                    audio={"output": {"format": ga_format(v.out_fmt), "voice": v.voice}})
    return body
