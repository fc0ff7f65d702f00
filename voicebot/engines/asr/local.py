"""faster-whisper on this machine's threads: the default ASR decoder (``asr.backend:
faster-whisper``).

``cfg.workers`` threads of our own each run one blocking CTranslate2 decode (decodes must
not queue behind unrelated ``to_thread()`` work). A thread cannot be interrupted: a job
marked stale stops at the decode's next checkpoint (before the encoder, before the
decoder; see :mod:`.whisper_window`), where :class:`~.jobs.DecodeAbandoned` ends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from voicebot.config import AsrConfig
from voicebot.engines.asr.agreement import continuation_after
from voicebot.engines.asr.jobs import DecodeAbandoned, DecodeJob, Priority
from voicebot.errors import ModelError

log = logging.getLogger(__name__)


class LocalWhisper:
    """A :class:`~.jobs.Decoder`: one faster-whisper model and its decode threads."""

    name = "asr-worker"
    samples = True

    def __init__(self, cfg: AsrConfig, model_path: str) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.model: Any = None
        self.executor: ThreadPoolExecutor | None = None

    @property
    def slots(self) -> int:
        return self.cfg.workers

    async def start(self) -> None:
        # heavy import (faster-whisper), only when serving
        from voicebot.engines.asr.whisper_window import WindowedWhisper

        cfg = self.cfg
        t0 = time.perf_counter()
        try:
            self.model = await asyncio.to_thread(
                WindowedWhisper,
                self.model_path,
                device=cfg.device,
                compute_type=cfg.compute_type,
                cpu_threads=cfg.cpu_threads,
                num_workers=cfg.workers,
            )
        except Exception as exc:
            raise ModelError(f"cannot load ASR model {self.model_path!r}: {exc}") from exc
        self.executor = ThreadPoolExecutor(cfg.workers, thread_name_prefix="asr")
        log.info("ASR model %s loaded in %.2f s (%d workers)", self.model_path, time.perf_counter() - t0, cfg.workers)

    async def aclose(self) -> None:
        if self.executor is not None:
            # Waits for at most the decodes already running (threads cannot be interrupted).
            await asyncio.to_thread(self.executor.shutdown, wait=True)
            self.executor = None
        self.model = None

    async def decode(self, job: DecodeJob) -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._decode, job)

    def abandon(self, job: DecodeJob) -> None:
        """Nothing to do here: the decode thread reads ``job.stale`` at its checkpoints."""

    def _decode(self, job: DecodeJob) -> tuple[str, float]:
        """Runs in a decode thread; returns the text after the prefix and the decode time."""
        cfg = self.cfg
        t0 = time.perf_counter()

        def checkpoint() -> None:
            if job.stale:  # set on the event loop; a bool read needs no lock
                raise DecodeAbandoned

        text = self.model.transcribe_text(
            job.audio,
            pad_s=cfg.encoder_pad_s,
            min_s=cfg.encoder_min_s,
            language=job.language,
            beam_size=cfg.beam_size if job.priority is Priority.FINAL else cfg.partial_beam_size,
            best_of=1,
            # One temperature: faster-whisper's own fallback re-decodes on a low log
            # probability too, whose cost is unbounded on short audio. Loops are caught
            # (and re-decoded at job.temperature) by loop_guard.py, for every backend.
            temperature=job.temperature,
            tokens_per_s=cfg.max_tokens_per_s,
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,  # our VAD runs upstream
            suppress_blank=True,
            prefix=job.prefix or None,
            checkpoint=checkpoint,
        )
        return continuation_after(text, job.prefix), time.perf_counter() - t0
