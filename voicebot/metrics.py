"""Prometheus metrics: one registry per server, handed to whoever observes.

No module-level collectors: tests and several servers in one process each get their
own :class:`Metrics`. Buckets are chosen for voice latencies (tens of ms to seconds).

A server of several workers (``server.workers``) is several processes on one port, and
a scrape reaches one of them: there prometheus_client's multiprocess mode keeps every
value in files that each worker's ``/metrics`` reads back for all of them
(``PROMETHEUS_MULTIPROC_DIR``, set by voicebot/server/workers.py before the workers
start). Counters and histograms add up; each gauge says how (``multiprocess_mode``:
``livesum`` for open calls, ``livemin`` for an engine being up, ...); the process
metrics come once per worker, labelled ``worker``.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector


class StageLatencies(Protocol):
    """A turn's stage latencies in milliseconds, None where a stage did not happen (the
    session's ``TurnTimings``; declared here so that metrics import no session module)."""

    @property
    def endpointing_ms(self) -> float | None: ...

    @property
    def asr_final_ms(self) -> float | None: ...

    @property
    def llm_ttft_ms(self) -> float | None: ...

    @property
    def first_clause_ms(self) -> float | None: ...

    @property
    def tts_first_audio_ms(self) -> float | None: ...

    @property
    def voice_to_voice_ms(self) -> float | None: ...

# Fine below 1.5 s, where turns are judged; above it, steps that keep p95/p99 of a slow
# minute readable (histogram_quantile interpolates inside one bucket).
_LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0,
                    5.0, 6.0, 8.0, 10.0, 15.0)


