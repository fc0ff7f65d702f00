"""benchmarks/tts_service_burst.py end to end, tiny: the real TTS service in a process of its
own over the stand-in forward, a burst of replies, and the figures it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCHMARKS


def test_a_burst_is_measured_clause_by_clause_with_the_services_own_figures(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "tts_service_burst.py"), "--replies", "6", "--connections", "2",
         "--switch-ms", "5", "0.5", "--bursts", "2", "--ops", "20", "--gpu-ms", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    levels = json.loads(out.read_text())["results"]["levels"]
    assert [lv["switch_ms"] for lv in levels] == [5.0, 0.5]
    for lv in levels:
        assert len(lv["bursts"]) == 2
        for row in lv["bursts"]:
            firsts = row["first_audio_ms"]
            assert set(firsts) == {"clause_1", "clause_2", "clause_3"}
            assert all(f["p50"] is not None and f["p50"] > 0 for f in firsts.values()), firsts
            stats = row["stats"]
            # Every clause ran through the service and its stand-in forwards, timed as Kokoro's are.
            assert stats["failed"] == 0 and stats["encode_ms_p95"] > 0 and stats["forward_rows_mean"] >= 1
            assert 0 <= stats["late"] <= 12  # this burst's later clauses, not the service's life's
            assert row["service_cpu_s"] > 0
        assert lv["bursts"][1]["stats"]["clauses"] == 2 * 18  # the service's count is for its life
