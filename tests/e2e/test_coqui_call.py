"""A server started with ``tts.engine=coqui`` and a Coqui model directory answers a call.

The model is the tiny random-weight VITS of tests/coqui_weights.py (no download): its reply
is noise, not speech, so the call is checked for a completed reply with audio and no error,
never for words. One native call: every transport hands its call to the same session, which
gets the TTS engine from the registry (``create_tts``), so the protocol does not change what
this checks; tests/engines/test_tts_coqui.py checks the engine itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from coqui_weights import tiny_vits
from servers import OUT_RATE, EnginePool, NativeCall, RunningServer, running_server, server_errors
from speech import Clip

from voicebot.config import ModelsConfig, load_config
from voicebot.engines.tts.coqui import CoquiTts

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    try:
        model = tiny_vits(tmp_path_factory.mktemp("coqui") / "vits-tiny")
    except ImportError as exc:
        pytest.fail(f"coqui-tts is not installed ({exc}): pip install 'voicebot[coqui]'")
    cfg = load_config("configs/test.yaml", [
        f"models.cache_dir={models_config.cache_dir}",
        "tts.engine=coqui",
        f"tts.coqui_model={model}",
        "llm.max_tokens=6",  # the random test LLM's words: a short reply, spoken in real time
        "server.transports=[native]",
    ])
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


async def test_a_call_is_answered_with_coquis_audio(server: RunningServer, speech_clips: list[Clip]) -> None:
    assert server.state.engines is not None and isinstance(server.state.engines.tts, CoquiTts)
    clip = min(speech_clips, key=lambda c: c.audio.size)
    with server_errors() as errors:
        call = await NativeCall.open(server)
        try:
            done = await call.turn(clip.audio, timeout=90)
        finally:
            await call.close()
    assert done["status"] == "completed", done
    assert call.reply_audio(done["response_id"]).size > OUT_RATE // 10, "the reply was spoken"
    assert not call.errors() and not errors, (call.errors(), [r.getMessage() for r in errors])
