"""The benchmarks are scripts beside each other, not a package: a test loads one by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str, *, beside: bool = False, register: bool = False) -> ModuleType:
    """``benchmarks/NAME.py`` as a module. ``beside``: benchmarks/ is on ``sys.path`` while it
    loads (a script that imports its helpers beside it), and only then. ``register``: it is
    in ``sys.modules`` under NAME (a dataclass looks its module up while the module loads)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    saved = list(sys.path)
    if beside:
        sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
