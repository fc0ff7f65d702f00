"""benchmarks/spy_summary.py: where a service's threads were over a GPU run's py-spy dumps,
read from dumps as the suite writes them (py-spy 0.4's text, taken of tts_service_burst.py's
service on this machine, cut short)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCHMARKS, load

DUMPS = """\
=== 12:48:06.033073315 pid 17990
Process 17990: /work/main/.venv/bin/python /work/main/benchmarks/tts_service_burst.py serve --switch-ms 5.0
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 17990 (idle): "MainThread"
    EpollSelector.select (selectors.py:468)
    BaseEventLoop._run_once (asyncio/base_events.py:1884)
Thread 17998 (idle): "tts-kokoro_0"
    standin_runner.<locals>.run (tts_service_burst.py:66)
    KokoroBatcher._work (voicebot/engines/tts/kokoro_batch.py:265)
    _WorkItem.run (concurrent/futures/thread.py:58)
Thread 17999 (active+gil): "tts-kokoro_1"
    Tensor.to (torch/_tensor.py:1)
    tokens (voicebot/engines/tts/kokoro_model.py:441)
    BucketedEncoder.encode (voicebot/engines/tts/kokoro_graphs.py:240)
=== 12:48:06.255009948 pid 17990
Error: Failed to copy PyCodeObject
=== 12:48:06.512009948 pid 17990
Process 17990: /work/main/.venv/bin/python /work/main/benchmarks/tts_service_burst.py serve --switch-ms 5.0
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 17990 (active+gil)
    EspeakG2P.phonemes (voicebot/engines/tts/kokoro.py:71)
    EspeakG2P.ids (voicebot/engines/tts/kokoro.py:80)
Thread 17998 (active): "tts-kokoro_0"
    Tensor.to (torch/_tensor.py:1)
    tokens (voicebot/engines/tts/kokoro_model.py:441)
Thread 17999 (idle): "tts-kokoro_1"
    standin_runner.<locals>.run (tts_service_burst.py:66)
    KokoroBatcher._work (voicebot/engines/tts/kokoro_batch.py:265)
"""


def test_each_kind_of_thread_says_where_it_was_and_under_which_of_our_lines() -> None:
    out = load("spy_summary", beside=True, register=True).summarize(DUMPS)
    assert out["dumps"] == 3
    assert list(out["threads"]) == ["tts-kokoro", "MainThread"]  # the pool's threads as one kind, most samples first
    kokoro = out["threads"]["tts-kokoro"]
    assert kokoro["samples"] == 4 and kokoro["active_pct"] == 50.0
    assert kokoro["innermost"] == [["standin_runner.<locals>.run (tts_service_burst.py:66)", 50.0],
                                   ["Tensor.to (torch/_tensor.py:1)", 50.0]]
    assert kokoro["own_line"] == [["KokoroBatcher._work (voicebot/engines/tts/kokoro_batch.py:265)", 50.0],
                                  ["tokens (voicebot/engines/tts/kokoro_model.py:441)", 50.0]]
    main = out["threads"]["MainThread"]  # named in one dump, not in the other: the same thread
    assert main["samples"] == 2 and main["active_pct"] == 50.0
    assert main["own_line"] == [["(none of ours)", 50.0], ["EspeakG2P.phonemes (voicebot/engines/tts/kokoro.py:71)", 50.0]]


def test_the_command_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    spy = tmp_path / "tts_server.spy.txt"
    spy.write_text(DUMPS)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "spy_summary.py"), str(spy), "--thread", "tts",
                           "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tts-kokoro: 4 samples, active in 50.0%" in proc.stdout and "MainThread" not in proc.stdout
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["benchmark"] == "spy_summary" and list(doc["results"]["threads"]) == ["tts-kokoro"]
