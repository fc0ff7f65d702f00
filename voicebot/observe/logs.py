"""``server.log_format: json``: one JSON object a line per log record, with its call id.

The call id is the one the record's call logged with (the session's log adapter puts
it on the record) or, for any other code running inside a call's tasks (engines,
tools), the one bound to the task's context (voicebot/affinity.py). Logs, traces
(``voicebot.call_id``) and call records (``call_id``) join on it.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from voicebot.affinity import current_session


class CallIdFilter(logging.Filter):
    """Puts the call id bound to the logging task's context on the record, while it is
    still that task's (a handler that formats later, or elsewhere, would miss it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "call_id", None) is None:
            record.call_id = current_session()
        return True


class WorkerFilter(logging.Filter):
    """Which worker of a server of several (``server.workers``) logged the record."""

    def __init__(self, worker: int) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        call_id = getattr(record, "call_id", None) or current_session()
        if call_id:
            line["call_id"] = call_id
        worker = getattr(record, "worker", None)
        if worker is not None:
            line["worker"] = worker
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def use_json_logs(root: logging.Logger | None = None) -> None:
    """Every handler of the root logger writes JSON lines from now on (a stderr
    handler is added when there is none)."""
    root = root or logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
        handler.addFilter(CallIdFilter())
