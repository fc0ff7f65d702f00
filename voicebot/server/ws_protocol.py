"""uvicorn's WebSocket protocol, with a deadline on a peer that stopped reading.

uvicorn (``ws="websockets-sansio"``) makes every send wait while the socket's write
buffer is over its high-water mark, and its ``transport.close()`` (after a keepalive
timeout, after a handler returns) waits for that buffer to flush. A peer that stopped
reading never drains it, so the send, the handler, the call it serves and the socket
were held for good: the keepalive cannot help, since its ping waits in the same buffer
and its close waits for the same flush.

:class:`WebSocketProtocol` bounds both with ``server.send_timeout_s``:

- writing paused (the buffer full) for that long: the connection is aborted, its
  unsent data dropped (nobody will read it). The handler's send raises as for a
  hang-up, and the connection's ASGI scope says why (:func:`stalled`), so the call
  ends with ``slow_consumer``;
- a close not done that long after it began: aborted too.

Only asyncio's ``Protocol`` callbacks are overridden and the ``Transport``'s public
API used (``is_closing``, ``abort``, ``get_write_buffer_size``); the ASGI scope is the
one the handler receives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger(__name__)

# Set on a connection's ASGI scope when it was aborted because its client read nothing.
_STALLED = "voicebot.stalled"


def stalled(scope: Mapping[str, Any]) -> bool:
    """Whether this connection was ended because its client stopped reading."""
    return bool(scope.get(_STALLED))


class WebSocketProtocol(WebSocketsSansIOProtocol):
    send_timeout_s: float = 15.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stall: asyncio.TimerHandle | None = None
        self._close_watch: asyncio.TimerHandle | None = None
        self._closing_seen = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._close_watch = self.loop.call_later(self.send_timeout_s, self._check_close)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._stall, self._close_watch):
            if timer is not None:
                timer.cancel()
        self._stall = self._close_watch = None
        super().connection_lost(exc)

    def _stalled(self) -> None:
        self._stall = None
        scope = getattr(self, "scope", None)  # there once the handshake came
        if scope is not None:
            scope[_STALLED] = True
        log.warning("client %s read nothing for %g s with %d bytes waiting for it: disconnected",
                    _address(self.client), self.send_timeout_s, self.transport.get_write_buffer_size())
        self.transport.abort()

    def _check_close(self) -> None:
        """Polled: uvicorn closes the transport itself. A close seen at one look and not
        done at the next could not flush: abort it."""
        self._close_watch = None
        if self.transport.is_closing():
            if self._closing_seen:
                log.warning("client %s: close could not flush %d bytes in %g s: aborted",
                            _address(self.client), self.transport.get_write_buffer_size(), self.send_timeout_s)
                self.transport.abort()
                return
            self._closing_seen = True
        self._close_watch = self.loop.call_later(self.send_timeout_s, self._check_close)


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def protocol_class(send_timeout_s: float) -> type[WebSocketProtocol]:
    """The protocol for uvicorn's ``ws`` setting, with this server's deadline (uvicorn
    builds each connection's protocol from the class, with its own arguments)."""
    timeout = send_timeout_s

    class Configured(WebSocketProtocol):
        send_timeout_s = timeout

    return Configured
