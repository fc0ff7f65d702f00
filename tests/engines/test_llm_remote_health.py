"""The remote LLM tier's health (voicebot/engines/llm/remote.py): requests failed in a row
mark it down, but not a timeout that fired while this frontend's own event loop was late
for most of the wait (the tier's answer may have sat unread meanwhile).

The engine's real HTTP client over httpx's MockTransport, which answers each request as
the test says (a connect timeout, a refused connection); the loop watch is a fake of our
own LoopLateness: it says whether the loop was late, as the real one reads its ticks
(tests/runtime/test_loop_lag.py)."""

from __future__ import annotations

import httpx
import pytest
from fakes import FakeLoopWatch

from voicebot.config import LlmConfig, RemoteLlmConfig
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.remote import RemoteLlmEngine, RemoteLlmError

THRESHOLD = 3


def tier(failure: type[httpx.TransportError], loop: FakeLoopWatch | None) -> RemoteLlmEngine:
    """An engine whose every request to the tier fails with ``failure`` (no retries)."""

    def answer(request: httpx.Request) -> httpx.Response:
        raise failure("scripted", request=request)

    cfg = LlmConfig(backend="remote", remote=RemoteLlmConfig(retries=0, failure_threshold=THRESHOLD))
    engine = RemoteLlmEngine(cfg, "unused-tokenizer", loop=loop)
    # What start() sets once the tier lists its model (it would load a tokenizer first).
    engine._client = engine._engine = httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://tier")
    engine._model = "m"
    return engine


async def fail_requests(engine: RemoteLlmEngine, n: int) -> None:
    for i in range(n):
        st = GenerationStats(f"r{i}", Lane.INTERACTIVE)
        with pytest.raises(RemoteLlmError):
            async for _ in engine._stream(f"r{i}", [1, 2, 3], Lane.INTERACTIVE, st, {}):
                pass


async def test_connect_timeouts_mark_the_tier_down() -> None:
    engine = tier(httpx.ConnectTimeout, FakeLoopWatch(late=False))
    await fail_requests(engine, THRESHOLD)
    assert engine.dead_reason is not None and "3 requests failed in a row" in engine.dead_reason


async def test_connect_timeouts_while_our_loop_was_late_do_not() -> None:
    loop = FakeLoopWatch(late=True)
    engine = tier(httpx.ConnectTimeout, loop)
    await fail_requests(engine, THRESHOLD * 2)
    assert engine.dead_reason is None and engine.late_loop_failures == THRESHOLD * 2 and loop.asked == THRESHOLD * 2
    loop.late = False  # the loop keeps up again, the tier still does not answer: now it is the tier's
    await fail_requests(engine, THRESHOLD)
    assert engine.dead_reason is not None


async def test_a_refused_connection_is_the_tiers_however_late_our_loop() -> None:
    loop = FakeLoopWatch(late=True)
    engine = tier(httpx.ConnectError, loop)
    await fail_requests(engine, THRESHOLD)
    assert engine.dead_reason is not None and loop.asked == 0


async def test_without_a_loop_watch_every_timeout_counts() -> None:
    engine = tier(httpx.ConnectTimeout, None)
    await fail_requests(engine, THRESHOLD)
    assert engine.dead_reason is not None


async def test_a_start_whose_warm_up_fails_closes_its_own_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier lists its model, then refuses the start-up's sampled replies: start() fails
    with that error and closes the HTTP client it opened, whoever called it (start_all
    closes engines too, but a caller that starts one engine alone must not leak its pool)."""
    from voicebot.engines.llm import remote

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(500, text="the tier refused it")

    opened: list[httpx.AsyncClient] = []
    real_client = httpx.AsyncClient

    def client(**kwargs: object) -> httpx.AsyncClient:
        c = real_client(transport=httpx.MockTransport(answer), **kwargs)  # type: ignore[arg-type]
        opened.append(c)
        return c

    monkeypatch.setattr(remote.httpx, "AsyncClient", client)
    monkeypatch.setattr(remote, "load_tokenizer", lambda path: FakeTokenizer())
    cfg = LlmConfig(backend="remote", warm_sampling_rows=2, remote=RemoteLlmConfig(retries=0))
    engine = RemoteLlmEngine(cfg, "unused-tokenizer")
    with pytest.raises(RemoteLlmError):
        await engine.start()
    assert len(opened) == 1 and opened[0].is_closed
    assert engine.dead_reason == "not started"


class FakeTokenizer:
    """What the engine asks of a tokenizer at start and to render the warm-up's prompt."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1, 2, 3]

    def apply_chat_template(self, messages: object, **kwargs: object) -> list[int]:
        return [1, 2, 3]
