"""``voicebot asr-serve`` hosting the streaming FastConformer (``asr.remote.engine:
fastconformer``) and its frontend engine: the real service code on a localhost WebSocket,
the tiny random-weight model (tests/fastconformer_weights.py) on real speech. A stream
through the service must transcribe exactly as the same engine does in-process, whatever
else shares its steps, and failures must reach the call as errors, never as hangs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import websockets
from fastconformer_weights import tiny_fastconformer_dir
from speech import Clip
from websockets.asyncio.client import ClientConnection

from voicebot.config import AsrConfig, RemoteAsrConfig
from voicebot.engines.asr.fastconformer import FastConformerAsr
from voicebot.engines.asr.remote_streams import RemoteStreamingAsr
from voicebot.engines.registry import create_asr
from voicebot.errors import EngineError, ModelError
from voicebot.services.asr_service import listen as listen_decodes
from voicebot.services.asr_stream_client import pack_audio, unpack_audio
from voicebot.services.asr_stream_service import StreamService
from voicebot.services.serve import listen

pytestmark = pytest.mark.engines

WAIT = 20.0
PIECE = 320  # 20 ms, as a call's frames arrive


def _engine(max_streams: int = 8) -> FastConformerAsr:
    cfg = AsrConfig(backend="fastconformer",
                    fastconformer={"model": str(tiny_fastconformer_dir()), "max_streams": max_streams})
    return FastConformerAsr(cfg, str(tiny_fastconformer_dir()))


@contextlib.asynccontextmanager
async def service(engine: FastConformerAsr, port: int = 0) -> AsyncIterator[tuple[StreamService, str]]:
    svc = StreamService(engine)
    async with listen(svc.handler, "127.0.0.1", port, max_size=32 * 1024 * 1024) as server:
        host, bound = next(iter(server.sockets)).getsockname()[:2]
        yield svc, f"ws://{host}:{bound}"


def frontend(url: str, **remote: object) -> RemoteStreamingAsr:
    rcfg = RemoteAsrConfig(url=url, engine="fastconformer",
                           **{"startup_timeout_s": 2.0, "retry_backoff_s": 0.05, "decode_timeout_s": WAIT, **remote})  # type: ignore[arg-type]
    asr = create_asr(AsrConfig(backend="remote", remote=rcfg), url)
    assert isinstance(asr, RemoteStreamingAsr)
    return asr


async def until(cond: object, timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def _speak(stream: object, audio: np.ndarray) -> None:
    for i in range(0, audio.size, PIECE):
        stream.push(audio[i : i + PIECE])  # type: ignore[attr-defined]
        await asyncio.sleep(0.002)


async def test_streams_through_the_service_transcribe_as_the_engine_does_alone(speech_clips: list[Clip]) -> None:
    clips = [c.audio[: 3 * 16_000] for c in speech_clips[:4]]
    async with _engine() as engine:
        alone = [(await engine.transcribe(a)).text for a in clips]
        assert sum(len(t.split()) for t in alone) > 8
        async with service(engine) as (svc, url), frontend(url) as one, frontend(url) as two:

            async def call(asr: RemoteStreamingAsr, first: np.ndarray, second: np.ndarray) -> list[tuple[str, list[str]]]:
                out = []
                async with asr.stream() as stream:
                    for audio in (first, second):  # two turns: the second after a reset
                        seen: list[str] = []

                        async def read() -> None:
                            async for p in stream:  # noqa: B023
                                seen.append(p.confirmed)  # noqa: B023

                        reader = asyncio.create_task(read())
                        await _speak(stream, audio)
                        final = await asyncio.wait_for(stream.finalize(), WAIT)
                        await asyncio.sleep(0.05)
                        reader.cancel()
                        out.append((final.text, seen))
                        stream.reset()
                return out

            results = await asyncio.gather(call(one, clips[0], clips[1]), call(two, clips[2], clips[3]),
                                           call(one, clips[3], clips[0]))
            assert svc.stats.finals == 6
            await until(lambda: svc.stats.open_streams == 0)
        assert engine.free_slots == 8  # every stream's slot came back
    got = {(0, 0): results[0][0], (0, 1): results[0][1], (1, 0): results[1][0], (1, 1): results[1][1],
           (2, 0): results[2][0], (2, 1): results[2][1]}
    expect = {(0, 0): alone[0], (0, 1): alone[1], (1, 0): alone[2], (1, 1): alone[3], (2, 0): alone[3], (2, 1): alone[0]}
    for key, (final, confirmed) in got.items():
        assert final == expect[key], key
        # The partials of a turn grow towards its final, none left over from the turn before.
        assert confirmed, key
        for earlier, later in zip(confirmed, confirmed[1:], strict=False):
            assert later.startswith(earlier), (key, confirmed)
        assert final.startswith(confirmed[-1]), (key, confirmed, final)
    assert any(c[-1] for _, c in got.values())


async def test_every_streams_audio_travels_in_few_frames(speech_clips: list[Clip]) -> None:
    frames: list[int] = []
    async with _engine() as engine, service(engine) as (svc, url), frontend(url, stream_flush_ms=40) as asr:
        handler = svc._on_audio

        async def counted(conn: object, frame: bytes) -> None:
            frames.append(len(unpack_audio(frame)))
            await handler(conn, frame)  # type: ignore[arg-type]

        svc._on_audio = counted  # type: ignore[method-assign]
        streams = [asr.stream() for _ in range(6)]
        audio = speech_clips[0].audio[:16_000]
        await asyncio.gather(*(_speak(s, audio) for s in streams))
        texts = {(await asyncio.wait_for(s.finalize(), WAIT)).text for s in streams}
        for s in streams:
            await s.aclose()
    pushes = 6 * (audio.size // PIECE)
    assert len(texts) == 1  # the same audio, the same words
    assert len(frames) < pushes / 10, (len(frames), pushes)
    assert max(frames) >= 3  # streams shared frames


async def test_a_caller_that_reuses_its_buffer_is_heard_as_it_spoke(speech_clips: list[Clip]) -> None:
    audio = speech_clips[3].audio[: 2 * 16_000]
    async with _engine() as engine, service(engine) as (_, url), frontend(url, stream_flush_ms=200) as asr:
        expected = (await engine.transcribe(audio)).text
        buffer = np.empty(PIECE, np.float32)  # one buffer, refilled per frame, as a transport's
        async with asr.stream() as stream:
            for i in range(0, audio.size - PIECE + 1, PIECE):
                buffer[:] = audio[i : i + PIECE]
                stream.push(buffer)
            assert (await asyncio.wait_for(stream.finalize(), WAIT)).text == expected


async def test_a_full_service_refuses_a_stream_with_an_error_and_it_opens_at_its_next_turn(speech_clips: list[Clip]) -> None:
    audio = speech_clips[0].audio[:16_000]
    async with _engine(max_streams=2) as engine, service(engine) as (svc, url), frontend(url) as asr:
        expected = (await engine.transcribe(audio)).text
        held = [asr.stream(), asr.stream()]
        third = asr.stream()
        third.push(audio)
        with pytest.raises(EngineError) as err:
            await asyncio.wait_for(third.finalize(), WAIT)
        assert err.value.code == "capacity_exceeded"
        assert svc.stats.refused_streams == 1
        await held[0].aclose()
        await until(lambda: engine.free_slots == 1)
        third.reset()  # the next turn opens it again
        await _speak(third, audio)
        assert (await asyncio.wait_for(third.finalize(), WAIT)).text == expected
        await third.aclose()
        await held[1].aclose()
        await until(lambda: engine.free_slots == 2)


async def test_a_frontend_gone_frees_its_slots_and_the_service_goes_on(speech_clips: list[Clip]) -> None:
    audio = speech_clips[1].audio[:16_000]
    async with _engine(max_streams=4) as engine, service(engine) as (svc, url):
        async with frontend(url) as gone:
            streams = [gone.stream() for _ in range(4)]
            for s in streams:
                s.push(audio)
            await until(lambda: engine.free_slots == 0)
        await until(lambda: engine.free_slots == 4 and svc.stats.open_streams == 0)
        expected = (await engine.transcribe(audio)).text
        async with frontend(url) as other, other.stream() as s:
            await _speak(s, audio)
            assert (await asyncio.wait_for(s.finalize(), WAIT)).text == expected


async def test_the_service_dying_fails_the_final_and_the_next_turn_finds_it_again(speech_clips: list[Clip]) -> None:
    audio = speech_clips[2].audio[:16_000]
    async with _engine() as engine:
        expected = (await engine.transcribe(audio)).text
        cm = service(engine)
        _, url = await cm.__aenter__()
        port = int(url.rsplit(":", 1)[1])
        async with frontend(url) as asr:
            stream = asr.stream()
            await _speak(stream, audio)
            await cm.__aexit__(None, None, None)  # the service goes away mid-turn
            with pytest.raises(EngineError) as err:
                await asyncio.wait_for(stream.finalize(), WAIT)
            assert err.value.code == "asr_unavailable"
            async with service(engine, port):
                stream.reset()  # the next turn
                await _speak(stream, audio)
                assert (await asyncio.wait_for(stream.finalize(), WAIT)).text == expected
                await stream.aclose()
            assert asr.client.reconnects >= 1


async def test_bad_messages_get_error_events_and_the_connection_goes_on() -> None:
    async with _engine() as engine, service(engine) as (svc, url), websockets.connect(url) as ws:
        hello = json.loads(await ws.recv())
        assert (hello["protocol"], hello["mode"], hello["backend"]) == (2, "streams", "fastconformer")
        await ws.send("not json")
        await ws.send(json.dumps({"type": "finalize", "stream": 9, "id": 1}))
        await ws.send(b"\x00\x00\x00\x05{}")
        await ws.send(pack_audio(1, [(9, np.zeros(10, np.float32))])[:-4])  # a sample short
        codes = [json.loads(await ws.recv())["code"] for _ in range(4)]
        assert codes == ["invalid_event", "asr_unavailable", "invalid_request", "invalid_request"]
        await ws.send(json.dumps({"type": "open", "stream": 1, "utt": 0}))
        await ws.send(json.dumps({"type": "open", "stream": 1, "utt": 0}))
        assert json.loads(await ws.recv())["code"] == "invalid_event"
        await ws.send(pack_audio(2, [(1, np.zeros(16_000, np.float32))]))
        await ws.send(json.dumps({"type": "finalize", "stream": 1, "id": 7}))
        final = await _next(ws, "final")
        assert (final["stream"], final["id"], final["audio_s"]) == (1, 7, 1.0)
        await ws.send(json.dumps({"type": "stats"}))
        stats = await _next(ws, "stats")
        assert stats["open_streams"] == 1 and stats["bad_requests"] == 5 and stats["steps"] > 0


async def _next(ws: ClientConnection, kind: str) -> dict[str, Any]:
    """The next message of ``kind`` (partials of the stream may come first)."""
    async with asyncio.timeout(WAIT):
        while (msg := json.loads(await ws.recv()))["type"] != kind:
            assert msg["type"] == "partials", msg
    return dict(msg)


def test_audio_frames_round_trip_and_malformed_ones_are_refused() -> None:
    a, b = np.arange(5, dtype=np.float32), np.arange(3, dtype=np.float32) * -1
    out = unpack_audio(pack_audio(4, [(1, a), (2, b)]))
    assert [sid for sid, _ in out] == [1, 2]
    assert np.array_equal(out[0][1], a) and np.array_equal(out[1][1], b)
    good = pack_audio(4, [(1, a)])
    head = json.dumps({"type": "audio", "id": 4, "streams": [[1, 6]]}).encode()
    with pytest.raises(ValueError, match="count 6 samples"):
        unpack_audio(len(head).to_bytes(4, "big") + head + good[-20:])
    head = json.dumps({"type": "audio", "id": 4, "streams": [[1, -5]]}).encode()
    with pytest.raises(ValueError, match="non-negative"):
        unpack_audio(len(head).to_bytes(4, "big") + head)


async def test_a_streams_frontend_and_a_decodes_service_refuse_each_other_at_start() -> None:
    from voicebot.config import AsrConfig as Cfg
    from voicebot.engines.asr.remote import RemoteAsrEngine
    from voicebot.services.asr_service import AsrService

    class _NoEngine:  # the decode service never decodes here: the frontends stop at its hello
        model_path = "whisper"

    decodes = AsrService(_NoEngine(), slots=1, queue_size=4, backend="vllm")  # type: ignore[arg-type]
    async with listen_decodes(decodes, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        with pytest.raises(ModelError, match="protocol 1, we speak 2.*asr.remote.engine"):
            await frontend(f"ws://{host}:{port}").start()
    async with _engine() as engine, service(engine) as (_, url):
        whisper_frontend = RemoteAsrEngine(Cfg(backend="remote", remote=RemoteAsrConfig(url=url, startup_timeout_s=1.0)))
        with pytest.raises(ModelError, match="protocol 2, we speak 1.*asr.remote.engine"):
            await whisper_frontend.start()
