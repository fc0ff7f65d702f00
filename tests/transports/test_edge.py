"""The edge helpers (voicebot/server/edge.py): pure, fast, no engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import StepClock
from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected

from voicebot.cli import main as cli_main
from voicebot.config import Config, ServerConfig, load_config
from voicebot.errors import (
    AuthError,
    BadMessage,
    CapacityError,
    ConfigError,
    MessageTooLarge,
    ProtocolError,
)
from voicebot.server import edge
from voicebot.server.connection import Connection
from voicebot.server.state import NotReady, ServerState
from voicebot.transports.tasks import run_until_first_ends


# ------------------------------------------------------------------ credentials
def test_bearer_parsing() -> None:
    assert edge.bearer("Bearer abc") == "abc"
    assert edge.bearer("bearer   abc  ") == "abc"
    assert edge.bearer("Basic abc") is None
    assert edge.bearer("Bearer ") is None
    assert edge.bearer(None) is None


def test_keys_from_env_and_file(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# rotated 2025-01\nsk-file-1\n\n  sk-file-2  \n")
    cfg = ServerConfig(api_key_file=str(keyfile), api_keys_env="VB_KEYS")
    keys = edge.load_api_keys(cfg, {"VB_KEYS": " sk-env-1, ,sk-env-2,sk-file-1"})
    assert keys == ("sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2")
    assert edge.load_api_keys(ServerConfig(), {}) == ()
    with pytest.raises(ConfigError, match="api_key_file"):
        edge.load_api_keys(ServerConfig(api_key_file=str(tmp_path / "missing")), {})


def test_every_key_is_accepted_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOICEBOT_API_KEYS", "sk-one,sk-two")
    state = ServerState(Config(server=ServerConfig(api_key="sk-three")))
    for key in ("sk-one", "sk-two", "sk-three"):
        state.check_auth(f"Bearer {key}")
        state.check_auth(None, key)
        state.check_api_key(f"Bearer {key}")
    for bad in ("sk-on", "sk-one2", "", "SK-ONE"):
        with pytest.raises(AuthError) as err:
            state.check_auth(f"Bearer {bad}", bad)
        assert bad not in str(err.value) or not bad  # never echoed
    secret, _ = state.mint_secret(60)
    state.check_auth(f"Bearer {secret}")  # ephemeral secrets still open sessions...
    with pytest.raises(AuthError):
        state.check_api_key(f"Bearer {secret}")  # ...but cannot mint more
    state.cfg.server.api_key = None  # read per request
    state.check_auth("Bearer sk-one")
    with pytest.raises(AuthError):
        state.check_auth("Bearer sk-three")


def test_no_keys_means_open() -> None:
    state = ServerState(Config(server=ServerConfig(api_keys_env="VB_TEST_UNSET_VAR")))
    state.check_auth(None)
    state.check_api_key(None)
    assert not state.auth_required


# ----------------------------------------------------------------------- origins
@pytest.mark.parametrize(
    ("origin", "host", "allowed", "ok"),
    [
        (None, "bot.example.com", [], True),  # not a browser
        ("https://bot.example.com", "bot.example.com", [], True),  # same origin
        ("https://bot.example.com", "bot.example.com:443", [], True),
        ("http://bot.example.com:8080", "bot.example.com:8080", [], True),
        ("http://bot.example.com:8081", "bot.example.com:8080", [], False),
        ("https://evil.example", "127.0.0.1:8080", [], False),  # the CSRF case
        ("http://localhost:3000", "127.0.0.1:8080", [], True),  # a local dev page
        ("http://127.0.0.1:5173", "127.0.0.1:8080", [], True),
        ("http://[::1]:5173", "127.0.0.1:8080", [], True),
        ("null", "127.0.0.1:8080", [], False),  # sandboxed frame / file://
        ("https://app.example.com", "voice.example.com", ["https://app.example.com/"], True),
        ("https://APP.example.com", "voice.example.com", ["https://app.example.com"], True),
        ("https://other.example.com", "voice.example.com", ["https://app.example.com"], False),
        ("https://other.example.com", "voice.example.com", ["*"], True),
        ("https://127.0.0.1.evil.example", "127.0.0.1", [], False),
    ],
)
def test_origin_allow_list(origin: str | None, host: str, allowed: list[str], ok: bool) -> None:
    assert edge.origin_allowed(origin, [host], allowed) is ok


def test_check_origin_uses_forwarded_host() -> None:
    cfg = ServerConfig()
    edge.check_origin({"origin": "https://bot.example.com", "host": "127.0.0.1:8080",
                       "x-forwarded-host": "bot.example.com"}, cfg)
    with pytest.raises(AuthError) as err:
        edge.check_origin({"origin": "https://evil.example", "host": "127.0.0.1:8080"}, cfg)
    assert err.value.code == "origin_not_allowed"
    assert edge.close_code(err.value.code) == 1008 and edge.http_status(err.value) == 403


# -------------------------------------------------------------------------- JSON
@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("{}", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[[[[[["}', 1),  # brackets inside a string do not count
        ('{"a": "\\"[[[[", "b": [[]]}', 3),  # an escaped quote does not end the string
        ('{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash does not escape the quote
        ('"plain"', 0),
        ("", 0),
    ],
)
def test_json_shape_depth(text: str, depth: int) -> None:
    assert edge.json_shape(text)[0] == depth


def test_deep_json_is_a_bad_message_not_a_recursion_error() -> None:
    for text in ('{"a":' * 70 + "1" + "}" * 70, "[" * 5_000 + "]" * 5_000, "[" * 9_000):
        with pytest.raises(BadMessage, match="nested deeper"):
            edge.load_json(text)
    ok = '{"a":' * 60 + "1" + "}" * 60
    assert edge.load_json(ok)["a"]["a"]
    # Many brackets, shallow: the exact scan counts it right.
    assert edge.json_shape(json.dumps({"type": "x", "items": [[] for _ in range(300_000)]}))[0] == 3
    assert edge.json_shape('{"a": "[[[{{", "b": ["\\"", "]]]"]}')[0] == 2  # brackets in strings, escaped quotes


def test_json_with_too_many_objects_and_arrays_is_refused_before_it_is_parsed() -> None:
    # Parsing builds a Python object per container on the loop every session shares: 300k
    # empty arrays in 1 MiB held it ~0.24 s (docs/benchmarks.md). Refused after the
    # bracket scan, unparsed.
    wide = json.dumps({"type": "x", "items": [[] for _ in range(300_000)]})
    with pytest.raises(BadMessage, match="more than 10000 objects and arrays"):
        edge.load_json(wide)
    with pytest.raises(BadMessage, match="nested deeper"):  # deep and many: the depth is said
        edge.load_json("[" * 100_000 + "]" * 100_000)
    assert edge.json_shape(wide) == (3, 300_002)  # the event, its list, 300k lists
    # A large real event is far below the cap: a session.update with 128 tools' schemas.
    tool = {"type": "function", "name": "t", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}} for i in range(8)}}}
    update = json.dumps({"type": "session.update", "session": {"tools": [tool] * 128}})
    assert len(edge.load_json(update)["session"]["tools"]) == 128
    assert len(edge.load_json(json.dumps([[] for _ in range(9_999)]))) == 9_999
    # Brackets inside strings are not containers: a tool's JSON result (a string field, up to
    # 200,000 characters) of 10,001 [time, value] pairs is accepted.
    result = json.dumps([[i, i] for i in range(10_001)])
    item = {"type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "call_1", "output": result}}
    assert edge.load_json(json.dumps(item))["item"]["output"] == result



def test_size_and_text_limits() -> None:
    edge.check_size(10, 10)
    with pytest.raises(MessageTooLarge):
        edge.check_size(11, 10)


# ------------------------------------------------------------------ caller audio
def test_token_bucket_refusal_takes_nothing() -> None:
    # A chunk too large for what is left is refused whole and leaves the bucket as it
    # was: a smaller one that fits still passes (a refusal is not a debt).
    clock = StepClock()
    bucket = edge.TokenBucket(rate=1.0, capacity=1.0, clock=clock)
    assert not bucket.take(1.5)
    assert bucket.take(1.0) and not bucket.take(0.5)
    clock.t += 0.25
    assert bucket.take(0.25) and not bucket.take(1e-3)
    assert bucket.take(1e-10, slack=1e-9)  # float noise within the slack


def test_audio_gate_allows_real_time_and_a_burst_only() -> None:
    clock = StepClock()
    gate = edge.AudioGate(max_message_ms=1000, rate=1.0, burst_ms=2000, clock=clock)
    # 2 s burst at once: accepted; the next 100 ms is refused until time passes.
    for _ in range(20):
        gate.check(1600, 16000)
    with pytest.raises(ProtocolError) as err:
        gate.check(1600, 16000)
    assert err.value.code == "input_rate_exceeded" and gate.refused_s == pytest.approx(0.1)
    # Real time from then on (after a pause that refills half the bucket): every 100 ms
    # chunk 100 ms after the last is accepted, for an hour.
    clock.t += 1.0
    for _ in range(36_000):
        clock.t += 0.1
        gate.check(2400, 24000)
    # One message longer than the limit is refused whatever the bucket holds.
    clock.t += 100
    with pytest.raises(MessageTooLarge):
        gate.check(16000 * 32, 16000)  # the 1 MiB, 32 s message
    gate.check(16000, 16000)  # exactly the limit


def test_audio_gate_reports_once_per_second() -> None:
    clock = StepClock()
    gate = edge.AudioGate(max_message_ms=1000, rate=1.0, burst_ms=1000, clock=clock)
    assert gate.report_due() and not gate.report_due()
    clock.t += 1.0
    assert gate.report_due()


def test_control_gate_allows_a_burst_then_its_rate() -> None:
    clock = StepClock()
    gate = edge.ControlGate(rate=16.0, burst=200, clock=clock)  # 1/16 s: exact in binary
    for _ in range(200):  # a client loading a conversation at once
        gate.check()
    with pytest.raises(ProtocolError) as err:
        gate.check()
    assert err.value.code == "message_rate_exceeded" and gate.refused == 1
    assert "server.control_rate" in str(err.value)
    # Then 16 a second, for an hour; one more within the same 1/16 s is refused.
    for _ in range(3600 * 16):
        clock.t += 1 / 16
        gate.check()
    with pytest.raises(ProtocolError):
        gate.check()
    assert gate.refused == 2
    # A pause refills the bucket, never beyond the burst.
    clock.t += 3600
    for _ in range(200):
        gate.check()
    with pytest.raises(ProtocolError):
        gate.check()


def test_burst_must_hold_one_message() -> None:
    with pytest.raises(ValueError, match="input_burst_ms"):
        ServerConfig(max_audio_message_ms=3000, input_burst_ms=2000)


# --------------------------------------------------------------------- admission
class _Engines:
    down: str | None = None

    def failure(self) -> str | None:
        return self.down


def test_admission_ready_capacity_per_client_and_draining() -> None:
    state = ServerState(Config(server=ServerConfig(max_sessions=3, max_sessions_per_client=2)))
    with pytest.raises(NotReady):
        state.check_admission("10.0.0.1")
    state.engines = _Engines()  # type: ignore[assignment]
    state.check_admission("10.0.0.1")
    state.siblings.opened("10.0.0.1")
    state.siblings.opened("10.0.0.1")
    with pytest.raises(CapacityError, match="one address"):
        state.check_admission("10.0.0.1")
    state.check_admission("10.0.0.2")
    state.check_admission(None)  # not counted per client (Twilio)
    state.siblings.opened(None)  # the third session: the server is full
    with pytest.raises(CapacityError, match="capacity"):
        state.check_admission("10.0.0.2")
    for client in ("10.0.0.1", "10.0.0.1", None):
        state.siblings.closed(client)
    if hasattr(state, "engine_failure"):  # the engines' health (lifecycle work)
        state.engines.down = "llm: engine core died"  # type: ignore[union-attr]
        with pytest.raises(NotReady, match="engine core died"):
            state.check_admission(None)
        state.engines.down = None  # type: ignore[union-attr]
    state.draining = True  # type: ignore[attr-defined]
    with pytest.raises(NotReady) as err:
        state.check_admission(None)
    assert err.value.code == "draining"


class _Stage:
    queue_depth = running = background_waiting = 0

    def voices(self) -> list[str]:
        return []


class _HealthyEngines(_Engines):
    """Enough of Engines for /healthz's body."""

    health: dict[str, object] = {}
    asr = tts = llm = _Stage()


