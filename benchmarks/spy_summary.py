"""Where a service's threads were, over the py-spy dumps of a GPU suite run.

    python benchmarks/spy_summary.py OUT/run-*/tts_server.spy.txt [--top 12] [--json OUT.json]

``gpu_suite.sh`` with ``SUITE_SPY=llm|asr|tts`` dumps the service's Python stacks every
~0.25 s while a run's levels go (``spy_start``), into ``<service>_server.spy.txt``: blocks of
``=== TIME pid N`` followed by ``py-spy dump``'s text. This reads them and, per kind of
thread (a name without its pool number: ``tts-kokoro_0`` and ``tts-kokoro_1`` are
``tts-kokoro``), says in how many dumps it was active, the functions it was in (the
innermost frame) and the project's own line it was under (the innermost frame in
``voicebot/`` or ``benchmarks/``), each as a share of that thread kind's samples. A forward
thread that waits in a host-to-device copy shows as the line of that copy; one that waits
for the GIL shows where it stood when it let it go.

Prints a table per thread kind; ``--json`` writes the same as ``results`` in the benchmarks'
one JSON shape.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, write_result  # benchmarks/, beside this file

_DUMP = re.compile(r"^=== (\S+) pid (\d+)")
_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?')
_FRAME = re.compile(r"^\s+(.+?) \((.+):(\d+)\)\s*$")
_POOL_NUMBER = re.compile(r"[_-]\d+$")
OWN = ("voicebot/", "benchmarks/")


@dataclass
class ThreadKind:
    samples: int = 0
    active: int = 0
    innermost: collections.Counter[str] = field(default_factory=collections.Counter)
    own_line: collections.Counter[str] = field(default_factory=collections.Counter)


def kind_of(name: str | None, tid: str) -> str:
    return _POOL_NUMBER.sub("", name) if name else f"thread {tid}"


def summarize(text: str) -> dict[str, Any]:
    """The thread kinds of every dump in ``text`` (the suite's spy file)."""
    kinds: dict[str, ThreadKind] = collections.defaultdict(ThreadKind)
    # A thread's name as any dump gave it: py-spy leaves it out now and then.
    names = {m.group(1): m.group(3) for line in text.splitlines() if (m := _THREAD.match(line)) and m.group(3)}
    dumps = 0
    current: ThreadKind | None = None
    frames: list[str] = []
    own: str | None = None

    def close() -> None:
        nonlocal current, frames, own
        if current is not None:
            current.innermost[frames[0] if frames else "(no frame)"] += 1
            current.own_line[own or "(none of ours)"] += 1
        current, frames, own = None, [], None

    for line in text.splitlines():
        if _DUMP.match(line):
            close()
            dumps += 1
            continue
        m = _THREAD.match(line)
        if m:
            close()
            tid, state, name = m.groups()
            current = kinds[kind_of(name or names.get(tid), tid)]
            current.samples += 1
            current.active += "active" in state
            continue
        f = _FRAME.match(line)
        if f and current is not None:
            func, path, lineno = f.groups()
            frames.append(f"{func} ({path}:{lineno})")
            start = min((i for p in OWN if (i := path.find(p)) >= 0), default=-1)
            if own is None and start >= 0:
                own = f"{func} ({path[start:]}:{lineno})"
        elif not line.strip() or not line.startswith(" "):
            close()
    close()
    return {"dumps": dumps, "threads": {
        name: {"samples": k.samples, "active_pct": round(100 * k.active / k.samples, 1) if k.samples else 0.0,
               "innermost": _shares(k.innermost, k.samples), "own_line": _shares(k.own_line, k.samples)}
        for name, k in sorted(kinds.items(), key=lambda kv: -kv[1].samples)}}


def _shares(counts: collections.Counter[str], total: int) -> list[list[Any]]:
    return [[where, round(100 * n / total, 1)] for where, n in counts.most_common()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=JSON_EPILOG)
    p.add_argument("spy", type=Path, help="a <service>_server.spy.txt of a run's details.tar.xz")
    p.add_argument("--top", type=int, default=12, help="places shown per thread kind")
    p.add_argument("--thread", default=None, help="only thread kinds whose name starts with this")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = summarize(args.spy.read_text(errors="replace"))
    if args.thread:
        out["threads"] = {k: v for k, v in out["threads"].items() if k.startswith(args.thread)}
    print(f"{out['dumps']} dumps of {args.spy}")
    for name, t in out["threads"].items():
        print(f"\n{name}: {t['samples']} samples, active in {t['active_pct']}%")
        print("  innermost frame:")
        for where, pct in t["innermost"][: args.top]:
            print(f"    {pct:5.1f}%  {where}")
        print("  our innermost line:")
        for where, pct in t["own_line"][: args.top]:
            print(f"    {pct:5.1f}%  {where}")
    write_result(args.json, "spy_summary", args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
