"""What every request handler shares: config, engines, metrics and the open sessions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from voicebot.config import Config
from voicebot.engines.contracts import SeveralServices
from voicebot.engines.registry import Engines
from voicebot.errors import AuthError, CapacityError, VoicebotError
from voicebot.metrics import Metrics
from voicebot.observe.telemetry import Telemetry
from voicebot.runtime.heap import HeapTrimmer
from voicebot.runtime.loop_watch import LoopWatch
from voicebot.server import edge
from voicebot.server.client_secrets import ClientSecrets
from voicebot.server.siblings import Siblings
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings

log = logging.getLogger(__name__)


class NotReady(VoicebotError):
    code = "not_ready"
    fatal = True


# Why check_admission refused a new session: the label of voicebot_admission_refusals.
REFUSAL_REASONS = ("loading", "draining", "engine_down", "capacity", "per_client", "loop_lag")


@dataclass
class ServerState:
    cfg: Config
    metrics: Metrics = field(default_factory=Metrics)
    engines: Engines | None = None
    load_error: str | None = None
    sessions: dict[str, Session] = field(default_factory=dict)
    # The other worker processes on this server's port, and the counts admission shares
    # with them (voicebot/server/siblings.py; a table of one row for one process).
    siblings: Siblings = field(default_factory=Siblings.alone)
    started_at: float = field(default_factory=time.monotonic)
    # Live WebRTC peer connections (transports/webrtc.py), so shutdown and tests can see them.
    peer_connections: set[Any] = field(default_factory=set)
    # Awaited by close_all() after the sessions close: a transport whose work outlives
    # the request that started it (a WebRTC call) waits for that work here.
    shutdown_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Set on SIGTERM/SIGINT (voicebot/server/drain.py): no new sessions, /healthz 503.
    draining: bool = False
    # Set once the engines are loaded, or failed to load (load_error): a worker of
    # several opens the shared port only then (voicebot/server/workers.py).
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    # How late the loop runs (voicebot/runtime/loop_watch.py; None: not watched): over
    # server.admission_max_loop_lag_ms, new sessions are refused.
    loop: LoopWatch | None = None

    # Keys from the environment / key file, read once (server.api_key is read per request).
    api_keys: tuple[str, ...] = ()

    # Gives freed native memory back after calls end (voicebot/runtime/heap.py).
    heap: HeapTrimmer = field(init=False)
    # Each call's trace, record and webhook (voicebot/observe).
    telemetry: Telemetry = field(init=False)
    # Ephemeral client secrets (browser, WebRTC, Twilio streams), shared by the workers.
    secrets: ClientSecrets = field(init=False)

    def __post_init__(self) -> None:
        self.api_keys = edge.load_api_keys(self.cfg.server)
        run_dir = self.siblings.runtime_dir
        self.secrets = ClientSecrets(None if run_dir is None else run_dir / "secrets")
        self.telemetry = Telemetry(self.cfg.telemetry, self.metrics,
                                   share=(self.siblings.index, self.siblings.count, self.siblings.started_at))
        self.metrics.capacity.set(self.cfg.server.max_sessions)
        self.metrics.serve_transports(self.cfg.server.transports)
        for reason in REFUSAL_REASONS:  # from 0: rate() misses a counter's first event
            self.metrics.admission_refusals.labels(reason)
        self.heap = HeapTrimmer(self.cfg.server.heap_trim_interval_s, on_trim=self.metrics.heap_trims.inc)

    @property
    def ready(self) -> bool:
        return self.engines is not None

    # ------------------------------------------------------------------ auth
    def keys(self) -> tuple[str, ...]:
        key = self.cfg.server.api_key
        return (*self.api_keys, key) if key else self.api_keys

    @property
    def auth_required(self) -> bool:
        return bool(self.keys())

    def check_auth(self, authorization: str | None, token: str | None = None) -> None:
        """Accept an API key or a live ephemeral secret, as a Bearer header or token."""
        keys = self.keys()
        if not keys:
            return
        supplied = edge.bearer(authorization) or token
        if not supplied:
            raise AuthError("missing credentials: send 'Authorization: Bearer <key>'")
        if edge.key_matches(supplied, keys):
            return
        if self.secrets.valid(supplied):  # random 192-bit values: a lookup leaks nothing useful
            return
        raise AuthError("invalid credentials")

    def admin_allowed(self, authorization: str | None) -> bool:
        """May this request see /metrics and the details of /healthz? Only with a long-lived
        API key when keys are configured (ephemeral secrets are for browsers, not operators);
        a bare liveness answer stays open to everyone."""
        keys = self.keys()
        return not keys or edge.key_matches(edge.bearer(authorization) or "", keys)

    def check_api_key(self, authorization: str | None) -> None:
        """Only a long-lived key (minting ephemeral secrets needs one)."""
        keys = self.keys()
        if keys and not edge.key_matches(edge.bearer(authorization) or "", keys):
            raise AuthError("invalid API key")

    def mint_secret(self, ttl_s: float = 60.0, session: dict[str, Any] | None = None) -> tuple[str, float]:
        """A client secret valid for ``ttl_s`` (CapacityError when too many are out), with
        the Realtime session config a call opened with it starts from."""
        return self.secrets.mint(ttl_s, session)

    # ------------------------------------------------------------- admission
    def check_admission(self, client: str | None = None) -> None:
        """Raise NotReady / CapacityError unless a new session may start now (each
        refusal counted by reason).

        ``client`` is the caller's address (None: not limited per client, e.g. Twilio, whose
        calls all come from Twilio's media servers)."""
        try:
            self._admit(client)
        except _Refused as refused:
            self.metrics.admission_refusals.labels(refused.reason).inc()
            raise refused.error from None

    def _admit(self, client: str | None) -> None:
        if self.engines is None:
            raise _Refused("loading", NotReady(self.load_error or "the server is still loading its models; retry shortly"))
        if self.draining:
            raise _Refused("draining", NotReady("the server is shutting down; retry on another instance", code="draining"))
        failure = self.engine_failure()
        if failure:  # an engine is down: say why instead of admitting a session that cannot work
            raise _Refused("engine_down", NotReady(f"engine unavailable: {failure}"))
        cfg = self.cfg.server
        # The whole server's counts: every worker on this port admits against them.
        if self.siblings.sessions_total() >= cfg.max_sessions:
            raise _Refused("capacity", CapacityError(f"server at capacity ({cfg.max_sessions} sessions)"))
        limit = cfg.max_sessions_per_client
        if client is not None and limit is not None and self.siblings.client_sessions(client) >= limit:
            raise _Refused("per_client", CapacityError(f"too many sessions from one address ({limit}); close one first"))
        lag_ms = self.loop_lag_ms()
        if lag_ms is not None and lag_ms > cfg.admission_max_loop_lag_ms:
            # The calls in progress already wait this long for every callback: one more
            # would make it worse for all of them (and its own audio would stutter).
            raise _Refused("loop_lag", CapacityError(
                f"server overloaded: its event loop ran {lag_ms:.0f} ms late on average over the last "
                f"{cfg.admission_lag_window_s:g} s (server.admission_max_loop_lag_ms {cfg.admission_max_loop_lag_ms:g}); "
                "retry shortly or on another instance"))

    def loop_lag_ms(self) -> float | None:
        """The loop's mean lateness that admission compares with its limit (None: not
        checked: no watch, or server.admission_max_loop_lag_ms 0)."""
        cfg = self.cfg.server
        if self.loop is None or cfg.admission_max_loop_lag_ms <= 0:
            return None
        return self.loop.mean_lag(cfg.admission_lag_window_s) * 1000.0

    def count_error(self, code: str) -> None:
        """The one place the edge counts an error it answered with (a refused connection,
        an error event of a transport's own); a session counts those it raises itself."""
        self.metrics.errors.labels(code).inc()

    # -------------------------------------------------------------- sessions
    def default_settings(self) -> SessionSettings:
        return SessionSettings.from_config(self.cfg)

    @contextlib.asynccontextmanager
    async def open_session(
        self, transport: str, settings: SessionSettings | None = None, *, client: str | None = None
    ) -> AsyncIterator[Session]:
        """Admit a session (or raise CapacityError / NotReady) and close it however it ends.

        ``client``: the caller's address, for ``server.max_sessions_per_client``."""
        with self.siblings.admitting():  # no other worker admits between the check and the count
            self.check_admission(client)
            self.siblings.opened(client)
        try:
            assert self.engines is not None  # check_admission raised otherwise
            session = Session(self.engines, settings or self.default_settings(), metrics=self.metrics,
                              transport=transport, observer=self.telemetry.observer())
            self.sessions[session.id] = session
            try:
                async with session:
                    yield session
            finally:
                self.sessions.pop(session.id, None)
        finally:
            self.siblings.closed(client)
            self.heap.session_ended()

    async def close_all(self) -> None:
        await asyncio.gather(*(s.aclose("server shutdown") for s in list(self.sessions.values())), return_exceptions=True)
        await asyncio.gather(*(hook() for hook in self.shutdown_hooks), return_exceptions=True)
        await self.telemetry.aclose()
        await self.heap.aclose()

    def voices(self) -> frozenset[str] | None:
        """The voices the TTS engine offers, for checking a session's choice (None: any)."""
        try:
            return frozenset(self.engines.tts.voices()) if self.engines is not None else None
        except Exception:  # an engine that cannot list its voices accepts any name
            return None

    def engine_failure(self) -> str | None:
        """Why sessions cannot be served now that the engines are loaded (an engine down), or None."""
        return None if self.engines is None else self.engines.failure()

    def status(self) -> tuple[str, str | None]:
        """("ok" | "loading" | "failed" | "unhealthy" | "draining" | "overloaded", reason);
        /healthz is 200 only for "ok". "overloaded": the loop is too late to admit new
        sessions (a balancer sends them elsewhere meanwhile; the calls here go on)."""
        if self.draining:
            return "draining", "draining: the server is shutting down"
        if self.engines is None:
            return ("failed", self.load_error) if self.load_error else ("loading", "loading models")
        failure = self.engines.failure()
        if failure:
            return "unhealthy", failure
        lag_ms = self.loop_lag_ms()
        if lag_ms is not None and lag_ms > self.cfg.server.admission_max_loop_lag_ms:
            return "overloaded", (f"the event loop ran {lag_ms:.0f} ms late on average "
                                  f"(server.admission_max_loop_lag_ms {self.cfg.server.admission_max_loop_lag_ms:g})")
        return "ok", None

    def health(self) -> dict[str, object]:
        e = self.engines
        status, reason = self.status()
        lag_ms = self.loop_lag_ms()
        body: dict[str, object] = {
            "ready": status == "ok",
            "status": status,
            "error": reason,
            "engines": {name: h.as_json() for name, h in e.health.items()} if e else {},
            "voices": e.tts.voices() if e else [],
            # The whole server's (every worker's) against its capacity.
            "active_sessions": self.siblings.sessions_total(),
            "capacity": self.cfg.server.max_sessions,
            # The measure admission compares (None: not checked) and its limit.
            "loop_lag_ms": None if lag_ms is None else round(lag_ms, 1),
            "max_loop_lag_ms": self.cfg.server.admission_max_loop_lag_ms or None,
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "queues": {
                "asr": e.asr.queue_depth if e else 0,
                "tts": e.tts.queue_depth if e else 0,
                "llm_running": e.llm.running if e else 0,
                "llm_background_waiting": e.llm.background_waiting if e else 0,
            },
        }
        if e is not None and isinstance(e.tts, SeveralServices):
            # Degraded, not unhealthy: the other TTS services carry the calls meanwhile.
            body["services_down"] = {"tts": e.tts.services_down()}
        if self.siblings.count > 1:
            # Which worker answered (a balancer's check reaches one of them), and all of them.
            body["worker"] = self.siblings.index
            body["workers"] = self.siblings.workers()
        return body

    def refresh_metrics(self) -> None:
        """The values set at a scrape (queues, live tasks, each engine's health); a worker
        of several also sets them on a tick, as a scrape may reach a sibling."""
        self.update_gauges()
        self.metrics.update_process(self.engines.health if self.engines else None)

    def update_gauges(self) -> None:
        if self.engines is None:
            return
        q = self.metrics.queue_depth
        q.labels("asr").set(self.engines.asr.queue_depth)
        q.labels("tts").set(self.engines.tts.queue_depth)
        q.labels("llm_running").set(self.engines.llm.running)
        q.labels("llm_background_waiting").set(self.engines.llm.background_waiting)


class _Refused(Exception):
    """check_admission's refusal: the error to raise, and its reason for the counter."""

    def __init__(self, reason: str, error: VoicebotError) -> None:
        super().__init__(reason)
        self.reason, self.error = reason, error