def shared_across_workers() -> bool:
    """Whether this process's values go to the workers' shared files (prometheus_client
    decides at its import, from the same variable)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.shared = shared_across_workers()
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.endpointing = hist("voicebot_endpointing_seconds", "End of user speech to end-of-turn decision.")
        self.asr_final = hist("voicebot_asr_final_seconds", "ASR finalize() call to final transcript.")
        self.llm_ttft = hist("voicebot_llm_ttft_seconds", "LLM request to first token.")
        self.first_clause = hist("voicebot_first_clause_seconds", "LLM request to first speakable clause.")
        self.tts_first_audio = hist("voicebot_tts_first_audio_seconds", "First clause to its first synthesised audio.")
        self.voice_to_voice = hist("voicebot_voice_to_voice_seconds", "End of user speech to first reply audio sent.")
        self.prompt_tokens = Counter("voicebot_llm_prompt_tokens", "Prompt tokens sent to the LLM.", registry=r)
        self.cached_tokens = Counter("voicebot_llm_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.cache_hit_ratio = Gauge("voicebot_llm_prefix_cache_hit_ratio", "Cached / prompt tokens since start.",
                                     registry=r, multiprocess_mode="liveall")
        self.active_sessions = Gauge("voicebot_active_sessions", "Sessions open now.", ["transport"], registry=r,
                                     multiprocess_mode="livesum")
        self.capacity = Gauge("voicebot_session_capacity", "Sessions this server admits at once (server.max_sessions).",
                              registry=r, multiprocess_mode="livemax")
        self.sessions = Counter("voicebot_sessions", "Sessions opened.", ["transport"], registry=r)
        self.turns = Counter("voicebot_turns", "User turns committed.", registry=r)
        self.barge_ins = Counter("voicebot_barge_ins", "Replies interrupted by the caller.", registry=r)
        self.false_interruptions = Counter(
            "voicebot_false_interruptions",
            "Replies paused by speech that was no turn (a backchannel, a noise) and resumed.", registry=r)
        self.reopened_turns = Counter(
            "voicebot_reopened_turns",
            "Turns taken for over too early: the caller went on before a word of the reply, which was withdrawn unseen.",
            registry=r)
        self.errors = Counter("voicebot_errors", "Errors sent to clients, by code.", ["code"], registry=r)
        self.queue_depth = Gauge("voicebot_queue_depth", "Jobs waiting per engine queue.", ["queue"], registry=r,
                                 multiprocess_mode="livesum")
        self.engine_up = Gauge("voicebot_engine_up", "1 while the engine works, 0 while failed or restarting.", ["engine"],
                               registry=r, multiprocess_mode="livemin")
        self.engine_restarts = Gauge("voicebot_engine_restarts", "Successful supervised restarts per engine.", ["engine"],
                                     registry=r, multiprocess_mode="livesum")
        # Leak watching (soak): live asyncio tasks, plus process_open_fds /
        # process_resident_memory_bytes from prometheus_client's process collector.
        self.heap_trims = Counter("voicebot_heap_trims", "glibc malloc_trim runs after calls ended (server.heap_trim_interval_s).", registry=r)
        self.asyncio_tasks = Gauge("voicebot_asyncio_tasks", "Live asyncio tasks of the server's loop.", registry=r,
                                   multiprocess_mode="liveall")
        self.loop_lag = Histogram("voicebot_event_loop_lag_seconds", "How late the event loop every call shares ran a 100 ms timer.",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=r)
        self.loop_stalls = Counter("voicebot_event_loop_stalls", "Times the event loop did not run for server.loop_stall_s or longer.", registry=r)
        self.admission_refusals = Counter(
            "voicebot_admission_refusals",
            "New sessions refused, by reason: loading, draining, engine_down, capacity (server.max_sessions), "
            "per_client (server.max_sessions_per_client), loop_lag (server.admission_max_loop_lag_ms).", ["reason"], registry=r)
        self.late_loop_timeouts = Counter(
            "voicebot_late_loop_timeouts",
            "Engine-client timeouts (LLM tier, ASR / TTS service) that fired after this server's event loop ran "
            "late for half the wait or more: failed for the call, not counted against the engine's health.", registry=r)
        # What calls leave behind (voicebot/observe): a record or webhook that fails never
        # disturbs a call, so these are where an operator sees it.
        self.records = Counter("voicebot_call_records", "Call records by outcome: written, failed (unwritable directory, full disk), dropped (the writer was behind).", ["outcome"], registry=r)
        self.call_audio = Counter("voicebot_call_audio", "Calls' WAVs (telemetry.record_audio) by outcome: written, failed (unwritable directory, full disk), dropped (the writer was behind: the WAV stops early).", ["outcome"], registry=r)
        self.webhooks = Counter("voicebot_call_webhooks", "End-of-call webhooks by outcome: delivered, failed (after its attempts), dropped (queue full, or given up at shutdown).", ["outcome"], registry=r)
        if not self.shared:
            ProcessCollector(registry=r)

    def serve_transports(self, transports: Iterable[str]) -> None:
        """Each served protocol's call counters from 0, before its first call: a labelled
        counter that appears at its first event is missed by ``rate()`` for that event."""
        for transport in transports:
            self.sessions.labels(transport)
            self.active_sessions.labels(transport)

    def observe_turn(self, t: StageLatencies) -> None:
        pairs = (
            (self.endpointing, t.endpointing_ms),
            (self.asr_final, t.asr_final_ms),
            (self.llm_ttft, t.llm_ttft_ms),
            (self.first_clause, t.first_clause_ms),
            (self.tts_first_audio, t.tts_first_audio_ms),
            (self.voice_to_voice, t.voice_to_voice_ms),
        )
        for hist, ms in pairs:
            if ms is not None:
                hist.observe(ms / 1000.0)

    def count_tokens(self, prompt: int, cached: int) -> None:
        """At a reply's end: a remote backend learns both counts from the last chunk only."""
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)

    def update_process(self, health: Mapping[str, Any] | None) -> None:
        """Scrape-time values: live tasks (call from the loop) and each engine's health."""
        self.asyncio_tasks.set(len(asyncio.all_tasks()))
        for name, h in (health or {}).items():
            self.engine_up.labels(name).set(1 if h.ok else 0)
            self.engine_restarts.labels(name).set(h.restarts)

    def render(self, workers: Callable[[], Mapping[int, int]] | None = None) -> bytes:
        """The exposition; with workers (index -> pid), every worker's values."""
        if not self.shared:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        if workers is not None:
            registry.register(_WorkerProcesses(workers))
        return generate_latest(registry)


class _WorkerProcesses:
    """prometheus_client's process metrics (memory, CPU, descriptors) of every worker,
    labelled ``worker``: read from /proc at the scrape, so none is stale."""

    def __init__(self, workers: Callable[[], Mapping[int, int]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for worker, pid in sorted(self._workers().items()):
            for family in ProcessCollector(pid=functools.partial(int, pid), registry=None).collect():
                out = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "worker": str(worker)}, sample.value)
        yield from families.values()
