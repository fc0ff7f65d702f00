"""Kokoro-82M behind the TTS interface, one model batched across every session's clauses.

- Weights: ``tts.kokoro_model`` is a local directory (``config.json``, one ``*.pth``, voice
  packs in ``voices/`` as ``NAME.pt`` or kokoro-js's ``NAME.bin``) or a Hugging Face repo id
  (``hexgrad/Kokoro-82M``: downloaded on start, voices on first use).
- G2P: espeak-ng (the copy bundled with piper-tts) in IPA with stress marks, filtered to the
  model's vocabulary, as kokoro-onnx does; English only (``en-us``).
- Synthesis: each sentence is one clause in the shared :class:`KokoroBatcher` (bounded,
  earliest deadline first): a stream's first sentence is due when the audio ahead of it
  (``ahead_s``: none for a reply's first clause) has played, a later one when playback
  reaches it. As with :func:`stream_jobs`, the next sentence is queued before the
  current one is handed over (one sentence of look-ahead per stream); closing or
  cancelling the stream drops it (or discards it if its forward has started).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np

from voicebot.config import TtsConfig
from voicebot.engines.tts.kokoro_batch import FRAMES_PER_S, KokoroBatcher, Runner
from voicebot.engines.tts.text import clean_text, resolve_speed, split_sentences
from voicebot.errors import ConfigError, EngineError, ModelError

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
# tts.kokoro_model for GPU measurements where no weights can be fetched: random weights of the
# real shape, any voice name (a random style table), and each phoneme forced to 2-3 frames
# (random weights would predict ~25): the real model's 2.53 on average (benchmarks/gpu_kokoro.py).
RANDOM = "random"
MAX_TOKENS = 510  # the model's 512 positions less the two boundary tokens
# Frames per clause a service warms its decode shapes up to (25 ms a frame: 9.6 s, past the
# longest clause a session sends, session.max_clause_words); longer ones are met at first use.
WARM_FRAMES = 384
# Phonemes with the boundaries a service warms its encode shapes up to: the bucket past
# the phonemes of a WARM_FRAMES clause (at the model's frames per phoneme).
WARM_TOKENS = 192
_SPACE = " "

# espeak-ng is one process-global C state: phonemize one text at a time (piper's
# phonemizer has the same rule). Module-level because the state it guards is.
_espeak_lock = threading.Lock()


class EspeakG2P:
    """Text to Kokoro phoneme ids through espeak-ng's IPA (the library piper-tts bundles)."""

    def __init__(self, vocab: dict[str, int], language: str = "en-us") -> None:
        from piper import espeakbridge
        from piper.phonemize_espeak import ESPEAK_DATA_DIR

        self._bridge = espeakbridge
        self.vocab = vocab
        self.language = language
        with _espeak_lock:
            espeakbridge.initialize(str(ESPEAK_DATA_DIR))

    def phonemes(self, text: str) -> str:
        with _espeak_lock:
            self._bridge.set_voice(self.language)
            clauses = self._bridge.get_phonemes(text)
        out = []
        for phonemes, terminator, _end in clauses:
            out.append(phonemes + terminator + (_SPACE if terminator in ",:;" else ""))
        return "".join(ch for ch in "".join(out) if ch in self.vocab).strip()

    def ids(self, text: str) -> list[list[int]]:
        """Phoneme ids in pieces of at most MAX_TOKENS, cut at word boundaries."""
        ids = [self.vocab[ch] for ch in self.phonemes(text)]
        space = self.vocab.get(_SPACE)
        pieces: list[list[int]] = []
        while len(ids) > MAX_TOKENS:
            cut = max((i for i in range(MAX_TOKENS) if ids[i] == space), default=MAX_TOKENS)
            pieces.append(ids[:cut])
            ids = ids[cut + 1 if cut < MAX_TOKENS else cut :]
        if ids:
            pieces.append(ids)
        return pieces


class VoicePacks:
    """Voice style tables (510 x 256: one style per utterance length), loaded on first use."""

    def __init__(self, source: str, local: Path | None) -> None:
        self._source = source
        self._local = local
        self._packs: dict[str, Any] = {}
        self._listed: set[str] = set()  # a hub repo's voices/ (list_hub)

    def names(self) -> list[str]:
        found = set(self._packs) | self._listed
        if self._local is not None and (self._local / "voices").is_dir():
            found |= {p.stem for p in (self._local / "voices").iterdir() if p.suffix in (".pt", ".bin")}
        return sorted(found)

    def list_hub(self) -> None:
        """Learn a hub repo's voice names (blocking), so sessions may ask for any of them."""
        if self._local is not None:
            return
        from huggingface_hub import list_repo_files

        try:
            files = list_repo_files(self._source)
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot list the voices of %s (%s): only loaded ones are offered", self._source, exc)
            return
        self._listed = {f[len("voices/"):-3] for f in files if f.startswith("voices/") and f.endswith(".pt")}

    def cached(self, name: str) -> Any | None:
        return self._packs.get(name)

    def load(self, name: str) -> Any:
        """The [510, 256] style table of ``name`` (blocking: call in a thread)."""
        if name in self._packs:
            return self._packs[name]
        import torch

        if "/" in name or not name.replace("_", "").isalnum():
            raise EngineError(f"bad Kokoro voice name {name!r}")
        path = self._find(name)
        if path.suffix == ".bin":  # kokoro-js: raw float32
            pack = torch.from_numpy(np.fromfile(path, dtype=np.float32).copy())
        else:
            pack = torch.load(path, map_location="cpu", weights_only=True)
        pack = pack.reshape(-1, 256).float()
        self._packs[name] = pack
        return pack

    def _find(self, name: str) -> Path:
        if self._local is not None:
            for suffix in (".pt", ".bin"):
                p = self._local / "voices" / f"{name}{suffix}"
                if p.is_file():
                    return p
            raise EngineError(f"unknown Kokoro voice {name!r} (not in {self._local / 'voices'})")
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(repo_id=self._source, filename=f"voices/{name}.pt"))
        except Exception as exc:  # noqa: BLE001 (hub errors have no common base we can rely on)
            raise EngineError(f"unknown Kokoro voice {name!r}: {exc}") from None


