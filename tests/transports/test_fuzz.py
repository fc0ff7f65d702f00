"""Bad input, fuzzed: every wire parser and the session's command surface (issue 8, part 3).

Property: whatever a client sends - JSON of any shape, real event names with mutated
fields, deep nesting, huge strings, wrong types, binary garbage - each message yields
a well-formed reply or error (a ProtocolError turned into an error event with a code),
never another exception, and the session is healthy afterwards (not closed, no
``internal_error``, still answering a normal request).

The parsers run on the real code path of each transport: native ``parse_json`` +
``apply_command`` on a real Session (fake engines of our own interfaces, from
test_session.py), the Realtime translator over a fake of its ``SessionPort`` and over a
real Session, Twilio ``parse_message`` + the call's message handler, and the WebRTC data
channel's message handler + translator.

Cost: ``FUZZ_EXAMPLES`` examples per test (default 150, deterministic; the whole file
runs in well under a minute). ``FUZZ_EXAMPLES=5000`` makes a long, randomised run.

Pinned examples (``@example``): the defects issue 8 names (deep JSON, ``"vad": 5``,
Twilio ``sampleRate``/``mediaFormat``), each an uncaught exception before the edge
layer, and what this fuzzing found since: a Telnyx ``custom_parameters`` entry with a
non-string name (TypeError) and error messages echoing a client's 10 kB id back.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fakes import clock_of, elapse, make_engines, until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from voicebot.config import Config
from voicebot.engines.registry import Engines
from voicebot.errors import ProtocolError, VoicebotError
from voicebot.server.connection import Connection
from voicebot.server.state import ServerState
from voicebot.session import events as ev
from voicebot.session.response import ResponseOptions
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings
from voicebot.tools.spec import ToolChoice, ToolSpec
from voicebot.transports import native
from voicebot.transports import realtime_events as rt
from voicebot.transports import twilio_protocol as tp
from voicebot.transports.realtime_session import RealtimeTranslator

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
LONG_RUN = "FUZZ_EXAMPLES" in os.environ
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    # CI: the same examples every run (no flakes); a long run explores freely.
    derandomize=not LONG_RUN,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
# Fewer for tests that open a real Session per example.
SESSION_FUZZ = settings(FUZZ, max_examples=max(20, EXAMPLES // 3))

MAX_MESSAGE = Config().server.max_message_bytes
ERROR_CODE = re.compile(r"^[a-z][a-z0-9_]{1,63}$")


# ----------------------------------------------------------------- strategies
def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value: scalars of every type, lists, objects, a few levels deep."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=40)
        | st.sampled_from(["", " ", "inf", "NaN", "-1", "1e309", "audio/pcm", "pcm16", "alloy", "\x00", "\ud7ff"])
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=max_leaves,
    )


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key/index path inside a JSON value (for mutation)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _parent(root: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        root = root[key]
    return root


def mutated(templates: dict[str, dict[str, Any]], key: str = "type") -> st.SearchStrategy[Any]:
    """A real event of a real type, then up to four mutations: a field replaced by any
    JSON value, dropped, added, wrapped in a list, or the type name itself bent."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        event = copy.deepcopy(templates[draw(st.sampled_from(sorted(templates)))])
        for _ in range(draw(st.integers(0, 4))):
            paths = list(_paths(event))
            op = draw(st.sampled_from(["replace", "drop", "add", "wrap", "type"]))
            if op == "type":
                name = str(event.get(key, "")) if isinstance(event, dict) else ""
                event = event if isinstance(event, dict) else {}
                event[key] = draw(
                    st.sampled_from([name.upper(), name + ".", name[:-1], name.replace(".", "_"), 5, None, [name], {}])
                )
            elif op == "add" or not paths:
                target = draw(st.sampled_from([(), *paths]))
                parent = event if not target else _parent(event, target)[target[-1]]
                if isinstance(parent, dict):
                    parent[draw(st.text(max_size=12) | st.sampled_from(sorted(_FIELD_NAMES)))] = draw(json_values())
                elif isinstance(parent, list):
                    parent.append(draw(json_values()))
            else:
                path = draw(st.sampled_from(paths))
                parent = _parent(event, path)
                if op == "replace":
                    parent[path[-1]] = draw(json_values())
                elif op == "drop":
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = [parent[path[-1]]]
        return event

    return build()


