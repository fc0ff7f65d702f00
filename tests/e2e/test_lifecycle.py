"""Engine lifecycle: all-or-nothing start, health, supervised restart, drain on SIGTERM.

The unit tests use fakes of our own engine interface (start / aclose / health reads);
the ``engines`` tests start the real test engines (tiny random Qwen3 on vLLM, Whisper
tiny, espeak-ng) and kill real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import websockets

from voicebot.config import Config, ModelsConfig, load_config
from voicebot.engines.registry import Engines, load_engines
from voicebot.engines.startup import ABORT_WAIT_S, start_all
from voicebot.engines.supervisor import RestartPolicy, Supervisor
from voicebot.engines.tts.pool import WorkerPool
from voicebot.errors import EngineError, ModelError
from voicebot.server.app import create_app
from voicebot.server.drain import drain
from voicebot.server.state import ServerState

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- helpers
def engine_processes() -> list[psutil.Process]:
    """Live vLLM processes under this one (multiprocessing's shared resource tracker aside)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                found.append(p)
    return found


def engine_threads() -> list[str]:
    """Threads of our engines' pools and of vLLM's client (its engine-core monitor)."""
    prefixes = ("asr", "tts-", "MPClientEngineMonitor")
    return [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]


def engine_builds() -> list[str]:
    """Threads still inside an engine's build (vLLM's ``from_engine_args`` runs in one:
    voicebot/engines/llm/inprocess.py): a build that went on after an aborted start would
    spawn an engine core later. Read from every thread's stack, so it holds at once."""
    found = []
    for ident, frame in sys._current_frames().items():
        f: Any = frame
        while f is not None:
            code = f.f_code
            if code.co_name == "_build" and f"voicebot{os.sep}engines{os.sep}" in code.co_filename:
                found.append(f"thread {ident}: {code.co_filename}:{f.f_lineno}")
                break
            f = f.f_back
    return found


def engine_core(parent: psutil.Process | None = None) -> psutil.Process | None:
    for p in (parent or psutil.Process()).children():
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("VLLM") and p.status() != psutil.STATUS_ZOMBIE:
                return p
    return None


async def until(condition: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(step)


def make_config(models_config: ModelsConfig, *overrides: str) -> Config:
    return load_config(
        str(ROOT / "configs/test.yaml"),
        [f"models.cache_dir={models_config.cache_dir}", "server.transports=[native]", *overrides],
    )


class FakeEngine:
    """Our engine interface (start / aclose), with a start that takes ``delay`` and may fail."""

    def __init__(self, name: str, delay: float = 0.0, error: Exception | None = None) -> None:
        self.name, self.delay, self.error = name, delay, error
        self.started = self.closed = False
        self.start_finished = False
        self.queue_depth = self.running = self.background_waiting = 0  # what /healthz reads

    async def start(self) -> None:
        try:
            await asyncio.sleep(self.delay)
            if self.error is not None:
                raise self.error
            self.started = True
        finally:
            self.start_finished = True

    async def aclose(self) -> None:
        self.closed = True


class FakeLlm(FakeEngine):
    dead_reason: str | None = None


class FakeAsr(FakeEngine):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.stats = SimpleNamespace(partial_decodes=0, final_decodes=0, failed_decodes=0)  # AsrStats


class FakeTts(FakeEngine):
    failure_streak = 0
    last_error = None

    def voices(self) -> list[str]:
        return ["en-us"]


# ------------------------------------------------------------------- start / abort
async def test_a_failed_start_closes_the_engines_that_started_and_waits_for_the_rest() -> None:
    fast = FakeEngine("fast")
    slow = FakeEngine("slow", delay=0.3)
    bad = FakeEngine("bad", delay=0.05, error=ModelError("no such voice"))
    with pytest.raises(ModelError, match="no such voice"):
        await start_all({"fast": fast, "slow": slow, "bad": bad})
    # The slow one was not abandoned mid-start: it finished and was closed after.
    assert slow.start_finished and slow.closed
    assert fast.started and fast.closed and bad.closed


async def test_cancelling_a_start_closes_everything() -> None:
    fast, slow = FakeEngine("fast"), FakeEngine("slow", delay=0.3)
    task = asyncio.create_task(start_all({"fast": fast, "slow": slow}))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fast.closed and slow.start_finished and slow.closed


@pytest.mark.engines
async def test_a_failed_engine_start_leaves_no_vllm_engine_running(models_config: ModelsConfig) -> None:
    # espeak-ng knows no voice "xx-none": TTS fails at once while vLLM is still building.
    cfg = make_config(models_config, "tts.voice=xx-none")
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="xx-none"):
        await load_engines(cfg)
    took = time.monotonic() - t0
    # Whatever vLLM had started is gone, and no build goes on in a thread: none can spawn
    # an engine core later.
    assert engine_processes() == [], [p.cmdline() for p in engine_processes()]
    assert engine_builds() == []
    assert engine_threads() == []
    print(f"failed start undone in {took:.1f} s")


@pytest.mark.engines
async def test_shutdown_while_loading_returns_promptly_and_leaves_nothing(models_config: ModelsConfig) -> None:
    state = ServerState(make_config(models_config))
    app = create_app(state.cfg, state=state)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(app.router.lifespan_context(app))
        # The build is in vLLM's hands once its engine-core process exists.
        await until(engine_core, 120, "vLLM's engine-core process to start")
        t0 = time.monotonic()
    took = time.monotonic() - t0
    # A hang bound: the build threads that cannot be interrupted get ABORT_WAIT_S.
    assert took < ABORT_WAIT_S, f"shutdown during loading took {took:.1f} s"
    assert state.engines is None
    assert engine_builds() == []  # none can bring an engine up later
    assert engine_processes() == [], [p.cmdline() for p in engine_processes()]
    print(f"shutdown during loading took {took:.1f} s")


# --------------------------------------------------------------------------- health
async def test_tts_pool_counts_failures_in_a_row() -> None:
    pool = WorkerPool(1, 4, "tts-test")
    pool.start()

    def fail() -> None:
        raise EngineError("synthesiser crashed")

    try:
        for _ in range(3):
            with pytest.raises(EngineError):
                await pool.submit(fail).future
        assert pool.failure_streak == 3 and "crashed" in str(pool.last_error)
        await pool.submit(lambda: np.zeros(1)).future
        assert pool.failure_streak == 0
    finally:
        await pool.aclose()


def fake_engines(specs: Any = None) -> Engines:
    return Engines(Config(), FakeAsr("asr"), FakeLlm("llm"), FakeTts("tts"), None, specs=specs)  # type: ignore[arg-type]


class FakeSpecs:
    """Builds replacement engines; the first ``fail_first`` LLM builds fail to start."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.built: list[FakeEngine] = []

    def llm(self) -> FakeLlm:
        error = ModelError("engine-core did not come up") if len(self.built) < self.fail_first else None
        engine = FakeLlm("llm", error=error)
        self.built.append(engine)
        return engine


async def test_supervisor_restarts_a_dead_llm_with_backoff() -> None:
    specs = FakeSpecs(fail_first=1)
    engines = fake_engines(specs)
    old = engines.llm
    failures: list[tuple[str, str]] = []
    sup = Supervisor(engines, policy=RestartPolicy(backoff_s=0.05), on_failure=lambda n, r: failures.append((n, r)))
    sup.check()
    assert engines.failure() is None and not failures

    old.dead_reason = "vLLM engine dead: its engine-core process exited"  # type: ignore[attr-defined]
    sup.check()
    assert failures and failures[0][0] == "llm" and "engine-core process exited" in failures[0][1]
    assert "llm: vLLM engine dead" in (engines.failure() or "")
    await sup.wait_restarts()
    assert old.closed
    assert len(specs.built) == 2 and specs.built[0].closed  # the failed try was cleaned up
    assert engines.llm is specs.built[1] and engines.llm.started
    h = engines.health["llm"]
    assert h.ok and h.restarts == 1 and engines.failure() is None
    await sup.aclose()


async def test_supervisor_gives_up_after_bounded_attempts() -> None:
    specs = FakeSpecs(fail_first=10)
    engines = fake_engines(specs)
    engines.llm.dead_reason = "dead"  # type: ignore[attr-defined]
    sup = Supervisor(engines, policy=RestartPolicy(backoff_s=0.01, max_attempts=3))
    sup.check()
    await sup.wait_restarts()
    assert len(specs.built) == 3
    h = engines.health["llm"]
    assert h.state == "gave_up" and "3 restarts failed" in (h.reason or "")
    assert "llm:" in (engines.failure() or "")
    await sup.aclose()


async def test_asr_and_tts_fail_after_consecutive_errors() -> None:
    engines = fake_engines()
    sup = Supervisor(engines, policy=RestartPolicy(failure_threshold=3))
    asr = engines.asr.stats  # type: ignore[attr-defined]
    asr.failed_decodes = 2
    assert sup.probe("asr") is None  # the first look sets the baseline
    asr.failed_decodes, asr.final_decodes = 4, 1  # a success in between: streak 0
    assert sup.probe("asr") is None
    asr.failed_decodes = 7
    assert "3 ASR decode calls failed in a row" in (sup.probe("asr") or "")
    engines.tts.failure_streak = 3  # type: ignore[misc]
    assert "TTS synthesis" in (sup.probe("tts") or "")


async def test_healthz_is_503_with_the_reason_while_an_engine_is_down() -> None:
    state = ServerState(Config())
    state.engines = fake_engines()
    app = create_app(state.cfg, load=False, state=state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        ok = await http.get("/healthz")
        assert ok.status_code == 200 and ok.json()["engines"]["llm"]["ok"] is True
        state.engines.health["llm"].set("failed", "vLLM engine dead: its engine-core process exited")
        bad = await http.get("/healthz")
    body = bad.json()
    assert bad.status_code == 503 and body["status"] == "unhealthy"
    assert "llm: vLLM engine dead" in body["error"] and body["engines"]["llm"]["ok"] is False
    assert state.engine_failure() == body["error"]


# ------------------------------------------------------------------ drain (unit)
class FakeSession:
    def __init__(self, sid: str, replying: bool) -> None:
        self.id, self.replying = sid, replying
        self.closed_reason: str | None = None
        self.errors: list[tuple[str, bool]] = []

    def error(self, code: str, message: str, *, fatal: bool = False) -> None:
        self.errors.append((code, fatal))
        self.closed_reason = code


async def test_drain_lets_replies_finish_then_ends_each_session() -> None:
    state = ServerState(Config())
    idle, speaking, stuck = FakeSession("a", False), FakeSession("b", True), FakeSession("c", True)
    state.sessions = {s.id: s for s in (idle, speaking, stuck)}  # type: ignore[misc]

    async def transports() -> None:
        # What a transport does: a session told to end leaves; one reply ends at 0.2 s.
        t0 = time.monotonic()
        while state.sessions:
            if time.monotonic() - t0 > 0.2:
                speaking.replying = False
            for sid, s in list(state.sessions.items()):
                if s.closed_reason:
                    del state.sessions[sid]
            await asyncio.sleep(0.01)

    helper = asyncio.create_task(transports())
    t0 = time.monotonic()
    await drain(state, timeout_s=0.6)
    took = time.monotonic() - t0
    await helper
    assert state.draining and not state.sessions
    assert idle.errors == [("server_shutdown", True)]
    assert speaking.errors == [("server_shutdown", True)] and stuck.errors == [("server_shutdown", True)]
    assert 0.55 < took < 3.5  # the stuck reply was cut at the timeout (0.6 s), not after its grace
    assert state.status() == ("draining", "draining: the server is shutting down")


# ------------------------------------------------------------ engine failure (e2e)
async def native_call(port: int, **start: object) -> Any:
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None)
    await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000, **start}))
    return ws


async def next_event(ws: Any, timeout: float = 30.0, kinds: tuple[str, ...] = ()) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                continue
            event = json.loads(msg)
            if not kinds or event["type"] in kinds:
                return event  # type: ignore[no-any-return]


async def reply_completes(port: int) -> dict[str, Any]:
    # A few tokens, spoken fast: the check is that the engine answers, and the random
    # test model's words would take the TTS a minute of real-time audio at its defaults.
    ws = await native_call(port, max_tokens=3, speed=4.0)
    try:
        started = await next_event(ws, kinds=("session.started", "error"))
        assert started["type"] == "session.started", started
        await ws.send(json.dumps({"type": "text.input", "text": "Hello there."}))
        return await next_event(ws, 120, kinds=("response.done", "error"))
    finally:
        await ws.close()


# ------------------------------------------------------------------- drain (e2e)
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_log(proc: subprocess.Popen[bytes]) -> str:
    log = proc.voicebot_log  # type: ignore[attr-defined]
    log.seek(0)
    text = log.read().decode(errors="replace")
    log.seek(0, os.SEEK_END)
    return str(text)


@contextlib.contextmanager
def serve_subprocess(models_config: ModelsConfig, port: int, *overrides: str) -> Iterator[subprocess.Popen[bytes]]:
    args = [sys.executable, "-m", "voicebot", "serve", "--config", "configs/test.yaml", "--port", str(port),
            "--no-pull", "--set", f"models.cache_dir={models_config.cache_dir}",
            "--set", "server.transports=[native,realtime]"]
    for o in overrides:
        args += ["--set", o]
    # The server's log, shown when a test fails (pytest prints captured output then).
    log = tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=log, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    proc.voicebot_log = log  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        if proc.poll() is None:
            # The whole tree: a SIGKILLed server would orphan its engine-core process.
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            proc.kill()
        proc.wait()
        log.seek(0)
        sys.stderr.write(log.read()[-20_000:].decode(errors="replace"))
        log.close()


# One server process for both stories: each start of the test engines costs ~50 s.
@pytest.mark.engines
async def test_a_killed_engine_core_is_reported_and_restarted_then_sigterm_drains_and_exits_0(
    models_config: ModelsConfig,
) -> None:
    port = free_port()
    with serve_subprocess(models_config, port, "server.drain_timeout_s=30") as proc:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            await until_ready(proc, http)
            await killed_engine_check(proc, port, http)
        await drain_check(proc, port)


async def until_ready(proc: subprocess.Popen[bytes], http: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "the server exited while starting"
        with contextlib.suppress(httpx.TransportError):
            if (await http.get("/healthz")).status_code == 200:
                return
        assert time.monotonic() < deadline, "server did not become ready"
        await asyncio.sleep(0.5)


async def killed_engine_check(proc: subprocess.Popen[bytes], port: int, http: httpx.AsyncClient) -> None:
    ws = await native_call(port)
    assert (await next_event(ws, kinds=("session.started",)))["type"] == "session.started"

    core = engine_core(psutil.Process(proc.pid))
    assert core is not None
    core.kill()

    # The call in progress gets an error event and is ended.
    error = await next_event(ws, 15, kinds=("error",))
    assert error["code"] == "engine_failed" and error["fatal"] is True, error
    assert "llm" in error["message"]
    with pytest.raises(websockets.ConnectionClosed):
        await next_event(ws, 10)
    # /healthz says why, and a new call is refused with that reason.
    health = await http.get("/healthz")
    body = health.json()
    assert health.status_code == 503 and body["status"] == "unhealthy", body
    assert "llm: vLLM engine dead" in body["error"], body
    refused = await native_call(port)
    event = await next_event(refused, kinds=("error", "session.started"))
    assert event["type"] == "error" and "vLLM engine dead" in event["message"], event
    await refused.close()

    # The supervised restart brings the service back in the same process, with a new
    # engine core, and calls are answered again.
    t0 = time.monotonic()

    async def restarted() -> bool:
        r = await http.get("/healthz")
        return r.status_code == 200 and r.json()["engines"]["llm"]["restarts"] == 1

    await until_async(restarted, bool, 180)
    print(f"LLM back {time.monotonic() - t0:.1f} s after the failure was reported")
    done = await reply_completes(port)
    assert done["type"] == "response.done" and done["status"] == "completed", done


async def drain_check(proc: subprocess.Popen[bytes], port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:

        async def healthz() -> httpx.Response | None:
            try:
                return await http.get("/healthz")
            except httpx.TransportError:
                return None

        await until_ready(proc, http)
        # What the server logs from here on is the drain's and the exit's.
        logged_before = len(server_log(proc))
        engines = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "resource_tracker" not in " ".join(p.cmdline())]

        # The random test model's 24 tokens are CJK that espeak-ng spells out for over
        # a minute: 3 tokens at 4x speed make a reply of a few seconds.
        ws = await native_call(port, max_tokens=3, speed=4.0)
        assert (await next_event(ws, kinds=("session.started",)))["type"] == "session.started"
        await ws.send(json.dumps({"type": "text.input", "text": "Tell me a story."}))
        await next_event(ws, 60, kinds=("response.started",))

        # A second caller, on the Realtime protocol, connected and silent.
        idle = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?model=m", subprotocols=["realtime"])
        assert (await next_event(idle, kinds=("session.created",)))["type"] == "session.created"

        # The loop watch runs (what the check of its log at the end relies on): its 100 ms
        # timer has fired (this point can come ~70 ms after the server is ready).
        async def ticks() -> float:
            found = re.search(r"^voicebot_event_loop_lag_seconds_count (\S+)$", (await http.get("/metrics")).text, re.M)
            return float(found.group(1)) if found else -1.0

        assert await until_async(ticks, lambda n: n > 0, 5) > 0

        # multiprocessing's resource tracker, which prints leaked shared memory as it exits.
        tracker = [p for p in psutil.Process(proc.pid).children() if "resource_tracker" in " ".join(p.cmdline())]
        proc.send_signal(signal.SIGTERM)
        # Draining: still listening, but out of rotation and refusing new calls.
        r = await until_async(healthz, lambda r: r is not None and r.status_code == 503, 5)
        assert r.json()["status"] == "draining", r.json()
        refused = await native_call(port)
        event = await next_event(refused, kinds=("error", "session.started"))
        assert event["type"] == "error" and event["code"] == "draining", event
        await refused.close()

        # The reply in progress finishes, then the call is ended with a reason.
        seen: list[dict[str, Any]] = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                seen.append(await next_event(ws, 30))
        kinds = [e["type"] for e in seen]
        why = (kinds[-6:], seen[-1], closed.value.rcvd)
        assert "response.done" in kinds and kinds[-1] == "error", why
        done = next(e for e in seen if e["type"] == "response.done")
        assert done["status"] == "completed", done
        assert seen[-1]["code"] == "server_shutdown" and seen[-1]["fatal"] is True, seen[-1]
        assert closed.value.rcvd is not None  # a close frame, not a dropped connection
        assert closed.value.rcvd.code == 1001, closed.value.rcvd  # going away
        # The idle Realtime caller is told why, in its protocol's error shape, and closed.
        with pytest.raises(websockets.ConnectionClosed) as idle_closed:
            while True:
                last = await next_event(idle, 30)
        assert last["type"] == "error" and last["error"]["code"] == "server_shutdown", last
        assert idle_closed.value.rcvd is not None and idle_closed.value.rcvd.code == 1001, idle_closed.value.rcvd
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0
        # No engine process outlives the server (the restarted engine core and its worker).
        _, alive = await asyncio.to_thread(psutil.wait_procs, engines, 10)
        assert not alive, [p.pid for p in alive]
        await asyncio.to_thread(psutil.wait_procs, tracker, 10)
        out = server_log(proc)
        # Shared memory is checked over the whole run: the killed engine core's rings too.
        assert "leaked shared_memory" not in out, out[-3000:]
        out = out[logged_before:]
        assert "Traceback" not in out and "Exception in ASGI application" not in out, out[-3000:]
        # vLLM force-kills an engine core that outlives its shutdown grace, before it
        # unlinks its shared-memory rings (voicebot/engines/shm.py releases them).
        assert "leaked shared_memory" not in out, out[-3000:]
        # Closing the engines leaves the loop free: vLLM's shutdown() joins its engine-core
        # process, which on the loop stalled it ~5 s at every exit (server.loop_stall_s
        # logged the stack: voicebot/engines/llm/inprocess.py, aclose, engine.shutdown()).
        stuck = [stack for stack in loop_stall_stacks(out) if "voicebot/engines/" in stack and "aclose" in stack]
        assert not stuck, stuck[0]


def loop_stall_stacks(log: str) -> list[str]:
    """The stacks voicebot/runtime/loop_watch.py logged for a blocked event loop."""
    stacks = []
    for block in log.split("the event loop has not run for")[1:]:
        lines = block.splitlines()
        stacks.append("\n".join(lines[:1] + [line for line in itertools.takewhile(
            lambda line: line.startswith("  "), lines[1:])]))
    return stacks


async def until_async(get: Any, ok: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await get()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: last {value}"
        await asyncio.sleep(0.05)


async def test_metrics_and_health_details_need_the_key_when_keys_are_set() -> None:
    state = ServerState(Config.model_validate({"server": {"api_key": "k-123"}}))
    state.engines = fake_engines()
    app = create_app(state.cfg, load=False, state=state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.get("/metrics")).status_code == 401
        metrics = await http.get("/metrics", headers={"Authorization": "Bearer k-123"})
        assert metrics.status_code == 200
        for name in ("voicebot_asyncio_tasks", "process_open_fds", "process_resident_memory_bytes", "voicebot_engine_up"):
            assert name in metrics.text, name
        bare = await http.get("/healthz")
        assert bare.status_code == 200 and bare.json() == {"ready": True, "status": "ok"}
        full = await http.get("/healthz", headers={"Authorization": "Bearer k-123"})
        assert full.json()["engines"]["tts"]["ok"] is True
        state.draining = True
        assert (await http.get("/healthz")).json() == {"ready": False, "status": "draining"}
