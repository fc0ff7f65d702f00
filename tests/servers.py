"""Run the real app in-process on a real socket, with real engines.

In-process (not a subprocess) so tests can look inside afterwards: the open
sessions, vLLM's unfinished requests, the tasks still alive.

A server's engines may come from the test process's :class:`EnginePool`: modules whose
servers differ only in what a session reads from its config (the transports, the reply
length, auth, limits ...) then share one vLLM start, which is most of a server's start
(three processes each importing vLLM). Each module still runs its own app, sessions,
metrics and config on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from aiohttp import web
from running_time import running_clock

from voicebot.audio import float_to_pcm16, pcm16_to_float
from voicebot.config import Config, LlmConfig, load_config
from voicebot.engines.contracts import EndOfTurn
from voicebot.engines.registry import Engines, import_transformers_once, load_engines, resolve_specs
from voicebot.engines.startup import reap_children, start_all
from voicebot.engines.turn.smart_turn import load_smart_turn
from voicebot.engines.turn.vad import SileroVad
from voicebot.probe.base import Audio, ClientClosed, ConnectOptions, Event, make_client
from voicebot.probe.native import NativeClient
from voicebot.server.app import create_app
from voicebot.server.http_server import uvicorn_config
from voicebot.server.state import ServerState

ROOT = Path(__file__).resolve().parents[1]
# For servers whose replies are the random test LLM's tokens, mostly CJK that espeak-ng
# spells out at length and the server plays out in real time (a 4-token reply was ~15 s):
# twice the rate halves that wait. Not for a test that transcribes a reply or barges into
# one (at this rate whisper-tiny hears nothing, and a reply can end before the barge-in).
FAST_SPEECH = "tts.speed=2.0"
MIC_RATE = 16000
OUT_RATE = 16000  # what NativeCall asks the server to send


def cpu_default_llm(max_tokens: int) -> LlmConfig:
    """configs/default.yaml's LLM (Qwen2.5-Coder-0.5B-Instruct, what `make run` serves) at
    temperature 0, for the modules whose replies must be real words: with one section they
    borrow one engine from the pool, and tests/conftest.py runs them in one test process
    (an engine start is ~50 s)."""
    return load_config("configs/default.yaml", ["llm.temperature=0.0", f"llm.max_tokens={max_tokens}"]).llm
FRAME = 320  # 20 ms at 16 kHz
PROTOCOL_PATHS = {"native": "/ws", "realtime": "/v1/realtime", "twilio": "/twilio"}  # WebRTC: HTTP signalling


@dataclass
class RunningServer:
    state: ServerState
    port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, path: str = "/ws") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"


@dataclass
class BorrowedEngines(Engines):
    """A server's engines lent by an :class:`EnginePool`: the app's shutdown leaves them
    running for the next module; the pool closes them at the end of the test process."""

    async def aclose(self) -> None:
        return None


class EnginePool:
    """The engines of one test process, by what each was built from.

    A stage is reused when its config section (and resolved model) is the same, apart
    from ``llm.max_tokens``, which the session reads from its own config for every reply.
    At most ``max_llms`` LLMs are kept (each is an engine core and a worker process, up to
    GBs): a new one closes the one used longest ago. tests/conftest.py orders the modules
    by LLM, so one is enough, and releases the pool before a module that does not use it.
    """

    def __init__(self, max_llms: int = 1) -> None:
        self.max_llms = max_llms
        self._stages: dict[tuple[str, str], Any] = {}  # (stage, key) -> started engine
        self._turn_models: dict[str, EndOfTurn | None] = {}

    async def borrow(self, cfg: Config) -> BorrowedEngines:
        specs = await resolve_specs(cfg)
        paths = {"asr": specs.asr_path, "llm": [specs.llm_path, specs.tokenizer_path], "tts": specs.voice_path}
        keys = {name: _stage_key(cfg, name, paths[name]) for name in ("asr", "llm", "tts")}
        new = {name: getattr(specs, name)() for name in keys if (name, keys[name]) not in self._stages}
        if "llm" in new:
            await self._make_room_for_an_llm()
        if new:
            await asyncio.to_thread(import_transformers_once, cfg)  # as load_engines does
            await start_all(new)
        for name, engine in new.items():
            self._stages[(name, keys[name])] = engine
        engines = {name: self._stages.pop((name, keys[name])) for name in keys}
        for name, engine in engines.items():  # most recently used last
            self._stages[(name, keys[name])] = engine
        turn_key = json.dumps([cfg.vad.model_dump(mode="json"), cfg.models.cache_dir])
        if turn_key not in self._turn_models:
            self._turn_models[turn_key] = await load_smart_turn(cfg)
        return BorrowedEngines(cfg, engines["asr"], engines["llm"], engines["tts"], SileroVad(), specs=specs,
                               turn_model=self._turn_models[turn_key])

    async def _make_room_for_an_llm(self) -> None:
        llms = [key for key in self._stages if key[0] == "llm"]
        for key in llms[: max(0, len(llms) - self.max_llms + 1)]:
            await self._stages.pop(key).aclose()

    async def aclose(self) -> None:
        """Close every engine (the pool stays usable: the next borrow starts them again)."""
        stages, self._stages = list(self._stages.values()), {}
        results = await asyncio.gather(*(e.aclose() for e in stages), return_exceptions=True)
        await reap_children()
        for model in self._turn_models.values():
            if model is not None:
                model.close()
        self._turn_models.clear()
        gc.collect()  # vLLM's AsyncLLM sits in a reference cycle (see voicebot/server/app.py)
        for r in results:
            if isinstance(r, BaseException):
                raise r


def _stage_key(cfg: Config, stage: str, resolved: object) -> str:
    section = getattr(cfg, stage).model_dump(mode="json", exclude={"max_tokens"} if stage == "llm" else None)
    return json.dumps([section, resolved], sort_keys=True)


@contextlib.asynccontextmanager
async def running_server(
    cfg: Config, state: ServerState | None = None, *, pool: EnginePool | None = None
) -> AsyncIterator[RunningServer]:
    """Load engines (unless ``state`` already has them; from ``pool`` if given), serve,
    and shut down cleanly."""
    state = state or ServerState(cfg)
    if state.engines is None:
        state.engines = await (pool.borrow(cfg) if pool is not None else load_engines(cfg))
    try:
        app = create_app(cfg, load=False, state=state)
    except BaseException:
        # Nothing will run the lifespan that would close them: no engine process may
        # outlive a failed start.
        await state.engines.aclose()
        raise
    # voicebot serve's settings on a free loopback port.
    server = uvicorn.Server(uvicorn_config(cfg, app, host="127.0.0.1", port=0, lifespan="on", log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(60):
            while not server.started:
                if task.done():
                    task.result()  # surfaces why it could not start
                await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningServer(state, port)
    finally:
        server.should_exit = True
        await task  # the app's lifespan closes sessions and engines
    # The heap frozen before the first call (voicebot/runtime/gc_freeze.py) is unfrozen,
    # so the exit's collection reached vLLM's AsyncLLM cycle.
    assert gc.get_freeze_count() == 0, "the server left the heap frozen"


@contextlib.contextmanager
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """Every ERROR the server logs (uvicorn's "Exception in ASGI application" included:
    uvicorn's loggers do not propagate to the root logger that caplog watches)."""
    seen: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Catch(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "voicebot")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield seen
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@dataclass
class NativeCall:
    """One scripted caller on native /ws: a mic that sends silence between utterances
    (a phone line is never quiet on the wire: the frames keep the VAD clock going) and
    streams clips in real time, and a record of what comes back. Every event carries
    its arrival time as ``_t``; ``audio`` holds (arrival time, response id, pcm)."""

    client: NativeClient
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: list[tuple[float, str | None, bytes]] = field(default_factory=list)
    _response: str | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _mic: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sender of mic frames at a time

    @classmethod
    async def open(cls, server: RunningServer, *, token: str | None = None, **start: object) -> NativeCall:
        client = NativeClient(ConnectOptions(server.ws(), MIC_RATE, OUT_RATE, token=token, start_fields=dict(start)))
        await client.connect()
        call = cls(client)
        call._tasks = [asyncio.create_task(call._read()), asyncio.create_task(call._silence())]
        return call

    @classmethod
    async def over(
        cls, server: RunningServer, protocol: str, *, output_rate: int | None = OUT_RATE,
        start_fields: dict[str, Any] | None = None,
    ) -> NativeCall:
        """A call over ``protocol`` (native, realtime, twilio, webrtc), driven by the probe's
        client for that wire, which reads back the native event names. ``output_rate``:
        the rate the client hands reply audio on (None: the wire's own, as the server sends
        it: native's session default, Realtime's 24 kHz PCM, Twilio's 8 kHz, WebRTC's 48 kHz)."""
        url = server.http if protocol == "webrtc" else server.ws(PROTOCOL_PATHS.get(protocol, "/ws"))
        before = set(server.state.sessions)
        client = make_client(protocol, ConnectOptions(url, MIC_RATE, output_rate, start_fields=start_fields or {}))
        await client.connect()
        call = cls(client)  # type: ignore[arg-type]
        call._tasks = [asyncio.create_task(call._read()), asyncio.create_task(call._silence())]
        if protocol == "twilio":  # the wire names no session: the one this call opened
            async with asyncio.timeout(10):
                while not set(server.state.sessions) - before:
                    await asyncio.sleep(0.02)
            (client.session_id,) = set(server.state.sessions) - before  # type: ignore[attr-defined]
        return call

    @property
    def session_id(self) -> str:
        assert self.client.session_id
        return self.client.session_id

    async def _read(self) -> None:
        with contextlib.suppress(ClientClosed):
            while True:
                item = await self.client.receive()
                if isinstance(item, Audio):
                    self.audio.append((item.t, self._response, item.pcm))
                elif isinstance(item, Event):
                    item.data["_t"] = item.t
                    if item.data["type"] == "response.started":
                        self._response = item.data["response_id"]
                    self.events.append(item.data)

    async def _silence(self) -> None:
        while True:
            async with self._mic:
                await self.client.send_audio(bytes(2 * FRAME))
            await asyncio.sleep(0.02)

    async def say(
        self, audio: np.ndarray, *, pause_at_s: float | None = None, resume_when: Callable[[], bool] | None = None
    ) -> float:
        """Stream ``audio`` (16 kHz) in real time; return when its last frame was sent.

        With ``pause_at_s``, the mic sends nothing from that point of the clip until
        ``resume_when()`` holds (within 60 s): the server's clock is the audio it gets, so a
        wire pause is not a pause in speech, and whatever the server does per second of
        audio (partials) happens before the rest however slow the machine is.
        """
        async with self._mic:
            start = time.monotonic()
            for i in range(0, audio.size, FRAME):
                if resume_when is not None and pause_at_s is not None and i == int(pause_at_s * MIC_RATE) // FRAME * FRAME:
                    async with asyncio.timeout(60):
                        while not resume_when():
                            await asyncio.sleep(0.02)
                    start = time.monotonic() - i / MIC_RATE
                await self.client.send_audio(float_to_pcm16(audio[i : i + FRAME]))
                # Sleep to the frame's due time, not a fixed 20 ms: no drift.
                await asyncio.sleep(max(0.0, start + (i + FRAME) / MIC_RATE - time.monotonic()))
            return time.monotonic()

    async def wait_for(self, kind: str, timeout: float = 60.0, after: int = 0, **match: object) -> dict[str, Any]:
        """The first event of ``kind`` (from index ``after`` on) whose fields match;
        TimeoutError after ``timeout`` s of this process's running time (tests/running_time.py)."""
        async with running_clock() as clock:
            while True:
                for e in self.events[after:]:
                    if e["type"] == kind and all(e.get(k) == v for k, v in match.items()):
                        return e
                if clock.over(timeout):
                    raise TimeoutError(f"no {kind} event in {clock.waited()}")
                await asyncio.sleep(0.02)

    async def turn(self, audio: np.ndarray, timeout: float = 60.0) -> dict[str, Any]:
        """Say ``audio``; return the response.done of the reply to it."""
        mark = len(self.events)
        await self.say(audio)
        return await self.wait_for("response.done", timeout, after=mark)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def errors(self) -> list[dict[str, Any]]:
        return self.of("error")

    def reply_audio(self, response_id: str) -> np.ndarray:
        return pcm16_to_float(b"".join(p for _, r, p in self.audio if r == response_id))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.client.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def serve_routes(routes: list[web.RouteDef]) -> AsyncIterator[str]:
    """A local aiohttp server of ``routes`` on a free port; yields its base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def service_process(command: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``voicebot asr-serve`` / ``tts-serve`` ``args`` in its own process group (killed
    whole on exit); yields it and its URL, which it prints as one JSON line once it
    listens (``{"asr_service": URL}``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicebot", command, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,  # not a session: autogroup would give it a share of the cores of its own
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # EOF if it died first
        assert line, f"{command} exited with {proc.wait(5)} before listening"
        yield proc, json.loads(line)[command.replace("-serve", "_service")]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