def late_loop(state: ServerState, lag_s: float, *, ago_s: float = 0.0) -> None:
    """Ticks of the state's loop watch, every 100 ms over the last second (ending ``ago_s``
    ago), each ``lag_s`` late: what a loop that late records."""
    import time

    assert state.loop is not None
    now = time.monotonic() - ago_s
    for i in range(10, -1, -1):
        state.loop.history.observe(now - i * 0.1, lag_s)


def test_healthz_lists_the_tts_services_left_out_and_stays_ready() -> None:
    class _Services(_Stage):
        def services_down(self) -> list[str]:
            return ["ws://tts-2:8093"]

    engines = _HealthyEngines()
    engines.tts = _Services()  # type: ignore[assignment]
    state = ServerState(Config())
    state.engines = engines  # type: ignore[assignment]
    body = state.health()
    assert body["services_down"] == {"tts": ["ws://tts-2:8093"]} and body["ready"] is True
    state.engines = _HealthyEngines()  # type: ignore[assignment]
    assert "services_down" not in state.health()  # engines of this process: no services to list


def test_a_late_loop_refuses_new_sessions_until_it_keeps_up_again() -> None:
    from voicebot.runtime.loop_watch import LoopWatch

    state = ServerState(Config(server=ServerConfig(admission_max_loop_lag_ms=300, admission_lag_window_s=5.0)))
    state.engines = _HealthyEngines()  # type: ignore[assignment]
    state.loop = LoopWatch(0.0)  # its samples are given below, as its tick records them
    state.sessions["in-progress"] = None  # type: ignore[assignment]
    late_loop(state, 0.002)
    state.check_admission("10.0.0.1")
    assert state.status() == ("ok", None) and state.health()["loop_lag_ms"] == 2.0

    late_loop(state, 2.0)  # the loop ~2 s late at every tick: more work than its core runs
    with pytest.raises(CapacityError, match="event loop ran .* ms late") as err:
        state.check_admission("10.0.0.1")
    assert err.value.code == "capacity_exceeded"  # what every transport already refuses with
    assert edge.close_code(err.value.code) == 1013 and edge.http_status(err.value) == 429
    assert state.metrics.admission_refusals.labels("loop_lag")._value.get() == 1
    assert state.metrics.admission_refusals.labels("capacity")._value.get() == 0
    status, reason = state.status()
    assert status == "overloaded" and "server.admission_max_loop_lag_ms 300" in (reason or "")
    assert state.health()["ready"] is False and state.health()["max_loop_lag_ms"] == 300
    assert "in-progress" in state.sessions  # refusing new calls touches none in progress

    # The late ticks leave the window; healthy ones follow: new sessions are admitted again.
    state.loop.history = type(state.loop.history)(60.0, 0.1)
    late_loop(state, 2.0, ago_s=6.0)
    late_loop(state, 0.002)
    state.check_admission("10.0.0.1")
    assert state.status() == ("ok", None)

    state.cfg.server.admission_max_loop_lag_ms = 0  # 0: never refused for lateness
    late_loop(state, 5.0)
    state.check_admission("10.0.0.1")
    assert state.health()["loop_lag_ms"] is None


