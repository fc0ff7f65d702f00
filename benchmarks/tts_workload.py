"""The TTS-at-scale workload of gpu_tts.py (Piper) and gpu_kokoro.py (Kokoro).

Standard library only: gpu_kokoro.py runs on a bare GPU machine, which has no pydantic
(voicebot.config) until the vLLM bundle is staged.

A caller hears a reply clause by clause in real time (a short first clause, then
``args.sentences`` sentences), then speaks for ``args.listen_s`` seconds, and again until
the scenario ends. First audio = the first clause's synthesis including queueing; a
reply stalls when playback waits for its next chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from bench_util import pct, summarise

FIRST = [
    "Sure, let me check that.", "The next train leaves at ten.", "Yes, bicycles are allowed.",
    "I'm sorry about the delay.", "That ticket costs twelve pounds.", "Platform four, in five minutes.",
]
REST = [
    "It stops at every station on the coast line and arrives a little after eleven in the morning.",
    "If your train was more than thirty minutes late, you can claim half of the single fare back.",
    "Folding bicycles travel free at any time, but full-size bikes need a free reservation.",
    "You can change an advance ticket before departure for a fee of ten pounds plus any difference.",
    "Staff at the station can help you board if you book assistance two hours ahead.",
    "Is there anything else I can help you with today?",
]

# speak(clause, ahead_s): the clause's audio chunks; ahead_s = seconds until playback
# reaches this clause (None for a reply's first clause: it is due now).
Speak = Callable[[str, "float | None"], AsyncIterator[Any]]


class Stats:
    def __init__(self) -> None:
        self.first_audio: list[float] = []
        self.stall: list[float] = []  # per reply, seconds of playback lost
        self.synth_rtf: list[float] = []  # per reply: wall from request to last audio / audio length
        self.audio_s = 0.0
        self.replies = 0
        self.errors: list[str] = []

    def report(self, sessions: int, wall: float, cpu_s: float, stall_tolerance_s: float, cut: int,
               **extra: Any) -> dict[str, Any]:
        """A scenario's JSON row: the callers' side, then ``extra`` (the engine's own figures)."""
        stalled = [s for s in self.stall if s > stall_tolerance_s]
        return {
            "sessions": sessions,
            "wall_s": round(wall, 1),
            "replies": self.replies,
            "replies_measured": len(self.first_audio),
            "first_audio_ms": summarise(self.first_audio),
            "stall_ms": summarise(self.stall),
            "replies_stalled": len(stalled),
            "stalled_fraction": round(len(stalled) / len(self.stall), 4) if self.stall else None,
            # Reply synthesis wall time over its audio length (< 1: faster than real time).
            "synth_wall_over_audio_p50_p95": [round(pct(self.synth_rtf, 50) or 0, 3),
                                              round(pct(self.synth_rtf, 95) or 0, 3)],
            "audio_s_per_wall_s": round(self.audio_s / wall, 2),
            "process_cpu": round(cpu_s / wall, 2),
            **extra,
            "errors": self.errors[:10],
            "n_errors": len(self.errors),
            "sessions_cut": cut,
        }


async def caller(speak: Speak, rate: int, args: argparse.Namespace, st: Stats, t_start: float, t_end: float,
                 rng: random.Random) -> None:
    """One caller until ``t_end``; ``rng`` picks the replies (and may be shared with ``speak``)."""
    await asyncio.sleep(rng.uniform(0, args.listen_s[1]))
    while time.monotonic() < t_end:
        clauses = [rng.choice(FIRST)] + rng.sample(REST, args.sentences)
        t0 = time.monotonic()
        play_start: float | None = None
        audio_pos = stall = 0.0
        first = None
        try:
            for clause in clauses:
                ahead = None if play_start is None else max(0.0, play_start + audio_pos + stall - time.monotonic())
                async for chunk in speak(clause, ahead):
                    now = time.monotonic()
                    if play_start is None:
                        play_start, first = now, now - t0
                    else:
                        due = play_start + audio_pos + stall  # when playback reaches this chunk
                        if now > due:
                            stall += now - due
                    audio_pos += chunk.size / rate
        except Exception as exc:  # noqa: BLE001
            st.errors.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(1.0)
            continue
        synth_wall = time.monotonic() - t0
        if t0 - t_start >= args.warmup_s and first is not None:
            st.first_audio.append(first)
            st.stall.append(stall)
            st.synth_rtf.append(synth_wall / audio_pos if audio_pos else 0.0)
        st.audio_s += audio_pos
        st.replies += 1
        # Play out what is left, then the caller speaks.
        end_of_playback = (play_start or t0) + audio_pos + stall
        wait = max(0.0, end_of_playback - time.monotonic()) + rng.uniform(*args.listen_s)
        if time.monotonic() + wait >= t_end:
            return
        await asyncio.sleep(wait)


# A table column: (heading, width, the scenario's key or a function of the scenario).
Column = tuple[str, int, "str | Callable[[dict[str, Any]], object]"]
FIRST_AUDIO: Column = (
    "first audio p50/p95/p99 ms", 29, lambda r: "/".join(str(r["first_audio_ms"].get(k)) for k in ("p50", "p95", "p99"))
)


def scenario_table(scenarios: list[dict[str, Any]], columns: list[Column]) -> str:
    """One row per scenario, right-aligned under the headings."""
    head = "".join(f"{name:>{width}}" for name, width, _ in columns)
    lines = [head, "-" * len(head)]
    for r in scenarios:
        cells = (value(r) if callable(value) else r[value] for _, _, value in columns)
        lines.append("".join(f"{cell!s:>{width}}" for cell, (_, width, _) in zip(cells, columns, strict=True)))
    return "\n".join(lines)
