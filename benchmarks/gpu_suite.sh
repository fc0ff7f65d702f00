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
#   benchmarks/gpu_suite.sh services DEST SVC        stage, then start the shared services detached into
#                                                    SVC (the LLM, then the ASR service, then the TTS
#                                                    service, each once the last is up; they outlive the
#                                                    call), for a later `run` with SUITE_SVC=SVC
#   benchmarks/gpu_suite.sh llm DEST SVC             start SVC's LLM server again (the one running is stopped) with
#                                                    this call's SUITE_* flags, the ASR and TTS services kept
#   benchmarks/gpu_suite.sh tts DEST SVC             the same for SVC's TTS service (e.g. SUITE_ARGS="--set tts.max_batch=128")
#   benchmarks/gpu_suite.sh stop DEST SVC            stop every service SVC records (and the MPS daemon
#                                                    SUITE_MPS started), for `services` again on the machine
#   benchmarks/gpu_suite.sh py DEST SCRIPT [ARG ...] a benchmark script (e.g. benchmarks/gpu_kokoro.py) with
#                                                    the packages `stage` installed on its path, as the runs have
#   --dry-run (after the verb): print what would run, run nothing (any machine)
#
# Environment: SUITE_FRONTENDS (2), SUITE_WORKERS (instead: ONE frontend of that many workers on one
# port, server.workers), SUITE_TURNS (2), SUITE_WARM (0: N, one unmeasured level of N
# callers x 1 turn before the levels, so that fresh services' first bursts are no level's), SUITE_WALL_S (480: no level starts that would
# end after it; a call may run 600 s), SUITE_ARGS (more pipeline_gpu.py flags, e.g. "--set
# asr.encoder_pad_s=1.0" or "--set asr.partials=false"), PYTHON (python3),
# SUITE_ASR (whisper: one shared Whisper-on-vLLM service; fastconformer: each frontend's own
# streaming FastConformer on the GPU, random weights of the real shape built on the machine, no
# ASR service; fastconformer-service: that FastConformer in one shared ASR service holding every
# frontend's streams), SUITE_FC_GRAPHS (1: the FastConformer's step in CUDA graphs), SUITE_SVC (a folder `services` started them into: `run` uses those services),
# SUITE_MAX (the largest level the services admit, for `services`: 256), SUITE_LLM_API_SERVERS (1: the
# LLM server's HTTP front processes, `vllm serve --api-server-count`, for `services`, `llm` and `run`),
# SUITE_LLM_STREAM_INTERVAL (1: tokens per streamed chunk after the first, `vllm serve --stream-interval`).
# SUITE_SPY (0; 1 or llm, asr, tts: sample that service of SUITE_SVC with py-spy during `run`, spy_start below).
# SUITE_TTS_GPU, SUITE_ASR_GPU (unset: the first GPU; I: that service alone on GPU I, e.g. 1 on
# an nvidia-h200-x2 machine, for `services`, `tts` and `run`; the LLM server keeps GPU 0).
# SUITE_TTS_SERVICES (1; N: `services` starts N TTS services, the Kth on the Kth GPU of
# SUITE_TTS_GPU if it names several, e.g. "0 1", and `run`'s frontends send each clause to the
# least loaded, tts.remote.urls; the `tts` verb restarts the first).
# SUITE_MPS (0; 1: `services` starts NVIDIA's Multi-Process Service daemon first, so that the
# services' kernels share the GPU at once instead of taking turns in time slices; mps_start below).
# What DEST holds and the calls that bring it: benchmarks/gpu_carries.sh. Staged copies live under
# $HOME (vllm-site, voicebot-site, gpu-models), so a later call on the same machine carries nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
verb=${1:?usage: gpu_suite.sh stage DEST | run DEST OUT [LEVEL ...] | services DEST SVC | llm DEST SVC | tts DEST SVC | stop DEST SVC | py DEST SCRIPT [ARG ...]  [--dry-run after the verb]}
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
  if [ -d "$DEST/tools" ]; then  # py-spy, for SUITE_SPY
    do_ "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$HOME/tools-site" "$DEST"/tools/*.whl
  fi
}

# SUITE_SPY=1 (or llm): while a run's levels go, a py-spy dump of each process of SVC's LLM
# server (its process group: the API server, the engine core) every ~0.25 s, into
# DIR/llm_server.spy.txt (details.tar.xz). A stall of the engine shows as what its main thread
# was doing meanwhile: it found vLLM compiling its top-p sampler in the middle of a burst
# (docs/gpu-results.md). SUITE_SPY=asr or tts: that service instead (every thread of it).
spy_start() {
  local dir=$1 spy=$HOME/tools-site/bin/py-spy name
  SPY_PID="" SPY_OUT=""
  case "${SUITE_SPY:-0}" in
    0) return 0 ;;
    1 | llm) name=llm ;;
    asr | tts) name=$SUITE_SPY ;;
    *) echo "SUITE_SPY=$SUITE_SPY: 1 (or llm), asr or tts" >&2; exit 2 ;;
  esac
  [ -n "${SUITE_SVC:-}" ] || { echo "SUITE_SPY needs SUITE_SVC (the services to sample)" >&2; exit 2; }
  local record=$SUITE_SVC/${name}_server.json out=$dir/${name}_server.spy.txt
  SPY_OUT=$out
  if [ "$DRY" = 1 ]; then echo "py-spy dump of the process group of $record every 0.25 s > $out"; return 0; fi
  [ -x "$spy" ] || { echo "no $spy: carry DEST/tools (benchmarks/gpu_carries.sh) and stage it" >&2; exit 2; }
  local group pids
  group=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['pid'])" "$record")
  pids=$(pgrep -g "$group" | tr '\n' ' ' || true)  # none: pgrep fails, which set -e must not take as the script's
  [ -n "$pids" ] || pids=$group  # not a group leader: the process alone
  # -k 1: a dump that ignores its TERM is killed (one that hung on a failed copy of the
  # target's code objects stopped the sampling for good)
  # set +e: the subshell inherits the script's errexit, and one dump that failed or timed out
  # (status 124) ended the sampling for good; spy_stop's kill of the gone loop then failed and
  # took the suite down with it, before the run's summary and archive (two loans' spied runs).
  ( set +e
    while true; do
      for p in $pids; do echo "=== $(date +%T.%N) pid $p"; timeout -k 1 3 "$spy" dump --pid "$p" --nonblocking 2>&1 | head -200; done
      sleep 0.2
    done > "$out" 2>&1 ) &
  SPY_PID=$!
}

spy_stop() {
  if [ -n "${SPY_PID:-}" ]; then kill "$SPY_PID" 2>/dev/null || true; fi
}

# Where the sampled service's threads were (benchmarks/spy_summary.py), beside pipeline.json:
# what a loan reads first, without unpacking the dumps.
spy_summary() {
  local dir=$1
  [ -n "${SPY_OUT:-}" ] || return 0
  do_ "$PY" benchmarks/spy_summary.py "$SPY_OUT" --top 8 --json "$dir/spy_summary.json" || true
}

# SUITE_MPS=1: the services are separate processes on one GPU. Without MPS the GPU runs one
# process's kernels at a time and switches between them in time slices, so Kokoro's vocoder
# waits out the LLM's decode steps even where both together would fit the GPU. The daemon
# uses its default pipe and log folders (/tmp/nvidia-mps, /var/log/nvidia-mps): every CUDA
# process started on the machine after it joins, with no variable to pass along. It changes no
# setting of the GPU (compute mode, MIG) and ends with `stop`.
MPS_CONTROL=nvidia-cuda-mps-control
mps_control() {  # on the PATH, else in the driver's folder
  [ "$DRY" = 1 ] || command -v "$MPS_CONTROL" > /dev/null && return 0
  MPS_CONTROL=/usr/local/nvidia/bin/nvidia-cuda-mps-control
  [ -x "$MPS_CONTROL" ] || { echo "SUITE_MPS=1: no nvidia-cuda-mps-control on this machine" >&2; exit 2; }
}

mps_start() {
  local svc=$1
  [ "${SUITE_MPS:-0}" = 1 ] || return 0
  mps_control
  do_ "$MPS_CONTROL" -d
  do_ sh -c "echo 'MPS control daemon started by gpu_suite.sh' > $svc/mps.txt"
}

mps_stop() {  # the daemon `services` started, if it did
  local svc=$1
  [ -f "$svc/mps.txt" ] || [ "${SUITE_MPS:-0}" = 1 ] || return 0
  mps_control
  do_ sh -c "echo quit | $MPS_CONTROL"
  do_ rm -f "$svc/mps.txt"
}

plugin_entry_point() {  # voicebot runs from the repo copy, not pip-installed: vLLM's spawned engine
  # processes find the windowed Whisper (vllm.general_plugins, pyproject.toml) only through a dist-info
  local d=voicebot-0.1.0.dist-info
  [ -f "$d/entry_points.txt" ] && return 0
  do_ mkdir -p "$d"
  do_ sh -c "printf 'Metadata-Version: 2.1\nName: voicebot\nVersion: 0.1.0\n' > $d/METADATA"
  do_ sh -c "printf '[vllm.general_plugins]\nvoicebot_windowed_whisper = voicebot.vllm_plugin:register\n' > $d/entry_points.txt"
}

ASR=${SUITE_ASR:-whisper}
case "$ASR" in whisper|fastconformer|fastconformer-service) ;;
  *) echo "SUITE_ASR: whisper, fastconformer or fastconformer-service, not $ASR" >&2; exit 2 ;; esac
FC_DIR=$MODELS/fastconformer  # random weights of the real shape, built on the machine (too big to carry)
FC_FLAGS=(--fastconformer "$FC_DIR")
[ "${SUITE_FC_GRAPHS:-0}" = 1 ] && FC_FLAGS+=(--fc-cuda-graphs)

environment() {
  export PYTHONPATH="$PWD:$HOME/vllm-site:$HOME/voicebot-site:$MODELS/fwstub${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  plugin_entry_point
}

# The flags every pipeline_gpu.py verb of the documented layout takes: the config, the LLM's
# shape and share, Kokoro in the TTS service, admission of MOST callers (split over the
# frontends, but the services see all of it, with a few slots to spare), SUITE_ARGS last.
common_flags() {
  local most=$1
  FLAGS=(--config configs/gpu-asr-service.yaml --gpu-dummy --llm-memory 0.45 --llm-dir "$MODELS/qwen7b"
    --set tts.engine=kokoro --set tts.kokoro_model=random --set tts.voice=af_heart --set tts.workers=2
    --set tts.max_batch=64 --set asr.partial_interval_ms=4000 --set "server.max_sessions=$((most + 8))"
    --set "vad.smart_turn_model=$MODELS/smart-turn" --set models.offline=true
    --llm-api-servers "${SUITE_LLM_API_SERVERS:-1}" --llm-stream-interval "${SUITE_LLM_STREAM_INTERVAL:-1}")
  # a machine of several GPUs: the ASR / TTS service on a GPU of its own (the LLM server keeps the first)
  if [ -n "${SUITE_ASR_GPU:-}" ]; then FLAGS+=(--asr-gpu "$SUITE_ASR_GPU"); fi
  if [ -n "${SUITE_TTS_GPU:-}" ]; then FLAGS+=(--tts-gpu "${SUITE_TTS_GPU%% *}"); fi
  # shellcheck disable=SC2206  # SUITE_ARGS is a list of flags
  FLAGS+=(${SUITE_ARGS:-})
}

# The ASR of SUITE_ASR in a run: the shared Whisper service, or each frontend's FastConformer.
asr_flags() {
  if [ "$ASR" = fastconformer ]; then
    ASR_FLAGS=("${FC_FLAGS[@]}")
  elif [ "$ASR" = fastconformer-service ]; then
    ASR_FLAGS=(--remote-asr "${FC_FLAGS[@]}")
  else
    ASR_FLAGS=(--remote-asr --whisper-memory 0.15 --whisper-dir "$MODELS/whisper-turbo")
  fi
}

fc_weights() {
  [ "$ASR" != whisper ] && do_ "$PY" benchmarks/pipeline_gpu.py fc-weights --out "$FC_DIR"
  return 0
}

services() {
  local svc=${1:?SVC: the folder the services record themselves in}
  stage
  environment
  common_flags "${SUITE_MAX:-256}"
  do_ mkdir -p "$svc"
  mps_start "$svc"
  do_ "$PY" benchmarks/pipeline_gpu.py llm-server "${FLAGS[@]}" --start-timeout-s 480 --out "$svc"
  fc_weights  # on the CPU while the LLM compiles
  local after=$svc/llm_server.json
  if [ "$ASR" = whisper ]; then
    do_ "$PY" benchmarks/pipeline_gpu.py asr-server "${FLAGS[@]}" --whisper-memory 0.15 \
      --whisper-dir "$MODELS/whisper-turbo" --start-timeout-s 480 --after "$after" --wait --out "$svc"
    after=$svc/asr_server.json
  elif [ "$ASR" = fastconformer-service ]; then
    do_ "$PY" benchmarks/pipeline_gpu.py asr-server "${FLAGS[@]}" "${FC_FLAGS[@]}" \
      --sessions "${SUITE_MAX:-256}" --start-timeout-s 480 --after "$after" --wait --out "$svc"
    after=$svc/asr_server.json
  fi
  do_ "$PY" benchmarks/pipeline_gpu.py tts-server "${FLAGS[@]}" --start-timeout-s 480 --after "$after" --wait \
    --out "$svc"
  local k gpus gpu last=tts  # more TTS services (tts2, tts3 ...), each after the last
  read -ra gpus <<< "${SUITE_TTS_GPU:-}"
  for ((k = 2; k <= ${SUITE_TTS_SERVICES:-1}; k++)); do
    gpu=()
    [ ${#gpus[@]} -gt 0 ] && gpu=(--tts-gpu "${gpus[$(( (k - 1) < ${#gpus[@]} ? k - 1 : ${#gpus[@]} - 1 ))]}")
    do_ "$PY" benchmarks/pipeline_gpu.py tts-server "${FLAGS[@]}" "${gpu[@]}" --index "$k" --start-timeout-s 480 \
      --after "$svc/${last}_server.json" --wait --out "$svc"
    last=tts$k
  done
}

again() {  # llm-server | tts-server: start SVC's server of that kind again, the others kept
  local verb=$1 svc=${2:?SVC: the folder the services were started into}
  environment
  common_flags "${SUITE_MAX:-256}"
  do_ "$PY" benchmarks/pipeline_gpu.py "$verb" "${FLAGS[@]}" --replace --wait --start-timeout-s 480 --out "$svc"
}

stop_all() {
  local svc=${1:?SVC: the folder the services were started into}
  environment
  do_ "$PY" benchmarks/pipeline_gpu.py stop --out "$svc"
  do_ sh -c "rm -f $svc/*_server.json"
  mps_stop "$svc"
}

run() {
  local out=${1:?OUT: the folder the run folders go in}
  shift
  local levels=("$@")
  [ ${#levels[@]} -gt 0 ] || levels=(16 32 48 64 96)
  local most=0 n
  for n in "${levels[@]}"; do [ "$n" -gt "$most" ] && most=$n; done
  stage
  local dir
  dir="$out/run-$(date -u +%Y%m%dT%H%M%SZ)"
  local k=1
  while [ -e "$dir" ]; do k=$((k + 1)); dir="${dir%-[0-9]}-$k"; done  # never the last run's folder
  do_ mkdir -p "$dir"
  environment
  fc_weights
  common_flags "$most"
  asr_flags
  local svc=()
  if [ -n "${SUITE_SVC:-}" ]; then  # the services `services` started: used, not started again
    svc=(--llm-url "$SUITE_SVC/llm_server.json" --tts-url "$SUITE_SVC/tts_server.json")
    for ((k = 2; k <= ${SUITE_TTS_SERVICES:-1}; k++)); do svc+=(--more-tts-url "$SUITE_SVC/tts${k}_server.json"); done
    [ "$ASR" != fastconformer ] && svc+=(--asr-url "$SUITE_SVC/asr_server.json")
  fi
  local fe=(--frontends "${SUITE_FRONTENDS:-2}")
  [ -n "${SUITE_WORKERS:-}" ] && fe=(--server-workers "$SUITE_WORKERS")
  spy_start "$dir"
  # A run that exits non-zero still measured something: its threads' summary, plot and
  # archive are made as for any other, then its status is the suite's (two spied runs of a
  # loan came back as loose files, their summary never made, when the suite left at once).
  local rc=0
  do_ "$PY" benchmarks/pipeline_gpu.py run "${FLAGS[@]}" --remote-llm --remote-tts "${ASR_FLAGS[@]}" "${svc[@]}" \
    "${fe[@]}" --audio "$MODELS"/audio/*.wav --sessions "${levels[@]}" \
    --turns "${SUITE_TURNS:-2}" --warm-level "${SUITE_WARM:-0}" --start-timeout-s 300 --keep-going --max-wall-s "${SUITE_WALL_S:-480}" --out "$dir" \
    || rc=$?
  spy_stop
  spy_summary "$dir"
  if [ "$DRY" = 1 ] || [ -f "$dir/pipeline.json" ]; then
    do_ "$PY" benchmarks/pipeline_gpu.py plot "$dir/pipeline.json" --png "$dir/pipeline.png" || echo "no plot" >&2
  fi
  do_ sh -c "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $dir/device.txt" || true
  # A call brings back 8 files of $OUT: the summary, its plot, the device and the threads' summary
  # stay files, the rest (every turn per level, the servers' logs and commands) travels as one archive.
  # find runs beside tar, which creates the archive at once: found, it would be archived into
  # itself and removed with the files (a test saw the archive vanish).
  do_ sh -c "cd $dir && find . -type f ! -name pipeline.json ! -name pipeline.png ! -name device.txt ! -name spy_summary.json ! -name details.tar.xz -printf '%P\\n' | tar -cJf details.tar.xz --remove-files -T - && find . -mindepth 1 -type d -empty -delete"
  echo "run folder: $dir (pipeline_gpu.py run: exit $rc)"
  return "$rc"
}

# `py DEST SCRIPT [ARG ...]`: a GPU microbenchmark beside (or instead of) the services, on the
# same packages: with only the voicebot wheels on the path, gpu_kokoro.py cannot import
# transformers' ALBERT on a lent machine.
py_script() {
  local script=${1:?usage: gpu_suite.sh py DEST SCRIPT [ARG ...] (SCRIPT: e.g. benchmarks/gpu_kokoro.py)}
  shift
  environment
  [ "$DRY" = 1 ] && echo "PYTHONPATH=$PYTHONPATH"
  do_ "$PY" "$script" "$@"
}

case "$verb" in
  stage) stage ;;
  run) run "$@" ;;
  services) services "$@" ;;
  llm) again llm-server "$@" ;;
  tts) again tts-server "$@" ;;
  stop) stop_all "$@" ;;
  py) py_script "$@" ;;
  *) echo "unknown verb $verb: stage | run | services | llm | tts | stop | py" >&2; exit 2 ;;
esac
