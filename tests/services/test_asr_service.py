"""The shared ASR service (``voicebot asr-serve``) and its frontend engine (``asr.backend: remote``).

Real service code on a real localhost WebSocket, with a fake of our own ``WhisperRunner``
inside the service's engine (a :class:`VllmAsrEngine`, the GPU path: token budgets and
request aborts included). The fake scripts one word per half second of audio after the
forced prefix and can hold decodes open, so ordering across frontends, cancellation and
failures are tested without a model. tests/services/test_asr_service_e2e.py runs real engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest
import websockets
from fake_whisper import WAIT, WORDS, FakeWhisper, LoopingWhisper, audio
from fakes import FakeLoopWatch

from voicebot.config import AsrConfig, RemoteAsrConfig
from voicebot.engines.asr.jobs import Priority
from voicebot.engines.asr.remote import RemoteAsrEngine
from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, WhisperVllmSettings
from voicebot.engines.registry import create_asr
from voicebot.errors import EngineError, LateLoopTimeout, ModelError
from voicebot.services.asr_client import pack_decode, unpack_decode
from voicebot.services.asr_service import AsrService, listen


@contextlib.asynccontextmanager
async def service(fake: FakeWhisper, *, slots: int = 4, queue_size: int = 64) -> AsyncIterator[tuple[AsrService, str]]:
    """The service around a started engine with the fake runner; yields it and its URL."""
    cfg = AsrConfig(backend="vllm", partial_interval_ms=500, agreement_n=2)
    engine = VllmAsrEngine(cfg, "fake-whisper", agreement_n=2, settings=WhisperVllmSettings(concurrency=slots), runner=fake)
    await engine.start()
    svc = AsrService(engine, slots=slots, queue_size=queue_size, backend="vllm")
    svc.start()
    try:
        async with listen(svc, "127.0.0.1", 0) as server:
            host, port = next(iter(server.sockets)).getsockname()[:2]
            yield svc, f"ws://{host}:{port}"
    finally:
        await svc.aclose()
        await engine.aclose()


def frontend(url: str, **remote: object) -> RemoteAsrEngine:
    rcfg = RemoteAsrConfig(url=url, **{"retries": 1, "retry_backoff_s": 0.05, "startup_timeout_s": 2.0, **remote})  # type: ignore[arg-type]
    cfg = AsrConfig(backend="remote", partial_interval_ms=500, agreement_n=2, remote=rcfg)
    return RemoteAsrEngine(cfg, agreement_n=2)


async def until(cond: object, timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_partials_come_through_the_service_with_the_forced_prefix_and_the_final_without() -> None:
    fake = FakeWhisper()
    async with service(fake) as (svc, url), frontend(url) as eng:
        stream = eng.stream()
        partials = []
        for _ in range(4):  # 4 x 0.5 s: one partial each
            stream.push(audio(0.5))
            partials.append(await asyncio.wait_for(anext(stream), WAIT))
        assert partials[-1].text == "alpha bravo charlie delta"
        confirmed = partials[-1].confirmed
        assert confirmed.startswith("alpha bravo")
        # The frontend's confirmed words reached the service's engine as the partial's
        # forced prefix; the final goes without them, as a one-shot decode.
        assert fake.calls[-1]["prompt"] == [1, 2, 3, 4] + [100 + WORDS.index(w) for w in ("alpha", "bravo")]
        final = await asyncio.wait_for(stream.finalize(), WAIT)
        last = fake.calls[-1]
        assert last["prompt"] == [1, 2, 3, 4]
        assert last["priority"] == 0
        assert all(c["priority"] == 1 for c in fake.calls[:-1])
        assert final.text == "alpha bravo charlie delta"
        assert final.audio_s == pytest.approx(2.0)
        one_shot = await asyncio.wait_for(eng.transcribe(audio(1.0)), WAIT)
        assert one_shot.text == "alpha bravo"
        assert svc.stats.finals == 2 and svc.stats.partials == 4
        assert eng.stats.failed_decodes == 0
        await stream.aclose()
        assert eng.client.hello is not None and eng.client.hello["backend"] == "vllm"


async def test_a_loop_is_decoded_again_at_the_service_and_never_reaches_the_frontend() -> None:
    fake = LoopingWhisper()
    async with service(fake) as (svc, url), frontend(url) as eng:
        result = await asyncio.wait_for(eng.transcribe(audio(3.0)), WAIT)
        assert result.text == "alpha bravo charlie delta echo foxtrot"
        # The service's engine caught the greedy loop and sampled again.
        assert [c["temperature"] for c in fake.calls] == [0.0, 0.4]
        assert eng.decoder.loops == 0


async def test_a_final_goes_before_queued_partials_of_other_frontends() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with service(fake, slots=1) as (svc, url), frontend(url) as a, frontend(url) as b:
        busy = a.stream()
        busy.push(audio(0.5))  # takes the only slot and is held
        await asyncio.wait_for(fake.started.wait(), WAIT)
        others = [b.stream() for _ in range(3)]
        for s in others:
            s.push(audio(0.5))
        await until(lambda: svc.queue_depth == 3)  # B's partials wait at the service
        talker = a.stream()
        talker.push(audio(0.4))  # under the partial interval: no partial of its own
        final = asyncio.create_task(talker.finalize())
        await until(lambda: svc.queue_depth == 4)
        fake.hold.set()
        await asyncio.wait_for(final, WAIT)
        await until(lambda: len(fake.calls) == 5)
        assert [c["priority"] for c in fake.calls] == [1, 0, 1, 1, 1]
        for s in (busy, talker, *others):
            await s.aclose()


async def test_a_cancelled_final_aborts_its_decode_at_the_service() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with service(fake) as (svc, url), frontend(url) as eng:
        stream = eng.stream()
        stream.push(audio(0.3))
        final = asyncio.create_task(stream.finalize())
        await asyncio.wait_for(fake.started.wait(), WAIT)
        final.cancel()
        with pytest.raises(asyncio.CancelledError):
            await final
        await until(lambda: len(fake.aborted) == 1)  # the engine's request was aborted
        assert svc.stats.cancelled == 1
        assert eng.stats.failed_decodes == 0
        fake.hold.set()  # the engine goes on
        assert (await asyncio.wait_for(stream.finalize(), WAIT)).text == ""
        await stream.aclose()


async def test_reset_and_close_cancel_a_running_partial_and_the_stream_goes_on() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with service(fake) as (svc, url), frontend(url) as eng:
        stream = eng.stream()
        stream.push(audio(0.5))
        await asyncio.wait_for(fake.started.wait(), WAIT)
        stream.reset()  # a new utterance: the old one's decode is superseded
        await until(lambda: len(fake.aborted) == 1)
        fake.hold.set()
        stream.push(audio(1.0))  # the stream schedules partials again
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert partial.text == "alpha bravo"
        fake.hold = asyncio.Event()
        stream.push(audio(0.5))
        await until(lambda: len(fake.calls) == 3)
        await stream.aclose()  # the call ended
        await until(lambda: len(fake.aborted) == 2)
        assert eng.stats.failed_decodes == 0
        assert svc.stats.cancelled == 2


async def test_a_closed_frontend_connection_cancels_its_decodes() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with service(fake) as (svc, url):
        eng = frontend(url)
        await eng.start()
        stream = eng.stream()
        stream.push(audio(0.5))
        await asyncio.wait_for(fake.started.wait(), WAIT)
        await eng.aclose()
        await until(lambda: len(fake.aborted) == 1 and svc.stats.open_connections == 0)


async def test_a_full_queue_drops_partials_which_the_stream_retries_and_finals_evict_them() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with service(fake, slots=1, queue_size=1) as (svc, url), frontend(url) as a, frontend(url) as b:
        running, queued, refused = a.stream(), b.stream(), b.stream()
        running.push(audio(0.5))
        await asyncio.wait_for(fake.started.wait(), WAIT)
        queued.push(audio(0.5))
        await until(lambda: svc.queue_depth == 1)
        refused.push(audio(0.5))  # queue full: answered "dropped"
        await until(lambda: b.stats.dropped_partials == 1)
        talker = a.stream()
        talker.push(audio(0.4))
        final = asyncio.create_task(talker.finalize())  # evicts B's queued partial
        await until(lambda: b.stats.dropped_partials == 2)
        fake.hold.set()
        assert (await asyncio.wait_for(final, WAIT)).text == ""
        refused.push(audio(0.1))  # the dropped partial is retried on the next audio
        assert (await asyncio.wait_for(anext(refused), WAIT)).text == "alpha"
        assert a.stats.failed_decodes == b.stats.failed_decodes == 0
        assert svc.stats.dropped_partials == 2
        for s in (running, queued, refused, talker):
            await s.aclose()


async def test_the_service_dying_mid_call_fails_the_final_with_an_error_not_a_hang() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    eng = None
    try:
        async with service(fake) as (svc, url):
            eng = frontend(url, retries=2, retry_backoff_s=0.05)
            await eng.start()
            stream = eng.stream()
            stream.push(audio(0.3))
            final = asyncio.create_task(stream.finalize())
            await asyncio.wait_for(fake.started.wait(), WAIT)
        # The service is gone (its server closed its connections) and nothing listens.
        with pytest.raises(EngineError) as err:
            await asyncio.wait_for(final, WAIT)
        assert err.value.code == "asr_unavailable"
        assert eng.stats.failed_decodes == 1
    finally:
        if eng is not None:
            await eng.aclose()


async def test_a_connection_lost_before_the_result_is_retried_on_a_new_one() -> None:
    fake = FakeWhisper()
    async with service(fake) as (svc, url):
        drops = 1

        async def flaky(ws: websockets.ServerConnection) -> None:
            nonlocal drops
            if drops:  # say hello, take the first decode, then drop the connection
                drops -= 1
                # The hello of an asr-serve from before hellos named their service: a
                # frontend upgraded first still takes it (it refused it, then: ServiceMismatch).
                await ws.send(json.dumps({"type": "hello", "protocol": 1, "backend": "flaky", "model": "m", "slots": 1}))
                await ws.recv()
                await ws.close()
                return
            await svc.handler(ws)

        async with websockets.serve(flaky, "127.0.0.1", 0) as flaky_server:
            host, port = next(iter(flaky_server.sockets)).getsockname()[:2]
            async with frontend(f"ws://{host}:{port}", retries=1) as eng:
                first = eng.client.hello
                result = await asyncio.wait_for(eng.transcribe(audio(1.0)), WAIT)
                assert result.text == "alpha bravo"
                assert first is not None and first["backend"] == "flaky"
                assert eng.client.reconnects == 1
                assert len(fake.calls) == 1  # decoded once: the lost try never reached the engine


async def test_an_unreachable_service_fails_start_up_within_its_timeout() -> None:
    async with websockets.serve(lambda ws: ws.close(), "127.0.0.1", 0) as srv:
        port = next(iter(srv.sockets)).getsockname()[1]
    eng = frontend(f"ws://127.0.0.1:{port}", startup_timeout_s=0.3)  # nothing listens there now
    with pytest.raises(ModelError, match="not reachable"):
        await asyncio.wait_for(eng.start(), WAIT)
    await eng.aclose()


async def test_a_decode_with_no_answer_times_out_and_is_cancelled_at_the_service() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with service(fake) as (svc, url), frontend(url, decode_timeout_s=0.3) as eng:
        with pytest.raises(EngineError) as err:
            await asyncio.wait_for(eng.transcribe(audio(0.5)), WAIT)
        assert err.value.code == "asr_timeout"
        await until(lambda: len(fake.aborted) == 1)


@pytest.mark.parametrize("late", [False, True])
async def test_a_decode_timed_out_by_our_own_late_loop_is_not_the_services_failure(late: bool) -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    rcfg = RemoteAsrConfig(retries=1, retry_backoff_s=0.05, startup_timeout_s=2.0, decode_timeout_s=0.3)
    async with service(fake) as (svc, url):
        rcfg.url = url
        cfg = AsrConfig(backend="remote", partial_interval_ms=500, agreement_n=2, remote=rcfg)
        async with RemoteAsrEngine(cfg, agreement_n=2, loop=FakeLoopWatch(late)) as eng:
            with pytest.raises(EngineError) as err:
                await asyncio.wait_for(eng.transcribe(audio(0.5)), WAIT)
            assert err.value.code == "asr_timeout"  # the caller's error is the same either way
            assert isinstance(err.value, LateLoopTimeout) is late
            # What the supervisor's failure streak reads: only the service's own failures.
            assert eng.stats.failed_decodes == (0 if late else 1)


async def test_bad_frames_get_error_events_and_the_connection_goes_on() -> None:
    fake = FakeWhisper()
    async with service(fake) as (svc, url), websockets.connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        await ws.send(b"\x00\x00")
        assert json.loads(await ws.recv())["code"] == "invalid_request"
        nan = np.array([np.nan], dtype=np.float32)
        await ws.send(pack_decode(1, Priority.FINAL, "", "en", nan))
        assert json.loads(await ws.recv())["code"] == "invalid_request"
        await ws.send("hello?")
        assert json.loads(await ws.recv())["code"] == "invalid_event"
        await ws.send(json.dumps({"type": "cancel", "id": [2]}))  # it closed the connection (1011)
        assert json.loads(await ws.recv())["code"] == "invalid_event"
        await ws.send(pack_decode(2, Priority.FINAL, "alpha", "en", audio(1.5)))
        reply = json.loads(await ws.recv())
        assert reply == {"type": "result", "id": 2, "text": "bravo charlie", "decode_s": reply["decode_s"]}
        await ws.send(json.dumps({"type": "stats"}))
        stats = json.loads(await ws.recv())
        assert stats["finals"] == 1 and stats["bad_requests"] == 4


def test_decode_frames_round_trip_and_malformed_ones_are_refused() -> None:
    a = np.linspace(-1, 1, 17, dtype=np.float32)
    header, back = unpack_decode(pack_decode(7, Priority.PARTIAL, "hi there", None, a))
    assert header["id"] == 7 and header["priority"] == 1 and header["prefix"] == "hi there"
    assert header["language"] is None
    np.testing.assert_array_equal(back, a)
    frame = pack_decode(7, Priority.PARTIAL, "", "en", a)
    for bad in (frame[:-1], frame[:3], b"\x00\x00\x00\x05{}", frame.replace(b'"priority": 1', b'"priority": 5')):
        with pytest.raises(ValueError):
            unpack_decode(bad)


async def test_the_remote_backend_builds_the_service_client_and_resolves_no_whisper_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import voicebot.provision
    from voicebot.config import Config
    from voicebot.engines.registry import resolve_specs

    assert isinstance(create_asr(AsrConfig(backend="remote"), ""), RemoteAsrEngine)
    resolved: list[str] = []

    def fake_resolve(ref: str, models: object, **kw: object) -> str:
        resolved.append(ref)
        return f"/models/{ref}"

    monkeypatch.setattr(voicebot.provision, "resolve_model", fake_resolve)
    cfg = Config()
    cfg.asr.backend = "remote"
    specs = await resolve_specs(cfg)
    assert specs.asr_path == cfg.asr.remote.url
    assert cfg.asr.model not in resolved  # a frontend does not need the Whisper model
    assert isinstance(specs.asr(), RemoteAsrEngine)


async def test_decodes_waiting_on_a_connect_that_fails_fail_with_it_not_one_timeout_after_another() -> None:
    """A service host that accepts TCP but never answers (hung, black-holed): 20 decodes
    waiting on the same connect must fail together after one connect timeout, not after 20
    connect timeouts one by one (a final would hang for minutes)."""
    from voicebot.services.asr_client import AsrServiceClient

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers the handshake

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AsrServiceClient(RemoteAsrConfig(url=f"ws://127.0.0.1:{port}", connect_timeout_s=0.3, retries=0))
    try:
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.wait_for(
            asyncio.gather(*(client.decode(audio(0.5), "", "en", Priority.FINAL) for _ in range(20)), return_exceptions=True),
            WAIT,
        )
        took = asyncio.get_running_loop().time() - t0
        assert all(isinstance(r, EngineError) and r.code == "asr_unavailable" for r in results), results
        assert took < 3.0, f"the waiting decodes failed one connect timeout after another ({took:.1f} s)"
    finally:
        await client.aclose()
        server.close()


async def test_partials_failing_while_the_service_is_gone_are_counted_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The supervisor's failure streak needs every failed partial counted; the log needs
    one line, not a traceback per caller per partial."""
    fake = FakeWhisper()
    async with service(fake) as (svc, url):
        eng = frontend(url, retries=0)
        await eng.start()
    try:
        streams = [eng.stream() for _ in range(3)]
        with caplog.at_level("WARNING", logger="voicebot.engines"):
            for s in streams:
                s.push(audio(0.5))
            await until(lambda: eng.stats.failed_decodes == 3)
            for s in streams:  # each stream schedules its next partial again
                s.push(audio(0.5))
            await until(lambda: eng.stats.failed_decodes == 6)
        lines = [r for r in caplog.records if r.name.startswith("voicebot.engines")]
        assert len(lines) == 1 and lines[0].exc_info is None, [r.getMessage() for r in lines]
        for s in streams:
            await s.aclose()
    finally:
        await eng.aclose()


