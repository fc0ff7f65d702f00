#!/usr/bin/env bash
# Every GPU measurement of docs/gpu-results.md in one run, on a lent GPU machine, JSON out.
#
#   benchmarks/gpu_suite.sh stage                  stage what this transfer carried (.gpu/cN: the vLLM
#                                                  bundle of build-bundle.sh; .gpu/tN: the Piper bundle);
#                                                  installs once all parts are there
#   benchmarks/gpu_suite.sh run OUT [PART...]      run measurements into OUT/*.json, then OUT/summary.json
#       PART: llm (LLM main + fcfs phases), llm-nocache (prefix caching off), asr, tts; default: all four
#
# Preparation on a CPU machine (in the repo root; .gpu/ is git-ignored):
#   bash ../shared/tools/vllm-gpu/build-bundle.sh .gpu                     # .gpu/c1 c2 c3 (vLLM 0.26.0)
#   python benchmarks/gpu_whisper_files.py --tokenizer-json TOK --out .gpu/whisper-turbo
#   .gpu/qwen7b (Qwen2.5-7B config.json + a Qwen tokenizer), .gpu/audio (16 kHz clips),
#   .gpu/t0..t3 (the Piper bundle split to fit the 64 MiB transfers): see docs/gpu-results.md
# Weights are never carried: the LLM and Whisper run with load_format=dummy (random
# weights of the real shape; speed does not depend on the values).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: gpu_suite.sh stage | run OUT [llm llm-nocache asr tts]}
shift

stage() {
  for c in c1 c2 c3; do
    if [ -d ".gpu/$c" ]; then bash ".gpu/$c/device-install.sh" .gpu; fi
  done
  mkdir -p "$HOME/tts-stage"
  for t in .gpu/t*/; do
    [ -d "$t" ] && cp "$t"tts.part_* "$HOME/tts-stage/" 2>/dev/null || true
  done
  if [ ! -d "$HOME/tts/site" ] && [ "$(ls "$HOME/tts-stage" | wc -l)" -ge 4 ]; then
    mkdir -p "$HOME/tts"
    cat "$HOME"/tts-stage/tts.part_* | xz -d | tar xf - -C "$HOME/tts"
    echo "tts bundle unpacked: $(ls "$HOME/tts")"
  else
    echo "tts parts staged: $(ls "$HOME/tts-stage" | tr '\n' ' ')"
  fi
}

run() {
  local out=${1:?usage: gpu_suite.sh run OUT [PART...]}
  shift
  local parts=("$@")
  [ ${#parts[@]} -gt 0 ] || parts=(llm llm-nocache asr tts)
  mkdir -p "$out"
  export PYTHONPATH="$HOME/vllm-site:$HOME/tts/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt" || true
  date -u +%FT%TZ >> "$out/device.txt"
  local rc=0
  for part in "${parts[@]}"; do
    case $part in
      llm)  # LLM stage through LlmEngine: 256/512/1024 sessions, bare-vLLM reference, saturation
            # with the priority policy, then the same saturation under FCFS (second engine).
        python3 benchmarks/llm_load.py --model-dir .gpu/qwen7b --sessions 256 512 1024 \
          --bare-sessions 512 1024 --bg-requests 0 --sat-requests 1024 --sat-sessions 128 \
          --phases main fcfs --duration-s 20 --warmup-s 3 --drain-s 20 --max-wall-s "${LLM_WALL_S:-500}" \
          --json "$out/llm.json" > "$out/llm.log" 2>&1 || rc=$? ;;
      llm-nocache)  # prefix caching off: the on/off ratio against llm's main/interactive-256
        python3 benchmarks/llm_load.py --model-dir .gpu/qwen7b --sessions --phases nocache \
          --nocache-sessions 256 --bg-requests 0 --duration-s 20 --warmup-s 3 --drain-s 20 \
          --max-wall-s "${NOCACHE_WALL_S:-200}" --json "$out/llm_nocache.json" > "$out/llm_nocache.log" 2>&1 || rc=$? ;;
      asr)  # Whisper large-v3-turbo shape on vLLM through VllmAsrEngine: real-time streams
        python3 benchmarks/gpu_asr.py --model-dir .gpu/whisper-turbo --clips .gpu/audio \
          --streams 64 128 256 512 --partial-ms-sweep 1000 2000 --duration-s 20 --burst 256 --pause-ms 0 \
          --gpu-memory-utilization 0.2 --max-wall-s "${ASR_WALL_S:-330}" \
          --json "$out/asr.json" > "$out/asr.log" 2>&1 || rc=$? ;;
      tts)  # Piper joe-medium on the machine's CPU cores through PiperTts
        python3 benchmarks/gpu_tts.py --voice "$HOME/tts/voice" --sessions 64 128 256 \
          --workers 8 16 --duration-s 20 --max-wall-s "${TTS_WALL_S:-240}" \
          --json "$out/tts.json" > "$out/tts.log" 2>&1 || rc=$? ;;
      *) echo "unknown part $part" >&2; return 2 ;;
    esac
    echo "== $part done (rc so far $rc)"
  done
  python3 benchmarks/gpu_report.py "$out" || rc=$?
  return $rc
}

case $cmd in
  stage) stage ;;
  run) run "$@" ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
