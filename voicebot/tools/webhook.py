"""Server-side tools: each declared tool is an HTTP webhook the server calls itself.

For calls with no client in the loop (native ``/ws``, Twilio): the model's call is
POSTed as JSON ``{"name", "arguments", "call_id", "session_id"}`` to the tool's URL
and the response body (JSON or text, at most ``tools.max_result_chars``) becomes the
tool result the model continues from. A tool never hangs the call: the whole request
is bounded by the tool's ``timeout_s``; a timeout, a connection error, a non-2xx status
or arguments that are not a JSON object all become an *error result*
(``{"error": "..."}``) that the model reads and can apologise for. Cancellation (a
barge-in, the call ending) aborts the request and re-raises.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
from collections.abc import Sequence

import httpx

from voicebot.config import ServerToolConfig
from voicebot.tools.spec import ToolCall, ToolSpec

log = logging.getLogger(__name__)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS verification (certifi's CA bundle, or ``SSL_CERT_FILE``/``_DIR``).

    Loading the CA bundle takes tens of milliseconds of CPU, and httpx does it for every client it
    builds: on the event loop, at every tool call, every call on the server would stall
    with it. Built once, off the loop (:meth:`WebhookTools._post`)."""
    return httpx.create_ssl_context()


def error_result(message: str) -> str:
    return json.dumps({"error": message})


class WebhookTools:
    """The configured server tools; :meth:`run` calls one. Shared by every session."""

    def __init__(self, tools: Sequence[ServerToolConfig], max_result_chars: int = 4000) -> None:
        self._tools = {t.name: t for t in tools}
        self.max_result_chars = max_result_chars

    @property
    def specs(self) -> list[ToolSpec]:
        return [ToolSpec(t.name, t.description, dict(t.parameters)) for t in self._tools.values()]

    def __bool__(self) -> bool:
        return bool(self._tools)

    async def run(self, call: ToolCall, session_id: str) -> str:
        tool = self._tools.get(call.name)
        if tool is None:
            return error_result(f"there is no tool named {call.name!r}")
        try:
            arguments = call.parsed_arguments()
        except ValueError as exc:
            return error_result(f"invalid arguments for {call.name}: {exc}")
        body: dict[str, object] = {"name": call.name, "arguments": arguments, "call_id": call.call_id, "session_id": session_id}
        try:
            async with asyncio.timeout(tool.timeout_s):  # the whole exchange, not each read
                return await self._post(tool, body)
        except TimeoutError:
            log.warning("[%s] tool %s timed out after %g s", session_id, call.name, tool.timeout_s)
            return error_result(f"{call.name} did not answer within {tool.timeout_s:g} s")
        except httpx.HTTPError as exc:
            log.warning("[%s] tool %s failed: %s", session_id, call.name, exc)
            return error_result(f"{call.name} could not be reached ({type(exc).__name__})")

    async def _post(self, tool: ServerToolConfig, body: dict[str, object]) -> str:
        limit = self.max_result_chars
        tls = await asyncio.to_thread(tls_context)
        async with (
            httpx.AsyncClient(timeout=tool.timeout_s, follow_redirects=False, verify=tls) as client,
            client.stream("POST", tool.url, json=body, headers=tool.headers) as resp,
        ):
            if resp.status_code >= 300:
                return error_result(f"{tool.name} failed with HTTP {resp.status_code}")
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > 4 * limit:  # enough to fill the limit in any encoding
                    break
        text = data.decode("utf-8", errors="replace").strip()
        return text[:limit] if text else json.dumps({"result": "done"})
