"""The small interface every probe client implements, one module per wire protocol.

A client turns its protocol into two things: PCM16 mono frames out, and a stream of
timestamped :class:`Audio` / :class:`Event` items in. Events use the *native* event
names and fields (``transcript.final``, ``response.audio.started``,
``response.done``, ``barge_in``, ``turn.timings``, ``error``; see docs/protocol.md),
so a ``realtime``, ``twilio`` or ``webrtc`` sibling only translates and the turn
logic stays shared. Register a new module in :data:`CLIENTS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol


class ClientError(Exception):
    """The server could not be reached or refused the session."""


class ClientClosed(ClientError):
    """The connection ended; the message says how (close code, reason)."""


@dataclass(frozen=True)
class Audio:
    pcm: bytes  # PCM16 mono little-endian at the client's ``output_rate``
    t: float  # time.monotonic() when it was read off the wire


@dataclass(frozen=True)
class Event:
    data: dict[str, Any]  # native event JSON, ``type`` included
    t: float


Incoming = Audio | Event


@dataclass(frozen=True)
class ConnectOptions:
    url: str
    sample_rate: int = 16000  # rate of the frames given to send_audio
    output_sample_rate: int | None = None  # None: whatever the server picks
    token: str | None = None
    timeout_s: float = 10.0  # connect + session handshake
    start_fields: dict[str, Any] = field(default_factory=dict)  # system_prompt, voice, ...


class ProbeClient(Protocol):
    output_rate: int  # known after connect()

    async def connect(self) -> None:
        """Open the connection and start the session; raise ClientError if refused."""

    async def send_audio(self, pcm: bytes) -> None:
        """Send one PCM16 frame at ``ConnectOptions.sample_rate``; ClientClosed if gone."""

    async def receive(self) -> Incoming:
        """Next item from the server, timestamped on arrival; ClientClosed at the end."""

    async def close(self) -> None:
        """End the session politely; never raises."""


# protocol name -> "module:Class"; imported lazily so one protocol's dependencies
# (aiortc for webrtc, say) are not needed to probe another.
CLIENTS: dict[str, str] = {
    "native": "voicebot.probe.native:NativeClient",
    "realtime": "voicebot.probe.realtime:RealtimeClient",
    "webrtc": "voicebot.probe.webrtc:WebRTCClient",
    "twilio": "voicebot.probe.twilio:TwilioClient",
}


def make_client(protocol: str, options: ConnectOptions) -> ProbeClient:
    try:
        target = CLIENTS[protocol]
    except KeyError:
        raise ValueError(
            f"unknown protocol {protocol!r}; known: {', '.join(sorted(CLIENTS))}"
        ) from None
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    client: ProbeClient = cls(options)
    return client
