"""The server's telemetry: each call's observer, and the sinks every call shares.

:class:`Telemetry` is built once per server from ``telemetry.*`` and the ``OTEL_*``
environment. :meth:`Telemetry.observer` gives a call what watches it: nothing when
nothing is configured (the call pays one no-op method call per event), else a
:class:`CallTelemetry` that feeds the call's record (kept when there is a record
directory or a webhook) and its trace. When the call ends, its record goes to the
writer thread (voicebot/observe/store.py), which serialises and writes it off the
event loop, then hands the JSON back to the loop for the webhook
(voicebot/observe/webhook.py). With ``telemetry.record_audio`` the call's audio is
streamed to a WAV beside its record (voicebot/observe/call_audio.py), by another
writer thread (voicebot/observe/audio_files.py). A failing consumer is logged once
and never reaches the call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from voicebot.config import TelemetryConfig
from voicebot.errors import ConfigError
from voicebot.metrics import Metrics
from voicebot.observe import tracing
from voicebot.observe.audio_files import AudioFiles, WavStream
from voicebot.observe.call_audio import CHANNELS, RATE, CallAudio
from voicebot.observe.records import CallRecorder
from voicebot.observe.store import RecordStore, record_name
from voicebot.observe.webhook import WebhookSender
from voicebot.session.events import SessionEvent
from voicebot.session.observer import NO_OBSERVER, AudioTap, CallObserver, TurnStages

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)


class CallTelemetry:
    """One call's observers behind one guard: an error in one of them is logged (once
    per call) and the call goes on."""

    def __init__(self, telemetry: Telemetry, recorder: CallRecorder | None,
                 tracer: tracing.CallTracer | None, audio: CallAudio | None = None) -> None:
        self._telemetry = telemetry
        self.recorder = recorder
        self.audio = audio
        self._observers: list[CallObserver] = [o for o in (recorder, tracer, audio) if o is not None]
        self._failed = False

    def _each(self, method: str, *args: object) -> None:
        for observer in self._observers:
            try:
                getattr(observer, method)(*args)
            except Exception:
                if not self._failed:
                    self._failed = True
                    log.exception("call telemetry failed (%s); the call goes on", type(observer).__name__)

    def audio_tap(self) -> AudioTap | None:
        return self.audio

    def started(self, call_id: str, transport: str, now: float) -> None:
        self._each("started", call_id, transport, now)
        if self.audio is not None and self.recorder is not None:
            try:  # named after the record: <start>_<call id>.wav beside <start>_<call id>.json
                stem = record_name({"started_at": self.recorder.started_at, "call_id": call_id})
                name = stem[: -len(".json")] + ".wav"
                self.audio.attach(name, self._telemetry.audio_file(name))
            except Exception:
                log.exception("call audio of %s not recorded; the call goes on", call_id)

    def details(self, fields: Mapping[str, str]) -> None:
        self._each("details", fields)

    def event(self, event: SessionEvent, now: float) -> None:
        self._each("event", event, now)

    def stages(self, stages: TurnStages) -> None:
        self._each("stages", stages)

    def ended(self, reason: str, now: float) -> None:
        self._each("ended", reason, now)
        if self.recorder is not None:
            try:
                if self.audio is not None:
                    self.recorder.audio = self.audio.reference()
                self._telemetry.finished(self.recorder)
            except Exception:
                log.exception("call record of %s not handed on; the call goes on", self.recorder.call_id)


class Telemetry:
    """What the server's calls leave behind; one per server (``ServerState.telemetry``)."""

    def __init__(self, cfg: TelemetryConfig, metrics: Metrics, environ: Mapping[str, str] | None = None,
                 share: tuple[int, int, float] = (0, 1, math.inf)) -> None:
        """``share``: (this worker, workers, when the server started) of a server of several
        on one port, which write into one record_dir: each keeps 1/K of its bounds, and the
        first takes in what was there before the start (voicebot/observe/rotation.py)."""
        environ = os.environ if environ is None else environ
        self.cfg = cfg
        self._worker, self._workers, started = share
        self._existing_before = started if self._worker == 0 else -math.inf
        self._metrics = metrics
        self.provider: TracerProvider | None = tracing.provider_from_env(environ) if tracing.wanted(environ) else None
        self._tracer = tracing.tracer_of(self.provider) if self.provider is not None else None
        self.webhook: WebhookSender | None = None
        if cfg.webhook_url:
            secret = environ.get(cfg.webhook_secret_env, "")
            if not secret:
                raise ConfigError(
                    f"telemetry.webhook_url is set but ${cfg.webhook_secret_env} (its signing secret) is empty"
                )
            self.webhook = WebhookSender(
                cfg.webhook_url, secret.encode(), timeout_s=cfg.webhook_timeout_s, attempts=cfg.webhook_attempts,
                backoff_s=cfg.webhook_backoff_s, queue_size=cfg.webhook_queue,
                on_outcome=lambda outcome: metrics.webhooks.labels(outcome).inc(),
            )
        if cfg.record_audio and not cfg.record_dir:
            raise ConfigError("telemetry.record_audio needs telemetry.record_dir (the WAVs go beside the records)")
        self._store: RecordStore | None = None
        self._audio_files: AudioFiles | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def records(self) -> bool:
        """Is a record kept of each call?"""
        return bool(self.cfg.record_dir or self.webhook)

    def observer(self) -> CallObserver:
        """What watches a new call (on the server's loop)."""
        if not self.records and self._tracer is None:
            return NO_OBSERVER
        recorder = CallRecorder(max_turns=self.cfg.max_turns, max_text_chars=self.cfg.max_text_chars) \
            if self.records else None
        tracer = tracing.CallTracer(self._tracer, include_text=self.cfg.include_text) \
            if self._tracer is not None else None
        audio = CallAudio(max_s=self.cfg.record_audio_max_s) if self.cfg.record_audio else None
        return CallTelemetry(self, recorder, tracer, audio)

    def audio_file(self, name: str) -> WavStream:
        """A call's WAV, from the writer thread started by the first one."""
        if self._audio_files is None:
            assert self.cfg.record_dir is not None
            self._audio_files = AudioFiles(
                self.cfg.record_dir, rate=RATE, channels=len(CHANNELS), max_files=self._share(self.cfg.record_max_files),
                max_bytes=self._share(int(self.cfg.record_audio_max_mb * (1 << 20))),
                on_outcome=lambda outcome: self._metrics.call_audio.labels(outcome).inc(),
                existing_before=self._existing_before,
            )
        return self._audio_files.open(name)

    def finished(self, recorder: CallRecorder) -> None:
        """A call ended: its record to the writer thread (and from there to the webhook)."""
        if self._store is None:
            self._loop = asyncio.get_running_loop()
            self._store = RecordStore(
                self.cfg.record_dir, max_files=self._share(self.cfg.record_max_files),
                max_bytes=self._share(int(self.cfg.record_max_mb * (1 << 20))),
                on_outcome=lambda outcome: self._metrics.records.labels(outcome).inc(),
                then=self._to_webhook if self.webhook is not None else None,
                existing_before=self._existing_before,
            )
        self._store.put(recorder.document())

    def _share(self, bound: int) -> int:
        """This worker's part of a bound of record_dir (all of it for one process)."""
        return max(1, bound // self._workers)

    def _to_webhook(self, call_id: str, body: bytes) -> None:
        """From the writer thread: the record's JSON to the webhook, on the loop."""
        assert self._loop is not None and self.webhook is not None
        self._loop.call_soon_threadsafe(self.webhook.put, call_id, body)

    async def aclose(self) -> None:
        """At shutdown, after the calls closed: records written and webhooks sent, each
        within ``telemetry.shutdown_wait_s``; spans flushed."""
        wait = self.cfg.shutdown_wait_s
        if self._audio_files is not None:
            await asyncio.to_thread(self._audio_files.close, wait)
        if self._store is not None:
            await asyncio.to_thread(self._store.close, wait)
            await asyncio.sleep(0)  # the records the writer handed on reach the webhook's queue
        if self.webhook is not None:
            await self.webhook.aclose(wait)
        if self.provider is not None:
            provider, self.provider, self._tracer = self.provider, None, None
            await asyncio.to_thread(provider.force_flush, int(wait * 1000))
            await asyncio.to_thread(provider.shutdown)
