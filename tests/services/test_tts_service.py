"""The shared TTS service (``voicebot tts-serve``) and its frontend engine (``tts.backend: remote``).

Real service code on a real localhost WebSocket, with a scripted fake of our own
:class:`~voicebot.engines.tts.TtsEngine` inside the service: it yields one chunk per sentence
only when asked and records what it was asked for and when its stream was closed, so flow
control, cancellation and failures are seen without a model. tests/services/test_tts_service_e2e.py
runs the real ``voicebot tts-serve`` with Piper.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator

import numpy as np
import pytest
import websockets
from fakes import FakeLoopWatch
from llm_tier import free_port

from voicebot.config import RemoteTtsConfig, TtsConfig, load_config
from voicebot.engines.contracts import SeveralServices
from voicebot.engines.registry import create_tts
from voicebot.engines.tts.remote import RemoteTts
from voicebot.errors import CapacityError, ConfigError, EngineError, LateLoopTimeout, ModelError
from voicebot.services.tts_service import TtsService, listen

WAIT = 10.0  # generous: only a hang reaches it
RATE = 16_000


class ScriptedTts:
    """A :class:`TtsEngine` whose sentence i is ``RATE // 10`` samples of value i + 1."""

    sample_rate = RATE

    def __init__(self, *, fail_on: str | None = None, hold: asyncio.Event | None = None) -> None:
        self.fail_on = fail_on  # text that raises EngineError after its first sentence
        self.hold = hold  # sentences after the first wait for this
        self.delay_s = 0.0  # before a clause's first sentence
        self.produced = 0  # sentences pulled from a stream
        self.closed = 0  # streams closed before their end (GeneratorExit / cancel)
        self.finished = 0
        self.texts: list[tuple[str, str | None, float | None]] = []
        self.aheads: list[float] = []

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    @property
    def queue_depth(self) -> int:
        return 0

    @property
    def failure_streak(self) -> int:
        return 0

    @property
    def last_error(self) -> BaseException | None:
        return None

    def voices(self) -> list[str]:
        return ["alpha", "beta"]

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        self.texts.append((text, voice, speed))
        self.aheads.append(ahead_s)
        sentences = [s for s in text.split(".") if s.strip()]
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            for i, _ in enumerate(sentences):
                if i and self.hold is not None:
                    await self.hold.wait()
                if i and text == self.fail_on:
                    raise EngineError("scripted failure", code="engine_error")
                self.produced += 1
                yield np.full(RATE // 10, float(i + 1), dtype=np.float32)
        except (GeneratorExit, asyncio.CancelledError):
            self.closed += 1
            raise
        self.finished += 1


@contextlib.asynccontextmanager
async def service(engine: ScriptedTts) -> AsyncIterator[tuple[TtsService, str]]:
    svc = TtsService(engine, engine_name="scripted")  # type: ignore[arg-type]
    try:
        async with listen(svc, "127.0.0.1", 0) as server:
            host, port = next(iter(server.sockets)).getsockname()[:2]
            yield svc, f"ws://{host}:{port}"
    finally:
        await svc.aclose()


@contextlib.asynccontextmanager
async def frontend(url: str, **remote: object) -> AsyncIterator[RemoteTts]:
    rcfg = RemoteTtsConfig(url=url, **{"retries": 1, "retry_backoff_s": 0.05, "startup_timeout_s": 2.0, **remote})  # type: ignore[arg-type]
    engine = create_tts(TtsConfig(backend="remote", remote=rcfg), None)
    assert isinstance(engine, RemoteTts)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.aclose()


async def until(cond: object, timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_a_clause_streams_sentence_by_sentence_with_the_services_rate_and_voices() -> None:
    fake = ScriptedTts()
    async with service(fake) as (svc, url), frontend(url) as tts:
        assert tts.sample_rate == RATE and tts.voices() == ["alpha", "beta"]
        chunks = [c async for c in tts.synthesize("One. Two. Three.", voice="beta", speed=1.5)]
        assert [float(c[0]) for c in chunks] == [1.0, 2.0, 3.0]
        assert all(c.dtype == np.float32 and c.size == RATE // 10 for c in chunks)
        assert fake.texts == [("One. Two. Three.", "beta", 1.5)] and fake.aheads == [0.0]
        assert len([c async for c in tts.synthesize("Four.", ahead_s=1.25)]) == 1
        assert fake.aheads == [0.0, 1.25]  # the engine's queue order crosses the wire
        assert [c async for c in tts.synthesize(" *** ")] == []  # nothing speakable: no request
        assert len(fake.texts) == 2
        await until(lambda: svc.running == 0)
        assert svc.stats.clauses == 2 and svc.stats.chunks == 4 and svc.stats.cancelled == 0
        assert tts.completed == 2 and tts.failure_streak == 0 and tts.queue_depth == 0


async def test_the_service_times_first_clauses_and_counts_later_ones_that_came_late() -> None:
    fake = ScriptedTts()
    async with service(fake) as (svc, url), frontend(url) as tts:
        assert "first_audio_ms_p95" not in svc.snapshot()  # no clause yet: no figure
        # A first clause (nothing ahead of it), and a later one needed in an hour: on time.
        assert len([c async for c in tts.synthesize("Sure.")]) == 1
        assert len([c async for c in tts.synthesize("Later.", ahead_s=3600.0)]) == 1
        # A later clause needed 10 ms after its request, whose first audio takes 50 ms: late.
        fake.delay_s = 0.05
        assert len([c async for c in tts.synthesize("Late.", ahead_s=0.01)]) == 1
        await until(lambda: svc.running == 0)
        snap = svc.snapshot()
    assert svc.stats.late == 1 and snap["late"] == 1
    assert 0.0 <= snap["first_audio_ms_p50"] <= snap["first_audio_ms_p95"] < 1000.0
    assert snap["late_ms_p95"] >= 30.0  # 50 ms against 10 ms of audio ahead
    assert "forward_ms_p95" not in snap  # the scripted engine batches nothing


async def test_the_service_runs_one_window_ahead_of_what_the_session_took() -> None:
    fake = ScriptedTts()
    async with service(fake) as (svc, url), frontend(url, window=1) as tts:
        async with contextlib.aclosing(tts.synthesize("a. b. c. d. e. f. g. h.")) as stream:
            first = await asyncio.wait_for(anext(stream), WAIT)
            assert float(first[0]) == 1.0
            # Taken: 1. Sent and not taken: 2. Pulled from the engine and held: 3.
            await until(lambda: fake.produced == 3)
            # Nothing runs between the engine's yield and the clause's wait for room, so the
            # clause is blocked now: window chunks unacked, and only an ack wakes it.
            (conn,) = svc._conns
            (job,) = conn.jobs.values()
            assert job.unacked == job.window == 1 and not job.room.is_set()
            assert job.task is not None and not job.task.done()
            assert fake.produced == 3, "the service ran ahead of the session's acks"
            assert float((await asyncio.wait_for(anext(stream), WAIT))[0]) == 2.0
            await until(lambda: fake.produced == 4)
        # Closing the stream early cancels the clause on the service: its engine stream closes.
        await until(lambda: fake.closed == 1 and svc.running == 0)
        assert svc.stats.cancelled == 1 and fake.produced == 4 and fake.finished == 0


async def test_a_cancelled_consumer_cancels_the_synthesis_on_the_service() -> None:
    hold = asyncio.Event()
    fake = ScriptedTts(hold=hold)
    async with service(fake) as (svc, url), frontend(url) as tts:

        async def speak() -> None:
            async for _ in tts.synthesize("a. b. c."):
                pass

        task = asyncio.create_task(speak())
        await until(lambda: fake.produced == 1)  # the second sentence is held in the engine
        task.cancel()  # a barge-in
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: fake.closed == 1 and svc.running == 0)
        assert svc.stats.cancelled == 1
        assert tts.failure_streak == 0 and tts.failed == 0  # a cancel is not a failure


async def test_a_closed_connection_cancels_its_clauses() -> None:
    hold = asyncio.Event()
    fake = ScriptedTts(hold=hold)
    async with service(fake) as (svc, url):
        async with frontend(url) as tts:
            stream = tts.synthesize("a. b. c.")
            pending = asyncio.ensure_future(anext(stream))
            first = await asyncio.wait_for(pending, WAIT)
            assert float(first[0]) == 1.0
            await until(lambda: svc.running == 1)
        # the frontend closed (its connection with it) while the clause waited in the engine
        await until(lambda: fake.closed == 1 and svc.running == 0 and svc.stats.open_connections == 0)
        with pytest.raises(EngineError):  # the orphaned stream ends, it does not hang
            await asyncio.wait_for(anext(stream), WAIT)
        await stream.aclose()


async def test_engine_errors_come_through_with_their_code_and_count_toward_health() -> None:
    fake = ScriptedTts(fail_on="bad. worse.")
    async with service(fake) as (svc, url), frontend(url) as tts:
        for n in (1, 2):
            got: list[np.ndarray] = []
            with pytest.raises(EngineError) as info:
                async for chunk in tts.synthesize("bad. worse."):
                    got.append(chunk)
            assert info.value.code == "engine_error" and "scripted failure" in str(info.value)
            assert len(got) == 1  # the sentence before the failure was delivered
            assert tts.failure_streak == n and tts.last_error is info.value
        assert [c.size async for c in tts.synthesize("fine.")] == [RATE // 10]
        assert tts.failure_streak == 0  # a success ends the streak
        assert svc.stats.failed == 2 and svc.stats.clauses == 1


@pytest.mark.parametrize("late", [False, True])
async def test_a_chunk_timed_out_by_our_own_late_loop_is_not_the_services_failure(late: bool) -> None:
    fake = ScriptedTts(hold=asyncio.Event())  # the second sentence never comes
    rcfg = RemoteTtsConfig(retries=1, retry_backoff_s=0.05, startup_timeout_s=2.0, chunk_timeout_s=0.3)
    async with service(fake) as (svc, url):
        rcfg.url = url
        tts = RemoteTts(TtsConfig(backend="remote", remote=rcfg), loop=FakeLoopWatch(late))
        await tts.start()
        try:
            with pytest.raises(EngineError) as err:
                async for _ in tts.synthesize("one. two."):
                    pass
            assert err.value.code == "tts_timeout"  # the caller's error is the same either way
            assert isinstance(err.value, LateLoopTimeout) is late
            assert tts.failure_streak == (0 if late else 1)  # what the supervisor reads
        finally:
            await tts.aclose()


async def test_a_service_that_goes_away_mid_clause_fails_it_without_a_hang() -> None:
    hold = asyncio.Event()
    fake = ScriptedTts(hold=hold)
    async with service(fake) as (svc, url), frontend(url, retries=2) as tts:
        async with contextlib.aclosing(tts.synthesize("a. b. c.")) as stream:
            await asyncio.wait_for(anext(stream), WAIT)
            assert tts.client._ws is not None
            await tts.client._ws.close()  # as a killed service does, from our side
            with pytest.raises(EngineError) as info:
                await asyncio.wait_for(anext(stream), WAIT)
        # audio had come: never asked for twice, whatever the retries
        assert info.value.code == "tts_unavailable"
        assert len([t for t in fake.texts if t[0] == "a. b. c."]) == 1
        assert tts.failure_streak == 1
        hold.set()
        # the next clause reconnects
        assert len([c async for c in tts.synthesize("x. y.")]) == 2
        assert tts.failure_streak == 0 and tts.client.reconnects == 1


async def test_the_frontends_concurrency_bound_raises_a_capacity_error() -> None:
    hold = asyncio.Event()
    fake = ScriptedTts(hold=hold)
    async with service(fake) as (_svc, url), frontend(url, concurrency=1) as tts:
        async with contextlib.aclosing(tts.synthesize("a. b.")) as first:
            await asyncio.wait_for(anext(first), WAIT)
            with pytest.raises(CapacityError):
                await anext(tts.synthesize("c. d."))
        assert tts.failure_streak == 0


async def test_malformed_requests_get_error_events_and_the_connection_goes_on() -> None:
    async with service(ScriptedTts()) as (svc, url), websockets.connect(url) as ws:
        hello = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
        assert hello["type"] == "hello" and hello["protocol"] == 1 and hello["sample_rate"] == RATE
        bad = [
            ({"type": "synthesize", "id": 1, "text": 5}, "invalid_request"),
            ({"type": "synthesize", "id": 2, "text": "a.", "speed": -1}, "invalid_request"),
            ({"type": "synthesize", "id": 3, "text": "a.", "window": 0}, "invalid_request"),
            ({"type": "synthesize", "id": 4, "text": "a.", "ahead_s": -1}, "invalid_request"),
            ({"type": "synthesize", "id": 5, "text": "a.", "ahead_s": "soon"}, "invalid_request"),
            ({"type": "synthesize", "id": "x", "text": "a."}, "invalid_request"),
            ({"type": "nonsense"}, "invalid_event"),
            ({"type": "ack", "id": [1]}, "invalid_request"),  # unhashable ids: the handler used to die (1011)
            ({"type": "cancel", "id": {"a": 1}}, "invalid_request"),
            ({"type": "ack", "id": True}, "invalid_request"),
        ]
        for message, code in bad:
            await ws.send(json.dumps(message))
            reply = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
            assert reply["type"] == "error" and reply["code"] == code, (message, reply)
        await ws.send(b"\x00\x01")
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["code"] == "invalid_event"
        await ws.send(json.dumps({"type": "synthesize", "id": 9, "text": "ok.", "window": 4}))
        frame = await asyncio.wait_for(ws.recv(), WAIT)
        assert isinstance(frame, bytes)
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT)) == {"type": "done", "id": 9}
        assert svc.stats.bad_requests == 11


def test_bad_remote_tts_config_is_refused() -> None:
    for override in ("tts.remote.url=http://127.0.0.1:8093", "tts.remote.window=0", "tts.backend=grpc",
                     "tts.remote.concurrency=0", "tts.remote.chunk_timeout_s=0"):
        with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1]):
            load_config("configs/test.yaml", [override])


