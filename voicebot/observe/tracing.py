"""OpenTelemetry traces of calls: one trace per call, one span per reply's turn.

Off unless the standard environment asks for it (:func:`wanted`): an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or an
exporter (``OTEL_TRACES_EXPORTER=otlp|console``), and not ``OTEL_SDK_DISABLED=true``.
The protocol is ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` (``http/protobuf``, the
default, or ``grpc``); the service name and resource come from ``OTEL_SERVICE_NAME``
and ``OTEL_RESOURCE_ATTRIBUTES`` as the SDK reads them. The SDK is the optional extra
``voicebot[otel]``.

The spans are built when a reply ends, from its marks (:class:`TurnStages`), with
their real start and end times: nothing is traced per audio frame, and export runs in
the SDK's batch thread. The tree::

    call                                   the whole call (call id, protocol, end reason)
      turn                                 a reply and the user turn it answers
        endpointing, asr, llm, first_clause, tts, playout
                                           events on the turn: barge_in, tool_call,
                                           tool_result, error

No transcript, reply or tool argument goes into a span unless ``telemetry.include_text``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from voicebot.errors import ConfigError
from voicebot.observe.records import hung_up_by
from voicebot.session import events as ev
from voicebot.session.observer import AudioTap, TurnStages

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

_ON = ("otlp", "console")
PERSONAL_DETAILS = frozenset({"from", "to"})  # a call's details that say who called whom


def _flag(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip().lower()


def wanted(environ: Mapping[str, str]) -> bool:
    """Does the OTEL_* environment ask for traces?"""
    if _flag(environ, "OTEL_SDK_DISABLED") == "true":
        return False
    exporter = _flag(environ, "OTEL_TRACES_EXPORTER")
    if exporter == "none":
        return False
    return exporter in _ON or bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def provider_from_env(environ: Mapping[str, str]) -> TracerProvider:
    """A tracer provider exporting as the environment says (raises ConfigError when the
    SDK is not installed or the protocol is unknown)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError as exc:
        raise ConfigError(
            f"OTEL_* asks for traces but the OpenTelemetry SDK is not installed ({exc}): "
            "pip install 'voicebot[otel]'"
        ) from None
    exporter_name = _flag(environ, "OTEL_TRACES_EXPORTER") or "otlp"
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        protocol = _flag(environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _flag(environ, "OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol in ("", "http/protobuf"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        elif protocol == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[no-redef, assignment]
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise ConfigError(f"OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc ({exc})") from None
        else:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: voicebot exports http/protobuf or grpc")
        exporter = OTLPSpanExporter(endpoint=_endpoint(environ, protocol or "http/protobuf"))
    else:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: voicebot exports otlp, console or none")
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES from os.environ.
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or "voicebot"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))  # its own thread, bounded queue
    return provider


def _endpoint(environ: Mapping[str, str], protocol: str) -> str | None:
    """Where spans go, as the OTLP exporter specification says (None: its default):
    the traces endpoint as given, or the base endpoint (plus ``/v1/traces`` over HTTP)."""
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    return base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"


def _ns(value: float) -> int:
    return int(value * 1e9)


