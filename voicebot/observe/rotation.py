"""Files of one kind in a directory kept within a count and a size, the oldest deleted
first: call records (store.py) and call audio (audio_files.py). Used from one writer
thread each; no locking.

The K workers of one port (``server.workers``) write into one directory: each keeps its
own files within 1/K of the bounds, and only the first takes in the files that were
there before the server started (Telemetry's ``share``)."""

from __future__ import annotations

import contextlib
import math
from collections import deque
from pathlib import Path


class Rotation:
    def __init__(self, directory: Path, pattern: str, *, max_files: int, max_bytes: int,
                 existing_before: float = math.inf) -> None:
        """Takes in the files of ``pattern`` already there (a restart goes on rotating
        them) last modified before ``existing_before`` (Unix time), oldest first: their
        names sort in the order calls started."""
        self._max_files, self._max_bytes = max_files, max_bytes
        found = []
        for p in directory.glob(pattern):
            with contextlib.suppress(OSError):
                stat = p.stat()
                if stat.st_mtime < existing_before:
                    found.append((p, stat.st_size))
        found.sort()
        self._files: deque[tuple[Path, int]] = deque(found)
        self._bytes = sum(size for _, size in found)

    def add(self, path: Path, size: int) -> None:
        """A file was written: delete the oldest beyond the bounds."""
        self._files.append((path, size))
        self._bytes += size
        while self._files and (len(self._files) > self._max_files or self._bytes > self._max_bytes):
            old, old_size = self._files.popleft()
            self._bytes -= old_size
            with contextlib.suppress(OSError):
                old.unlink(missing_ok=True)
