"""Does a process started in its own session get a different share of the CPU?

    python benchmarks/autogroup_share.py        # ~10 s, loads every core: take the lock

tests/llm_tier.py starts ``vllm serve`` with ``start_new_session=True`` (so its process
group can be killed as one). With ``kernel.sched_autogroup_enabled = 1`` a new session is
a scheduling group of its own, and CFS shares the cores between groups before threads:
a busy server then gets a full core however many threads the frontend runs. This runs
4 busy "frontend" processes in this session against 1 busy "server" process, first in
this session, then in its own, and prints the cores each side got
(docs/benchmarks.md, remote LLM tier).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SPIN = [sys.executable, "-c", "while True: pass"]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def share(new_session: bool, seconds: float = 4.0) -> tuple[float, float]:
    front = [subprocess.Popen(SPIN) for _ in range(4)]
    server = subprocess.Popen(SPIN, start_new_session=new_session)
    procs = [*front, server]
    try:
        time.sleep(0.5)
        c0, t0 = {p.pid: cpu_s(p.pid) for p in procs}, time.monotonic()
        time.sleep(seconds)
        c1, dt = {p.pid: cpu_s(p.pid) for p in procs}, time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return sum(c1[p.pid] - c0[p.pid] for p in front) / dt, (c1[server.pid] - c0[server.pid]) / dt


def main() -> int:
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    print("sched_autogroup_enabled:", autogroup.read_text().strip() if autogroup.exists() else "n/a")
    for new_session in (False, True):
        front, server = share(new_session)
        print(f"server in its own session: {new_session!s:5}  frontend (4 procs) {front:.2f} cores, "
              f"server (1 proc) {server:.2f} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
