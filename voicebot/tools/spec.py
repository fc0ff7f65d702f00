"""What a tool is, how the model may use tools, and one call the model made.

Plain values, no I/O. Tools come from two places with the same shape once parsed:
a Realtime client's ``session.tools`` (client-side: the client runs them) and the
server's ``tools.server`` config (server-side: an HTTP webhook each, see webhook.py).
Both the Realtime shape ``{"type": "function", "name", "description", "parameters"}``
and the Chat Completions shape ``{"type": "function", "function": {...}}`` are read.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from voicebot.errors import BadMessage

MAX_TOOLS = 32  # each tool's schema is rendered into the system prompt: keep it bounded
MAX_SCHEMA_CHARS = 16_000
MAX_DESCRIPTION_CHARS = 4000
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(BadMessage):
    """A tool declaration or tool choice we cannot use (the session goes on)."""

    code = "invalid_tool"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_OBJECT))

    def as_chat_tool(self) -> dict[str, Any]:
        """The Chat Completions shape chat templates and vLLM's tool code take."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}

    def as_realtime(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters}


def tool_from_dict(raw: Any, where: str = "tools") -> ToolSpec | None:
    """One declared tool; None for tool types we do not run (``mcp``: skipped, not an
    error, so a client that also declares those keeps working)."""
    if not isinstance(raw, dict):
        raise ToolError(f"{where}: a tool must be an object")
    if raw.get("type", "function") != "function":
        return None
    fn = raw.get("function")
    body: dict[str, Any] = fn if isinstance(fn, dict) else raw
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}: a function name must match [A-Za-z0-9_-]{{1,64}}, got {str(name)[:80]!r}")
    description = body.get("description") or ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise ToolError(f"{where}.{name}: description must be a string of at most {MAX_DESCRIPTION_CHARS} characters")
    params = body.get("parameters")
    if params is None:
        params = dict(EMPTY_OBJECT)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolError(f"{where}.{name}: parameters must be a JSON schema of type 'object'")
    if len(json.dumps(params)) > MAX_SCHEMA_CHARS:
        raise ToolError(f"{where}.{name}: parameters schema is longer than {MAX_SCHEMA_CHARS} characters")
    return ToolSpec(name, description, params)


def tools_from_list(raw: Any, where: str = "tools") -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolError(f"{where} must be a list")
    tools = [t for i, item in enumerate(raw) if (t := tool_from_dict(item, f"{where}[{i}]")) is not None]
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"{where}: at most {MAX_TOOLS} function tools, got {len(tools)}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError(f"{where}: function names must be unique")
    return tools


ChoiceMode = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's ``tool_choice``: auto / none / required, or one named function."""

    mode: ChoiceMode = "auto"
    name: str | None = None  # for mode "function"

    @classmethod
    def parse(cls, raw: Any) -> ToolChoice:
        if raw is None:
            return cls()
        if isinstance(raw, str):
            if raw in ("auto", "none", "required"):
                return cls(raw)  # type: ignore[arg-type]
            raise ToolError(f"tool_choice must be auto, none, required or a function, got {raw[:40]!r}")
        if isinstance(raw, dict) and raw.get("type") == "function":
            # Realtime/Responses: {"type": "function", "name"}; Chat: {"function": {"name"}}
            fn = raw.get("function")
            name = fn.get("name") if isinstance(fn, dict) else raw.get("name")
            if isinstance(name, str) and _NAME.match(name):
                return cls("function", name)
        raise ToolError("tool_choice: a forced function is {\"type\": \"function\", \"name\": NAME}")

    def check(self, tools: list[ToolSpec]) -> None:
        if self.mode == "function" and self.name not in {t.name for t in tools}:
            raise ToolError(f"tool_choice names {self.name!r}, which is not among the session's tools")
        if self.mode == "required" and not tools:
            raise ToolError("tool_choice 'required' needs at least one tool")

    def as_wire(self) -> str | dict[str, Any]:
        return {"type": "function", "name": self.name} if self.mode == "function" else self.mode

    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made. ``arguments`` is JSON text (an object) when ``valid``."""

    call_id: str
    item_id: str
    name: str
    arguments: str
    valid: bool = True

    def parsed_arguments(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError("arguments are not a JSON object")
        return value