def deep_nesting(templates: dict[str, dict[str, Any]], key: str = "type") -> st.SearchStrategy[str]:
    """A valid-looking event with one field nested far past any sane depth."""

    @st.composite
    def build(draw: st.DrawFn) -> str:
        kind = draw(st.sampled_from(sorted(templates)))
        depth = draw(st.sampled_from([50, 500, 1_000, 5_000, 100_000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        nested = opener * depth + "1" + closer * depth
        field = draw(st.sampled_from(["x", *templates[kind].keys()]))
        if field == key:
            field = "x"
        head = json.dumps({key: templates[kind][key]})[:-1]
        return f'{head}, "{field}": {nested}}}'

    return build()


def huge_strings(templates: dict[str, dict[str, Any]]) -> st.SearchStrategy[str]:
    """Every string field of a real event blown up to up to the message limit."""

    @st.composite
    def build(draw: st.DrawFn) -> str:
        event = copy.deepcopy(templates[draw(st.sampled_from(sorted(templates)))])
        size = draw(st.sampled_from([10_000, 100_000, MAX_MESSAGE // 2]))
        filler = draw(st.sampled_from(["a", "é", "\u2603 ", "word ", "\\", '"']))
        paths = [p for p in _paths(event) if isinstance(_parent(event, p)[p[-1]], str) and p[-1] != "type"]
        if paths:
            path = draw(st.sampled_from(paths))
            _parent(event, path)[path[-1]] = (filler * size)[:size]
        else:
            event["padding"] = (filler * size)[:size]
        return json.dumps(event)

    return build()


def garbage() -> st.SearchStrategy[str]:
    """Text frames that are not JSON objects at all."""
    return (
        st.text(max_size=200)
        | st.binary(max_size=200).map(lambda b: b.decode("latin-1"))
        | st.binary(max_size=200).map(lambda b: b.decode("utf-8", errors="surrogateescape"))
        | json_values().map(json.dumps)
        | st.sampled_from(["", "{", "}", "null", "[]", '{"type":', '{"type": null}', "\x00" * 64, "1e999999", "-"])
    )


def wire_texts(templates: dict[str, dict[str, Any]], key: str = "type") -> st.SearchStrategy[str]:
    return st.one_of(
        mutated(templates, key).map(json.dumps),
        garbage(),
        deep_nesting(templates, key),
        huge_strings(templates),
        st.sampled_from(sorted(json.dumps(t) for t in templates.values())),
    )


# ----------------------------------------------------------- real event names
PCM_100MS_24K = base64.b64encode(np.full(2400, 1000, dtype="<i2").tobytes()).decode()

NATIVE = {
    "input.commit": {"type": "input.commit", "event_id": "e1"},
    "input.clear": {"type": "input.clear"},
    "response.create": {"type": "response.create"},
    "response.cancel": {"type": "response.cancel"},
    "text.input": {"type": "text.input", "text": "what time is it", "respond": False},
    "session.update": {
        "type": "session.update",
        "system_prompt": "Be brief.",
        "voice": None,
        "speed": 1.1,
        "language": "en",
        "max_tokens": 20,
        "turn_detection": True,
        "create_response": False,
        "vad": {"min_silence_ms": 500, "threshold": 0.5},
    },
    "session.end": {"type": "session.end"},
}
NATIVE_START = {
    "type": "session.start",
    "sample_rate": 16000,
    "output_sample_rate": 24000,
    "system_prompt": "Be brief.",
    "voice": None,
    "speed": 1.0,
    "language": "en",
    "vad": {"min_silence_ms": 400},
    "turn_detection": True,
    "max_tokens": 32,
}

REALTIME = {
    "session.update": {
        "type": "session.update",
        "event_id": "evt_1",
        "session": {
            "type": "realtime",
            "instructions": "Be brief.",
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "turn_detection": {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 500,
                                       "prefix_padding_ms": 300, "create_response": True},
                    "transcription": {"model": "whisper-1"},
                },
                "output": {"format": {"type": "audio/pcmu"}, "voice": "alloy", "speed": 1.0},
            },
            "max_output_tokens": "inf",
        },
    },
    "session.update.beta": {
        "type": "session.update",
        "session": {"modalities": ["text", "audio"], "input_audio_format": "g711_ulaw",
                    "output_audio_format": "pcm16", "turn_detection": None, "voice": "alloy",
                    "max_response_output_tokens": 30},
    },
    "input_audio_buffer.append": {"type": "input_audio_buffer.append", "audio": PCM_100MS_24K},
    "input_audio_buffer.commit": {"type": "input_audio_buffer.commit"},
    "input_audio_buffer.clear": {"type": "input_audio_buffer.clear"},
    "conversation.item.create": {
        "type": "conversation.item.create",
        "previous_item_id": None,
        "item": {"id": "item_a", "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "hello there"}]},
    },
    "conversation.item.truncate": {"type": "conversation.item.truncate", "item_id": "item_a",
                                   "content_index": 0, "audio_end_ms": 100},
    "conversation.item.delete": {"type": "conversation.item.delete", "item_id": "item_a"},
    "response.create": {"type": "response.create", "response": {"instructions": "shout"}},
    "response.cancel": {"type": "response.cancel", "response_id": "resp_1"},
    "output_audio_buffer.clear": {"type": "output_audio_buffer.clear"},  # WebRTC's own
}

ULAW_20MS = base64.b64encode(b"\xff" * 160).decode()
TWILIO = {
    "connected": {"event": "connected", "protocol": "Call", "version": "1.0.0"},
    "start": {
        "event": "start",
        "sequenceNumber": "1",
        "streamSid": "MZ1",
        "start": {
            "streamSid": "MZ1",
            "callSid": "CA1",
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": {"system_prompt": "Be brief.", "speed": "1.2"},
        },
    },
    "start.telnyx": {
        "event": "start",
        "stream_id": "st1",
        "start": {"call_control_id": "cc1", "media_format": {"encoding": "PCMA", "sample_rate": 8000},
                  "custom_parameters": [{"name": "voice", "value": "en-us"}]},
    },
    "media": {"event": "media", "streamSid": "MZ1", "media": {"track": "inbound", "chunk": "2",
                                                               "timestamp": "20", "payload": ULAW_20MS}},
    "dtmf": {"event": "dtmf", "streamSid": "MZ1", "dtmf": {"track": "inbound_track", "digit": "5"}},
    "mark": {"event": "mark", "streamSid": "MZ1", "mark": {"name": "resp_1:100"}},
    "stop": {"event": "stop", "streamSid": "MZ1", "stop": {"callSid": "CA1"}},
}

_FIELD_NAMES = {k for t in (*NATIVE.values(), NATIVE_START, *REALTIME.values(), *TWILIO.values()) for k in t}


# ------------------------------------------------------------------- fixtures
class _Runner(asyncio.Runner):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "<event loop>"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.Runner]:
    """One event loop for every example of the module (hypothesis drives sync tests)."""
    with _Runner() as runner:
        yield runner


class _Engines(Engines):
    def __repr__(self) -> str:
        return "<fake engines>"


@pytest.fixture(scope="module")
def engines(tokenizer) -> Engines:  # type: ignore[no-untyped-def]
    # Virtual time (the fakes' delays and the session's pacer): examples cost no waiting.
    e = make_engines(tokenizer, reply="Fine, thanks.", word_delay=0.01)
    e.__class__ = _Engines
    return e


def open_session(engines: Engines, **changes: object) -> Session:
    base = SessionSettings.from_config(engines.cfg).model_copy(update=changes)
    return Session(engines, base, clock=clock_of(engines))


# ------------------------------------------------------------------ checkers
def check_wire_error(exc: VoicebotError) -> None:
    """A refusal a transport can put on the wire as it is."""
    assert isinstance(exc, ProtocolError), f"client input raised a non-protocol error: {exc!r}"
    assert ERROR_CODE.match(exc.code), exc.code
    assert str(exc) and len(str(exc)) < 4096, "error messages are short (no echo of a huge input)"


def check_json(body: Any) -> None:
    json.dumps(body, allow_nan=False)


def drain(session: Session) -> list[ev.SessionEvent]:
    out = []
    while not session.outbox.empty():
        out.append(session.outbox.get_nowait())
    return out


def check_healthy(session: Session, events: list[ev.SessionEvent], *, allow_fatal: bool = False) -> None:
    for e in events:
        body = native.render_event(e)
        if body is not None:
            check_json(body)
        if isinstance(e, ev.ErrorEvent):
            assert e.code != "internal_error", f"a session task crashed: {e.message}"
            assert ERROR_CODE.match(e.code), e.code
            assert allow_fatal or not e.fatal, e
    if not allow_fatal:
        assert session.closed_reason is None, session.closed_reason
        assert not session.ended


async def answers_a_normal_request(session: Session) -> None:
    """After the fuzz: a typed question still gets a completed, spoken reply."""
    drain(session)
    session.update_settings(
        **{k: v for k, v in SessionSettings.from_config(session.cfg).model_dump().items()
           if k not in ("vad", "output_sample_rate")}
    )
    session.add_text("user", "Are you still there?")
    rid = session.create_response()
    seen: list[ev.SessionEvent] = []

    def done() -> bool:
        seen.extend(drain(session))
        return any(isinstance(e, ev.ResponseDone) and e.response_id == rid for e in seen)

    await until(clock_of(session.engines), done, timeout=10)
    assert not [e for e in seen if isinstance(e, ev.ErrorEvent) and e.code == "internal_error"], seen
    assert [e.status for e in seen if isinstance(e, ev.ResponseDone) and e.response_id == rid] == ["completed"]
    assert any(isinstance(e, ev.ResponseAudio) for e in seen), "the reply was spoken"


# ---------------------------------------------------------------- native /ws
# Pinned: the defects named in issue 8 and the ones this fuzzing found (see the docstring).
DEEP = "[" * 100_000 + "]" * 100_000
LONG_ID = "a" * 10_000


@FUZZ
@given(text=wire_texts(NATIVE))
@example(text='{"type": "input.clear", "x": ' + DEEP + "}")
def test_native_parse_json_accepts_an_object_or_refuses_with_a_code(text: str) -> None:
    try:
        data = native.parse_json(text)
    except VoicebotError as exc:
        check_wire_error(exc)
    else:
        assert isinstance(data, dict) and isinstance(data["type"], str)


@FUZZ
@given(start=mutated({"session.start": NATIVE_START}))
def test_native_session_start_is_settings_or_a_clear_refusal(start: Any) -> None:
    base = SessionSettings.from_config(Config())
    try:
        msg = native.StartMessage.model_validate(start)
        for rate in filter(None, (msg.sample_rate, msg.output_sample_rate)):
            native._rate(rate, "sample_rate")
        settings_ = native.settings_from_start(base, msg)
    except ValidationError:
        pass  # _read_start turns this into BadMessage
    except VoicebotError as exc:
        check_wire_error(exc)
    else:
        assert isinstance(settings_, SessionSettings)
        SessionSettings.model_validate(settings_.model_dump())  # and it stays valid


async def _native_once(engines: Engines, text: str) -> None:
    async with open_session(engines) as session:
        fatal = False
        try:
            data = native.parse_json(text)
            reply = native.apply_command(session, data)
        except native._Hangup:
            return
        except VoicebotError as exc:
            check_wire_error(exc)
            fatal = exc.fatal
            session.error(exc.code, str(exc), fatal=exc.fatal)  # what the reader does
        else:
            if reply is not None:
                assert isinstance(reply.get("type"), str)
                check_json(reply)
        await elapse(clock_of(engines), 0.02)  # let what the command spawned run
        check_healthy(session, drain(session), allow_fatal=fatal)
        if not fatal:
            await answers_a_normal_request(session)


@SESSION_FUZZ
@given(text=wire_texts(NATIVE))
@example(text='{"type": "session.update", "vad": 5}')
@example(text='{"type": "session.update", "vad": {"nonsense": 1}}')
@example(text='{"type": "session.update", "type2": 1, "event_id": {"a": 1}}')
def test_native_commands_on_a_live_session(loop: asyncio.Runner, engines: Engines, text: str) -> None:
    loop.run(_native_once(engines, text))


@SESSION_FUZZ
@given(frames=st.lists(st.binary(max_size=2048), min_size=1, max_size=8))
def test_native_binary_garbage_is_audio_or_bad_audio(loop: asyncio.Runner, engines: Engines, frames: list[bytes]) -> None:
    async def run() -> None:
        async with open_session(engines) as session:
            for data in frames:
                try:
                    session.push_audio(data, 16000)
                except VoicebotError as exc:
                    check_wire_error(exc)
                    assert len(data) % 2, "only odd-length frames are bad PCM16"
            await elapse(clock_of(engines), 0.02)
            check_healthy(session, drain(session))

    loop.run(run())


# ----------------------------------------------------------------- Realtime
class FakePort:
    """The translator's SessionPort: our interface, the real settings validation."""

    def __init__(self) -> None:
        self.settings = SessionSettings.from_config(Config())
        self.items: dict[str, str] = {}
        self.audio_ms = 0.0
        self._n = 0

    @property
    def conversation(self) -> FakePort:
        return self

    def delete(self, item_id: str) -> bool:
        return self.items.pop(item_id, None) is not None

    def _id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def push_audio(self, audio: bytes, sample_rate: int) -> None:
        assert isinstance(audio, bytes) and len(audio) % 2 == 0 and sample_rate in (8000, 24000)
        self.audio_ms += 1000 * len(audio) / 2 / sample_rate

    def commit_input(self) -> str:
        return self._id("item")

    def clear_input(self) -> None:
        self.audio_ms = 0.0

    def add_text(self, role: str, text: str, item_id: str | None = None) -> str:
        assert role in ("user", "assistant", "system") and isinstance(text, str)
        item_id = item_id or self._id("item")
        self.items[item_id] = text
        return item_id

    @property
    def input_ms(self) -> float:
        return self.audio_ms

    @property
    def token_count(self) -> int:
        return sum(len(t) // 4 for t in self.items.values())

    budget_tokens = 4096

    def create_response(self, options: ResponseOptions | None = None) -> str:
        assert options is None or isinstance(options, ResponseOptions)
        return self._id("resp")

    def set_tools(self, tools: list[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None:
        assert tools is None or all(isinstance(t, ToolSpec) for t in tools)
        assert choice is None or isinstance(choice, ToolChoice)

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        assert isinstance(call_id, str) and isinstance(output, str)
        item_id = item_id or self._id("item")
        self.items[item_id] = output
        return item_id

    def add_tool_call(self, call_id: str, name: str, arguments: dict[str, object], item_id: str | None = None) -> str:
        assert isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, dict)
        item_id = item_id or self._id("item")
        self.items[item_id] = name
        return item_id

    def cancel_response(self) -> bool:
        return False

    def truncate(self, item_id: str, audio_end_ms: int) -> str | None:
        assert isinstance(audio_end_ms, int) and audio_end_ms >= 0
        return None

    def set_played(self, ms: int) -> None:
        assert isinstance(ms, int) and ms >= 0

    def update_settings(self, **changes: object) -> None:
        new = self.settings.model_copy(update=changes)
        self.settings = SessionSettings.model_validate(new.model_dump())


def check_realtime_out(out: list[dict[str, Any]]) -> None:
    assert isinstance(out, list)
    for body in out:
        check_json(body)
        assert isinstance(body["type"], str) and isinstance(body["event_id"], str)
        if body["type"] == "error":
            err = body["error"]
            assert err["type"] == "invalid_request_error", f"client input caused a server error: {err}"
            assert ERROR_CODE.match(err["code"]), err
            assert isinstance(err["message"], str) and len(err["message"]) < 4096


@FUZZ
@given(texts=st.lists(wire_texts(REALTIME), min_size=1, max_size=4), beta=st.booleans())
@example(texts=['{"type": "conversation.item.delete", "item_id": "' + LONG_ID + '"}'], beta=False)
def test_realtime_translator_answers_every_message(texts: list[str], beta: bool) -> None:
    port = FakePort()
    tr = RealtimeTranslator(port, session_id="sess_fuzz", model="m", beta=beta, voices={"en-us"})
    tr.opening()
    for text in texts:
        check_realtime_out(tr.client_message(text))
    # Still in service: a plain request gets its plain answer.
    out = tr.client_message('{"type": "input_audio_buffer.clear", "event_id": "ok"}')
    assert [b["type"] for b in out] == ["input_audio_buffer.cleared"]


@FUZZ
@given(data=mutated(REALTIME))
def test_realtime_validation_is_a_typed_event_or_a_request_error(data: Any) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        return  # load_json's job, covered above
    try:
        rt.validate_client_event(data)
    except VoicebotError as exc:
        check_wire_error(exc)
        assert exc.param is None or isinstance(exc.param, str)  # type: ignore[attr-defined]


async def _realtime_once(engines: Engines, texts: list[str]) -> None:
    async with open_session(engines) as session:
        tr = RealtimeTranslator(session, session_id=session.id, model="m", voices=set(engines.tts.voices()))
        tr.opening()
        for text in texts:
            check_realtime_out(tr.client_message(text))
        await elapse(clock_of(engines), 0.02)
        events = drain(session)
        for e in events:
            check_realtime_out(tr.session_event(e))
        check_healthy(session, events)
        await answers_a_normal_request(session)


@SESSION_FUZZ
@given(texts=st.lists(wire_texts(REALTIME), min_size=1, max_size=3))
def test_realtime_commands_on_a_live_session(loop: asyncio.Runner, engines: Engines, texts: list[str]) -> None:
    loop.run(_realtime_once(engines, texts))


# ------------------------------------------------------- WebRTC data channel
class FakeChannel:
    readyState = "open"

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, text: str) -> None:
        self.sent.append(json.loads(text))


async def _datachannel_once(engines: Engines, messages: list[str | bytes]) -> None:
    from voicebot.transports.webrtc_call import Call

    state = ServerState(engines.cfg, engines=engines)
    async with open_session(engines) as session:
        call = Call(Connection(state, "webrtc"), "v=0\r\n", {})
        call.session = session
        call._tr = RealtimeTranslator(session, session_id=session.id, model="m", voices=set(engines.tts.voices()))
        channel = call._channel = FakeChannel()  # type: ignore[assignment]
        worker = asyncio.create_task(call._apply_commands())
        try:
            for message in messages:
                call._on_message(message)
            await until(clock_of(engines), call._commands.empty)
            await elapse(clock_of(engines), 0.02)
        finally:
            worker.cancel()
            await asyncio.wait([worker])
        assert worker.cancelled(), "the command worker died"
        check_realtime_out(channel.sent)
        answered = sum(1 for b in channel.sent if b["type"] == "error")
        assert answered <= len(messages)
        check_healthy(session, drain(session))
        await answers_a_normal_request(session)


@SESSION_FUZZ
@given(messages=st.lists(wire_texts(REALTIME) | st.binary(max_size=64), min_size=1, max_size=3))
def test_webrtc_data_channel_messages(loop: asyncio.Runner, engines: Engines, messages: list[str | bytes]) -> None:
    loop.run(_datachannel_once(engines, messages))


def test_webrtc_data_channel_message_over_the_limit_is_refused(loop: asyncio.Runner, engines: Engines) -> None:
    """Issue 8: data-channel messages skipped the size limit every other transport applies."""

    async def run() -> None:
        from voicebot.transports.webrtc_call import Call

        cfg = engines.cfg.model_copy(deep=True)
        cfg.server.max_message_bytes = 4096
        state = ServerState(cfg, engines=engines)
        call = Call(Connection(state, "webrtc"), "v=0\r\n", {})
        channel = call._channel = FakeChannel()  # type: ignore[assignment]
        call._on_message(json.dumps({"type": "conversation.item.create", "item": {
            "role": "user", "content": [{"type": "input_text", "text": "x" * 10_000}]}}))
        assert call._commands.empty(), "an oversized message was queued for the session"
        assert [b["error"]["code"] for b in channel.sent] == ["message_too_large"]

    loop.run(run())


# -------------------------------------------------------------------- Twilio
@FUZZ
@given(text=wire_texts(TWILIO, key="event"))
@example(text='{"event": "start", "start": {"streamSid": "MZ1", "mediaFormat": {"sampleRate": "8k"}}}')
@example(text='{"event": "start", "start": {"streamSid": "MZ1", "mediaFormat": "audio/x-mulaw"}}')
@example(text='{"event": "media", "media": ' + DEEP + "}")
@example(text='{"event": "start", "stream_id": "st1", "start": {"media_format": {"encoding": "PCMA", '
              '"sample_rate": 8000}, "custom_parameters": [{"name": ["voice"], "value": "en-us"}]}}')
@example(text='{"event": "dtmf", "dtmf": {"digit": "' + LONG_ID + '"}}')
def test_twilio_parse_message_is_an_event_or_a_refusal(text: str) -> None:
    try:
        msg = tp.parse_message(text)
    except VoicebotError as exc:
        check_wire_error(exc)
    else:
        assert isinstance(msg, tp.Connected | tp.Start | tp.Media | tp.DtmfPress | tp.MarkEcho | tp.Stop | tp.Other)
        if isinstance(msg, tp.Start):
            assert msg.encoding in ("audio/pcmu", "audio/pcma") and isinstance(msg.stream_id, str)
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in msg.custom.items())


@FUZZ
@given(custom=st.dictionaries(st.sampled_from([*tp.CALL_FIELDS, "token", "x"]) | st.text(max_size=8),
                              st.text(max_size=30) | st.sampled_from(["1e9", "-1", "nan", "inf", "0", "en-us"]),
                              max_size=6))
def test_twilio_custom_parameters_are_settings_or_a_refusal(custom: dict[str, str]) -> None:
    try:
        s = tp.call_settings(SessionSettings.from_config(Config()), custom)
    except VoicebotError as exc:
        check_wire_error(exc)
    else:
        SessionSettings.model_validate(s.model_dump())


@FUZZ
@given(names=st.lists(st.text(max_size=30) | st.from_regex(r"\Aresp_1:[0-9]{1,25}(:end)?\Z"), max_size=6),
       digits=st.lists(st.text(min_size=1, max_size=2), max_size=8))
def test_twilio_marks_and_keypad_take_anything(names: list[str], digits: list[str]) -> None:
    marks = tp.PlayoutMarks(100)
    marks.begin("resp_1")
    for name in names:
        heard = marks.echoed(name)
        assert heard is None or (isinstance(heard, int) and heard >= 0)
    keypad = tp.DtmfCollector(Config().telephony)
    for i, d in enumerate(digits):
        keypad.press(d, float(i))
        keypad.poll(float(i) + 10)


async def _twilio_once(engines: Engines, texts: list[str]) -> None:
    from voicebot.transports.twilio import _Call

    state = ServerState(engines.cfg, engines=engines)
    start = tp.Start("MZ1", "CA1", "audio/pcmu", {}, "twilio")
    async with open_session(engines) as session:
        call = _Call(None, Connection(state, "twilio"), session, state, start)  # type: ignore[arg-type]  # _handle never sends
        for text in texts:
            try:
                if call._handle(tp.parse_message(text)):
                    return  # stop / hang-up digit: the call is over, by the caller's wish
            except VoicebotError as exc:
                check_wire_error(exc)
        await elapse(clock_of(engines), 0.02)
        check_healthy(session, drain(session))
        await answers_a_normal_request(session)


@SESSION_FUZZ
@given(texts=st.lists(wire_texts(TWILIO, key="event"), min_size=1, max_size=4))
def test_twilio_messages_on_a_live_call(loop: asyncio.Runner, engines: Engines, texts: list[str]) -> None:
    loop.run(_twilio_once(engines, texts))


# --------------------------------------------------- session command surface
# What a transport can hand the session after its own parsing: strings, ints and
# settings of any value (session.update passes client fields straight through).
_settings_changes = st.dictionaries(
    st.sampled_from(["system_prompt", "voice", "speed", "language", "turn_detection", "create_response",
                     "interrupt_response", "max_tokens", "output_sample_rate", "unknown_field"]),
    json_values(4),
    max_size=3,
)
_commands = st.one_of(
    st.tuples(st.just("commit_input")),
    st.tuples(st.just("clear_input")),
    st.tuples(st.just("create_response")),
    st.tuples(st.just("cancel_response")),
    st.tuples(st.just("add_text"), st.sampled_from(["user", "assistant", "system", "tool", ""]),
              st.text(max_size=300) | st.sampled_from(["", " ", "x" * 20_000])),
    st.tuples(st.just("truncate"), st.text(max_size=20) | st.just("item_x_1"), st.integers(0, 2**31)),
    st.tuples(st.just("set_played"), st.integers(0, 2**31)),
    st.tuples(st.just("update_settings"), _settings_changes),
    st.tuples(st.just("push_audio"), st.binary(max_size=4000).map(lambda b: b[: len(b) // 2 * 2]),
              st.sampled_from([8000, 16000, 24000, 48000])),
    st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.01, 0.05])),
)


async def _commands_once(engines: Engines, commands: list[tuple[Any, ...]], manual: bool) -> None:
    async with open_session(engines, turn_detection=not manual) as session:
        for name, *args in commands:
            if name == "sleep":
                await elapse(clock_of(engines), args[0])
                continue
            try:
                if name == "update_settings":
                    session.update_settings(**args[0])
                else:
                    getattr(session, name)(*args)
            except VoicebotError as exc:
                assert ERROR_CODE.match(exc.code), exc.code
            except (ValueError, TypeError) as exc:
                # update_settings: the transports turn these into BadMessage
                assert name == "update_settings", f"{name}{tuple(args)!r} raised {exc!r}"
        await elapse(clock_of(engines), 0.05)
        check_healthy(session, drain(session))
        await answers_a_normal_request(session)


@SESSION_FUZZ
@given(commands=st.lists(_commands, min_size=1, max_size=12), manual=st.booleans())
def test_session_command_sequences_leave_it_healthy(
    loop: asyncio.Runner, engines: Engines, commands: list[tuple[Any, ...]], manual: bool
) -> None:
    loop.run(_commands_once(engines, commands, manual))
