"""What the worker processes of one server share (``server.workers``).

A server with K workers is K processes on one port (voicebot/server/workers.py). Each
one admits calls against the whole server's ``server.max_sessions`` and
``server.max_sessions_per_client``, so the counts live in shared memory: one row per
worker that only that worker writes, summed by whoever admits, under one lock so that
two workers never both take the last slot. A worker that dies has its row zeroed by
the parent. The same table holds each worker's pid and status for ``/healthz``.

A server of one process has a table of one row: the same code, no other process.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# A worker's row: its pid, its open sessions, its status (STATUSES' index), the connections
# it holds open from the shared socket (voicebot/server/balance.py).
_PID, _SESSIONS, _STATUS, _CONNECTIONS = range(4)
_FIELDS = 4
# Per-client counts are kept in buckets of the address's CRC: two addresses that share a
# bucket count against each other's limit (a refusal too many, never an admission too
# many); with 65,536 buckets that takes hundreds of distinct callers at the limit.
CLIENT_BUCKETS = 1 << 16

STATUSES = ("starting", "loading", "ok", "unhealthy", "draining", "overloaded", "failed", "stopped")


@dataclass(frozen=True)
class Siblings:
    """This worker's place among the server's workers, and the counts they share."""

    index: int  # this worker's (0 .. count-1); -1 in the parent
    count: int
    # The server's private folder (sockets, shared secrets, metrics); None for one process.
    runtime_dir: Path | None
    started_at: float  # the server's start (Unix time): what is older in record_dir is from before
    _table: Any  # RawArray of int64: count rows of _FIELDS
    _clients: Any  # RawArray of int32: count rows of CLIENT_BUCKETS
    _lock: Any

    @classmethod
    def alone(cls) -> Siblings:
        """A server of one process: plain memory and a thread lock (no semaphore, no
        resource-tracker process for a server, or a test, that shares nothing)."""
        return cls(0, 1, None, math.inf, (ctypes.c_int64 * _FIELDS)(), (ctypes.c_int32 * CLIENT_BUCKETS)(),
                   threading.Lock())

    @classmethod
    def create(cls, count: int, runtime_dir: Path | None) -> Siblings:
        """The parent's, for ``count`` workers (:meth:`worker` gives each its view)."""
        # spawn's primitives: the workers are spawned (a fork would copy the parent's
        # threads' locks mid-state), and these are handed to them as arguments.
        ctx = multiprocessing.get_context("spawn")
        return cls(-1, count, runtime_dir, time.time(), ctx.RawArray("q", count * _FIELDS),
                   ctx.RawArray("i", count * CLIENT_BUCKETS), ctx.Lock())

    def worker(self, index: int) -> Siblings:
        """The view of worker ``index`` (the parent hands it to the worker it spawns)."""
        if not 0 <= index < self.count:
            raise ValueError(f"worker {index} of {self.count}")
        return replace(self, index=index)

    # ------------------------------------------------------------------ admission
    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Held from the admission check to :meth:`opened`: no other worker admits between."""
        with self._lock:
            yield

    def sessions_total(self) -> int:
        return sum(self._table[w * _FIELDS + _SESSIONS] for w in range(self.count))

    def client_sessions(self, client: str) -> int:
        bucket = _bucket(client)
        return sum(self._clients[w * CLIENT_BUCKETS + bucket] for w in range(self.count))

    def opened(self, client: str | None) -> None:
        self._add(client, 1)

    def closed(self, client: str | None) -> None:
        self._add(client, -1)

    def _add(self, client: str | None, delta: int) -> None:
        # No lock (an opening holds admitting()'s already): only this worker writes its
        # row, so a sum read meanwhile can only count a closing call still open.
        self._table[self.index * _FIELDS + _SESSIONS] += delta
        if client is not None:
            self._clients[self.index * CLIENT_BUCKETS + _bucket(client)] += delta

    # ------------------------------------------------------------------ balance
    def set_connections(self, count: int) -> None:
        """The connections this worker holds open (a call's, a handshake's, a request's)."""
        self._table[self.index * _FIELDS + _CONNECTIONS] = count

    def load(self, worker: int) -> int:
        """What a worker carries, for the balance: its open connections, or its sessions
        where those are more (a WebRTC call holds no connection once it is set up)."""
        row = worker * _FIELDS
        return int(max(self._table[row + _SESSIONS], self._table[row + _CONNECTIONS]))

    def least_loaded(self) -> int | None:
        """The least load of the workers that serve (status ok), None if none does."""
        ok = STATUSES.index("ok")
        loads = [self.load(w) for w in range(self.count) if self._table[w * _FIELDS + _STATUS] == ok]
        return min(loads) if loads else None

    # ------------------------------------------------------------------ status
    def set_status(self, status: str, pid: int | None = None) -> None:
        row = self.index * _FIELDS
        self._table[row + _STATUS] = STATUSES.index(status)
        if pid is not None:
            self._table[row + _PID] = pid

    def workers(self) -> list[dict[str, Any]]:
        """Every worker's pid, status and open sessions (the admin view of ``/healthz``)."""
        rows = []
        for w in range(self.count):
            row = w * _FIELDS
            rows.append({"worker": w, "pid": self._table[row + _PID] or None,
                         "status": STATUSES[self._table[row + _STATUS]],
                         "active_sessions": self._table[row + _SESSIONS]})
        return rows

    def pids(self) -> dict[int, int]:
        """Worker index -> pid, for the workers that have one."""
        return {w: pid for w in range(self.count) if (pid := self._table[w * _FIELDS + _PID])}

    def reset(self, index: int, status: str = "starting") -> None:
        """The parent, once worker ``index`` exited: its calls are gone, so are its counts."""
        with self._lock:
            row = index * _FIELDS
            self._table[row + _PID] = 0
            self._table[row + _SESSIONS] = 0
            self._table[row + _CONNECTIONS] = 0
            self._table[row + _STATUS] = STATUSES.index(status)
            start = index * CLIENT_BUCKETS
            self._clients[start:start + CLIENT_BUCKETS] = [0] * CLIENT_BUCKETS

    # ------------------------------------------------------------------ routing
    def socket_path(self, index: int) -> Path:
        """Worker ``index``'s Unix socket: a sibling forwards it what only that worker
        holds (a WebRTC call's hang-up)."""
        if self.runtime_dir is None:
            raise RuntimeError("a server of one process has no sibling sockets")
        return self.runtime_dir / f"worker-{index}.sock"


def _bucket(client: str) -> int:
    # CRC-32, not hash(): every worker must put one address in the same bucket, and
    # Python salts str hashes per process.
    return zlib.crc32(client.encode("utf-8", "surrogatepass")) % CLIENT_BUCKETS
