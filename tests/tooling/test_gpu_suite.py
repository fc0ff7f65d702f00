"""benchmarks/gpu_suite.sh and gpu_carries.sh, on the CPU: the suite's dry run prints a
pipeline_gpu.py command that its own parser accepts, with the documented layout, the
levels asked for and a run folder of its own under OUT; the carries script parses."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def pipeline_gpu() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its own helpers sit beside it
    try:
        spec = importlib.util.spec_from_file_location("pipeline_gpu", ROOT / "benchmarks" / "pipeline_gpu.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def dry_run(dest: Path, out: Path, *levels: str, env: dict[str, str] | None = None) -> list[list[str]]:
    proc = subprocess.run(["bash", str(SUITE), "run", "--dry-run", str(dest), str(out), *levels],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def run_command(lines: list[list[str]]) -> list[str]:
    runs = [cmd for cmd in lines if cmd[1:3] == ["benchmarks/pipeline_gpu.py", "run"]]
    assert len(runs) == 1, lines
    return runs[0][2:]


def test_the_dry_run_prints_the_documented_layout_at_the_levels_into_a_new_folder(tmp_path: Path) -> None:
    dest, out = tmp_path / "gpu", tmp_path / "out"
    (dest / "models").mkdir(parents=True)
    lines = dry_run(dest, out, "16", "48")
    argv = run_command(lines)
    args = pipeline_gpu().build_parser().parse_args(argv)
    assert args.sessions == [16, 48]
    assert args.gpu_dummy and args.remote_llm and args.remote_asr and args.remote_tts and args.frontends == 2
    assert args.config == "configs/gpu-asr-service.yaml" and args.keep_going
    assert "tts.engine=kokoro" in args.set and "tts.kokoro_model=random" in args.set
    run_dir = Path(args.out)
    assert run_dir.parent == out and run_dir.name.startswith("run-")
    assert ["cp", "-r", f"{dest}/models/.", f"{Path.home()}/gpu-models/"] in lines  # staged first
    assert not out.exists(), "a dry run creates nothing"
    # The last run's folder is never written into again.
    run_dir.mkdir(parents=True)
    again = Path(pipeline_gpu().build_parser().parse_args(run_command(dry_run(dest, out, "16"))).out)
    assert again != run_dir and again.parent == out


def test_the_servers_admit_the_largest_level(tmp_path: Path) -> None:
    args = pipeline_gpu().build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", "64", "256", "192")))
    admitted = [int(s.split("=", 1)[1]) for s in args.set if s.startswith("server.max_sessions=")]
    assert admitted and admitted[-1] >= 256, args.set


def test_the_default_levels_and_extra_flags_reach_the_run(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, SUITE_ARGS="--set asr.partials=false", SUITE_FRONTENDS="1")
    args = pipeline_gpu().build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", env=env)))
    assert args.sessions == [16, 32, 48, 64, 96]
    assert args.frontends == 1 and "asr.partials=false" in args.set


def test_the_scripts_parse() -> None:
    for script in ("gpu_suite.sh", "gpu_carries.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
