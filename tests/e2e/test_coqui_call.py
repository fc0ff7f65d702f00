"""A server started with ``tts.engine=coqui`` and ``tts.model=<dir>`` answers a call over every
protocol (native, Realtime, Twilio, WebRTC), each driven by the probe's client for its wire.

The model is the tiny random-weight VITS of tests/coqui_weights.py (no download): its reply
is noise, not speech, so each call is checked for a completed reply with audio at its wire's
rate and no error, never for words. One server serves the four calls;
tests/engines/test_tts_coqui.py checks the engine itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from coqui_weights import tiny_vits
from servers import (
    FAST_SPEECH,
    EnginePool,
    NativeCall,
    RunningServer,
    running_server,
    server_errors,
)
from speech import Clip

from voicebot.config import ModelsConfig, load_config
from voicebot.engines.tts.coqui import CoquiTts

pytestmark = pytest.mark.engines

# The rate each wire carries reply audio at (native: the session's default, asked for nothing).
WIRE_RATES = {"native": 24_000, "realtime": 24_000, "twilio": 8_000, "webrtc": 48_000}


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    try:
        model = tiny_vits(tmp_path_factory.mktemp("coqui") / "vits-tiny")
    except ImportError as exc:
        pytest.fail(f"coqui-tts is not installed ({exc}): pip install 'voicebot[coqui]'")
    cfg = load_config("configs/test.yaml", [
        f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH,
        "tts.engine=coqui",
        f"tts.model={model}",  # the generic setting: tts.coqui_model for this engine
        "llm.max_tokens=4",  # the random test LLM's words: a short reply, spoken in real time
        "session.output_sample_rate=24000",
        "server.transports=[native,realtime,twilio,webrtc]",
    ])
    assert cfg.tts.coqui_model == str(model)
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


@pytest.mark.parametrize("protocol", list(WIRE_RATES))
async def test_a_call_is_answered_with_coquis_audio(server: RunningServer, speech_clips: list[Clip], protocol: str) -> None:
    assert server.state.engines is not None and isinstance(server.state.engines.tts, CoquiTts)
    clip = min(speech_clips, key=lambda c: c.audio.size)
    with server_errors() as errors:
        call = await NativeCall.over(server, protocol, output_rate=None)  # audio at the wire's own rate
        try:
            rate = call.client.output_rate
            done = await call.turn(clip.audio, timeout=90)
        finally:
            await call.close()
    assert rate == WIRE_RATES[protocol]
    assert done["status"] == "completed", done
    reply = call.reply_audio(done["response_id"])
    assert reply.size > rate // 10, f"the reply was spoken ({reply.size} samples at {rate} Hz)"
    assert not call.errors() and not errors, (call.errors(), [r.getMessage() for r in errors])
