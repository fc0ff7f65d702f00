"""The end-of-call webhook: each call record POSTed to ``telemetry.webhook_url``, signed.

Signing (as Stripe and Svix do): the receiver gets

- ``Voicebot-Timestamp``: the attempt's Unix time in seconds,
- ``Voicebot-Signature``: ``v1=`` and the hex HMAC-SHA256, keyed with the shared
  secret, of ``TIMESTAMP.BODY`` (the timestamp's digits, a dot, the raw body bytes),
- ``Voicebot-Delivery``: the call id, the same on every attempt (to drop a repeat).

It recomputes the HMAC over the raw body, compares in constant time and refuses a
timestamp older than a few minutes (:func:`verify` does all three; docs/operations.md
shows the same in a few lines for a receiver).

Delivery never blocks a call: :meth:`WebhookSender.put` only queues (a full queue
drops the record, counted); a few worker tasks POST with a timeout and retry with
doubling backoff a bounded number of times; at shutdown, :meth:`aclose` waits a
bounded time and counts what it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "Voicebot-Timestamp"
SIGNATURE_HEADER = "Voicebot-Signature"
DELIVERY_HEADER = "Voicebot-Delivery"

_WORKERS = 4  # deliveries in flight at once: one slow receiver's answer does not hold the rest
# Client errors that a retry can fix; any other 4xx is final.
_RETRY_4XX = frozenset({408, 409, 425, 429})


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``Voicebot-Signature`` value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def verify(secret: bytes, timestamp: str, signature: str, body: bytes, *,
           tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """A receiver's check: the signature is ours and the timestamp recent."""
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, ts, body), signature)


class WebhookSender:
    """Queues records and POSTs them in the background (start it on the server's loop)."""

    def __init__(self, url: str, secret: bytes, *, timeout_s: float, attempts: int, backoff_s: float,
                 queue_size: int, on_outcome: Callable[[str], None],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.url = url
        self._secret = secret
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._outcome = on_outcome
        self._sleep = sleep
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(queue_size)
        self._workers: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._warned = False

    def put(self, delivery_id: str, body: bytes) -> None:
        """Queue a record (event loop only); dropped, and counted, when the queue is full."""
        if not self._workers:
            self._start()
        try:
            self._queue.put_nowait((delivery_id, body))
        except asyncio.QueueFull:
            self._outcome("dropped")
            log.warning("webhook queue full: record of %s dropped", delivery_id)

    def _start(self) -> None:
        self._workers = [asyncio.create_task(self._work(), name=f"webhook-{i}") for i in range(_WORKERS)]

    async def _work(self) -> None:
        while True:
            delivery_id, body = await self._queue.get()
            try:
                ok = await self._deliver(delivery_id, body)
            except asyncio.CancelledError:
                self._outcome("dropped")  # shutdown gave up on it mid-delivery
                raise
            else:
                self._outcome("delivered" if ok else "failed")
            finally:
                self._queue.task_done()

    async def _deliver(self, delivery_id: str, body: bytes) -> bool:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        why = ""
        for attempt in range(self._attempts):
            if attempt:
                await self._sleep(self._backoff_s * 2 ** (attempt - 1))
            ts = int(time.time())
            headers = {
                "Content-Type": "application/json",
                TIMESTAMP_HEADER: str(ts),
                SIGNATURE_HEADER: sign(self._secret, ts, body),
                DELIVERY_HEADER: delivery_id,
            }
            try:
                async with self._http.post(self.url, data=body, headers=headers) as answer:
                    if 200 <= answer.status < 300:
                        if self._warned:
                            log.info("webhook delivers again")
                            self._warned = False
                        return True
                    why = f"HTTP {answer.status}"
                    if 400 <= answer.status < 500 and answer.status not in _RETRY_4XX:
                        break  # the receiver refuses this record: a retry would too
            except Exception as exc:  # whatever the receiver does, the worker goes on
                why = f"{type(exc).__name__}: {exc}"
        # Once per run of failures: a receiver that is down must not fill the log.
        level = logging.DEBUG if self._warned else logging.WARNING
        log.log(level, "webhook %s: record of %s not delivered (%s)", self.url, delivery_id, why)
        self._warned = True
        return False

    async def aclose(self, wait_s: float) -> None:
        """Let queued records go out for up to ``wait_s``; what is left is dropped (counted)."""
        if self._workers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._queue.join()
            for task in self._workers:
                task.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)
            self._workers = []
        while not self._queue.empty():  # never taken by a worker
            self._queue.get_nowait()
            self._outcome("dropped")
        if self._http is not None:
            await self._http.close()
            self._http = None