def test_every_refusal_is_counted_by_its_reason() -> None:
    state = ServerState(Config(server=ServerConfig(max_sessions=2, max_sessions_per_client=1)))
    refusals = state.metrics.admission_refusals
    with pytest.raises(NotReady):
        state.check_admission(None)
    state.engines = _Engines()  # type: ignore[assignment]
    state.siblings.opened("10.0.0.1")
    with pytest.raises(CapacityError):
        state.check_admission("10.0.0.1")
    state.siblings.opened(None)
    with pytest.raises(CapacityError):
        state.check_admission(None)
    state.engines.down = "tts: down"  # type: ignore[union-attr]
    with pytest.raises(NotReady):
        state.check_admission(None)
    state.draining = True
    with pytest.raises(NotReady):
        state.check_admission(None)
    counts = {r: refusals.labels(r)._value.get() for r in ("loading", "per_client", "capacity", "engine_down", "draining", "loop_lag")}
    assert counts == {"loading": 1, "per_client": 1, "capacity": 1, "engine_down": 1, "draining": 1, "loop_lag": 0}


def test_one_close_code_and_status_per_error() -> None:
    assert edge.close_code("unauthorized") == 1008
    for code in ("capacity_exceeded", "not_ready", "draining"):
        assert edge.close_code(code) == 1013
    assert edge.close_code("internal_error") == 1011
    assert edge.close_code("invalid_event") == 1000
    assert edge.close_code("server_shutdown") == 1001
    assert edge.close_code("engine_failed") == 1011
    assert edge.http_status(AuthError("x")) == 401
    assert edge.http_status(CapacityError("x")) == 429
    assert edge.http_status(NotReady("x")) == 503
    assert edge.http_status(BadMessage("x")) == 400
    assert edge.http_status(BadMessage("x", code="payload_too_large")) == 413


