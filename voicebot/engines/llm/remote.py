"""The LLM engine over HTTP: vLLM's OpenAI-compatible server, usually several behind vllm-router.

``llm.backend: remote`` swaps this in for the in-process engine; the session sees the same
:class:`~voicebot.engines.contracts.Llm` (the priority lanes, the background cap and
generate/warm/complete are the shared :class:`~voicebot.engines.llm.lanes.LaneEngine`; only
the transport differs). What crosses the wire, and why:

- ``POST /v1/completions`` with ``prompt`` = the token ids the session built (vLLM
  accepts a token-id list): the frontend's chat template and history stay the only
  ones, and a call's prompts keep sharing their prefix, so the server's prefix cache
  hits turn after turn. ``return_token_ids`` brings the reply's ids back (the history
  stores a finished reply as its ids); ``stream_options.include_usage`` brings the
  usage block, whose ``prompt_tokens_details.cached_tokens`` is the prefix-cache hit
  (the servers need ``--enable-prompt-tokens-details``). The usage block comes last:
  a reply's cached-token count is known when its stream ends, not at its first token.
- ``X-Session-ID: <session id>`` on every request (voicebot/affinity.py): vllm-router's
  ``sticky_least_loaded`` / ``consistent_hash`` policies keep a call on the server
  that holds its prefix (docs/scaling.md). ``priority`` in the body: the lanes, as
  in-process (the servers run ``--scheduling-policy priority``).
- Abort = closing the stream: vLLM's server aborts a request whose client went away.
  Cancelling the consumer, or closing the iterator early, closes the connection.
- The client is aiohttp's: all at once, a frontend worker streams ~43 replies and their
  background prefills, and httpx's connection pool took ~4x as long to each first token
  there, for ~4x the CPU (``benchmarks/llm_client.py``; encode/httpx#3215).
- Retries only before the first token (refused, dropped, 5xx, first-token timeout):
  until then nothing was said and another try (the router picks a live server) is
  invisible; after it a retry would repeat words, so a broken stream is the reply's
  error (an error event; the call goes on and its next turn is routed afresh).
- Health: ``llm.remote.failure_threshold`` requests failed in a row mark the tier down
  (``/healthz`` 503, new calls refused). A request whose last try timed out after this
  process's own event loop ran late for half its wait or more is not one of them (the
  loop watch says so: :mod:`voicebot.runtime.loop_lag`): the tier's answer may have sat
  unread while our loop was stuck, so that failure is the frontend's overload, not the tier's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from voicebot.affinity import current_session
from voicebot.config import LlmConfig
from voicebot.engines.contracts import GenerationStats, Lane, TextDelta
from voicebot.engines.llm.lanes import LaneEngine
from voicebot.errors import EngineError, ModelError
from voicebot.runtime.loop_lag import LoopLateness, loop_was_late

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"  # what vllm-router's session-affinity policies read first
# A streamed line's bound (aiohttp's buffer per connection): a chunk of a few tokens is far below.
READ_BUFFER = 1 << 18


class RemoteLlmError(EngineError):
    """The remote LLM tier could not give this reply (after the retries allowed)."""

    code = "llm_unavailable"


class _Retryable(Exception):
    """A try that failed before its first token: nothing was said, another try is invisible.
    ``timed_out``: a timeout's (wall time ran out), not the tier's answer or refusal."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def load_tokenizer(path: str) -> Any:
    """The tokenizer vLLM itself would use (the prompt ids must be the server's), or
    transformers' when vLLM is not installed on a frontend."""
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # pragma: no cover - frontends without vLLM
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return get_tokenizer(path)


