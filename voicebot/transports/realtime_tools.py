"""Function tools on the Realtime wire: what clients send, and the items we send back.

Pure functions, no I/O, shared by WebSocket and WebRTC (both run the one translator).
Client side: ``session.tools`` / ``tool_choice`` (GA and beta alike), per-response
overrides in ``response.create`` (``instructions``, ``tools``, ``tool_choice``,
``max_output_tokens``), and ``conversation.item.create`` of a ``function_call_output``
(or a ``function_call``). Server side: the ``function_call`` item of a reply, as the GA
API shapes it (``openai.types.realtime.RealtimeConversationItemFunctionCall``).
"""

from __future__ import annotations

import json
from typing import Any

from voicebot.session.response import ResponseOptions
from voicebot.tools.spec import ToolChoice, ToolError, ToolSpec, tools_from_list
from voicebot.transports import realtime_events as rt

MAX_OUTPUT_TOKENS = 4096  # OpenAI's bound for max_output_tokens


def _request_error(exc: ToolError, param: str) -> rt.RealtimeRequestError:
    return rt.RealtimeRequestError(str(exc), code="invalid_value", param=param)


def session_tools(cfg: rt.SessionIn) -> tuple[list[ToolSpec] | None, ToolChoice | None]:
    """``session.tools`` / ``session.tool_choice`` of a session.update (None: not given)."""
    given = cfg.model_fields_set
    try:
        tools = tools_from_list(cfg.tools, "session.tools") if "tools" in given else None
    except ToolError as exc:
        raise _request_error(exc, "session.tools") from None
    try:
        choice = ToolChoice.parse(cfg.tool_choice) if "tool_choice" in given else None
    except ToolError as exc:
        raise _request_error(exc, "session.tool_choice") from None
    return tools, choice


def response_options(raw: dict[str, Any] | None) -> ResponseOptions | None:
    """The overrides of a ``response.create`` (None when it has none we apply)."""
    if not raw:
        return None
    instructions = raw.get("instructions")
    if instructions is not None and (not isinstance(instructions, str) or len(instructions) > 20_000):
        raise rt.RealtimeRequestError("response.instructions must be a string of at most 20000 characters",
                                      code="invalid_value", param="response.instructions")
    try:
        tools = tools_from_list(raw["tools"], "response.tools") if "tools" in raw else None
    except ToolError as exc:
        raise _request_error(exc, "response.tools") from None
    try:
        choice = ToolChoice.parse(raw["tool_choice"]) if raw.get("tool_choice") is not None else None
    except ToolError as exc:
        raise _request_error(exc, "response.tool_choice") from None
    tokens = raw.get("max_output_tokens", raw.get("max_response_output_tokens"))
    max_tokens: int | None = None
    if tokens is not None and tokens != "inf":
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_OUTPUT_TOKENS:
            raise rt.RealtimeRequestError(f"response.max_output_tokens must be 1-{MAX_OUTPUT_TOKENS} or 'inf'",
                                          code="invalid_value", param="response.max_output_tokens")
        max_tokens = tokens
    if instructions is None and tools is None and choice is None and max_tokens is None:
        return None
    return ResponseOptions(instructions=instructions, tools=tools, tool_choice=choice, max_tokens=max_tokens)


def call_arguments(item: rt.ItemIn) -> dict[str, Any]:
    """A client ``function_call`` item's arguments as an object."""
    try:
        value = json.loads(item.arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise rt.RealtimeRequestError("a function_call item's arguments must be a JSON object",
                                      code="invalid_value", param="item.arguments")
    return value


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status,
            "name": name, "call_id": call_id, "arguments": arguments}


def function_call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
            "call_id": call_id, "output": output}
