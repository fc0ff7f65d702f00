"""What the shared engine services and their frontend clients have in common on the wire.

``voicebot asr-serve`` (:mod:`.asr_service`, client :mod:`.asr_client`) and ``voicebot
tts-serve`` (:mod:`.tts_service`, client :mod:`.tts_client`)
each speak their own protocol over one multiplexed WebSocket per frontend, with the same
conventions: the service says ``{"type": "hello", "service": "asr" | "tts", "protocol": N, ...}``
first and a client finding another service or protocol number hangs up (:class:`ServiceMismatch`); control messages are JSON text; audio travels as
binary frames of a 4-byte big-endian header length, a JSON header, then little-endian
float32 samples; pings find a dead peer even while nothing else is sent.

Both sides' frames and the clients' connection live here; the serving process's helpers
(listener, signals, the frozen heap) are in :mod:`.serve`, so a frontend's engines
import no server module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeGuard, TypeVar

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection

from voicebot.errors import EngineError, LateLoopTimeout, ModelError
from voicebot.runtime.loop_lag import LoopLateness, loop_was_late

__all__ = [
    "CONNECT_ERRORS",
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "ServiceClient",
    "ServiceConn",
    "ServiceLost",
    "ServiceMismatch",
    "connect_at_start",
    "open_service",
    "pack_frame",
    "samples_of",
    "split_frame",
]

# A dead peer (service killed, host gone) is noticed within PING_INTERVAL_S + PING_TIMEOUT_S
# even with nothing else on the connection; each request's own timeout bounds the rest.
PING_INTERVAL_S = 5.0
PING_TIMEOUT_S = 10.0
_HEADER = struct.Struct(">I")

log = logging.getLogger(__name__)

J = TypeVar("J")


@dataclass(eq=False)
class ServiceConn(Generic[J]):
    """A service's side of one frontend's connection: its requests under way, by id."""

    ws: ServerConnection
    jobs: dict[int, J] = field(default_factory=dict)
    closed: bool = False


class ServiceMismatch(ValueError):
    """The URL answers as another service (an ASR service for the TTS client, or the
    reverse) or with another protocol: a configuration error, which retrying does not mend."""


def pack_frame(header: dict[str, Any], samples: np.ndarray) -> bytes:
    """A binary frame: header length, JSON header, float32 little-endian samples."""
    head = json.dumps(header).encode()
    return _HEADER.pack(len(head)) + head + np.ascontiguousarray(samples, dtype="<f4").tobytes()


def split_frame(frame: bytes, kind: str) -> tuple[dict[str, Any], bytes]:
    """The JSON header (whose ``type`` must be ``kind``) and the body of a binary frame;
    ValueError when it is malformed."""
    if len(frame) < _HEADER.size:
        raise ValueError(f"{kind} frame shorter than its header length")
    (n,) = _HEADER.unpack_from(frame)
    end = _HEADER.size + n
    if end > len(frame):
        raise ValueError(f"{kind} frame header runs past the frame")
    try:
        header = json.loads(frame[_HEADER.size : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{kind} frame header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("type") != kind:
        raise ValueError(f"{kind} frame header is not a {kind}")
    job_id = header.get("id")
    if not isinstance(job_id, int) or isinstance(job_id, bool):
        raise ValueError(f"{kind} id must be an integer")
    return header, frame[end:]


def samples_of(body: bytes, kind: str) -> np.ndarray:
    """A frame body as a writable native float32 array; ValueError unless whole finite samples."""
    if len(body) % 4:
        raise ValueError(f"{kind} audio is not whole float32 samples")
    audio = np.frombuffer(body, dtype="<f4").astype(np.float32)  # a writable native copy
    if not np.isfinite(audio).all():
        raise ValueError(f"{kind} audio has NaN or infinite samples")
    return audio


async def open_service(
    url: str, *, what: str, service: str, protocol: int, open_timeout_s: float, max_size: int
) -> tuple[ClientConnection, dict[str, Any]]:
    """Connect to a service and read its hello; ValueError (connection closed) when it is
    not one, :class:`ServiceMismatch` when it is not the ``service`` asked for or speaks
    another protocol."""
    ws = await connect(
        url,
        open_timeout=open_timeout_s,
        max_size=max_size,
        compression=None,
        ping_interval=PING_INTERVAL_S,
        ping_timeout=PING_TIMEOUT_S,
    )
    try:
        raw = await asyncio.wait_for(ws.recv(), open_timeout_s)
        hello = json.loads(raw)
        if not isinstance(hello, dict) or hello.get("type") != "hello":
            raise ValueError(f"{what} {url} did not say hello: {raw!r:.200}")
        # asr-serve said no name before the TTS service existed (the same protocol 1):
        # frontends upgraded before their ASR service must still start.
        said = hello.get("service", "asr")
        if said != service:
            raise ServiceMismatch(
                f"{url} is not a {what}: it says it is the {said!r} service, not {service!r}"
                " (is the URL the other service's?)"
            )
        if hello.get("protocol") != protocol:
            raise ServiceMismatch(f"{what} speaks protocol {hello.get('protocol')}, we speak {protocol}")
    except BaseException:
        await ws.close()
        raise
    return ws, hello


class RemoteServiceSettings(Protocol):
    """What a client reads of its config section (asr.remote, tts.remote)."""

    @property
    def url(self) -> str: ...

    @property
    def connect_timeout_s(self) -> float: ...


# What a failed connect raises: the client retries it (ServiceMismatch is a ValueError too;
# connect_at_start gives up on it at once).
CONNECT_ERRORS = (OSError, TimeoutError, websockets.InvalidHandshake, websockets.ConnectionClosed, ValueError)


class ServiceLost(Exception):
    """The connection went away (or could not be made) before a request's end: retryable."""