async def test_a_frontend_without_its_service_refuses_to_start() -> None:
    cfg = TtsConfig(backend="remote", remote=RemoteTtsConfig(url="ws://127.0.0.1:9", startup_timeout_s=0.2))
    with pytest.raises(ModelError, match="not reachable"):
        await RemoteTts(cfg).start()


async def test_a_service_gone_for_good_turns_the_frontends_tts_health_failed() -> None:
    from types import SimpleNamespace

    from voicebot.engines.supervisor import RestartPolicy, Supervisor

    svc = TtsService(ScriptedTts(), engine_name="scripted")  # type: ignore[arg-type]
    async with listen(svc, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        async with frontend(f"ws://{host}:{port}", retries=0) as tts:
            supervisor = Supervisor(SimpleNamespace(tts=tts), policy=RestartPolicy(failure_threshold=3))  # type: ignore[arg-type]
            assert [c.size async for c in tts.synthesize("a.")] == [RATE // 10]
            assert supervisor.probe("tts") is None
            server.close()  # the service is gone: its connections and its port
            await server.wait_closed()
            for n in range(1, 4):
                with pytest.raises(EngineError, match="unavailable"):
                    await asyncio.wait_for(anext(tts.synthesize("a.")), WAIT)
                assert tts.failure_streak == n
            reason = supervisor.probe("tts")
            assert reason is not None and "3 TTS synthesis calls failed in a row" in reason


async def test_a_clause_cancelled_while_its_request_drains_is_cancelled_on_the_service() -> None:
    # The synthesize frame is written, then the send waits for the socket to drain and the
    # session is cancelled there (a barge-in): the service must still hear a cancel.
    hold = asyncio.Event()
    fake = ScriptedTts(hold=hold)
    async with service(fake) as (svc, url), frontend(url) as tts:
        ws = tts.client._ws
        assert ws is not None
        real_send = ws.send
        draining = asyncio.Event()

        async def send(message: str) -> None:
            await real_send(message)
            if json.loads(message)["type"] == "synthesize":
                draining.set()
                await asyncio.Event().wait()  # the drain that never ends before the cancel

        ws.send = send  # type: ignore[method-assign]

        async def speak() -> None:
            async for _ in tts.synthesize("a. b. c."):
                pass

        task = asyncio.create_task(speak())
        await asyncio.wait_for(draining.wait(), WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Not the engine stream's close: when the request and the cancel arrive in one
        # read, the clause is cancelled before its engine stream ever starts.
        await until(lambda: svc.running == 0 and svc.stats.cancelled == 1)
        assert tts.failure_streak == 0


async def test_a_clause_whose_frontend_never_acks_is_dropped_by_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    import voicebot.services.tts_service as tts_service

    monkeypatch.setattr(tts_service, "ACK_TIMEOUT_S", 0.05)
    fake = ScriptedTts()
    async with service(fake) as (svc, url), websockets.connect(url) as ws:
        await asyncio.wait_for(ws.recv(), WAIT)  # hello
        await ws.send(json.dumps({"type": "synthesize", "id": 1, "text": "a. b. c."}))
        assert isinstance(await asyncio.wait_for(ws.recv(), WAIT), bytes)  # window 1, never acked
        reply = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
        assert reply["type"] == "error" and reply["id"] == 1 and reply["code"] == "tts_timeout", reply
        await until(lambda: svc.running == 0 and fake.closed == 1)


async def test_a_frontend_pointed_at_the_asr_service_refuses_to_start_at_once() -> None:
    from fake_whisper import FakeWhisper

    from voicebot.config import AsrConfig
    from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, WhisperVllmSettings
    from voicebot.services.asr_service import AsrService
    from voicebot.services.asr_service import listen as listen_asr

    asr = VllmAsrEngine(AsrConfig(backend="vllm"), "fake-whisper", settings=WhisperVllmSettings(concurrency=1),
                        runner=FakeWhisper())
    await asr.start()
    svc = AsrService(asr, slots=1, queue_size=4, backend="vllm")
    svc.start()
    try:
        async with listen_asr(svc, "127.0.0.1", 0) as server:
            host, port = next(iter(server.sockets)).getsockname()[:2]
            url = f"ws://{host}:{port}"
            # Before: it started (22050 Hz assumed) and every clause then waited for tts_timeout.
            cfg = TtsConfig(backend="remote", remote=RemoteTtsConfig(url=url, startup_timeout_s=60))
            with pytest.raises(ModelError, match="'asr' service, not 'tts'"):
                await asyncio.wait_for(RemoteTts(cfg).start(), WAIT)  # not after startup_timeout_s
    finally:
        await svc.aclose()
        await asr.aclose()


@pytest.mark.parametrize(
    ("hello", "refusal"),
    [
        # asr-serve's hello before it named itself: an ASR service's.
        ({"protocol": 1, "backend": "vllm", "model": "m", "slots": 1}, "'asr' service, not 'tts'"),
        *(({"service": "tts", "protocol": 1, "sample_rate": rate}, "sample rate") for rate in (None, 0, "22050", True)),
    ],
)
async def test_a_hello_that_is_no_tts_service_is_refused_at_start(hello: dict[str, object], refusal: str) -> None:
    async def say_hello(ws: websockets.ServerConnection) -> None:
        await ws.send(json.dumps({"type": "hello", **hello}))
        await ws.wait_closed()

    async with websockets.serve(say_hello, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        cfg = TtsConfig(backend="remote", remote=RemoteTtsConfig(url=f"ws://{host}:{port}", startup_timeout_s=60))
        with pytest.raises(ModelError, match=refusal):
            await asyncio.wait_for(RemoteTts(cfg).start(), WAIT)


async def test_a_busy_service_is_a_capacity_error_that_does_not_count_toward_health(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import voicebot.services.tts_service as tts_service

    monkeypatch.setattr(tts_service, "MAX_JOBS_PER_CONNECTION", 1)
    hold = asyncio.Event()
    fake = ScriptedTts(hold=hold)
    async with service(fake) as (svc, url), frontend(url) as tts:
        async with contextlib.aclosing(tts.synthesize("a. b.")) as first:
            await asyncio.wait_for(anext(first), WAIT)
            for _ in range(3):
                with pytest.raises(CapacityError, match="too many clauses"):
                    await asyncio.wait_for(anext(tts.synthesize("c. d.")), WAIT)
            assert svc.stats.busy == 3
        assert tts.failure_streak == 0 and tts.failed == 0 and tts.last_error is None


async def test_a_sentence_longer_than_a_frame_comes_in_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import voicebot.services.tts_client as tts_remote
    import voicebot.services.tts_service as tts_service

    # 4096-byte frames hold 960 samples: each 1600-sample sentence needs two.
    monkeypatch.setattr(tts_remote, "MAX_FRAME", 4096)
    monkeypatch.setattr(tts_service, "MAX_FRAME", 4096)
    fake = ScriptedTts()
    async with service(fake) as (svc, url), frontend(url) as tts:
        chunks = [c async for c in tts.synthesize("One. Two.")]
        assert [c.size for c in chunks] == [960, 640, 960, 640]
        expected = np.concatenate([np.full(RATE // 10, 1.0), np.full(RATE // 10, 2.0)]).astype(np.float32)
        np.testing.assert_array_equal(np.concatenate(chunks), expected)
        assert tts.failure_streak == 0 and tts.client.reconnects == 0
        await until(lambda: svc.running == 0)
        assert svc.stats.clauses == 1 and svc.stats.chunks == 4


async def test_the_concurrency_bound_counts_clauses_still_connecting() -> None:
    fake = ScriptedTts()
    async with service(fake) as (_svc, url), frontend(url, concurrency=1) as tts:
        release = asyncio.Event()
        real_connect = tts.client.connect

        async def slow_connect() -> None:  # as while the service is down: connect / retry backoff
            await release.wait()
            await real_connect()

        tts.client.connect = slow_connect  # type: ignore[method-assign]
        first = tts.synthesize("a.")
        pending = asyncio.ensure_future(anext(first))
        await until(lambda: tts.queue_depth == 1)  # in synthesize, not yet registered with the client
        assert tts.client.open_clauses == 0
        with pytest.raises(CapacityError):
            await asyncio.wait_for(anext(tts.synthesize("b.")), WAIT)
        release.set()
        assert (await asyncio.wait_for(pending, WAIT)).size == RATE // 10
        await first.aclose()
        assert [c.size async for c in tts.synthesize("c.")] == [RATE // 10]  # the slot is free again


# ------------------------------------------------------------ several TTS services
@contextlib.asynccontextmanager
async def two_services(a: ScriptedTts, b: ScriptedTts) -> AsyncIterator[tuple[str, str, TtsService]]:
    async with service(a) as (_svc_a, url_a), service(b) as (svc_b, url_b):
        yield url_a, url_b, svc_b


async def test_clauses_spread_over_several_services_by_their_load() -> None:
    """tts.remote.urls: each clause goes to the service with the fewest of this frontend's
    clauses in flight (ties in turn), so one Kokoro process is not every frontend's cap."""
    hold = asyncio.Event()
    a, b = ScriptedTts(hold=hold), ScriptedTts(hold=hold)
    async with two_services(a, b) as (url_a, url_b, _), frontend(url_a, urls=[url_b]) as tts:
        assert tts.sample_rate == RATE and tts.voices() == ["alpha", "beta"]
        streams = [tts.synthesize(f"c{i}. held.") for i in range(6)]
        firsts = [await asyncio.wait_for(anext(s), WAIT) for s in streams]  # each holds its second sentence
        assert all(float(f[0]) == 1.0 for f in firsts)
        assert (len(a.texts), len(b.texts)) == (3, 3)
        hold.set()
        for s in streams:
            assert [float(c[0]) async for c in s] == [2.0]
        assert tts.completed == 6 and tts.failure_streak == 0


async def test_a_service_that_cannot_be_reached_leaves_its_clauses_to_the_others() -> None:
    """One of two services goes away: its clauses fail over before their first audio (not
    after each one's retries), the frontend stays healthy, and the service is left out
    until it answers again."""
    a, b = ScriptedTts(), ScriptedTts()
    async with service(a) as (_svc_a, url_a):
        svc_b = TtsService(b, engine_name="scripted")  # type: ignore[arg-type]
        async with listen(svc_b, "127.0.0.1", 0) as server_b:
            host, port = next(iter(server_b.sockets)).getsockname()[:2]
            url_b = f"ws://{host}:{port}"
            async with frontend(url_a, urls=[url_b], retries=1, retry_backoff_s=5.0) as tts:
                server_b.close()  # the second service is gone: its connections and its port
                await server_b.wait_closed()
                async with asyncio.timeout(WAIT / 2):  # no clause waits out a 5 s backoff
                    for i in range(6):
                        assert [c.size async for c in tts.synthesize(f"x{i}.")] == [RATE // 10]
                assert len(a.texts) == 6 and tts.failure_streak == 0
                assert tts.services_down() == [url_b]
        await svc_b.aclose()


async def test_every_service_down_fails_the_clause_as_one_would() -> None:
    a = ScriptedTts()
    svc = TtsService(a, engine_name="scripted")  # type: ignore[arg-type]
    async with listen(svc, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        async with frontend(f"ws://{host}:{port}", urls=[f"ws://{host}:{port}/again"], retries=0) as tts:
            server.close()
            await server.wait_closed()
            with pytest.raises(EngineError, match="unavailable") as info:
                await asyncio.wait_for(anext(tts.synthesize("a.")), WAIT)
            assert info.value.code == "tts_unavailable" and tts.failure_streak == 1
    await svc.aclose()


@pytest.mark.parametrize("late_rate", [RATE, 24_000])
async def test_a_service_down_at_start_is_left_out_and_joins_when_it_answers_at_the_others_rate(
    late_rate: int,
) -> None:
    """A frontend restarted while one of its TTS services is down starts on the others;
    the down one gets clauses once it answers, unless it synthesises at another rate."""
    a, b = ScriptedTts(), ScriptedTts()
    b.sample_rate = late_rate  # type: ignore[misc]
    url_b = f"ws://127.0.0.1:{free_port()}"
    async with service(a) as (_, url_a), frontend(url_a, urls=[url_b], startup_timeout_s=0.3, down_s=0.1) as tts:
        assert tts.sample_rate == RATE and tts.services_down() == [url_b]
        assert isinstance(tts, SeveralServices)  # what /healthz lists (ServerState.health)
        assert [c.size async for c in tts.synthesize("x.")] == [RATE // 10]
        svc_b = TtsService(b, engine_name="scripted")  # type: ignore[arg-type]
        async with listen(svc_b, "127.0.0.1", int(url_b.rsplit(":", 1)[1])):
            await asyncio.sleep(0.15)  # its down_s is over: the next clauses try it again
            for i in range(4):
                assert [c.size async for c in tts.synthesize(f"y{i}.")] == [RATE // 10]
            assert len(b.texts) == (2 if late_rate == RATE else 0)  # in turn with the first, or never
            assert tts.failure_streak == 0
        await svc_b.aclose()


async def test_a_frontend_whose_services_are_all_down_refuses_to_start() -> None:
    cfg = TtsConfig(backend="remote", remote=RemoteTtsConfig(
        url=f"ws://127.0.0.1:{free_port()}", urls=[f"ws://127.0.0.1:{free_port()}"], startup_timeout_s=0.2))
    with pytest.raises(ModelError, match="not reachable"):
        await RemoteTts(cfg).start()


async def test_services_that_disagree_on_their_rate_are_refused_at_start() -> None:
    other = ScriptedTts()
    other.sample_rate = 24_000  # type: ignore[misc]
    async with two_services(ScriptedTts(), other) as (url_a, url_b, _):
        with pytest.raises(ConfigError, match="24000"):
            async with frontend(url_a, urls=[url_b]):
                pass


def test_bad_service_lists_are_refused() -> None:
    for override in ("tts.remote.urls=[http://127.0.0.1:8094]", "tts.remote.urls=[ws://127.0.0.1:8093]"):
        with pytest.raises(ConfigError, match="urls"):
            load_config("configs/test.yaml", [override])


async def test_a_full_service_hands_the_clause_to_another_and_all_full_is_a_capacity_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import voicebot.services.tts_service as tts_service

    monkeypatch.setattr(tts_service, "MAX_JOBS_PER_CONNECTION", 1)
    hold = asyncio.Event()
    a, b = ScriptedTts(hold=hold), ScriptedTts(hold=hold)
    async with two_services(a, b) as (url_a, url_b, _), frontend(url_a, urls=[url_b], retry_backoff_s=5.0) as tts:
        first = tts.synthesize("a. held.")
        await asyncio.wait_for(anext(first), WAIT)  # service a is full now
        client_a, client_b = tts.clients
        assert (len(a.texts), len(b.texts)) == (1, 0)
        tts._in_flight[client_b] += 5  # b looks busier from here: the clause tries a first
        second = tts.synthesize("b. held.")
        await asyncio.wait_for(anext(second), WAIT)  # a said busy, b took it
        tts._in_flight[client_b] -= 5
        assert (len(a.texts), len(b.texts)) == (1, 1)
        async with asyncio.timeout(WAIT / 2):  # all full: at once, not after rounds of backoff
            with pytest.raises(CapacityError):
                await anext(tts.synthesize("c."))
        assert tts.services_down() == [] and tts.failure_streak == 0
        hold.set()
        for stream in (first, second):
            assert [float(c[0]) async for c in stream] == [2.0]