class CallTracer:
    """One call's trace; a CallObserver. Never raises into the call (Telemetry guards it)."""

    def __init__(self, tracer: Tracer, *, include_text: bool) -> None:
        self._tracer = tracer
        self._text = include_text
        self._call: Span | None = None
        self._wall0 = 0.0  # the call's clock at its start, and the wall clock then
        self._mono0 = 0.0
        self._turns = 0
        # Events since the last turn span (they belong to the next one to end).
        self._pending: list[tuple[str, dict[str, Any], float]] = []
        self._transcript: str | None = None

    def _wall(self, now: float) -> int:
        return _ns(self._wall0 + (now - self._mono0))

    def audio_tap(self) -> AudioTap | None:
        return None

    def started(self, call_id: str, transport: str, now: float) -> None:
        self._mono0, self._wall0 = now, time.time()
        self._call = self._tracer.start_span(
            "call", start_time=self._wall(now),
            attributes={"voicebot.call_id": call_id, "voicebot.protocol": transport},
        )

    def details(self, fields: Mapping[str, str]) -> None:
        """The carrier's ids as attributes of the call span; phone numbers only with
        include_text (they say who called)."""
        if self._call is not None:
            self._call.set_attributes({f"voicebot.{k}": v for k, v in fields.items()
                                       if self._text or k not in PERSONAL_DETAILS})

    def event(self, event: ev.SessionEvent, now: float) -> None:
        match event:
            case ev.TranscriptFinal(_, text) if text.strip():
                self._transcript = text
            case ev.BargeIn(response_id, played_ms, heard):
                attrs: dict[str, Any] = {"voicebot.response_id": response_id, "voicebot.played_ms": played_ms}
                if self._text:
                    attrs["voicebot.heard"] = heard
                self._pending.append(("barge_in", attrs, now))
            case ev.ReplyTruncated(response_id, _, played_ms, heard) if self._call is not None:
                # A client's truncate comes after its reply's turn span ended: the call's.
                attrs = {"voicebot.response_id": response_id, "voicebot.played_ms": played_ms}
                if self._text:
                    attrs["voicebot.heard"] = heard
                self._call.add_event("truncated", attrs, timestamp=self._wall(now))
            case ev.ToolCallDone(response_id, call):
                attrs = {"voicebot.tool.name": call.name, "voicebot.tool.call_id": call.call_id}
                if self._text:
                    attrs["voicebot.tool.arguments"] = call.arguments
                self._pending.append(("tool_call", attrs, now))
            case ev.ToolResult(call_id, name, output):
                attrs = {"voicebot.tool.name": name, "voicebot.tool.call_id": call_id}
                if self._text:
                    attrs["voicebot.tool.result"] = output
                self._pending.append(("tool_result", attrs, now))
            case ev.ErrorEvent(code, message, _, fatal):
                self._pending.append(("error", {"voicebot.error.code": code, "voicebot.error.fatal": fatal,
                                                "voicebot.error.message": message}, now))

    def stages(self, s: TurnStages) -> None:
        if self._call is None:
            return
        from opentelemetry import trace

        start = next(m for m in (s.speech_end, s.committed, s.asr_started, s.llm_requested, s.ended) if m is not None)
        attrs: dict[str, Any] = {
            "voicebot.response_id": s.response_id,
            "voicebot.turn": self._turns,
            "voicebot.status": s.status,
            "voicebot.speculative": s.speculative,
        }
        if s.speech_end is not None and s.audio_started is not None:
            attrs["voicebot.voice_to_voice_ms"] = round(1000 * (s.audio_started - s.speech_end), 1)
        if self._text and self._transcript is not None:
            attrs["voicebot.transcript"] = self._transcript
        self._transcript = None
        self._turns += 1
        turn = self._tracer.start_span("turn", context=trace.set_span_in_context(self._call),
                                       start_time=self._wall(start), attributes=attrs)
        inside = trace.set_span_in_context(turn)

        def child(name: str, a: float | None, b: float | None, **attributes: Any) -> None:
            if a is not None and b is not None:
                self._tracer.start_span(name, context=inside, start_time=self._wall(a),
                                        attributes=attributes).end(end_time=self._wall(max(a, b)))

        child("endpointing", s.speech_end, s.committed)
        child("asr", s.asr_started, s.asr_done)
        llm: dict[str, Any] = {
            "gen_ai.usage.input_tokens": s.prompt_tokens,
            "gen_ai.usage.cached_input_tokens": s.cached_tokens,
            "gen_ai.usage.output_tokens": s.output_tokens,
        }
        if s.llm_ttft_s is not None:
            llm["voicebot.llm.ttft_ms"] = round(1000 * s.llm_ttft_s, 1)
        child("llm", s.llm_requested, s.llm_done or s.ended, **llm)
        child("first_clause", s.llm_requested, s.first_clause)
        child("tts", s.tts_started, s.tts_first_audio)
        child("playout", s.audio_started, s.ended)
        for name, event_attrs, at in self._pending:
            turn.add_event(name, event_attrs, timestamp=self._wall(at))
        self._pending.clear()
        turn.end(end_time=self._wall(s.ended))

    def ended(self, reason: str, now: float) -> None:
        if self._call is None:
            return
        for name, attrs, at in self._pending:  # errors after the last reply, say
            self._call.add_event(name, attrs, timestamp=self._wall(at))
        self._pending.clear()
        self._call.set_attributes({"voicebot.end_reason": reason, "voicebot.hung_up_by": hung_up_by(reason),
                                   "voicebot.turns": self._turns})
        self._call.end(end_time=self._wall(now))
        self._call = None


def tracer_of(provider: TracerProvider) -> Tracer:
    return provider.get_tracer("voicebot")
