"""What the shared engine services and their frontend clients have in common on the wire.

``voicebot asr-serve`` (:mod:`voicebot.asr_service`, client :mod:`voicebot.engines.asr_remote`)
and ``voicebot tts-serve`` (:mod:`voicebot.tts_service`, client :mod:`voicebot.engines.tts_remote`)
each speak their own protocol over one multiplexed WebSocket per frontend, with the same
conventions: the service says ``{"type": "hello", "service": "asr" | "tts", "protocol": N, ...}``
first and a client finding another service or protocol number hangs up (:class:`ServiceMismatch`); control messages are JSON text; audio travels as
binary frames of a 4-byte big-endian header length, a JSON header, then little-endian
float32 samples; pings find a dead peer even while nothing else is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import struct
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

__all__ = [
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "ServiceMismatch",
    "listen",
    "open_service",
    "pack_frame",
    "quiet_server_log",
    "samples_of",
    "split_frame",
    "stop_on_signals",
]

# A dead peer (service killed, host gone) is noticed within PING_INTERVAL_S + PING_TIMEOUT_S
# even with nothing else on the connection; each request's own timeout bounds the rest.
PING_INTERVAL_S = 5.0
PING_TIMEOUT_S = 10.0
_HEADER = struct.Struct(">I")


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
        if hello.get("service") != service:
            raise ServiceMismatch(
                f"{url} is not a {what}: it says it is the {hello.get('service')!r} service, not {service!r}"
                " (is the URL the other service's?)"
            )
        if hello.get("protocol") != protocol:
            raise ServiceMismatch(f"{what} speaks protocol {hello.get('protocol')}, we speak {protocol}")
    except BaseException:
        await ws.close()
        raise
    return ws, hello


def listen(handler: Callable[[ServerConnection], Awaitable[None]], host: str, port: int, *, max_size: int) -> serve:
    """A service's WebSocket server (use as ``async with``)."""
    return serve(
        handler,
        host,
        port,
        max_size=max_size,
        compression=None,
        ping_interval=PING_INTERVAL_S,
        ping_timeout=PING_TIMEOUT_S,
    )


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while inside (the service closes its engine cleanly)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def quiet_server_log() -> None:
    """websockets logs "connection open/closed" at INFO, one pair per stats probe."""
    ws_log = logging.getLogger("websockets.server")
    if ws_log.level == logging.NOTSET:
        ws_log.setLevel(logging.WARNING)
