"""``voicebot serve``'s start-up mistakes, each one clear CLI error before anything loads.

``--no-pull`` with a model not built: a CLI error, nothing built.

``voicebot serve --help``: "--no-pull  fail instead of building missing bundle models".
voicebot/server/run.py skipped only the pull before binding; the engines then resolved
``bundle:NAME`` with ``resolve_model(ref, models)`` whose ``pull`` defaults to True
(voicebot/engines/__init__.py, voicebot/engines/turn/smart_turn.py), so the server bound,
answered /healthz "loading" and downloaded and converted every missing model in the
background (1.3 GB and a 60 s GGUF conversion for the default config), found trying the
server as a new user would: ``HOME=<empty> voicebot serve --no-pull`` -> "whisper-tiny.en:
building", then the Qwen download and conversion. Here the package index is unreachable,
so nothing heavy runs either way: the test reads what the command says and how it exits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_no_pull_fails_on_a_missing_model_instead_of_building_it(tmp_path: Path) -> None:
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="2")
    cmd = [sys.executable, "-m", "voicebot.cli", "serve", "--no-pull", "--port", str(_free_port()),
           "--set", f"models.cache_dir={tmp_path / 'cache'}"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                if "building" in log.read_text(errors="replace"):
                    break
                time.sleep(0.2)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    assert "building" not in text, f"--no-pull started building a missing model:\n{text[-2000:]}"
    assert proc.returncode not in (None, 0)
    assert "voicebot models pull" in text, text[-2000:]


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "voicebot.cli", "serve", "--config", "configs/test.yaml", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_port_in_use_is_one_cli_error_before_anything_loads() -> None:
    # Found trying the server as a new user would: a second server on the same port
    # logged "listening on ...", pulled and loaded its models, then uvicorn's "address
    # already in use", and exited 3 with no voicebot error line.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = _serve("--port", str(port))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"voicebot: error: cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr[-2000:]
    assert "listening on" not in done.stderr and time.monotonic() - t0 < 30


def test_an_unreadable_api_key_file_is_one_cli_error_before_the_model_pull(tmp_path: Path) -> None:
    # It was read when the app was built, after the pull: ~70 s on an empty cache.
    done = _serve("--port", str(_free_port()), "--set", f"server.api_key_file={tmp_path / 'no-such-keys'}",
                  "--set", f"models.cache_dir={tmp_path / 'empty-cache'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "server.api_key_file: cannot read" in done.stderr, done.stderr[-2000:]
    assert "building" not in done.stderr
