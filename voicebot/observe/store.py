"""Call records on disk: ``telemetry.record_dir``, rotated, written off the event loop.

One thread takes finished records from a bounded queue, serialises each to JSON,
writes it (a temporary file renamed into place, so a reader never sees half a record)
and deletes the oldest records beyond ``record_max_files`` / ``record_max_mb``. A full
disk or an unwritable directory costs that record only: the call is long gone, the
failure is logged once per run of failures and counted
(``voicebot_call_records{outcome="failed"}``); a full queue drops the record
(``outcome="dropped"``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from voicebot.observe.rotation import Rotation

log = logging.getLogger(__name__)

_QUEUE = 256  # records waiting for the writer; a disk this far behind drops, not grows


def record_name(record: dict[str, Any]) -> str:
    """``<started_at>_<call id>.json``: names sort in the order calls started."""
    started = str(record["started_at"]).replace(":", "").replace("-", "")
    return f"{started}_{record['call_id']}.json"


class RecordStore:
    """Writes records to a directory from its own thread; ``then`` gets each record's
    JSON bytes after it was written or failed (the webhook), from that thread."""

    def __init__(self, directory: str | None, *, max_files: int, max_bytes: int,
                 on_outcome: Callable[[str], None],
                 then: Callable[[str, bytes], None] | None = None, existing_before: float = math.inf) -> None:
        self.directory = Path(directory).expanduser() if directory else None
        self._existing_before = existing_before
        self._max_files = max_files
        self._max_bytes = max_bytes
        self._outcome = on_outcome
        self._then = then
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(_QUEUE)
        self._rotation: Rotation | None = None  # what is on disk, from the first write
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="voicebot-records", daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        """Queue a finished record (never blocks; a full queue drops it, counted)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._outcome("dropped")
            log.warning("call record writer is behind: record of %s dropped", record.get("call_id"))

    def close(self, wait_s: float) -> None:
        """Write what is queued, for up to ``wait_s`` (blocking: run it in a thread)."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=wait_s)
        self._thread.join(wait_s)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                body = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
            except (TypeError, ValueError):
                log.exception("call record of %s cannot be serialised", record.get("call_id"))
                self._outcome("failed")
                continue
            if self.directory is not None:
                self._write(record_name(record), body)
            if self._then is not None:
                try:
                    self._then(str(record["call_id"]), body)
                except Exception:  # the loop closed under us at shutdown
                    log.debug("record of %s not handed on", record.get("call_id"), exc_info=True)

    def _write(self, name: str, body: bytes) -> None:
        assert self.directory is not None
        path = self.directory / name
        tmp = path.with_suffix(".tmp")
        try:
            if self._rotation is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._rotation = Rotation(self.directory, "*.json", max_files=self._max_files,
                                          max_bytes=self._max_bytes, existing_before=self._existing_before)
            tmp.write_bytes(body)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._outcome("failed")
            if not self._failing:
                log.warning("call records cannot be written to %s (%s); counting failures until they can",
                            self.directory, exc)
                self._failing = True
            return
        if self._failing:
            log.info("call records are written to %s again", self.directory)
            self._failing = False
        self._outcome("written")
        assert self._rotation is not None  # made before the first write
        self._rotation.add(path, len(body))