async def test_a_partial_from_before_the_end_of_speech_is_stopped_not_awaited_by_the_final() -> None:
    # Under load a decode takes a while; waiting for a partial that cannot be the final and
    # then for the one that covers doubled the ASR final's p95 at 64 callers on one GPU.
    fake = FakeWhisper()
    stale = asyncio.Event()  # never set: only the partial that started early waits on it
    fake.hold = stale
    async with service(fake) as (svc, url), frontend(url) as eng:
        stream = eng.stream()
        stream.push(audio(0.5))  # a partial starts on the first 0.5 s ...
        await asyncio.wait_for(fake.started.wait(), WAIT)
        fake.hold = None  # ... and is held; later decodes are not
        stream.push(audio(0.5))  # the caller speaks on and ends at 1.0 s
        final = await asyncio.wait_for(stream.finalize(covering_s=1.0), WAIT)
        assert final.text == "alpha bravo"
        assert final.audio_s == pytest.approx(1.0)
        await until(lambda: len(fake.aborted) == 1)  # the early partial was stopped at the service
        assert svc.stats.cancelled == 1
        assert eng.stats.abandoned_partials == 1
        assert fake.calls[-1]["priority"] == 0  # the final decoded as a final
        await stream.aclose()


async def test_a_partial_that_covers_the_end_of_speech_is_the_final() -> None:
    fake = FakeWhisper()
    async with service(fake) as (svc, url), frontend(url) as eng:
        stream = eng.stream()
        stream.push(audio(1.0))  # one partial on the whole second
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert partial.text == "alpha bravo"
        final = await asyncio.wait_for(stream.finalize(covering_s=1.0), WAIT)
        assert final.text == "alpha bravo"
        assert len(fake.calls) == 1 and not fake.aborted  # reused, nothing stopped
        await stream.aclose()


async def test_a_frontend_pointed_at_the_tts_service_refuses_to_start_at_once() -> None:
    from types import SimpleNamespace

    from voicebot.services.tts_service import TtsService
    from voicebot.services.tts_service import listen as listen_tts

    svc = TtsService(SimpleNamespace(sample_rate=16_000, voices=list), engine_name="none")  # type: ignore[arg-type]
    async with listen_tts(svc, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        eng = frontend(f"ws://{host}:{port}", startup_timeout_s=60)
        try:
            with pytest.raises(ModelError, match="'tts' service, not 'asr'"):
                await asyncio.wait_for(eng.start(), WAIT)  # not after startup_timeout_s
        finally:
            await eng.aclose()