class RandomVoices(VoicePacks):
    """Any voice name: a fixed random style table (``tts.kokoro_model: random``)."""

    def __init__(self) -> None:
        super().__init__(RANDOM, None)

    def list_hub(self) -> None:
        return

    def load(self, name: str) -> Any:
        if name not in self._packs:
            import torch

            gen = torch.Generator().manual_seed(len(self._packs))
            self._packs[name] = torch.randn(510, 256, generator=gen) * 0.15
        return self._packs[name]


def _total(waits: list[Any]) -> float:
    return float(sum(wait() for wait in waits))


def _model_files(source: str) -> tuple[Path, Path | None, Path | None]:
    """(config.json, weights .pth, local directory or None for a hub repo)."""
    p = Path(source).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.pth"))
        if not (p / "config.json").is_file() or len(found) != 1:
            raise ModelError(f"Kokoro directory {p} needs config.json and exactly one .pth file")
        return p / "config.json", found[0], p
    try:
        from huggingface_hub import hf_hub_download

        config = Path(hf_hub_download(repo_id=source, filename="config.json"))
        weights = Path(hf_hub_download(repo_id=source, filename="kokoro-v1_0.pth"))
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"cannot fetch Kokoro model {source!r}: {exc}") from exc
    return config, weights, None


class KokoroTts:
    """``tts.engine: kokoro``; ``runner`` replaces the torch model (tests drive fakes)."""

    sample_rate = SAMPLE_RATE

    def __init__(self, cfg: TtsConfig, *, runner: Runner | None = None, g2p: EspeakG2P | None = None,
                 voices: VoicePacks | None = None) -> None:
        self._cfg = cfg
        self._runner = runner
        self._g2p = g2p
        self._voices = voices
        self._batcher: KokoroBatcher | None = None
        self._forced_durations = False
        self._graph_sets: list[Any] = []  # the Bucketed{De,En}coder in use (tts.kokoro_cuda_graphs)

    async def start(self) -> None:
        if self._runner is None or self._g2p is None or self._voices is None:
            await asyncio.to_thread(self._load)
        assert self._runner is not None and self._voices is not None
        await asyncio.to_thread(self._voices.load, self._cfg.voice)  # a bad default voice fails here
        self._batcher = KokoroBatcher(self._runner, max_batch=self._cfg.max_batch,
                                      queue_size=self._cfg.queue_size, workers=self._cfg.workers,
                                      max_frames=round(self._cfg.max_batch_s * FRAMES_PER_S))
        self._batcher.start()

    def _load(self) -> None:
        import torch

        from voicebot.engines.tts import kokoro_model as km
        from voicebot.engines.tts.kokoro_batch import torch_runner

        t0 = time.perf_counter()
        device = self._cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if self._cfg.kokoro_cuda_graphs and not device.startswith("cuda"):
            raise ConfigError(f"tts.kokoro_cuda_graphs needs a CUDA device; tts.device is {device}")
        dtype = self._cfg.kokoro_dtype
        if not km.native_precision(device, dtype):
            raise ConfigError(f"tts.kokoro_dtype={dtype} needs a GPU or a CPU with {dtype} units (AVX-512 or AMX): "
                              f"this CPU has none, and torch's fallback decodes many times slower than in float32; "
                              "use float32")
        random_weights = self._cfg.kokoro_model == RANDOM
        if random_weights:  # GPU measurements: the real shape, no download
            config, weights, local = km.random_config(), None, None
        else:
            config_path, weights, local = _model_files(self._cfg.kokoro_model)
            config = json.loads(config_path.read_text(encoding="utf-8"))
        try:
            model = km.build_model(config, None if weights is None else str(weights), device,
                                   compile=self._cfg.kokoro_compile, dtype=dtype)
        except Exception as exc:
            raise ModelError(f"cannot load Kokoro model {self._cfg.kokoro_model}: {exc}") from exc
        decoder = encoder = lock_wait = None
        if self._cfg.kokoro_cuda_graphs:
            from voicebot.engines.tts.kokoro_graphs import BucketedDecoder, BucketedEncoder

            # Every bucket a batch of clauses will meet, captured now, before any caller
            # waits for a capture; nothing is captured after (kokoro_graphs' docstring).
            bucketed = BucketedDecoder(model, cuda_graphs=True)
            t1 = time.perf_counter()
            shapes = bucketed.warm_up(self._cfg.max_batch, WARM_FRAMES)
            log.info("Kokoro: %d decode shapes captured in %.1f s", len(shapes), time.perf_counter() - t1)
            decoder, waits = bucketed.decode, [bucketed.take_lock_wait]
            self._graph_sets.append(bucketed)
            if self._cfg.kokoro_encode_graphs:
                enc = BucketedEncoder(model, cuda_graphs=True)
                t1 = time.perf_counter()
                shapes = enc.warm_up(self._cfg.max_batch, WARM_TOKENS, forced=random_weights)
                log.info("Kokoro: %d encode shapes %s in %.1f s", len(shapes),
                         "captured" if enc.cuda_graphs else "run (eager: the capture failed)", time.perf_counter() - t1)
                encoder = enc.encode
                waits.append(enc.take_lock_wait)
                self._graph_sets.append(enc)
            lock_wait = functools.partial(_total, waits)
        elif self._cfg.kokoro_compile:
            t1 = time.perf_counter()
            km.warm_up_compiled(model)
            log.info("Kokoro: decode compiled in %.1f s", time.perf_counter() - t1)
        self._runner = self._runner or torch_runner(model, decoder=decoder, encoder=encoder, lock_wait=lock_wait)
        self._g2p = self._g2p or EspeakG2P(config["vocab"])
        if self._voices is None:
            self._voices = RandomVoices() if random_weights else VoicePacks(self._cfg.kokoro_model, local)
            self._voices.list_hub()
        self._forced_durations = random_weights
        log.info("loaded Kokoro %s on %s in %.1f s", self._cfg.kokoro_model, device, time.perf_counter() - t0)

    async def aclose(self) -> None:
        if self._batcher is not None:
            await self._batcher.aclose()

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth if self._batcher is not None else 0

    @property
    def failure_streak(self) -> int:
        return self._batcher.failure_streak if self._batcher is not None else 0

    def forward_stats(self) -> dict[str, float]:
        """The batcher's recent forwards (KokoroBatcher.forward_stats), for the TTS service's
        stats; with CUDA graphs ``graph_misses`` (batches run eagerly, past the captured
        buckets), with ``tts.kokoro_compile`` ``compiles`` (Dynamo's graphs so far): counts
        since start, whose rise during a burst would explain a stall of the whole service."""
        out: dict[str, float] = self._batcher.forward_stats() if self._batcher is not None else {}
        if self._graph_sets:
            out["graph_misses"] = sum(g.eager_calls for g in self._graph_sets)
        if self._cfg.kokoro_compile and self._batcher is not None:
            from voicebot.engines.tts.kokoro_fused import compiles

            out["compiles"] = compiles()
        return out

    @property
    def last_error(self) -> BaseException | None:
        return self._batcher.last_error if self._batcher is not None else None

    def voices(self) -> list[str]:
        names = self._voices.names() if self._voices is not None else []
        return [self._cfg.voice, *(n for n in names if n != self._cfg.voice)]

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        batcher, g2p, packs = self._batcher, self._g2p, self._voices
        if batcher is None or g2p is None or packs is None:
            raise EngineError("Kokoro engine is not started")
        sentences = split_sentences(clean_text(text))
        if not sentences:
            return
        rate = resolve_speed(speed, self._cfg.speed)
        name = voice or self._cfg.voice
        cached = packs.cached(name)  # first use: read (or download) it off the event loop
        pack: Any = cached if cached is not None else await asyncio.to_thread(packs.load, name)
        loop = asyncio.get_running_loop()
        # Loop time the caller starts hearing this text: once the audio ahead of it has played
        # (``ahead_s`` from now), or when its first sentence is handed over if that is later.
        play_from: float | None = None
        handed = 0.0  # seconds of audio handed over so far
        heard_from = loop.time() + max(ahead_s, 0.0)

        # espeak on the event loop: phonemising a sentence costs less than a thread hop.
        pieces = (ids for sentence in sentences for ids in g2p.ids(sentence))

        def submit(ids: list[int] | None) -> asyncio.Task[np.ndarray] | None:
            if ids is None:
                return None
            due = heard_from if play_from is None else play_from + handed  # when playback needs it
            style = pack[min(len(ids), pack.shape[0]) - 1]
            durations = [2 + (i % 2) for i in range(len(ids))] if self._forced_durations else None
            return asyncio.ensure_future(
                batcher.synthesize(ids, style, speed=rate, deadline=due, durations=durations))

        pending = submit(next(pieces, None))
        try:
            while pending is not None:
                audio = await pending
                if play_from is None:
                    play_from = max(loop.time(), heard_from)
                handed += audio.size / SAMPLE_RATE
                pending = submit(next(pieces, None))
                if audio.size:
                    yield audio
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                # Let the drop happen now, so queue_depth is exact when we return.
                await asyncio.gather(pending, return_exceptions=True)
