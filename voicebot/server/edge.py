"""The edge: what every transport checks before anything reaches a session.

One place for each of these, so the four wire protocols cannot drift apart:

- credentials: ``Authorization: Bearer`` parsing, API keys (config, environment
  variable, key file; several at once), compared in constant time, never logged;
- origins: browser requests (they carry ``Origin``) only from the allow-list, the
  server's own host or a loopback page;
- JSON: bounded in size and nesting depth before the parser sees it;
- caller audio: one message's length and the sustained rate (a token bucket);
- control messages (everything else a client sends): a rate per session (a token bucket);
- errors on the wire: one mapping of error code to WebSocket close code and HTTP status;
- start-up: no unauthenticated server on a non-loopback address by accident.

Pure functions and small classes; the only I/O is reading the key file once and
reading a bounded HTTP body. What needs the server's state (keys, admission) is
:class:`~voicebot.server.state.ServerState`'s; :mod:`voicebot.server.connection` puts
both together for one connection.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
from starlette.requests import Request
from starlette.types import Message

from voicebot.errors import (
    AuthError,
    BadMessage,
    CapacityError,
    ConfigError,
    MessageTooLarge,
    ProtocolError,
    VoicebotError,
)

if TYPE_CHECKING:
    from voicebot.config import Config, ServerConfig

log = logging.getLogger(__name__)

# Deepest JSON accepted. Realtime's deepest real event (session.update with a tool's
# JSON schema) nests ~12 levels; Python's C parser hits RecursionError near 1000.
MAX_JSON_DEPTH = 64
# Most objects and arrays in one message (outside strings). A real event has tens (a
# session.update with tools: hundreds to a few thousand); building Python objects is what
# parsing costs, on the event loop all sessions share: a message of many empty arrays holds
# it far longer than refusing it after the bracket scan does (docs/benchmarks.md).
MAX_JSON_CONTAINERS = 10_000


# ------------------------------------------------------------------ credentials
def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return None


def load_api_keys(cfg: ServerConfig, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Keys from ``cfg.api_keys_env`` (comma-separated) and ``cfg.api_key_file`` (one a line).

    ``server.api_key`` is not included: it is read per request (tests and operators
    may change it live). A key file that cannot be read stops start-up."""
    env = os.environ if environ is None else environ
    keys: list[str] = [k.strip() for k in env.get(cfg.api_keys_env, "").split(",")]
    if cfg.api_key_file:
        path = Path(cfg.api_key_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"server.api_key_file: cannot read {path}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(k for k in keys if k))


def key_matches(supplied: str, keys: Iterable[str]) -> bool:
    """Constant time per key, and every key is compared (no early exit on a match)."""
    given = supplied.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


# ---------------------------------------------------------------------- origins
def _host_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError:
        return "", None
    default = {"http": 80, "ws": 80, "https": 443, "wss": 443}.get(scheme)
    return (parts.hostname or "").lower(), port if port is not None else default


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, hosts: Iterable[str], allowed: Iterable[str]) -> bool:
    """A request without ``Origin`` is not from a browser page: the origin check does not
    apply. A browser page may call us from an allowed origin ("*" allows every one), from
    our own host (``hosts``: the Host / X-Forwarded-Host the request came in on), or from
    a page served by the same machine (loopback)."""
    if origin is None:
        return True
    origin = origin.strip()
    allowed = [a.rstrip("/").lower() for a in allowed]
    if "*" in allowed or origin.lower() in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed frames, file://) and anything odd
    name, port = _host_port(parts.netloc, parts.scheme)
    if not name:
        return False
    if is_loopback_host(name):
        return True
    return any(_host_port(h, parts.scheme) == (name, port) for h in hosts if h)


def check_origin(headers: Mapping[str, str], cfg: ServerConfig) -> None:
    """Raise AuthError (``origin_not_allowed``) for a browser page we do not serve."""
    hosts = [headers.get("host", ""), headers.get("x-forwarded-host", "").split(",")[0].strip()]
    if not origin_allowed(headers.get("origin"), hosts, cfg.allowed_origins):
        raise AuthError(
            f"origin {headers.get('origin', '')[:100]!r} is not allowed; add it to server.allowed_origins",
            code="origin_not_allowed",
        )


