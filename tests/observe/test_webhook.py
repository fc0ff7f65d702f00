"""The end-of-call webhook against a real HTTP server on a real socket: signed, retried
with backoff a bounded number of times, never blocking its caller, every outcome counted."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from voicebot.config import TelemetryConfig
from voicebot.errors import ConfigError
from voicebot.metrics import Metrics
from voicebot.observe import webhook as wh
from voicebot.observe.telemetry import Telemetry

SECRET = b"whsec_test"


@dataclass
class Receiver:
    """A webhook receiver that verifies what it gets and answers as told."""

    answers: collections.deque[int] = field(default_factory=collections.deque)  # status per request; then 200
    hold: bool = False  # answer only when released (the fixture releases it at its end)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    got: list[tuple[dict[str, str], bytes, bool]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        ok = wh.verify(SECRET, request.headers[wh.TIMESTAMP_HEADER], request.headers[wh.SIGNATURE_HEADER], body)
        self.got.append((dict(request.headers), body, ok))
        if self.hold:
            await self.released.wait()
        return web.Response(status=self.answers.popleft() if self.answers else 200)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/hook", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    rec.url = f"http://127.0.0.1:{port}/hook"
    yield rec
    rec.released.set()
    await runner.cleanup()


def sender(url: str, outcomes: list[str], **kw: object) -> wh.WebhookSender:
    async def no_wait(_: float) -> None:
        await asyncio.sleep(0)

    settings: dict[str, object] = dict(timeout_s=5.0, attempts=3, backoff_s=1.0, queue_size=8, sleep=no_wait)
    return wh.WebhookSender(url, SECRET, on_outcome=outcomes.append, **(settings | kw))  # type: ignore[arg-type]


async def until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.01)


def test_the_signature_covers_the_timestamp_and_the_body() -> None:
    ts = int(time.time())
    sig = wh.sign(SECRET, ts, b'{"a":1}')
    assert sig.startswith("v1=") and len(sig) == 3 + 64
    assert wh.verify(SECRET, str(ts), sig, b'{"a":1}')
    assert not wh.verify(SECRET, str(ts), sig, b'{"a":2}'), "a changed body"
    assert not wh.verify(SECRET, str(ts + 1), sig, b'{"a":1}'), "a changed timestamp"
    assert not wh.verify(b"other", str(ts), sig, b'{"a":1}'), "another secret"
    old = ts - 3600
    assert not wh.verify(SECRET, str(old), wh.sign(SECRET, old, b"x"), b"x"), "a replay an hour later"
    assert not wh.verify(SECRET, "soon", sig, b"x")


async def test_a_record_is_delivered_signed(receiver: Receiver) -> None:
    outcomes: list[str] = []
    s = sender(receiver.url, outcomes)
    s.put("sess_1", b'{"call_id":"sess_1"}')
    await until(lambda: outcomes)
    await s.aclose(1.0)
    assert outcomes == ["delivered"]
    (headers, body, ok) = receiver.got[0]
    assert ok and body == b'{"call_id":"sess_1"}'
    assert headers[wh.DELIVERY_HEADER] == "sess_1" and headers["Content-Type"] == "application/json"


async def test_server_errors_are_retried_then_delivered(receiver: Receiver) -> None:
    receiver.answers.extend([503, 429])
    outcomes: list[str] = []
    s = sender(receiver.url, outcomes)
    s.put("sess_2", b"{}")
    await until(lambda: outcomes)
    await s.aclose(1.0)
    assert outcomes == ["delivered"] and len(receiver.got) == 3
    assert all(ok for _, _, ok in receiver.got), "each attempt signed afresh"


async def test_retries_are_bounded_and_a_refusal_is_final(receiver: Receiver) -> None:
    receiver.answers.extend([500] * 10)
    outcomes: list[str] = []
    s = sender(receiver.url, outcomes, attempts=3)
    s.put("sess_3", b"{}")
    await until(lambda: outcomes)
    assert outcomes == ["failed"] and len(receiver.got) == 3
    receiver.answers.clear()
    receiver.answers.append(400)
    s.put("sess_4", b"{}")
    await until(lambda: len(outcomes) == 2)
    await s.aclose(1.0)
    assert outcomes == ["failed", "failed"] and len(receiver.got) == 4, "a 400 is not retried"


async def test_backoff_doubles(receiver: Receiver) -> None:
    receiver.answers.extend([500] * 10)
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    outcomes: list[str] = []
    s = sender(receiver.url, outcomes, attempts=4, backoff_s=0.5, sleep=sleep)
    s.put("sess_5", b"{}")
    await until(lambda: outcomes)
    await s.aclose(1.0)
    assert waits == [0.5, 1.0, 2.0]


async def test_a_dead_receiver_fails_counted_and_logged_once(caplog) -> None:  # type: ignore[no-untyped-def]
    outcomes: list[str] = []
    s = sender("http://127.0.0.1:9/hook", outcomes, attempts=2)  # nothing listens on the discard port
    for i in range(3):
        s.put(f"sess_{i}", b"{}")
    await until(lambda: len(outcomes) == 3)
    await s.aclose(1.0)
    assert outcomes == ["failed"] * 3
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "not delivered" in r.getMessage()]
    assert len(warnings) == 1


async def test_a_slow_receiver_times_out_and_never_holds_the_caller(receiver: Receiver) -> None:
    receiver.hold = True
    outcomes: list[str] = []
    s = sender(receiver.url, outcomes, attempts=2, timeout_s=0.2)
    s.put("sess_6", b"{}")  # returns at once: the POST runs in the background
    assert outcomes == [] and not receiver.got
    await until(lambda: outcomes)
    await s.aclose(1.0)
    assert outcomes == ["failed"] and len(receiver.got) == 2


async def test_a_full_queue_drops_and_shutdown_gives_up_after_its_wait(receiver: Receiver) -> None:
    receiver.hold = True
    outcomes: list[str] = []
    s = sender(receiver.url, outcomes, queue_size=2, timeout_s=60.0)
    for i in range(4 + 2 + 3):  # 4 in flight (one per worker), 2 queued, 3 dropped
        s.put(f"sess_{i}", b"{}")
        await asyncio.sleep(0)
    await until(lambda: len(receiver.got) == 4)
    assert outcomes == ["dropped"] * 3
    t0 = time.monotonic()
    await s.aclose(0.2)
    assert time.monotonic() - t0 < 5.0, "shutdown waited for a receiver that never answers"
    assert outcomes == ["dropped"] * 9


def test_a_webhook_needs_its_secret() -> None:
    cfg = TelemetryConfig(webhook_url="http://127.0.0.1:1/hook")
    with pytest.raises(ConfigError, match="VOICEBOT_WEBHOOK_SECRET"):
        Telemetry(cfg, Metrics(), environ={})
    assert Telemetry(cfg, Metrics(), environ={"VOICEBOT_WEBHOOK_SECRET": "s"}).webhook is not None
