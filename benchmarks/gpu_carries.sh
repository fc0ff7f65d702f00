#!/usr/bin/env bash
# Build every folder a GPU run of benchmarks/gpu_suite.sh needs, on a CPU machine with PyPI,
# each small enough for one transfer to a lent GPU machine, and print the calls that carry them.
#
#   benchmarks/gpu_carries.sh [DEST]          DEST: an ignored folder of the repo (default .gpu)
#
# The GPU machines have no internet and no vLLM, take at most 64 MiB per call (the repo's files
# and the carried folders together) and 8 carried paths; a machine goes back 30 s after its last
# call, so the calls below must follow each other at once. Weights are never carried: the LLM and
# Whisper run with random weights of the real shape (load_format dummy), Kokoro with random weights
# (tts.kokoro_model: random). What each folder holds:
#
#   DEST/c1 c2 c3   vLLM 0.26.0 and its wheels, built by the vLLM bundle script (VLLM_BUNDLE,
#                   default ../shared/tools/vllm-gpu/build-bundle.sh); each holds device-install.sh
#   DEST/site       the wheels the server needs that the machine lacks (soxr, soundfile, piper-tts for
#                   espeak-ng's G2P, kokoro without its G2P), for its Python 3.12
#   DEST/models     qwen7b: Qwen2.5-7B-Instruct's config.json and a Qwen tokenizer (the LLM's shape);
#                   whisper-turbo: Whisper large-v3-turbo's config, features and tokenizer
#                   (gpu_whisper_files.py); smart-turn: the Smart Turn v3.2 ONNX; fwstub: the
#                   faster_whisper package's Silero VAD asset (the server's VAD), with an empty
#                   package around it; audio: the test speech (16 kHz clips the callers say)
#   DEST/tools      py-spy's wheel (a static binary): gpu_suite.sh's SUITE_SPY samples the LLM server's
#                   processes with it during a run; carried with a later call (site and models fill one)
#
# SKIP_VLLM=1 builds the other folders only (c1..c3 take ~2 minutes and 140 MB of downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu}
PY=${PYTHON:-.venv/bin/python}
VLLM_BUNDLE=${VLLM_BUNDLE:-../shared/tools/vllm-gpu/build-bundle.sh}
LIMIT=$((64 * 1024 * 1024))
mkdir -p "$DEST"
exclude=$(git rev-parse --git-path info/exclude)  # never committed, never sent with the repo's files
case "$DEST" in /*) ;; *) grep -qxF "/$DEST/" "$exclude" 2>/dev/null || echo "/$DEST/" >> "$exclude";; esac

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

if [ "${SKIP_VLLM:-0}" != 1 ] && [ ! -f "$DEST/c3/device-install.sh" ]; then
  [ -f "$VLLM_BUNDLE" ] || { echo "no vLLM bundle script at $VLLM_BUNDLE (set VLLM_BUNDLE)" >&2; exit 1; }
  bash "$VLLM_BUNDLE" "$(cd "$DEST" && pwd)"  # it works in a folder of its own: an absolute path
fi

rm -rf "$DEST/site" && mkdir -p "$DEST/site"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST/site" \
  soxr==1.0.0 soundfile==0.13.1 piper-tts==1.8.0
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/site" kokoro==0.9.4

rm -rf "$DEST/tools" && mkdir -p "$DEST/tools"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST/tools" py-spy==0.4.1

rm -rf "$DEST/models" && mkdir -p "$DEST/models/qwen7b" "$DEST/models/fwstub/faster_whisper/assets"
"$PY" - "$DEST/models" <<'EOF'
import json, shutil, sys
from pathlib import Path

from voicebot.config import ModelsConfig
from voicebot.provision import resolve_model

out = Path(sys.argv[1])
models = ModelsConfig()
# Qwen2.5-7B-Instruct's config.json (its published shape); the weights are never read (dummy).
qwen = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
(out / "qwen7b" / "config.json").write_text(json.dumps(qwen, indent=2))
tok = Path(resolve_model("bundle:qwen3-tokenizer", models))
for f in tok.iterdir():
    if f.name.startswith(("tokenizer", "special_tokens")):  # tokenizer.json holds vocab and merges
        shutil.copy(f, out / "qwen7b" / f.name)
whisper = Path(resolve_model("bundle:whisper-base", models)) / "tokenizer.json"  # multilingual
shutil.copy(whisper, out / "whisper-base-tokenizer.json")
smart = Path(resolve_model("bundle:smart-turn-v3.2", models))
shutil.copytree(smart, out / "smart-turn", ignore=shutil.ignore_patterns("voicebot-manifest.json"))
import faster_whisper
src = Path(faster_whisper.__file__).parent / "assets" / "silero_vad_v6.onnx"
shutil.copy(src, out / "fwstub" / "faster_whisper" / "assets" / src.name)
(out / "fwstub" / "faster_whisper" / "__init__.py").write_text("")  # only its asset is read
sys.path.insert(0, "tests")
from speech import load_clips
(out / "audio").mkdir()
for clip in load_clips(models):
    shutil.copy(clip.path, out / "audio" / clip.path.name)
EOF
"$PY" benchmarks/gpu_whisper_files.py --tokenizer-json "$DEST/models/whisper-base-tokenizer.json" \
  --shape large-v3-turbo --out "$DEST/models/whisper-turbo"
rm "$DEST/models/whisper-base-tokenizer.json"

size() { du -sb "$@" | awk '{s += $1} END {print s}'; }
repo=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
status=0
for d in c1 c2 c3 site models tools; do
  [ -d "$DEST/$d" ] || continue
  s=$(size "$DEST/$d")
  printf '%-8s %6.1f MiB\n' "$d" "$(echo "$s / 1048576" | bc -l)"
  if [ "$((s + repo))" -gt "$LIMIT" ]; then echo "  over the 64 MiB a call carries (with the repo's files)" >&2; status=1; fi
done
call() {  # the carry list of one call, and whether it fits
  local total=$repo list=""
  for d in "$@"; do
    [ -d "$DEST/$d" ] || { echo "(no $DEST/$d: build it first)"; return; }
    total=$((total + $(size "$DEST/$d"))); list="$list \"$DEST/$d\","
  done
  printf 'carry [%s]  (%.1f MiB with the repo)\n' "${list%,}" "$(echo "$total / 1048576" | bc -l)"
  if [ "$total" -gt "$LIMIT" ]; then echo "  over the 64 MiB a call carries" >&2; status=1; fi
}
echo
echo "The calls, back to back (the run tool's carry lists; gpu_suite.sh stage installs once all parts are in):"
echo "1. $(call c1)"
echo "   command: bash benchmarks/gpu_suite.sh stage $DEST"
echo "2. $(call c2)"
echo "   command: bash benchmarks/gpu_suite.sh stage $DEST"
echo "3. $(call c3)"
echo "   command: bash benchmarks/gpu_suite.sh stage $DEST"
echo "4. $(call site models)"
echo "   command: bash benchmarks/gpu_suite.sh run $DEST \$OUT [LEVEL ...]"
echo "(SUITE_SPY=1 runs: $(call tools), once, in any later call, e.g. with: bash benchmarks/gpu_suite.sh stage $DEST)"
exit $status
