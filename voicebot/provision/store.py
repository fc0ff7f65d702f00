"""The on-disk store of built model directories: ``<cache>/models/<NAME>``.

A directory is complete when it holds ``voicebot-manifest.json`` (written last), and it
only ever appears under its final name by ``os.rename`` of a finished temporary
sibling, so an interrupted build leaves at most a ``.NAME.tmp-*`` folder that the next
build removes. Builds of one name are serialised by an advisory ``flock`` (POSIX; the
server targets Linux), which is also what makes removing leftovers safe.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from voicebot.provision.bundle import Entry
from voicebot.provision.fetch import sha256_file

log = logging.getLogger(__name__)

MANIFEST = "voicebot-manifest.json"


def _walk(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            yield p


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        return self.root / name

    def manifest(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path(name) / MANIFEST).read_text())
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None

    def problem(self, entry: Entry, *, full: bool) -> str | None:
        """Why the built directory cannot be used as is (None: it can).

        ``full`` re-hashes every file; otherwise a file is re-hashed only when its size
        or mtime differs from the manifest (cheap enough for every start-up).
        """
        man = self.manifest(entry.name)
        if man is None:
            return "not built"
        if man.get("recipe") != entry.recipe_hash:
            return "built from an older recipe"
        root = self.path(entry.name)
        for rel, info in man.get("files", {}).items():
            p = root / rel
            try:
                st = p.stat()
            except FileNotFoundError:
                return f"{rel} is missing"
            if st.st_size != info["size"]:
                return f"{rel} changed size since it was built"
            if (full or st.st_mtime_ns != info["mtime_ns"]) and sha256_file(p) != info["sha256"]:
                return f"{rel} changed since it was built (sha256 differs)"
        return None

    @contextmanager
    def lock(self, name: str, log_line: Any = None) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f".{name}.lock").open("a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if log_line is not None:
                    log_line(f"{name}: another process is building it; waiting")
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def clean_leftovers(self, name: str) -> list[Path]:
        """Remove temporaries of interrupted builds. Call with the name's lock held."""
        gone = [*self.root.glob(f".{name}.tmp-*"), *self.root.glob(f".{name}.old-*")]
        for p in gone:
            log.info("removing leftover of an interrupted build: %s", p)
            shutil.rmtree(p, ignore_errors=True)
        return gone

    def staging(self, name: str) -> Path:
        """A fresh temporary sibling of the final directory (same filesystem: rename works)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=self.root))

    def publish(self, entry: Entry, tmp: Path, known: dict[str, str]) -> Path:
        """Write the manifest into ``tmp`` and move it into place, replacing a stale build.

        ``known`` maps file names to hashes already computed while assembling them.
        """
        files: dict[str, dict[str, Any]] = {}
        for p in _walk(tmp):
            rel = p.relative_to(tmp).as_posix()
            st = p.stat()
            files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                          "sha256": known.get(rel) or sha256_file(p), "pinned": rel in known}
        man = {"name": entry.name, "recipe": entry.recipe_hash, "built": time.time(),
               "versions": _versions(entry), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(man, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        final = self.path(entry.name)
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{entry.name}.old-", dir=self.root))
            os.rename(final, old / "dir")
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final


def _versions(entry: Entry) -> dict[str, str]:
    # Conversion outputs depend on these; recorded to explain a hash that differs
    # between two machines.
    if entry.build == "files":
        return {}
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "transformers", "gguf", "safetensors")}