def _plain(value: Any) -> Any:
    """vLLM's StructuredOutputsParams (a dataclass) as the JSON body field it mirrors."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        raw = dataclasses.asdict(value)
        return {k: v for k, v in raw.items() if not k.startswith("_") and v is not None and v is not False}
    return value


class RemoteLlmEngine(LaneEngine):
    """One HTTP client to the LLM tier, shared by every session of this frontend."""

    def __init__(self, cfg: LlmConfig, tokenizer_path: str, *, loop: LoopLateness | None = None) -> None:
        super().__init__(cfg, tokenizer_path, tokenizer_path)
        self._loop_watch = loop  # the server's loop watch: was a timeout ours?
        self.remote = cfg.remote
        self._client: aiohttp.ClientSession | None = None
        self._base = cfg.remote.url.rstrip("/")  # paths join onto it (a prefix behind a proxy kept)
        self._model: str | None = cfg.remote.model
        self._failures = 0  # requests failed in a row, after their retries
        self._last_error: str | None = None
        self.retries_total = 0
        self.late_loop_failures = 0  # requests failed by a timeout of our late loop: not counted

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._tokenizer = await asyncio.to_thread(load_tokenizer, self.tokenizer_path)
        await self._preload_tools()
        r = self.remote
        client = self._new_client()
        try:
            self._model = await self._wait_ready(client)
        except BaseException:
            await client.close()
            raise
        self._client = client
        self._engine = client  # the backend's handle: LaneEngine.generate checks it for "started"
        try:
            await self._warm_sampling()  # the tier's sampler, before this frontend's first caller
        except BaseException:
            await self.aclose()  # a failed start leaves no open pool, whoever called it
            raise
        log.info("LLM ready: remote tier %s, model %s", r.url, self._model)

    def _new_client(self) -> aiohttp.ClientSession:
        """The HTTP client to the tier (in a running loop): its connections, timeouts, key."""
        r = self.remote
        headers = {}
        key = os.environ.get(r.api_key_env, "")  # read at start-up, never at import
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # trust_env stays off: the tier is reached directly, never through HTTP(S)_PROXY.
        return aiohttp.ClientSession(
            headers=headers,
            # sock_read: the longest gap between two chunks of a stream; the wait for the first
            # token is bounded separately (first_token_timeout_s), it includes queueing, as does
            # the wait for a free connection (connect) but not the TCP connect (sock_connect).
            timeout=aiohttp.ClientTimeout(total=None, connect=r.first_token_timeout_s,
                                          sock_connect=r.connect_timeout_s, sock_read=r.read_timeout_s),
            connector=aiohttp.TCPConnector(limit=r.max_connections),
            read_bufsize=READ_BUFFER,
        )

    async def _wait_ready(self, client: aiohttp.ClientSession) -> str:
        """Wait until the tier lists a model (vLLM loads for minutes; the router comes up first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.remote.startup_timeout_s
        last = "no answer"
        while True:
            try:
                async with client.get(f"{self._base}/v1/models") as resp:
                    if resp.status == 200:
                        listed = await resp.json(content_type=None)
                        models = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
                        if self._model is not None:
                            return self._model  # a router may list nothing of its own: trust the config
                        if models and isinstance(models[0], str):
                            return models[0]
                        last = "no model listed"
                    else:
                        last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if loop.time() >= deadline:
                raise ModelError(
                    f"remote LLM tier {self.remote.url} not ready after "
                    f"{self.remote.startup_timeout_s:.0f} s (llm.remote.startup_timeout_s): {last}"
                )
            await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        self._engine = None
        if client is not None:
            await client.close()

    # ------------------------------------------------------------------ queries
    @property
    def dead_reason(self) -> str | None:
        if self._client is None:
            return "not started"
        if self._failures >= self.remote.failure_threshold:
            return (
                f"remote LLM tier {self.remote.url}: {self._failures} requests failed in a row, "
                f"last: {self._last_error}"
            )
        return None

    @property
    def keeps_prefills(self) -> bool:
        """The tier's servers keep their own prefix cache (``--enable-prefix-caching``)."""
        return True

    def unfinished_requests(self) -> int:
        """Streams open to the tier (the servers' own count is on their /metrics)."""
        return len(self._running)

    @property
    def model(self) -> str | None:
        return self._model

    # --------------------------------------------------------------- generation
    def _params(self, values: dict[str, Any]) -> dict[str, Any]:
        """The remote form of LaneEngine._sampling's values: the /v1/completions body fields
        of the same names (vLLM's CompletionRequest), unset ones left out."""
        body = {k: v for k, v in values.items() if v not in (None, [], {})}
        if "structured_outputs" in body:
            body["structured_outputs"] = _plain(body["structured_outputs"])
        if "logit_bias" in body:
            body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}  # JSON keys are strings
        return body

    async def _stream(
        self,
        rid: str,
        prompt_ids: list[int],
        lane: Lane,
        st: GenerationStats,
        params: Any,
    ) -> AsyncGenerator[TextDelta, None]:
        priority = self._priority(lane)
        body = {
            **params,
            "model": self._model,
            "prompt": prompt_ids,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "priority": priority,
        }
        session = current_session()
        headers = {SESSION_HEADER: session} if session else {}
        st.submitted_at = time.monotonic()
        self._running[rid] = st
        r = self.remote
        retries = 0 if st.best_effort else r.retries
        try:
            for attempt in range(retries + 1):
                started = time.monotonic()  # this try's wait: what its timeouts measure
                try:
                    async with contextlib.aclosing(self._try(body, headers, st)) as stream:
                        async for delta in stream:
                            yield delta
                    if not st.best_effort:
                        self._failures = 0
                    return
                except _Retryable as exc:
                    if st.best_effort:
                        raise RemoteLlmError(f"remote LLM tier {r.url}: {exc}") from None
                    self._last_error = str(exc)
                    if attempt == retries:
                        self._count_failure(exc, started)
                        raise RemoteLlmError(
                            f"remote LLM tier {r.url}: no reply after {attempt + 1} tries: {exc}"
                        ) from None
                    self.retries_total += 1
                    delay = r.retry_backoff_s * 2**attempt
                    log.warning("LLM request %s (session %s) failed before its first token (%s); retry in %.2f s",
                                rid, session, exc, delay)
                    await asyncio.sleep(delay)
        finally:
            self._done(rid, st)

    def _count_failure(self, exc: _Retryable, started: float) -> None:
        """A request failed after its retries: one more towards the tier's failure_threshold,
        unless its last try timed out while our own loop was late for most of that try's wait."""
        if exc.timed_out and loop_was_late(self._loop_watch, started):
            self.late_loop_failures += 1
            log.warning("LLM request timed out (%s) while this server's event loop ran late for most of "
                        "its wait: not counted against the tier's health", exc)
            return
        self._failures += 1

    async def _try(self, body: dict[str, Any], headers: dict[str, str], st: GenerationStats) -> AsyncGenerator[TextDelta, None]:
        """One request. Raises _Retryable for a failure before the first token; closing
        this generator closes the connection, which is how the server learns to abort."""
        assert self._client is not None
        client = self._client
        got_token = False
        done = False
        try:
            # Bounds connect + queueing + prefill; lifted at the first token (before the
            # first yield, so it never fires while the consumer holds a delta).
            async with asyncio.timeout(self.remote.first_token_timeout_s) as first_token_deadline:
                async with client.post(f"{self._base}/v1/completions", json=body, headers=headers) as resp:
                    if resp.status != 200:
                        detail = (await resp.read()).decode(errors="replace")[:300]
                        if resp.status >= 500 or resp.status == 429:
                            raise _Retryable(f"HTTP {resp.status}: {detail}")
                        raise RemoteLlmError(f"LLM server refused the request: HTTP {resp.status}: {detail}",
                                             code="llm_request_rejected")
                    async for raw in resp.content:  # a line at a time (SSE)
                        line = raw.decode()
                        if not line.startswith("data:"):
                            continue  # SSE blank lines and comments
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if err := chunk.get("error"):
                            message = err.get("message", err) if isinstance(err, dict) else err
                            if not got_token:
                                raise _Retryable(f"server error: {message}")
                            raise RemoteLlmError(f"LLM server error mid-reply: {message}")
                        if usage := chunk.get("usage"):
                            st.prompt_tokens = usage.get("prompt_tokens") or st.prompt_tokens
                            details = usage.get("prompt_tokens_details") or {}
                            st.cached_tokens = int(details.get("cached_tokens") or 0)
                            st.cached_known = True
                        for choice in chunk.get("choices") or ():
                            ids = tuple(choice.get("token_ids") or ())
                            text = choice.get("text") or ""
                            if (ids or text) and not got_token:
                                got_token = True
                                st.first_token_at = time.monotonic()
                                first_token_deadline.reschedule(None)
                            st.output_tokens += len(ids)
                            if reason := choice.get("finish_reason"):
                                st.finish_reason = reason
                            if text or ids:
                                yield TextDelta(text, len(ids), ids)
        except TimeoutError as exc:  # first_token_deadline's, or aiohttp's (connect, read)
            what = (f"{type(exc).__name__}: {exc}" if isinstance(exc, aiohttp.ClientError)
                    else f"no first token within {self.remote.first_token_timeout_s:.1f} s")
            if not got_token:
                raise _Retryable(what, timed_out=True) from None
            raise RemoteLlmError(f"LLM stream timed out mid-reply: {what}") from None
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: bad JSON, or a line over READ_BUFFER
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not got_token:
                raise _Retryable(what) from None
            raise RemoteLlmError(f"LLM stream broke after {st.output_tokens} tokens: {what}",
                                 code="llm_stream_broken") from None
        if not done:
            if not got_token:
                raise _Retryable("stream ended before its first token")
            raise RemoteLlmError(f"LLM stream ended without [DONE] after {st.output_tokens} tokens",
                                 code="llm_stream_broken")