# ------------------------------------------------------------------------- JSON
def clip(value: object, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages and logs echo what a
    client sent, and a 500 kB id must not come back (or be logged) whole."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_size(size: int, limit: int, what: str = "message") -> None:
    if size > limit:
        raise MessageTooLarge(f"{what} of {size} bytes exceeds server.max_message_bytes ({limit})")


def json_shape(text: str) -> tuple[int, int]:
    """Nesting depth and number of objects and arrays of a JSON text, brackets inside
    strings not counted.

    Vectorised (numpy) so a 1 MiB message costs tens of milliseconds, not a Python loop
    per character. Exact for valid JSON; for invalid JSON any answer is fine, the parser
    rejects it anyway."""
    raw = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    if raw.size == 0:
        return 0, 0
    backslash = raw == 0x5C
    idx = np.arange(raw.size)
    # Position of the last non-backslash at or before i: a quote is escaped when the run
    # of backslashes right before it has odd length.
    last_plain = np.maximum.accumulate(np.where(backslash, -1, idx))
    run_before = np.empty(raw.size, np.int64)
    run_before[0] = 0
    run_before[1:] = idx[:-1] - last_plain[:-1]
    quote = (raw == 0x22) & (run_before % 2 == 0)
    inside = (np.cumsum(quote) - quote) % 2 == 1  # after an odd number of real quotes
    opens = ((raw == 0x5B) | (raw == 0x7B)) & ~inside
    closes = ((raw == 0x5D) | (raw == 0x7D)) & ~inside
    steps = opens.astype(np.int64) - closes.astype(np.int64)
    return int(np.cumsum(steps).max(initial=0)), int(np.count_nonzero(opens))


def load_json(
    text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, max_containers: int = MAX_JSON_CONTAINERS
) -> Any:
    """``json.loads`` that raises BadMessage for bad, too deeply nested, or too big JSON."""
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise BadMessage("malformed JSON: not UTF-8") from None
    # Counting brackets runs in C; only a message with many of them gets the exact scan,
    # which leaves out those inside strings (a tool's JSON result is a string of them).
    if text.count("[") + text.count("{") > max_depth:
        depth, containers = json_shape(text)
        if depth > max_depth:
            raise BadMessage(f"JSON nested deeper than {max_depth} levels")
        if containers > max_containers:
            raise BadMessage(f"JSON with more than {max_containers} objects and arrays")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadMessage(f"malformed JSON: {exc.msg} (at {exc.pos})") from None
    except RecursionError:  # belt and braces: the scan above should have caught it
        raise BadMessage(f"JSON nested deeper than {max_depth} levels") from None


def load_event(text: str | bytes, key: str = "type") -> dict[str, Any]:
    """A JSON object with a string ``key`` (``type`` for our events, ``event`` for Twilio)."""
    data = load_json(text)
    if not isinstance(data, dict) or not isinstance(data.get(key), str):
        raise BadMessage(f"an event must be a JSON object with a string '{key}'")
    return data


async def read_body(request: Request, limit: int) -> Request:
    """Read an HTTP body of at most ``limit`` bytes; a copy of the request that replays it.

    Checked as it streams in (and up front from Content-Length): a client announcing or
    sending more gets ``payload_too_large`` (HTTP 413) before the rest is buffered."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"request body of {declared} bytes exceeds {limit}", code="payload_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"request body exceeds {limit} bytes", code="payload_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)

    async def replay() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, replay)


# ------------------------------------------------------------------- rate limits
class TokenBucket:
    """``capacity`` at once, refilled at ``rate`` a second: the one bucket both gates use."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._last = clock()

    def take(self, amount: float, *, slack: float = 0.0) -> bool:
        """Take ``amount`` if the bucket holds it (to within ``slack``: float noise); a
        refused take takes nothing."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if amount > self._tokens + slack:
            return False
        self._tokens -= amount
        return True


# ------------------------------------------------------------------ caller audio
class AudioGate:
    """Per-session wire limits on caller audio, checked before ``session.push_audio``.

    One message may hold at most ``max_message_ms``: a 32 s message would be processed
    in one go and stall the event loop for every session. Sustained input may run at
    ``rate`` times real time with a bucket of ``burst_ms`` (network jitter, a client
    catching up after a stall); beyond that audio is refused, not queued: a sender
    faster than real time is either broken or trying to make us do its work.
    """

    def __init__(self, max_message_ms: float, rate: float, burst_ms: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_s = max_message_ms / 1000.0
        self.rate = rate
        self.burst_s = burst_ms / 1000.0
        self._clock = clock
        self._bucket = TokenBucket(rate, self.burst_s, clock)
        self.refused_s = 0.0  # audio refused so far (for logs and tests)
        self._reported = -1e9

    @classmethod
    def from_config(cls, cfg: ServerConfig, clock: Callable[[], float] = time.monotonic) -> AudioGate:
        return cls(cfg.max_audio_message_ms, cfg.input_rate, cfg.input_burst_ms, clock)

    def check(self, samples: int, sample_rate: int) -> None:
        """Admit ``samples`` of audio, or raise (and the caller drops the message)."""
        seconds = samples / sample_rate
        if seconds > self.max_s + 1e-6:
            raise MessageTooLarge(
                f"one audio message of {seconds * 1000:.0f} ms exceeds server.max_audio_message_ms "
                f"({self.max_s * 1000:.0f} ms); send it in smaller chunks, in real time"
            )
        if not self._bucket.take(seconds, slack=1e-6):  # 1 µs: float noise, not audio
            self.refused_s += seconds
            raise ProtocolError(
                f"audio arrives faster than real time (more than {self.rate:g}x beyond a "
                f"{self.burst_s:g} s burst); this chunk was dropped",
                code="input_rate_exceeded",
            )

    def report_due(self, every_s: float = 1.0) -> bool:
        """For senders of many small frames (WebRTC, Twilio): one report per ``every_s``."""
        now = self._clock()
        if now - self._reported >= every_s:
            self._reported = now
            return True
        return False


# -------------------------------------------------------------- control messages
class ControlGate:
    """Per-session limit on control messages: every client message that is not caller
    audio (JSON commands, Realtime events, WebRTC data-channel events, Twilio marks and
    keys). Each is parsed and acted on by the event loop all sessions share, and some make
    work (a session.update, a conversation item); audio has its own gate. A token bucket:
    ``burst`` at once (a Realtime client loading a conversation's history), then ``rate``
    a second. Beyond it a message is refused with an error, not queued.
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._bucket = TokenBucket(rate, self.burst, clock)
        self.refused = 0  # messages refused so far (for logs and tests)

    @classmethod
    def from_config(cls, cfg: ServerConfig, clock: Callable[[], float] = time.monotonic) -> ControlGate:
        return cls(cfg.control_rate, cfg.control_burst, clock)

    def check(self) -> None:
        """Admit one control message, or raise (and the caller drops it)."""
        if not self._bucket.take(1.0, slack=1e-9):  # float noise, not a message
            self.refused += 1
            raise ProtocolError(
                f"more than {self.rate:g} control messages a second beyond a burst of {self.burst:g} "
                "(server.control_rate, control_burst); this one was dropped",
                code="message_rate_exceeded",
            )


# ------------------------------------------------------------------ errors on wire
_RETRY_LATER = frozenset({"capacity_exceeded", "not_ready", "draining", "input_rate_exceeded", "message_rate_exceeded",
                          "engine_unavailable"})
_POLICY = frozenset({"unauthorized", "origin_not_allowed"})
_SERVER_FAULT = frozenset({"internal_error", "engine_error", "model_unavailable", "engine_failed"})


def close_code(code: str) -> int:
    """WebSocket close code for an error code: what a client's retry logic acts on."""
    if code in _POLICY:
        return 1008  # policy violation: do not retry with the same credentials
    if code in _RETRY_LATER:
        return 1013  # try again later
    if code in _SERVER_FAULT:
        return 1011
    if code == "message_too_large":
        return 1009
    if code == "server_shutdown":
        return 1001  # going away: reconnect elsewhere
    return 1000


def http_status(exc: VoicebotError) -> int:
    if exc.code == "origin_not_allowed":
        return 403
    if isinstance(exc, AuthError):
        return 401
    if exc.code == "payload_too_large":
        return 413
    if exc.code == "unsupported_media_type":
        return 415
    if isinstance(exc, CapacityError):
        return 429
    if exc.code in ("not_ready", "draining"):
        return 503
    if isinstance(exc, ProtocolError):
        return 400
    return 500


# ---------------------------------------------------------------------- start-up
def check_exposure(cfg: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """Refuse (ConfigError) to serve a non-loopback address without any API key.

    Returns a warning to log when ``server.allow_unauthenticated`` overrides that."""
    server = cfg.server
    if is_loopback_host(server.host):
        return None
    if server.api_key or load_api_keys(server, environ):
        return None
    if server.allow_unauthenticated:
        return (f"serving {server.host} without an API key (server.allow_unauthenticated): "
                "anyone who can reach this port can open sessions")
    raise ConfigError(
        f"server.host {server.host!r} is not a loopback address and no API key is set: set "
        f"{server.api_keys_env} (comma-separated keys) or server.api_key_file, or "
        "server.allow_unauthenticated: true to accept that anyone who can reach the port may use it"
    )
