"""Calls' WAV files in ``telemetry.record_dir``, streamed from one writer thread.

Each recorded call opens a file as it starts and appends a block of stereo PCM16 about
every half second (voicebot/observe/call_audio.py). After each block the header's sizes
are rewritten, so the file on disk is a valid WAV of everything written so far, even
if the process dies mid-call. Closed files are rotated like the records: at most
``record_max_files`` WAVs and ``record_audio_max_mb`` MiB of them, the oldest deleted
first (files of calls still running are never deleted).

Nothing here blocks the event loop: blocks wait in a queue bounded by their bytes; a
disk so slow that ``_MAX_PENDING`` bytes wait drops the blocks (the call's recording
stops there, counted as ``dropped``). An unwritable directory or a full disk costs the
file only: logged once per run of failures, counted as ``failed``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from voicebot.observe.rotation import Rotation

log = logging.getLogger(__name__)

_MAX_PENDING = 64 << 20  # bytes of audio waiting for the disk, all calls together
_HEADER = 44


def wav_header(rate: int, channels: int, data_bytes: int) -> bytes:
    """A canonical 44-byte PCM16 WAV header for ``data_bytes`` of samples."""
    align = 2 * channels
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * align, align, 16)
            + b"data" + struct.pack("<I", data_bytes))


class WavStream:
    """One call's WAV, as the loop sees it: blocks appended, then closed."""

    def __init__(self, files: AudioFiles, key: int) -> None:
        self._files, self._key = files, key

    def write(self, block: bytes) -> bool:
        """Append interleaved PCM16 frames; False: the writer is behind and the block
        was dropped (the file keeps what came before)."""
        return self._files._put_block(self._key, block)

    def close(self) -> None:
        """No more blocks: the file's header is final and it joins the rotation."""
        self._files._queue.put(_Op("close", self._key))


@dataclass
class _File:
    path: Path
    handle: BinaryIO | None = None
    size: int = 0  # data bytes written
    failed: bool = False
    dropped: bool = False


@dataclass
class _Op:
    kind: str  # open, write, dropped, close, stop
    key: int = 0
    data: bytes = b""
    path: Path | None = None


class AudioFiles:
    """The writer thread of every call's WAV; ``on_outcome`` gets each file's outcome
    (written, failed, dropped) as it closes."""

    def __init__(self, directory: str, *, rate: int, channels: int, max_files: int, max_bytes: int,
                 on_outcome: Callable[[str], None], existing_before: float = math.inf) -> None:
        self.directory = Path(directory).expanduser()
        self._existing_before = existing_before
        self._rate, self._channels = rate, channels
        self._max_files, self._max_bytes = max_files, max_bytes
        self._outcome = on_outcome
        # Bounded by _MAX_PENDING bytes of blocks (put() refuses beyond it) and by the
        # open calls for the rest (an open and a close each).
        self._queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._next_key = 0
        self._files: dict[int, _File] = {}  # the thread's own
        self._rotation: Rotation | None = None  # closed files on disk, from the first open
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="voicebot-call-audio", daemon=True)
        self._thread.start()

    # ------------------------------------------------------ from the loop
    def open(self, name: str) -> WavStream:
        """Start the WAV ``name`` in the directory (on the loop; never blocks)."""
        with self._lock:
            key = self._next_key
            self._next_key += 1
        self._queue.put(_Op("open", key, path=self.directory / name))
        return WavStream(self, key)

    def _put_block(self, key: int, block: bytes) -> bool:
        with self._lock:
            room = self._pending + len(block) <= _MAX_PENDING
            if room:
                self._pending += len(block)
        self._queue.put(_Op("write", key, block) if room else _Op("dropped", key))
        return room

    def close(self, wait_s: float) -> None:
        """Write what is queued, for up to ``wait_s`` (blocking: run it in a thread)."""
        self._queue.put(_Op("stop"))
        self._thread.join(wait_s)

    # ---------------------------------------------------------- the thread
    def _run(self) -> None:
        while (op := self._queue.get()).kind != "stop":
            if op.kind == "open":
                assert op.path is not None
                self._files[op.key] = self._open(op.path)
                continue
            file = self._files.get(op.key)
            if file is None:
                continue
            if op.kind == "write":
                with self._lock:
                    self._pending -= len(op.data)
                self._append(file, op.data)
            elif op.kind == "dropped":
                file.dropped = True
            elif op.kind == "close":
                del self._files[op.key]
                self._finish(file)
        for file in self._files.values():  # calls still open at shutdown: valid as they are
            self._finish(file)
        self._files.clear()

    def _open(self, path: Path) -> _File:
        file = _File(path)
        try:
            if self._rotation is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._rotation = Rotation(self.directory, "*.wav", max_files=self._max_files,
                                          max_bytes=self._max_bytes, existing_before=self._existing_before)
            file.handle = open(path, "wb")  # noqa: SIM115 (open for the whole call)
            file.handle.write(wav_header(self._rate, self._channels, 0))
        except OSError as exc:
            self._failed(file, exc)
        return file

    def _append(self, file: _File, block: bytes) -> None:
        if file.handle is None or file.failed:
            return
        try:
            file.handle.write(block)
            file.size += len(block)
            # The header's sizes, so that the file is whole as it stands.
            file.handle.seek(4)
            file.handle.write(struct.pack("<I", 36 + file.size))
            file.handle.seek(40)
            file.handle.write(struct.pack("<I", file.size))
            file.handle.seek(0, os.SEEK_END)
            file.handle.flush()
        except OSError as exc:
            self._failed(file, exc)

    def _finish(self, file: _File) -> None:
        if file.handle is not None:
            with contextlib.suppress(OSError):
                file.handle.close()
        if file.failed:
            self._outcome("failed")
            return
        if self._failing:
            log.info("call audio is written to %s again", self.directory)
            self._failing = False
        self._outcome("dropped" if file.dropped else "written")
        if self._rotation is not None:
            self._rotation.add(file.path, _HEADER + file.size)

    def _failed(self, file: _File, exc: OSError) -> None:
        file.failed = True
        if file.handle is not None:
            with contextlib.suppress(OSError):
                file.handle.close()
            file.handle = None
        if not self._failing:
            log.warning("call audio cannot be written to %s (%s); counting failures until it can",
                        self.directory, exc)
            self._failing = True
