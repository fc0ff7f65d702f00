"""The last few hundred pieces of a shared engine's or service's work, for its stats.

A batched engine (the streaming FastConformer's steps, Kokoro's forwards, its clauses'
waits) and the TTS service (its clauses' first audio) report their recent times as p50 /
p95 over a bounded window, so a burst shows while it lasts and a long run keeps no history.
Nearest rank over the window, in ms.

``add`` may run on a worker thread while the event loop reads ``stats``: a deque's append
and copy are single C calls under the GIL, so no lock.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence


def quantile_ms(ordered_s: Sequence[float], q: float, digits: int = 1) -> float:
    """The ``q`` quantile (nearest rank) of seconds sorted ascending, in ms."""
    return round(ordered_s[min(len(ordered_s) - 1, int(q * len(ordered_s)))] * 1000, digits)


def _percentiles(name: str, seconds: Iterable[float], digits: int) -> dict[str, float]:
    ordered = sorted(seconds)
    return {f"{name}_ms_p50": quantile_ms(ordered, 0.5, digits), f"{name}_ms_p95": quantile_ms(ordered, 0.95, digits)}


class RecentTimes:
    """The last ``size`` durations of one kind (a clause's wait, a forward's phase)."""

    def __init__(self, size: int) -> None:
        self._seconds: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._seconds.append(seconds)

    def stats(self, name: str, digits: int = 1) -> dict[str, float]:
        """``NAME_ms_p50`` and ``NAME_ms_p95``; empty before the first."""
        seconds = self._seconds.copy()
        return _percentiles(name, seconds, digits) if seconds else {}


class RecentWork:
    """The last ``size`` units of work (a batched step, a forward): their seconds and rows."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[tuple[float, int]] = collections.deque(maxlen=size)

    def add(self, seconds: float, rows: int) -> None:
        self._items.append((seconds, rows))

    def stats(self, name: str, digits: int = 1) -> dict[str, float]:
        """``NAME_ms_p50``, ``NAME_ms_p95`` and ``NAME_rows_mean``; empty before the first."""
        items = self._items.copy()
        if not items:
            return {}
        return {**_percentiles(name, [s for s, _ in items], digits),
                f"{name}_rows_mean": round(sum(n for _, n in items) / len(items), 1)}
