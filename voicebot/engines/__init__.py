"""The shared engines: one ASR, one LLM, one TTS and one VAD model serve every session."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from voicebot.config import Config
from voicebot.engines.asr import AsrEngine
from voicebot.engines.llm import LlmEngine
from voicebot.engines.tts import TtsEngine, create_tts
from voicebot.engines.vad import SileroVad

log = logging.getLogger(__name__)


@dataclass
class Engines:
    cfg: Config
    asr: AsrEngine
    llm: LlmEngine
    tts: TtsEngine
    vad: SileroVad

    async def aclose(self) -> None:
        # Close all even if one fails; the first error is re-raised after.
        results = await asyncio.gather(
            self.asr.aclose(), self.tts.aclose(), self.llm.aclose(), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r


async def load_engines(cfg: Config) -> Engines:
    """Resolve every model reference (building offline bundles if needed) and start the engines."""
    from voicebot.provision import resolve_model

    if cfg.models.offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    m = cfg.models
    asr_path = await asyncio.to_thread(resolve_model, cfg.asr.model, m)
    llm_path = await asyncio.to_thread(resolve_model, cfg.llm.model, m)
    tok_path = await asyncio.to_thread(resolve_model, cfg.llm.tokenizer, m) if cfg.llm.tokenizer else None
    voice_path = await asyncio.to_thread(resolve_model, cfg.tts.voice, m) if cfg.tts.engine == "piper" else None

    asr = AsrEngine(cfg.asr, asr_path, agreement_n=cfg.asr.agreement_n)
    llm = LlmEngine(cfg.llm, llm_path, tok_path)
    tts = create_tts(cfg.tts, voice_path)
    vad = SileroVad()
    # The LLM takes longest to start (engine-core process); load the rest meanwhile.
    await asyncio.gather(llm.start(), asr.start(), tts.start())
    log.info("engines ready: asr=%s llm=%s tts=%s", asr_path, llm_path, cfg.tts.engine)
    return Engines(cfg, asr, llm, tts, vad)