# ---------------------------------------------------------------------- start-up
def test_exposure_check() -> None:
    def cfg(**server: object) -> Config:
        return Config(server=ServerConfig(api_keys_env="VB_TEST_UNSET_VAR", **server))  # type: ignore[arg-type]

    assert edge.check_exposure(cfg(host="127.0.0.1"), {}) is None
    assert edge.check_exposure(cfg(host="localhost"), {}) is None
    assert edge.check_exposure(cfg(host="::1"), {}) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "bot.example.com"):
        with pytest.raises(ConfigError, match="not a loopback address"):
            edge.check_exposure(cfg(host=host), {})
    assert edge.check_exposure(cfg(host="0.0.0.0"), {"VB_TEST_UNSET_VAR": "sk-1"}) is None
    assert edge.check_exposure(cfg(host="0.0.0.0", api_key="sk-1"), {}) is None
    warning = edge.check_exposure(cfg(host="0.0.0.0", allow_unauthenticated=True), {})
    assert warning and "without an API key" in warning


def test_cli_refuses_an_exposed_server_and_keys_on_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VOICEBOT_API_KEYS", raising=False)
    assert cli_main(["serve", "--config", "configs/test.yaml", "--host", "0.0.0.0", "--no-pull"]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    code = cli_main(["serve", "--config", "configs/test.yaml", "--set", "server.api_key=sk-secret-123"])
    err = capsys.readouterr().err
    assert code == 2 and "command line" in err and "sk-secret-123" not in err
    code = cli_main(["serve", "--config", "configs/test.yaml", "--set", "telephony.auth_token=tw-secret"])
    err = capsys.readouterr().err
    assert code == 2 and "tw-secret" not in err


def test_config_has_the_edge_fields() -> None:
    cfg = load_config("configs/test.yaml")
    assert cfg.server.allowed_origins == [] and cfg.server.max_sessions_per_client is None
    assert cfg.server.max_audio_message_ms <= cfg.server.input_burst_ms
    assert cfg.telephony.auth_token is None and cfg.telephony.auth_token_env == "TWILIO_AUTH_TOKEN"


def test_admin_details_need_a_long_lived_key() -> None:
    state = ServerState(Config(server=ServerConfig(api_keys_env="VB_TEST_UNSET_VAR")))
    assert state.admin_allowed(None)  # no keys: open, like everything else
    state.cfg.server.api_key = "sk-admin"
    assert state.admin_allowed("Bearer sk-admin")
    assert not state.admin_allowed(None)
    assert not state.admin_allowed("Bearer sk-admi")
    secret, _ = state.mint_secret(60)
    assert not state.admin_allowed(f"Bearer {secret}")


def test_clip_bounds_echoed_values() -> None:
    assert edge.clip("abc") == "'abc'"
    assert len(edge.clip("a" * 500_000)) == 64 + 3


def test_error_messages_never_echo_a_whole_client_value() -> None:
    from voicebot.transports import twilio_protocol as tp
    from voicebot.transports.native import apply_command

    huge = "x" * 100_000
    with pytest.raises(BadMessage) as err:
        apply_command(None, {"type": huge})  # type: ignore[arg-type]
    assert len(str(err.value)) < 200
    with pytest.raises(BadMessage) as err:
        tp.parse_message(json.dumps({"event": "dtmf", "dtmf": {"digit": huge}}))
    assert len(str(err.value)) < 200
    # Telnyx parameters whose name is not a string are dropped, not a TypeError.
    start = tp.parse_message(json.dumps({"event": "start", "stream_id": "st1", "start": {
        "media_format": {"encoding": "PCMA", "sample_rate": 8000},
        "custom_parameters": [{"name": ["voice"], "value": "x"}, {"name": "speed", "value": "1.2"}]}}))
    assert isinstance(start, tp.Start) and start.custom == {"speed": "1.2"}


async def test_a_send_to_a_gone_client_ends_the_connection_quietly() -> None:
    # Both ends of a race the live fuzzer hit: one task's send finds the socket gone
    # (WebSocketDisconnect), the other's then finds it closed (WebSocketDisconnected,
    # a RuntimeError); either one first, the connection just ends.
    async def gone() -> None:
        raise WebSocketDisconnect(1006)

    async def closed() -> None:
        raise WebSocketDisconnected('Cannot call "send" once a close message has been sent.')

    for coros in ({"a": gone, "b": closed}, {"a": closed, "b": gone}, {"a": closed}):
        conn = Connection(ServerState(Config()), "native")
        await run_until_first_ends(conn, {k: f() for k, f in coros.items()}, reason="client closed")
        assert conn.reason == "client closed"


async def test_a_task_error_that_is_not_a_hang_up_still_surfaces() -> None:
    async def broken() -> None:
        raise RuntimeError("a bug")

    conn = Connection(ServerState(Config()), "native")
    with pytest.raises(RuntimeError, match="a bug"):
        await run_until_first_ends(conn, {"a": broken()}, reason="client closed")
    assert conn.reason == "client closed"


async def test_read_body_refuses_a_non_ascii_content_length() -> None:
    # '\xb2' (superscript two) is a latin-1 header byte that str.isdigit() accepts and
    # int() refuses: it must be a 400-class refusal or be ignored, never a ValueError.
    from starlette.requests import Request

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"v=0", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"\xb2")]}
    request = await edge.read_body(Request(scope, receive), 1024)
    assert await request.body() == b"v=0"


