"""The shared engines: one ASR, one LLM, one TTS and one VAD model serve every session."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from voicebot.config import Config
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.health import EngineHealth
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.engines.startup import reap_children, start_all
from voicebot.engines.tts.pool import TtsEngine, create_tts
from voicebot.engines.turn.smart_turn import SmartTurn, load_smart_turn
from voicebot.engines.turn.vad import SileroVad

log = logging.getLogger(__name__)

ENGINE_NAMES = ("asr", "llm", "tts")


@dataclass(frozen=True)
class EngineSpecs:
    """Resolved model paths: what it takes to build each engine again (a supervised restart)."""

    cfg: Config
    asr_path: str
    llm_path: str
    tokenizer_path: str | None
    voice_path: str | None

    def asr(self) -> AsrEngine:
        # asr.backend picks faster-whisper or Whisper on vLLM (imports vLLM only in start()).
        from voicebot.engines.asr.vllm_whisper import create_asr

        return create_asr(self.cfg.asr, self.asr_path)

    def llm(self) -> LlmEngine:
        if self.cfg.llm.backend == "remote":
            # The tier over HTTP; llm_path is then the tokenizer (resolve_specs).
            from voicebot.engines.llm.remote import RemoteLlmEngine

            return RemoteLlmEngine(self.cfg.llm, self.tokenizer_path or self.llm_path)
        return LlmEngine(self.cfg.llm, self.llm_path, self.tokenizer_path)

    def tts(self) -> TtsEngine:
        return create_tts(self.cfg.tts, self.voice_path)


@dataclass
class Engines:
    cfg: Config
    asr: AsrEngine
    llm: LlmEngine
    tts: TtsEngine
    vad: SileroVad
    # None when the engines were built by hand (tests): then they cannot be restarted.
    specs: EngineSpecs | None = None
    # The end-of-turn model (vad.turn_detector: smart_turn), else None.
    turn_model: SmartTurn | None = None
    # Kept current by the supervisor (voicebot/engines/supervisor.py).
    health: dict[str, EngineHealth] = field(default_factory=lambda: {n: EngineHealth(n) for n in ENGINE_NAMES})

    def failure(self) -> str | None:
        """Why a session cannot be served now (an engine down), or None."""
        down = [h.describe() for h in self.health.values() if not h.ok]
        return "; ".join(down) if down else None

    async def aclose(self) -> None:
        # Close all even if one fails; the first error is re-raised after.
        results = await asyncio.gather(
            self.asr.aclose(), self.tts.aclose(), self.llm.aclose(), return_exceptions=True
        )
        await reap_children()
        if self.turn_model is not None:
            self.turn_model.close()
        for r in results:
            if isinstance(r, BaseException):
                raise r


async def resolve_specs(cfg: Config) -> EngineSpecs:
    """Resolve every model reference (building offline bundles if needed)."""
    from voicebot.provision import resolve_model
    from voicebot.provision.resolve import frontend_refs

    if cfg.models.offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    m = cfg.models
    refs = frontend_refs(cfg)  # what `voicebot serve` pulled before it started

    async def resolve(ref: str | None) -> str | None:
        return None if ref is None else await asyncio.to_thread(resolve_model, ref, m)

    # A shared ASR service (voicebot asr-serve) holds the Whisper model: its URL stands in.
    asr_path = cfg.asr.remote.url if refs.asr is None else await asyncio.to_thread(resolve_model, refs.asr, m)
    # With a remote LLM tier the weights live on its servers: refs.llm is the tokenizer.
    llm_path = await asyncio.to_thread(resolve_model, refs.llm, m)
    return EngineSpecs(cfg, asr_path, llm_path, await resolve(refs.tokenizer), await resolve(refs.voice))


def _import_transformers_once(cfg: Config) -> None:
    """transformers' lazy module is not safe to import from two threads at once: a GPU
    frontend (remote LLM: the tokenizer; vLLM Whisper: vLLM) failed to start with "cannot
    import name 'PretrainedConfig' from 'transformers'" (H100, 2026-11-23). With vLLM Whisper
    beside either LLM backend, both are imported here, on one thread, before the engines
    start concurrently; a missing package is left for its engine to report."""
    if cfg.asr.backend != "vllm":
        return  # one importer only: the LLM's thread
    with contextlib.suppress(ImportError):
        import transformers
        import vllm  # noqa: F401

        _ = transformers.PretrainedConfig, transformers.AutoTokenizer


async def load_engines(cfg: Config) -> Engines:
    """Resolve the models and start the engines: all of them, or none (see start_all)."""
    specs = await resolve_specs(cfg)
    asr, llm, tts = specs.asr(), specs.llm(), specs.tts()
    await asyncio.to_thread(_import_transformers_once, cfg)
    # The LLM takes longest to start (engine-core process); load the rest meanwhile.
    await start_all({"llm": llm, "asr": asr, "tts": tts})
    try:
        turn_model = await load_smart_turn(cfg)
    except BaseException:
        await Engines(cfg, asr, llm, tts, SileroVad()).aclose()  # all or nothing
        raise
    log.info("engines ready: asr=%s llm=%s tts=%s", specs.asr_path, specs.llm_path, cfg.tts.engine)
    return Engines(cfg, asr, llm, tts, SileroVad(), specs=specs, turn_model=turn_model)
