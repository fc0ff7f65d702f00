"""The registry: which backend each stage runs, from the config, and the shared engines.

One ASR, one LLM, one TTS and one VAD model serve every session. ``create_asr``,
``create_llm`` and ``create_tts`` are the only places that read ``asr.backend``,
``llm.backend`` and ``tts.engine`` / ``tts.backend``; each imports its backend's module
only when that backend is chosen (vLLM, faster-whisper, Piper ... are heavy). To add a
backend: implement the stage's contract (:mod:`voicebot.engines.contracts`), add its
name to the config's ``Literal``, and a branch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from voicebot.config import AsrConfig, Config, LlmConfig, TtsConfig
from voicebot.engines.contracts import Asr, EndOfTurn, Llm, Tts, Vad
from voicebot.engines.health import EngineHealth
from voicebot.engines.startup import reap_children, start_all
from voicebot.engines.turn.smart_turn import load_smart_turn
from voicebot.engines.turn.vad import SileroVad
from voicebot.errors import ModelError
from voicebot.runtime.loop_lag import LoopLateness

if TYPE_CHECKING:
    from voicebot.engines.asr.engine import AsrEngine
    from voicebot.engines.asr.fastconformer import FastConformerAsr
    from voicebot.engines.asr.remote_streams import RemoteStreamingAsr
    from voicebot.engines.asr.vllm_whisper import WhisperVllmSettings

log = logging.getLogger(__name__)

ENGINE_NAMES = ("asr", "llm", "tts")


def create_asr(
    cfg: AsrConfig, model_path: str, *, settings: WhisperVllmSettings | None = None,
    loop: LoopLateness | None = None,
) -> AsrEngine | FastConformerAsr | RemoteStreamingAsr:
    """The ASR engine ``cfg.backend`` names: faster-whisper (CPU, or CUDA 12), Whisper on vLLM,
    the shared ASR service (``model_path`` is then its URL) or the streaming FastConformer
    (``model_path``: asr.fastconformer.model, resolved). ``settings`` (benchmarks) replaces
    everything the config says of the vLLM engine, the encoder window included. ``loop``:
    the server's loop watch, which a remote engine's client asks whether a timeout was ours."""
    if cfg.backend == "fastconformer":
        from voicebot.engines.asr.fastconformer import FastConformerAsr

        return FastConformerAsr(cfg, model_path)
    if cfg.backend == "vllm":
        from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, WhisperVllmSettings

        settings = settings or WhisperVllmSettings(
            **cfg.vllm.model_dump(), window_pad_s=cfg.encoder_pad_s, window_min_s=cfg.encoder_min_s
        )
        return VllmAsrEngine(cfg, model_path, agreement_n=cfg.agreement_n, settings=settings)
    if cfg.backend == "remote" and cfg.remote.engine == "fastconformer":
        # The service holds the streams (voicebot asr-serve with a streaming engine).
        from voicebot.engines.asr.remote_streams import RemoteStreamingAsr

        return RemoteStreamingAsr(cfg, model_path, loop=loop)
    if cfg.backend == "remote":  # the shared ASR service (voicebot asr-serve)
        from voicebot.engines.asr.remote import RemoteAsrEngine

        return RemoteAsrEngine(cfg, model_path, agreement_n=cfg.agreement_n, loop=loop)
    from voicebot.engines.asr.engine import AsrEngine

    return AsrEngine(cfg, model_path, agreement_n=cfg.agreement_n)


def create_llm(cfg: LlmConfig, model_path: str, tokenizer_path: str | None = None, *,
               loop: LoopLateness | None = None) -> Llm:
    """The LLM ``cfg.backend`` names: vLLM in this process, or the remote tier over HTTP
    (then only the tokenizer is loaded here: ``tokenizer_path``, else ``model_path``)."""
    if cfg.backend == "remote":
        from voicebot.engines.llm.remote import RemoteLlmEngine

        return RemoteLlmEngine(cfg, tokenizer_path or model_path, loop=loop)
    from voicebot.engines.llm.inprocess import LlmEngine

    return LlmEngine(cfg, model_path, tokenizer_path)


def create_tts(cfg: TtsConfig, voice_path: str | None, *, loop: LoopLateness | None = None) -> Tts:
    """The TTS engine ``cfg.engine`` names; ``voice_path`` is the engine's resolved model
    reference (:func:`voicebot.provision.resolve.tts_model_ref`): Piper's voice directory,
    Coqui's model directory or hub id. With ``cfg.backend: remote`` it is the client of the
    shared service that hosts that engine."""
    if cfg.backend == "remote":
        from voicebot.engines.tts.remote import RemoteTts

        return RemoteTts(cfg, loop=loop)
    if cfg.engine == "piper":
        from voicebot.engines.tts.piper import PiperTts

        if voice_path is None:
            raise ModelError("tts.engine=piper needs a resolved voice directory (tts.model or tts.voice)")
        return PiperTts(cfg, voice_path)
    if cfg.engine == "kokoro":
        from voicebot.engines.tts.kokoro import KokoroTts

        return KokoroTts(cfg)
    if cfg.engine == "coqui":
        from voicebot.engines.tts.coqui import CoquiTts

        if voice_path is None:
            raise ModelError("tts.engine=coqui needs a resolved model (tts.model or tts.coqui_model)")
        return CoquiTts(cfg, voice_path)
    from voicebot.engines.tts.espeak import EspeakTts

    return EspeakTts(cfg)


@dataclass(frozen=True)
class EngineSpecs:
    """Resolved model paths: what it takes to build each engine again (a supervised restart)."""

    cfg: Config
    asr_path: str
    llm_path: str
    tokenizer_path: str | None
    voice_path: str | None
    # The server's loop watch: a restarted engine's client asks it too.
    loop: LoopLateness | None = None

    def asr(self) -> Asr:
        return create_asr(self.cfg.asr, self.asr_path, loop=self.loop)

    def llm(self) -> Llm:
        return create_llm(self.cfg.llm, self.llm_path, self.tokenizer_path, loop=self.loop)

    def tts(self) -> Tts:
        return create_tts(self.cfg.tts, self.voice_path, loop=self.loop)


@dataclass
class Engines:
    cfg: Config
    asr: Asr
    llm: Llm
    tts: Tts
    vad: Vad
    # None when the engines were built by hand (tests): then they cannot be restarted.
    specs: EngineSpecs | None = None
    # The end-of-turn model (vad.turn_detector: smart_turn), else None.
    turn_model: EndOfTurn | None = None
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


async def resolve_specs(cfg: Config, loop: LoopLateness | None = None) -> EngineSpecs:
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
    return EngineSpecs(cfg, asr_path, llm_path, await resolve(refs.tokenizer), await resolve(refs.voice), loop)


def import_transformers_once(cfg: Config) -> None:
    """transformers' lazy module is not safe to import from two threads at once: a GPU
    frontend (remote LLM: the tokenizer; vLLM Whisper: vLLM) failed to start with "cannot
    import name 'PretrainedConfig' from 'transformers'", and so did a server whose Coqui
    engine (its XTTS code imports transformers) loaded beside vLLM. With vLLM Whisper or
    Coqui beside either LLM backend, all are imported here, on one thread, before the
    engines start concurrently; a missing package is left for its engine to report."""
    coqui = cfg.tts.engine == "coqui" and cfg.tts.backend == "local"
    if cfg.asr.backend not in ("vllm", "fastconformer") and not coqui:
        return  # one importer only: the LLM's thread
    with contextlib.suppress(ImportError):
        import transformers
        import vllm  # noqa: F401

        _ = transformers.PretrainedConfig, transformers.AutoTokenizer
    if coqui:
        with contextlib.suppress(ImportError):
            import TTS.tts.models.xtts  # noqa: F401


async def load_engines(cfg: Config, *, loop: LoopLateness | None = None) -> Engines:
    """Resolve the models and start the engines: all of them, or none (see start_all).
    ``loop``: the server's loop watch, for the remote engines' clients."""
    specs = await resolve_specs(cfg, loop)
    asr, llm, tts = specs.asr(), specs.llm(), specs.tts()
    await asyncio.to_thread(import_transformers_once, cfg)
    # The LLM takes longest to start (engine-core process); load the rest meanwhile.
    await start_all({"llm": llm, "asr": asr, "tts": tts})
    try:
        turn_model = await load_smart_turn(cfg)
    except BaseException:
        await Engines(cfg, asr, llm, tts, SileroVad()).aclose()  # all or nothing
        raise
    log.info("engines ready: asr=%s llm=%s tts=%s", specs.asr_path, specs.llm_path, cfg.tts.engine)
    return Engines(cfg, asr, llm, tts, SileroVad(), specs=specs, turn_model=turn_model)
