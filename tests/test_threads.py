"""server.omp_threads: OpenMP threads of the server, the ASR service and their engine children."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from voicebot import asr_service
from voicebot.config import load_config
from voicebot.server import threads

CHILD = "import os, torch; print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_zero_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    threads.limit_omp_threads(0)
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_engine_children_inherit_the_cap() -> None:
    # The vLLM engine core is a child process: it must start with one OpenMP thread.
    code = (
        "import subprocess, sys; from voicebot.server.threads import limit_omp_threads; limit_omp_threads(1); "
        f"print(subprocess.run([sys.executable, '-c', {CHILD!r}], capture_output=True, text=True).stdout.strip())"
    )
    assert _run(code) == "1 1"


def test_torch_imported_before_is_resized() -> None:
    code = (
        "import torch; before = torch.get_num_threads(); from voicebot.server.threads import limit_omp_threads; "
        "limit_omp_threads(1); print(before, torch.get_num_threads())"
    )
    before, after = _run(code).split()
    assert after == "1"
    assert int(before) == (os.cpu_count() or 1)  # the default this guards against: one thread per core


def test_the_asr_service_applies_the_config_before_its_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(asr_service, "limit_omp_threads", lambda n: calls.append(f"omp {n}"))
    monkeypatch.setattr(asr_service, "limit_arenas", lambda n: calls.append(f"arenas {n}"))

    async def fake_serve(cfg: object, host: str, port: int, **kw: object) -> None:
        calls.append("engine")

    monkeypatch.setattr(asr_service, "serve_asr", fake_serve)
    cfg = load_config("configs/gpu-asr-service.yaml", ["models.offline=true"])
    asr_service.run_asr_service(cfg, "127.0.0.1", 0, pull=False)
    assert calls == ["arenas 2", "omp 1", "engine"]