class ServiceClient:
    """One multiplexed WebSocket to a service, many requests in flight matched by id: the
    connecting, the reader's loop and its end, fire-and-forget control messages and closing.
    A subclass says which service it wants and handles its messages (``_on_message``) and
    what a lost connection means for its requests (``_lose_all``).

    ``loop``: the frontend's loop watch; a request that times out after the loop ran late
    for most of its wait fails with :class:`~voicebot.errors.LateLoopTimeout`, which the
    engine's health does not count (:meth:`_timed_out`)."""

    what: ClassVar[str]  # "ASR service": for messages
    service: ClassVar[str]  # what the hello must say: "asr", "tts"
    protocol: ClassVar[int]
    max_size: ClassVar[int]  # the largest message the service may send
    hint: ClassVar[str] = ""  # added to a protocol mismatch's message: what to check

    def __init__(self, cfg: RemoteServiceSettings, *, loop: LoopLateness | None = None) -> None:
        self.cfg = cfg
        self._loop_watch = loop
        self.hello: dict[str, Any] | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._connecting = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.reconnects = 0
        self._attempts = 0  # connect attempts made
        self._last_error: BaseException | None = None  # of the last failed attempt

    @property
    def connected(self) -> bool:
        return self._ws is not None

    def check_hello(self, hello: dict[str, Any]) -> None:
        """Raise ValueError when the service's hello does not suit this client."""

    def _on_message(self, msg: str | bytes) -> None:
        raise NotImplementedError

    def _timed_out(self, message: str, code: str, started: float) -> EngineError:
        """A wait begun at ``started`` (``time.monotonic()``) ran out: the service's failure,
        or, when our own loop was late for half the wait or more, ours."""
        if loop_was_late(self._loop_watch, started):
            return LateLoopTimeout(f"{message}; this server's event loop ran late for most of the wait", code=code)
        return EngineError(message, code=code)

    def _lose_all(self, lost: ServiceLost) -> None:
        """Fail every request in flight on the lost connection (no await: none may register meanwhile)."""
        raise NotImplementedError

    async def connect(self) -> None:
        """Open the connection unless open; raises what connecting raised.

        Callers that waited while another one's attempt failed share that failure instead
        of trying again one after another (with a host that never answers, 20 waiting
        requests would otherwise take 20 connect timeouts)."""
        seen = self._attempts
        async with self._connecting:
            if self._ws is not None:
                return
            if self._closed:
                raise EngineError(f"{self.what} client is closed")
            if self._attempts != seen and self._last_error is not None:
                raise self._last_error
            self._attempts += 1
            self._last_error = None  # a cancelled attempt leaves none: waiters try themselves
            try:
                await self._open()
            except Exception as exc:
                self._last_error = exc
                raise

    async def _open(self) -> None:
        try:
            ws, hello = await open_service(
                self.cfg.url,
                what=self.what,
                service=self.service,
                protocol=self.protocol,
                open_timeout_s=self.cfg.connect_timeout_s,
                max_size=self.max_size,
            )
        except ServiceMismatch as exc:
            raise ServiceMismatch(f"{exc}{self.hint}") from None
        try:
            self.check_hello(hello)
        except BaseException:
            await ws.close()
            raise
        if self.hello is not None:
            self.reconnects += 1
        self.hello = hello
        self._ws = ws
        self._reader = asyncio.create_task(self._read(ws), name=f"{self.service}-service-reader")

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for msg in ws:
                self._on_message(msg)
        except websockets.ConnectionClosed:
            pass
        except Exception:
            log.exception("%s connection: bad message; dropping the connection", self.what)
            await ws.close()
        finally:
            # No await from here on: no request can register on this connection meanwhile.
            if self._ws is ws:
                self._ws = None
            self._lose_all(ServiceLost(f"connection to {self.cfg.url} lost"))

    def _send_soon(self, ws: ClientConnection, payload: dict[str, Any]) -> None:
        """Send a control message without waiting (an ack or a cancel: never worth blocking a
        caller on; a connection gone meanwhile took the service's side of the request with it)."""
        if ws is not self._ws:
            return

        async def send() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(json.dumps(payload))

        task = asyncio.create_task(send(), name=f"{self.service}-service-send")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        self._closed = True
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


class ServiceUnreachable(ModelError):
    """A service did not answer within the start-up wait (it may be down for now, unlike one
    that answers as another service)."""


async def connect_at_start(client: ServiceClient, startup_timeout_s: float) -> float:
    """Connect a frontend's client at start-up, retrying for up to ``startup_timeout_s`` while
    the service comes up; ServiceUnreachable then, or ModelError at once for another service
    or protocol. Returns the seconds it took."""
    url, what = client.cfg.url, client.what
    t0 = time.monotonic()
    while True:
        try:
            await client.connect()
            return time.monotonic() - t0
        except ServiceMismatch as exc:
            raise ModelError(f"{what} {url}: {exc}") from exc
        except CONNECT_ERRORS as exc:
            if time.monotonic() - t0 >= startup_timeout_s:
                raise ServiceUnreachable(f"{what} {url} not reachable after {startup_timeout_s:g} s: {exc}") from exc
            await asyncio.sleep(min(1.0, startup_timeout_s / 10 or 0.1))


def is_id(value: object) -> TypeGuard[int]:
    """A job id on the wire: an int, not a bool (anything else is a bad request, never a
    dictionary lookup that raises in the connection handler)."""
    return isinstance(value, int) and not isinstance(value, bool)

