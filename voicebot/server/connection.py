"""One client connection through the edge, whatever its wire.

Every transport (native ``/ws``, Realtime ``/v1/realtime``, Twilio/Telnyx ``/twilio``,
WebRTC ``/v1/realtime/calls``) wraps its request in a :class:`Connection` and goes
through it for what the edge decides:

- origin: :meth:`check_origin` (browser pages only from allowed origins);
- credentials: :meth:`authenticate` (the one ``Authorization: Bearer`` parser, or a
  token the wire carries elsewhere: ``?token=``, a subprotocol, a stream parameter),
  :meth:`authenticate_api_key` (a long-lived key only);
- admission: :meth:`check_admission` (ready, not draining, a free slot, under the
  per-client limit), and :meth:`session`, which admits, opens the call and closes it
  with the reason the connection ended;
- limits: :attr:`max_bytes`, :meth:`check_size`, :meth:`audio_gate`, :meth:`control_gate`;
- errors: :meth:`refuse`, :meth:`refuse_http` and :meth:`count_error`, through which
  every error code the edge answers with is counted (once); :attr:`close_code` for the
  WebSocket close;
- close reasons: a transport says why it is ending with :meth:`end`; the reason
  reaches the call through its API (``session.aclose(reason)``) when the connection
  lets go of it. Transports never set the call's attributes.

What is left to a transport is its wire: parsing, rendering, and the order its
protocol needs (a WebSocket may refuse a foreign origin before the handshake; Twilio
sends its credentials in the first message).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, QueryParams
from starlette.requests import HTTPConnection

from voicebot.server import edge
from voicebot.server.state import ServerState
from voicebot.server.ws_protocol import stalled

if TYPE_CHECKING:
    from voicebot.config import ServerConfig
    from voicebot.errors import VoicebotError
    from voicebot.session.session import Session
    from voicebot.session.settings import SessionSettings

SLOW_CONSUMER = "slow_consumer"  # the call's close reason when its client stopped reading


class Connection:
    """The edge's side of one request: a WebSocket, or an HTTP request that starts a call.

    ``per_client``: whether ``server.max_sessions_per_client`` applies (not to Twilio,
    whose calls all come from the carrier's media servers)."""

    def __init__(self, state: ServerState, transport: str, request: HTTPConnection | None = None, *,
                 per_client: bool = True) -> None:
        self.state = state
        self.transport = transport
        # No request: a call started in-process (tests), with no headers and no address.
        self.headers = request.headers if request is not None else Headers()
        self.query = request.query_params if request is not None else QueryParams()
        self.scope = request.scope if request is not None else {}
        client = request.client if request is not None else None
        self.client = client.host if per_client and client else None
        self.call: Session | None = None
        self._reason: str | None = None

    @property
    def cfg(self) -> ServerConfig:
        return self.state.cfg.server

    # ------------------------------------------------------------------ checks
    def check_origin(self) -> None:
        """Raise AuthError (``origin_not_allowed``) for a browser page we do not serve."""
        edge.check_origin(self.headers, self.cfg)

    def bearer(self) -> str | None:
        """The token of the request's ``Authorization: Bearer`` header, if any."""
        return edge.bearer(self.headers.get("authorization"))

    def authenticate(self, token: str | None = None) -> None:
        """An API key or a live ephemeral secret, as a Bearer header or ``token`` (raises AuthError)."""
        self.state.check_auth(self.headers.get("authorization"), token)

    def authenticate_api_key(self) -> None:
        """Only a long-lived API key, as a Bearer header (raises AuthError)."""
        self.state.check_api_key(self.headers.get("authorization"))

    def check_admission(self) -> None:
        """Raise NotReady / CapacityError unless a new session may start now."""
        self.state.check_admission(self.client)

    # ------------------------------------------------------------------ limits
    @property
    def max_bytes(self) -> int:
        return self.cfg.max_message_bytes

    def check_size(self, size: int, what: str = "message") -> None:
        edge.check_size(size, self.max_bytes, what)

    def audio_gate(self) -> edge.AudioGate:
        return edge.AudioGate.from_config(self.cfg)

    def control_gate(self, extra_rate: float = 0.0) -> edge.ControlGate:
        """``extra_rate``: messages a second the wire adds on its own (Twilio's mark echoes)."""
        return edge.ControlGate(self.cfg.control_rate + extra_rate, self.cfg.control_burst)

    # ------------------------------------------------------------------ errors
    def count_error(self, code: str) -> None:
        """An error the transport answered with (a Realtime error event, say)."""
        self.state.count_error(code)

    def refuse(self, exc: VoicebotError) -> int:
        """The connection is refused (or ended) for ``exc``: counted once; returns the
        WebSocket close code for it."""
        self.state.count_error(exc.code)
        return edge.close_code(exc.code)

    def refuse_http(self, exc: VoicebotError) -> int:
        """An HTTP request is refused for ``exc``: counted once; returns its HTTP status."""
        self.state.count_error(exc.code)
        return edge.http_status(exc)

    # ------------------------------------------------------------------- call
    @contextlib.asynccontextmanager
    async def session(self, settings: SessionSettings | None = None) -> AsyncIterator[Session]:
        """Admit and open the call; when the block ends, close it with :attr:`reason`."""
        async with self.state.open_session(self.transport, settings, client=self.client) as call:
            self.call = call
            try:
                yield call
            finally:
                if stalled(self.scope):  # counted here: no error event could reach the client
                    self.state.count_error(SLOW_CONSUMER)
                await call.aclose(self.reason or "closed")

    def end(self, reason: str) -> None:
        """Why the transport is ending the call (the first reason given stands)."""
        if self._reason is None:
            self._reason = reason

    @property
    def reason(self) -> str | None:
        """Why the call ended: the call's own reason (a fatal error, idle, shutdown),
        else a client that stopped reading (the socket was aborted), else the one the
        transport gave."""
        own = self.call.closed_reason if self.call is not None else None
        return own or (SLOW_CONSUMER if stalled(self.scope) else None) or self._reason

    @property
    def close_code(self) -> int:
        """The WebSocket close code for how the call ended: 1001 at shutdown, 1011 for a
        dead engine, 1000 for a hang-up."""
        return edge.close_code(self.reason or "")
