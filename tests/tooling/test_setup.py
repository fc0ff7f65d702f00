"""The README's set-up commands find a usable Python on any machine (Makefile)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")


def _shim(folder: Path, name: str, target: str) -> None:
    path = folder / name
    path.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
    path.chmod(0o755)


def _make(path_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run make with PATH = ``path_dir``: the shims there, coreutils, and no Python."""
    assert MAKE, "make is needed for the README's commands"
    for tool in ("cat", "cut", "echo", "sha256sum", "rm", "touch", "id"):
        found = shutil.which(tool)
        if found and not (path_dir / tool).exists():
            (path_dir / tool).symlink_to(found)
    return subprocess.run(
        [MAKE, "-s", "-C", str(ROOT), *args],
        env={"PATH": str(path_dir), "HOME": str(path_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_makefile_takes_any_python_from_3_11(tmp_path: Path) -> None:
    # A machine with only python3.12 on PATH (here a shim to this interpreter).
    _shim(tmp_path, "python3.12", sys.executable)
    out = _make(tmp_path, "which-python")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "python3.12"


def test_makefile_skips_a_python_older_than_3_11(tmp_path: Path) -> None:
    # python3 answers the version check as 3.10 would (exit 1).
    _shim(tmp_path, "python3", f"{sys.executable} -c 'import sys; sys.exit(1)'")
    _shim(tmp_path, "python3.13", sys.executable)
    out = _make(tmp_path, "which-python")
    assert out.stdout.strip() == "python3.13"


def test_makefile_says_what_is_missing_without_python(tmp_path: Path) -> None:
    # No Python at all and no venv: the install step stops with a message, not a
    # "python3.11: command not found" from deep inside the recipe.
    out = _make(tmp_path, "install", "VENV=" + str(tmp_path / "venv"))
    assert out.returncode != 0
    assert "needs Python 3.11 or newer" in out.stderr
    assert "PYTHON=" in out.stderr
