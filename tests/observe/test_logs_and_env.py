"""JSON log lines carry the call id; the OTEL_* environment turns traces on and picks
the exporter; nothing configured costs a call nothing."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

from voicebot.affinity import bind_session
from voicebot.config import TelemetryConfig
from voicebot.errors import ConfigError
from voicebot.metrics import Metrics
from voicebot.observe import tracing
from voicebot.observe.logs import CallIdFilter, JsonFormatter
from voicebot.observe.telemetry import CallTelemetry, Telemetry
from voicebot.session.observer import NO_OBSERVER
from voicebot.session.session import SessionLog


def lines(records: list[logging.LogRecord]) -> list[dict[str, object]]:
    fmt = JsonFormatter()
    return [json.loads(fmt.format(r)) for r in records]


def test_json_lines_carry_the_call_id(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("voicebot.test_logs")
    caplog.handler.addFilter(CallIdFilter())  # as use_json_logs does on every handler
    with caplog.at_level(logging.INFO, "voicebot.test_logs"):
        SessionLog(log, {"session": "sess_abc"}).info("barge-in: %d ms dropped", 120)
        log.info("no call here")
        token = bind_session("sess_ctx")  # an engine logging inside a call's task
        try:
            log.warning("inside the call's context")
        finally:
            from voicebot.affinity import _SESSION_ID
            _SESSION_ID.reset(token)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    a, b, c, d = lines(caplog.records)
    assert a["call_id"] == "sess_abc" and a["message"] == "[sess_abc] barge-in: 120 ms dropped"
    assert a["level"] == "INFO" and a["logger"] == "voicebot.test_logs" and str(a["time"]).endswith("Z")
    assert "call_id" not in b
    assert c["call_id"] == "sess_ctx"
    assert "ValueError: boom" in str(d["exception"])


def test_the_otel_environment_turns_traces_on() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})


@pytest.mark.parametrize(("protocol", "kind"), [("", HttpExporter), ("http/protobuf", HttpExporter), ("grpc", GrpcExporter)])
def test_the_protocol_picks_the_exporter(protocol: str, kind: type) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    provider = tracing.provider_from_env(env)
    try:
        (processor,) = provider._active_span_processor._span_processors
        assert isinstance(processor.span_exporter, kind)  # type: ignore[attr-defined]
        assert provider.resource.attributes["service.name"] == "voicebot"
    finally:
        provider.shutdown()


def test_an_unknown_protocol_or_exporter_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="http/json"):
        tracing.provider_from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="zipkin"):
        tracing.provider_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


async def test_what_watches_a_call_follows_the_config() -> None:
    assert Telemetry(TelemetryConfig(), Metrics(), environ={}).observer() is NO_OBSERVER
    recorded = Telemetry(TelemetryConfig(record_dir="/nonexistent"), Metrics(), environ={}).observer()
    assert isinstance(recorded, CallTelemetry) and recorded.recorder is not None
    traced = Telemetry(TelemetryConfig(), Metrics(), environ={"OTEL_TRACES_EXPORTER": "console"})
    observer = traced.observer()
    assert isinstance(observer, CallTelemetry) and observer.recorder is None
    await traced.aclose()
