"""Building bundle entries into the model store (`pull`): idempotent and interruptible."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from voicebot.config import ModelsConfig
from voicebot.provision.assemble import assemble_file
from voicebot.provision.bundle import Bundle, Entry, load_bundle
from voicebot.provision.fetch import Downloads
from voicebot.provision.store import ModelStore

LogFn = Callable[[str], object]


def cache_root(models: ModelsConfig) -> Path:
    return Path(models.cache_dir).expanduser()


def model_store(models: ModelsConfig) -> ModelStore:
    return ModelStore(cache_root(models) / "models")


def downloads_for(models: ModelsConfig) -> Downloads:
    return Downloads(cache_root(models) / "downloads")


def _build(entry: Entry, downloads: Downloads, out: Path) -> dict[str, str]:
    """Fill ``out`` with the entry's files; returns the pinned hashes of kept files."""
    # Temporaries (the GGUF) go in a subfolder that is removed before publishing.
    scratch = out / ".inputs"
    scratch.mkdir()
    pinned: dict[str, str] = {}
    for spec in entry.files:
        sha = assemble_file(spec, downloads, scratch if spec.temporary else out)
        if not spec.temporary:
            pinned[spec.name] = sha
    if entry.build == "gguf":
        from voicebot.provision.convert import gguf_to_hf

        gguf_to_hf(scratch / entry.convert["gguf"], out, entry.convert, entry.generation)
    elif entry.build == "random":
        from voicebot.provision.convert import random_model

        random_model(out, entry.model, entry.generation, entry.seed)
    shutil.rmtree(scratch)
    return pinned


def pull_entry(entry: Entry, store: ModelStore, downloads: Downloads, *,
               log: LogFn = print, verify: bool = True) -> Path:
    """Make sure ``entry`` is built and intact; build it if not. Returns its directory."""
    final = store.path(entry.name)
    problem = store.problem(entry, full=verify)
    if problem is None:
        return final
    with store.lock(entry.name, log):
        # Another process may have finished it while we waited for the lock.
        if store.problem(entry, full=False) is None and problem == "not built":
            return final
        store.clean_leftovers(entry.name)
        if problem != "not built":
            log(f"{entry.name}: {problem}; rebuilding")
        log(f"{entry.name}: building ({entry.build}, {len(entry.packages)} package(s))")
        t0 = time.monotonic()
        tmp = store.staging(entry.name)
        try:
            pinned = _build(entry, downloads, tmp)
            final = store.publish(entry, tmp, pinned)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when published
        log(f"{entry.name}: ready in {time.monotonic() - t0:.1f} s: {final}")
        return final


def pull(names: list[str], models: ModelsConfig, *, log: LogFn = print,
         bundle: Bundle | None = None, downloads: Downloads | None = None,
         verify: bool = True) -> dict[str, Path]:
    """Build (or verify) the named bundle entries under ``<cache_dir>/models``.

    Idempotent: an intact directory is kept; ``verify`` re-hashes its files against the
    manifest (otherwise only files whose size or mtime changed are re-hashed). A missing
    package or a hash mismatch raises :class:`~voicebot.errors.BundleError` naming the
    package and the fix. ``bundle`` and ``downloads`` default to ``models/bundle.toml``
    and ``<cache_dir>/downloads``; tests pass their own.
    """
    bundle = bundle or load_bundle()
    entries = [bundle.get(n) for n in dict.fromkeys(names)]  # unknown names fail first
    store = model_store(models)
    downloads = downloads or downloads_for(models)
    return {e.name: pull_entry(e, store, downloads, log=log, verify=verify) for e in entries}
