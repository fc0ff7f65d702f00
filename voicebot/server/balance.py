"""A worker's side of the listening socket its siblings share (``server.workers``).

Every worker watches the one socket, and each new connection wakes them all; whoever
accepts first takes it. Left at that, the least busy event loop would win, which is
not the one with the fewest calls, and the kernel's other answer (one socket per
worker with SO_REUSEPORT, a hash of the caller's address) spreads calls only as evenly
as a die: at 256 callers on 6 workers the busiest carried ~30% more than the mean.
So a worker accepts only while its load (the connections it holds open, or its calls
where those are more) is within one of the least loaded serving sibling's; otherwise it
steps aside for a few milliseconds and lets them take the connection. Bounded: a
worker that has stepped aside for _MAX_WAIT_S takes the connection anyway (a sibling
whose loop is stuck must not strand a caller).

A worker starts watching once its engines are loaded (voicebot/server/http_server.py):
until then a connection waits in the socket's queue for a worker that can serve it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import select
import socket
import time
from collections.abc import Callable

from voicebot.server.siblings import Siblings

log = logging.getLogger(__name__)

# How far above the least loaded sibling a worker may be and still accept.
_SLACK = 1
_STEP_ASIDE_S = 0.005
# How often the connections this worker holds are counted again (a closed one leaves the
# count within this; transports have no close callback to hook).
_RECOUNT_S = 0.05
# Long enough for a sibling on a busy host to be scheduled (at 50 ms, a 2-core machine
# running a test suite beside the workers sent 10 of 12 calls to one), short beside a
# call's set-up.
_MAX_WAIT_S = 0.25


class SharedListener:
    def __init__(self, sock: socket.socket, siblings: Siblings,
                 protocol_factory: Callable[[], asyncio.Protocol]) -> None:
        self._sock = sock
        self._siblings = siblings
        self._factory = protocol_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting_since: float | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._handshakes: set[asyncio.Task[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]]] = set()
        self._open: set[asyncio.BaseTransport] = set()
        self._recount: asyncio.TimerHandle | None = None
        self.accepted = 0
        self.stepped_aside = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._readable)
        self._publish()

    def close(self) -> None:
        """Stop accepting (shutdown); the socket stays open for the siblings."""
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        for handle in (self._resume, self._recount):
            if handle is not None:
                handle.cancel()
        self._loop = None

    def _publish(self) -> None:
        """The connections held open, to the siblings' table; again every _RECOUNT_S."""
        self._open = {t for t in self._open if not t.is_closing()}
        self._siblings.set_connections(len(self._open) + len(self._handshakes))
        if self._loop is not None:
            if self._recount is not None:
                self._recount.cancel()
            self._recount = self._loop.call_later(_RECOUNT_S, self._publish)

    def _readable(self) -> None:
        loop = self._loop
        if loop is None:
            return
        now = time.monotonic()
        if self._should_step_aside(now):
            if self._waiting_since is None:
                self._waiting_since = now
            self.stepped_aside += 1
            loop.remove_reader(self._sock.fileno())
            self._resume = loop.call_later(_STEP_ASIDE_S, self._watch_again)
            return
        self._waiting_since = None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return  # a sibling took it
        except OSError as exc:  # out of descriptors, say: the connection stays queued
            log.warning("cannot accept a connection: %s", exc)
            loop.remove_reader(self._sock.fileno())
            self._resume = loop.call_later(0.1, self._watch_again)
            return
        conn.setblocking(False)
        self.accepted += 1
        task: asyncio.Task[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]] = loop.create_task(
            loop.connect_accepted_socket(self._factory, conn))
        self._handshakes.add(task)
        task.add_done_callback(functools.partial(self._connected, conn=conn))
        self._publish()  # counted at once: the next connection sees this one

    def _connected(self, task: asyncio.Task[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]], *,
                   conn: socket.socket) -> None:
        self._handshakes.discard(task)
        if task.cancelled():
            conn.close()
        elif task.exception() is not None:
            log.warning("accepted connection not served: %s", task.exception())
            conn.close()
        else:
            self._open.add(task.result()[0])
        if self._loop is not None:
            self._publish()

    def _should_step_aside(self, now: float) -> bool:
        if self._waiting_since is not None and now - self._waiting_since >= _MAX_WAIT_S:
            return False
        least = self._siblings.least_loaded()
        return least is not None and self._siblings.load(self._siblings.index) > least + _SLACK

    def _watch_again(self) -> None:
        self._resume = None
        if self._loop is None:
            return
        # Nothing waiting any more (a sibling took it): the next connection is a new wait.
        if not select.select([self._sock], [], [], 0)[0]:
            self._waiting_since = None
        self._loop.add_reader(self._sock.fileno(), self._readable)
