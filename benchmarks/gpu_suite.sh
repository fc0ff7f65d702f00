#!/usr/bin/env bash
# The callers-per-GPU run of docs/gpu-results.md on a lent GPU machine, in one call per run:
# the documented layout (one `vllm serve` with the Qwen2.5-7B shape, one `voicebot asr-serve`
# with Whisper large-v3-turbo on vLLM, one `voicebot tts-serve` with Kokoro on the GPU, K
# frontends; random weights of the real shapes) driven at each level of callers by
# benchmarks/pipeline_gpu.py. Each run writes to a folder of its own, OUT/run-<UTC time>: pipeline.json
# (a row per level), pipeline.png, device.txt and details.tar.xz (level_N.json, the servers' logs).
#
#   benchmarks/gpu_suite.sh stage DEST               install what this call carried (DEST: the folder
#                                                    gpu_carries.sh built, e.g. .gpu)
#   benchmarks/gpu_suite.sh run DEST OUT [LEVEL ...] stage, then the run at these numbers of callers
#                                                    (default: 16 32 48 64 96) into OUT/run-<time>/
#   --dry-run (after the verb): print what would run, run nothing (any machine)
#
# Environment: SUITE_FRONTENDS (2), SUITE_TURNS (2), SUITE_WALL_S (480: no level starts that would
# end after it; a call may run 600 s), SUITE_ARGS (more pipeline_gpu.py flags, e.g. "--set
# asr.encoder_pad_s=1.0" or "--set asr.partials=false"), PYTHON (python3).
# What DEST holds and the calls that bring it: benchmarks/gpu_carries.sh. Staged copies live under
# $HOME (vllm-site, voicebot-site, gpu-models), so a later call on the same machine carries nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
verb=${1:?usage: gpu_suite.sh stage DEST | run DEST OUT [LEVEL ...]  [--dry-run after the verb]}
shift
DRY=0
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
DEST=${1:?DEST: the folder gpu_carries.sh built}
shift
PY=${PYTHON:-python3}
MODELS=$HOME/gpu-models

do_() {  # run, or with --dry-run print, one command
  if [ "$DRY" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

stage() {
  for c in c1 c2 c3; do
    if [ -d "$DEST/$c" ]; then do_ bash "$DEST/$c/device-install.sh" "$DEST"; fi
  done
  if [ -d "$DEST/site" ]; then
    do_ "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$HOME/voicebot-site" "$DEST"/site/*.whl
  fi
  if [ -d "$DEST/models" ]; then
    do_ mkdir -p "$MODELS"
    do_ cp -r "$DEST"/models/. "$MODELS"/
  fi
}

plugin_entry_point() {  # voicebot runs from the repo copy, not pip-installed: vLLM's spawned engine
  # processes find the windowed Whisper (vllm.general_plugins, pyproject.toml) only through a dist-info
  local d=voicebot-0.1.0.dist-info
  [ -f "$d/entry_points.txt" ] && return 0
  do_ mkdir -p "$d"
  do_ sh -c "printf 'Metadata-Version: 2.1\nName: voicebot\nVersion: 0.1.0\n' > $d/METADATA"
  do_ sh -c "printf '[vllm.general_plugins]\nvoicebot_windowed_whisper = voicebot.vllm_plugin:register\n' > $d/entry_points.txt"
}

run() {
  local out=${1:?OUT: the folder the run folders go in}
  shift
  local levels=("$@")
  [ ${#levels[@]} -gt 0 ] || levels=(16 32 48 64 96)
  # Every server admits the largest level (split over the frontends, but the services see
  # all of it), with a few slots to spare.
  local most=0 n
  for n in "${levels[@]}"; do [ "$n" -gt "$most" ] && most=$n; done
  stage
  local dir
  dir="$out/run-$(date -u +%Y%m%dT%H%M%SZ)"
  local k=1
  while [ -e "$dir" ]; do k=$((k + 1)); dir="${dir%-[0-9]}-$k"; done  # never the last run's folder
  do_ mkdir -p "$dir"
  export PYTHONPATH="$PWD:$HOME/vllm-site:$HOME/voicebot-site:$MODELS/fwstub${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  plugin_entry_point
  # shellcheck disable=SC2086  # SUITE_ARGS is a list of flags
  do_ "$PY" benchmarks/pipeline_gpu.py run --config configs/gpu-asr-service.yaml --gpu-dummy \
    --remote-llm --remote-asr --remote-tts --frontends "${SUITE_FRONTENDS:-2}" \
    --llm-memory 0.45 --whisper-memory 0.15 --llm-dir "$MODELS/qwen7b" --whisper-dir "$MODELS/whisper-turbo" \
    --audio "$MODELS"/audio/*.wav --sessions "${levels[@]}" --turns "${SUITE_TURNS:-2}" \
    --start-timeout-s 300 --keep-going --max-wall-s "${SUITE_WALL_S:-480}" \
    --set tts.engine=kokoro --set tts.kokoro_model=random --set tts.voice=af_heart --set tts.workers=2 \
    --set tts.max_batch=64 --set asr.partial_interval_ms=4000 --set "server.max_sessions=$((most + 8))" \
    --set "vad.smart_turn_model=$MODELS/smart-turn" --set models.offline=true \
    ${SUITE_ARGS:-} --out "$dir"
  do_ "$PY" benchmarks/pipeline_gpu.py plot "$dir/pipeline.json" --png "$dir/pipeline.png"
  do_ sh -c "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $dir/device.txt"
  # A call brings back 8 files of $OUT: the summary, its plot and the device stay files, the rest
  # (every turn per level, the servers' logs and commands) travels as one archive.
  do_ sh -c "cd $dir && find . -type f ! -name pipeline.json ! -name pipeline.png ! -name device.txt -printf '%P\\n' | tar -cJf details.tar.xz --remove-files -T -"
  echo "run folder: $dir"
}

case "$verb" in
  stage) stage ;;
  run) run "$@" ;;
  *) echo "unknown verb $verb: stage | run" >&2; exit 2 ;;
esac
