"""benchmarks/llm_client.py end to end at its smallest: the stand-in tier in its own process,
the frontend's real remote LLM client asking for a few replies at once, the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_client_benchmark_measures_every_reply_of_every_level(tmp_path: Path) -> None:
    out = tmp_path / "llm_client.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "llm_client.py"), "--sessions", "2", "5", "--rounds", "2",
         "--steps", "3", "--step-ms", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    levels = json.loads(out.read_text())["results"]["levels"]
    assert [(lv["sessions"], lv["replies"]) for lv in levels] == [(2, 4), (5, 10)]
    for lv in levels:
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p95"] < 10_000
        assert lv["client_cpu_ms_per_reply"] > 0