# -------------------------------------------------------------------- connection
def test_a_connection_authenticates_counts_refusals_once_and_keeps_the_first_reason() -> None:
    from starlette.requests import Request

    state = ServerState(Config(server=ServerConfig(api_key="sk-k", api_keys_env="VB_TEST_UNSET_VAR")))
    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"token=sk-k",
             "headers": [(b"authorization", b"Bearer nope")], "client": ("10.0.0.9", 5000)}
    conn = Connection(state, "native", Request(scope))
    assert conn.bearer() == "nope" and conn.client == "10.0.0.9"
    with pytest.raises(AuthError):  # a Bearer header is what is checked, not the token beside it
        conn.authenticate(conn.query.get("token"))
    assert Connection(state, "twilio", Request(scope), per_client=False).client is None

    def counted(code: str) -> float | None:
        return state.metrics.registry.get_sample_value("voicebot_errors_total", {"code": code})

    assert conn.refuse(AuthError("x")) == 1008 and counted("unauthorized") == 1
    assert conn.refuse_http(CapacityError("x")) == 429 and counted("capacity_exceeded") == 1
    conn.count_error("invalid_event")
    assert counted("invalid_event") == 1

    assert conn.reason is None and conn.close_code == 1000
    conn.end("hangup digit")
    conn.end("call ended")  # the first reason given stands
    assert conn.reason == "hangup digit"
