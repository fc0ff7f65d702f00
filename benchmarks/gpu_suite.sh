#!/usr/bin/env bash
# Every GPU measurement of docs/gpu-results.md in one run, on a lent GPU machine, JSON out.
#
#   benchmarks/gpu_suite.sh stage                  stage what this transfer carried (.gpu/cN: the vLLM
#                                                  bundle of build-bundle.sh; .gpu/tN: the Piper bundle);
#                                                  installs once all parts are there
#   benchmarks/gpu_suite.sh run OUT [PART...]      run measurements into OUT/*.json, then OUT/summary.json
#       PART: llm (LLM main + fcfs phases), llm-nocache (prefix caching off), asr, tts; default: all four
#             kokoro (issue 9 section 2: Kokoro-82M shape, random weights, batched across sessions on the
#               GPU vs batch-1 on CUDA streams, gpu_kokoro.py, ~4 min; needs .gpu/kokoro, see that script)
#             llm-ratio (ours vs bare vLLM at 512/1024 only: the issue's section 3 ratio, ~6 min)
#             probe-cost (the probe's own CPU and timing error at 128-1024 sessions, trivial server)
#             pipeline (the whole server of configs/gpu.yaml + the probe at N sessions, pipeline_gpu.py;
#               PIPE_SESSIONS, PIPE_WALL_S, PIPE_ARGS: e.g. "--detach" or "--url ws://...")
#             llm-server (the scale-out LLM: one `vllm serve` at PIPE_LLM_MEMORY of the GPU, started
#               detached into OUT/llm-server, so its start-up overlaps the next transfer)
#             pipeline-multi (scale-out, issue 9 after issue 10: that one LLM server (started here if
#               llm-server did not) + K voicebot frontends with llm.backend remote, each with its own
#               Whisper on the GPU and Piper on the CPU; the probe spreads N sessions over them;
#               PIPE_FRONTENDS="1 4" (one run per K), PIPE_MULTI_SESSIONS, PIPE_WHISPER_MEMORY,
#               PIPE_WALL_S, PIPE_ARGS) -> OUT/pipeline-multi-kK/pipeline.json
#             asr-server (issue 9: the ONE shared ASR service, `voicebot asr-serve` hosting Whisper on vLLM
#               at PIPE_WHISPER_MEMORY, started detached into OUT/asr-server like llm-server)
#             pipeline-asr (issue 9 after the third GPU session: the LLM server + that ONE ASR service +
#               K frontends with asr.backend remote and llm.backend remote (configs/gpu-asr-service.yaml):
#               no frontend holds a GPU engine; PIPE_FRONTENDS="1 4", PIPE_ASR_SESSIONS, PIPE_ASR_SLOTS,
#               PIPE_WHISPER_MEMORY, PIPE_WALL_S, PIPE_ARGS) -> OUT/pipeline-asr-kK/pipeline.json
#             tts-server (issue 9 after stop 20: the ONE shared TTS service, `voicebot tts-serve` hosting Piper
#               from ~/tts/voice as the other parts, or with PIPE_TTS_ARGS applied (e.g. "--set tts.engine=kokoro --set
#               tts.kokoro_model=random": Kokoro on the GPU), started detached into OUT/tts-server once the
#               ASR service answers (or the LLM server, without one); pipeline-asr then runs its frontends
#               with tts.backend remote pointing at it: no frontend holds a GPU context)
#             asr-window (issue 9: the asr streams through Whisper's 30 s encoder window, then through the window
#               cut to the utterance (asr.encoder_pad_s: whisper_vllm_window.py) -> OUT/asr_stock.json, asr_window.json;
#               asr-server takes PIPE_ASR_ARGS, e.g. "--set asr.encoder_pad_s=1.0" for the cut window)
#             llm-stop (stop what llm-server / asr-server / tts-server / --detach left running in OUT)
#             remote-tier (issue 10, one GPU: two vLLM servers sharing it behind vllm-router vs one,
#               affinity on vs off, gpu_remote_tier.py; needs the vllm-router wheel: .whl/, see below)
#
# PIPE_MPS=1 (any part): run every CUDA process this run starts under NVIDIA MPS, so that the contexts of
#   the LLM server, the ASR service and the frontends' Kokoro run concurrently instead of time-slicing.
#   Before the first part, `nvidia-cuda-mps-control -d` starts (or is found running) with
#   CUDA_MPS_PIPE_DIRECTORY=OUT/mps/pipe and CUDA_MPS_LOG_DIRECTORY=OUT/mps/log exported, which every server
#   started here inherits; OUT/mps/status.log records the daemon's server list and nvidia-smi's process
#   table after each part (an MPS client shows as type M+C). At exit (a trap: whatever happens) the daemon
#   is told to quit, unless PIPE_MPS_KEEP=1: the detached llm-server / asr-server outlive this call as MPS
#   clients, and a later run's llm-stop part (or a run without PIPE_MPS_KEEP) quits it. GPU settings are
#   left as they are (no nvidia-smi -c: the default compute mode accepts MPS).
#
# Model folders are read from .gpu/NAME, else from $HOME/gpu-models/NAME (stage copies them there,
# so a later transfer need not carry them again).
#
# Preparation on a CPU machine (in the repo root; .gpu/ is git-ignored):
#   bash ../shared/tools/vllm-gpu/build-bundle.sh .gpu                     # .gpu/c1 c2 c3 (vLLM 0.26.0)
#   python benchmarks/gpu_whisper_files.py --tokenizer-json TOK --out .gpu/whisper-turbo
#   .gpu/qwen7b (Qwen2.5-7B config.json + a Qwen tokenizer), .gpu/audio (16 kHz clips),
#   .gpu/t0..t3 (the Piper bundle split to fit the 64 MiB transfers): see docs/gpu-results.md
#   .gpu/fwstub/faster_whisper/{__init__.py,assets/silero_vad_v6.onnx}: the server's VAD model (from the
#     faster-whisper wheel; the GPU machine has no faster-whisper and the GPU profile does not use it)
#   .gpu/src: `git archive HEAD voicebot benchmarks configs web tests/llm_tier.py | tar -x -C .gpu/src`
#     (run from there: a snapshot of what is committed, not of a working tree others are editing)
#   .whl (remote-tier): vllm-router 0.1.17 and orjson wheels (pip download, docs/gpu-results.md); the
#     part installs them into the machine's Python (vllm-router must sit beside python3)
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
  mkdir -p "$HOME/gpu-models"
  for m in qwen7b whisper-turbo audio fwstub kokoro; do
    if [ -d ".gpu/$m" ]; then rm -rf "$HOME/gpu-models/$m"; cp -r ".gpu/$m" "$HOME/gpu-models/"; fi
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

model_dir() {  # .gpu/NAME if this transfer carried it, else the staged copy
  if [ -d ".gpu/$1" ]; then echo ".gpu/$1"; else echo "$HOME/gpu-models/$1"; fi
}

plugin_entry_point() {  # voicebot runs from PYTHONPATH here, not pip-installed: vLLM's spawned engine
  # processes find the windowed Whisper (vllm.general_plugins, pyproject.toml) only through a dist-info
  if ! python3 -c "import importlib.metadata as m, sys; sys.exit(not m.entry_points(group='vllm.general_plugins', name='voicebot_windowed_whisper'))" 2>/dev/null; then
    mkdir -p voicebot-0.1.0.dist-info
    printf 'Metadata-Version: 2.1\nName: voicebot\nVersion: 0.1.0\n' > voicebot-0.1.0.dist-info/METADATA
    printf '[vllm.general_plugins]\nvoicebot_windowed_whisper = voicebot.vllm_plugin:register\n' \
      > voicebot-0.1.0.dist-info/entry_points.txt
  fi
}

MPS_DIR=""
mps_status() {  # append the daemon's server list and the GPU's process table to OUT/mps/status.log
  [ -n "$MPS_DIR" ] || return 0
  {
    echo "== $(date -u +%FT%TZ) $1"
    echo "get_server_list: $(echo get_server_list | timeout 10 nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
    nvidia-smi 2>&1 | sed -n '/Processes:/,$p'
  } >> "$MPS_DIR/status.log" 2>&1 || true
}

mps_start() {  # PIPE_MPS=1: the MPS control daemon, pipe and log directories under OUT/mps
  MPS_DIR="$1/mps"
  mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "PIPE_MPS=1: nvidia-cuda-mps-control not found" | tee -a "$MPS_DIR/status.log" >&2
    return 1
  fi
  if echo get_server_list | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "MPS control daemon already running ($MPS_DIR)" | tee -a "$MPS_DIR/status.log"
  else
    # its own session (setsid), so that it outlives this call like the detached servers, its clients
    if command -v setsid >/dev/null; then setsid nvidia-cuda-mps-control -d; else nvidia-cuda-mps-control -d; fi
    sleep 1
    echo "MPS control daemon started ($MPS_DIR)" | tee -a "$MPS_DIR/status.log"
  fi
  mps_status "start"
}

mps_quit() {  # tell the daemon to quit (it stops its servers once their clients are gone)
  [ -n "$MPS_DIR" ] || return 0
  mps_status "quit"
  if echo get_server_list | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo quit | timeout 30 nvidia-cuda-mps-control || true
    echo "MPS control daemon told to quit" >> "$MPS_DIR/status.log"
  fi
  tail -n 20 "$MPS_DIR/log/control.log" >> "$MPS_DIR/status.log" 2>/dev/null || true
}

run() {
  local out=${1:?usage: gpu_suite.sh run OUT [PART...]}
  shift
  if [ "${PIPE_MPS:-0}" = 1 ]; then
    mkdir -p "$out"
    [ "${PIPE_MPS_KEEP:-0}" = 1 ] || trap mps_quit EXIT
    mps_start "$out"
  fi
  local parts=("$@")
  [ ${#parts[@]} -gt 0 ] || parts=(llm llm-nocache asr tts)
  mkdir -p "$out"
  local qwen whisper audio
  qwen=$(model_dir qwen7b); whisper=$(model_dir whisper-turbo); audio=$(model_dir audio)
  export PYTHONPATH="$PWD:$HOME/vllm-site:$HOME/tts/site:$(model_dir fwstub)${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
  plugin_entry_point
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt" || true
  date -u +%FT%TZ >> "$out/device.txt"
  local rc=0
  for part in "${parts[@]}"; do
    case $part in
      llm)  # LLM stage through LlmEngine: 256/512/1024 sessions, bare-vLLM reference, saturation
            # with the priority policy, then the same saturation under FCFS (second engine).
        python3 benchmarks/llm_load.py --model-dir "$qwen" --sessions 256 512 1024 \
          --bare-sessions 512 1024 --bg-requests 0 --sat-requests 1024 --sat-sessions 128 \
          --phases main fcfs --duration-s 20 --warmup-s 3 --drain-s 20 --max-wall-s "${LLM_WALL_S:-500}" \
          --json "$out/llm.json" > "$out/llm.log" 2>&1 || rc=$? ;;
      llm-nocache)  # prefix caching off: the on/off ratio against llm's main/interactive-256
        python3 benchmarks/llm_load.py --model-dir "$qwen" --sessions --phases nocache \
          --nocache-sessions 256 --bg-requests 0 --duration-s 20 --warmup-s 3 --drain-s 20 \
          --max-wall-s "${NOCACHE_WALL_S:-200}" --json "$out/llm_nocache.json" > "$out/llm_nocache.log" 2>&1 || rc=$? ;;
      asr)  # Whisper large-v3-turbo shape on vLLM through VllmAsrEngine: real-time streams
        python3 benchmarks/gpu_asr.py --model-dir "$whisper" --clips "$audio" \
          --streams 64 128 256 512 --partial-ms-sweep 1000 2000 --duration-s 20 --burst 256 --pause-ms 0 \
          --gpu-memory-utilization 0.2 --max-wall-s "${ASR_WALL_S:-330}" \
          --json "$out/asr.json" > "$out/asr.log" 2>&1 || rc=$? ;;
      asr-window)  # the same streams through Whisper on vLLM with the 30 s encoder window (stock) and with
        # the window cut to the utterance (asr.encoder_pad_s 1 s, at least 8 s: whisper_vllm_window.py), one
        # engine after the other on the whole GPU; ASR_WINDOW_STREAMS, ASR_WINDOW_PARTIAL_MS
        local label pad
        for label in stock window; do
          pad=""; [ "$label" = window ] && pad="--window-pad-s 1.0 --window-min-s 8"
          # shellcheck disable=SC2086  # word lists
          python3 benchmarks/gpu_asr.py --model-dir "$whisper" --clips "$audio" $pad \
            --streams ${ASR_WINDOW_STREAMS:-64 128 256} --partial-ms "${ASR_WINDOW_PARTIAL_MS:-2000}" \
            --duration-s 20 --burst 256 --pause-ms 0 --gpu-memory-utilization 0.2 \
            --max-wall-s "${ASR_WALL_S:-240}" --json "$out/asr_$label.json" > "$out/asr_$label.log" 2>&1 || rc=$?
        done ;;
      tts)  # Piper joe-medium on the machine's CPU cores through PiperTts
        python3 benchmarks/gpu_tts.py --voice "$HOME/tts/voice" --sessions 64 128 256 \
          --workers 8 16 --duration-s 20 --max-wall-s "${TTS_WALL_S:-240}" \
          --json "$out/tts.json" > "$out/tts.log" 2>&1 || rc=$? ;;
      kokoro)  # Kokoro-82M shape (random weights) batched across sessions on the GPU (gpu_kokoro.py)
        PYTHONPATH="$PYTHONPATH:$(model_dir kokoro)/site" python3 benchmarks/gpu_kokoro.py --device cuda \
          --sessions 64 128 256 512 1024 --modes batched streams --stream-sessions 64 128 --duration-s 20 \
          --max-wall-s "${KOKORO_WALL_S:-290}" --json "$out/kokoro.json" > "$out/kokoro.log" 2>&1 || rc=$? ;;
      llm-ratio)  # section 3 after the history fix: ours vs bare vLLM at equal load, 512 and 1024
        python3 benchmarks/llm_load.py --model-dir "$qwen" --sessions 512 1024 --bare-sessions 512 1024 \
          --bg-requests 0 --phases main --duration-s 20 --warmup-s 3 --drain-s 20 \
          --max-wall-s "${LLM_WALL_S:-500}" --json "$out/llm_ratio.json" > "$out/llm_ratio.log" 2>&1 || rc=$? ;;
      probe-cost)  # the probe's own cost against a trivial server (no GPU work)
        python3 benchmarks/pipeline_probe_cost.py --sessions 128 512 1024 --server-procs 4 --turns 2 \
          --audio "$audio"/librivox_08*.wav "$audio"/goforward.wav \
          --json "$out/probe_cost.json" > "$out/probe_cost.log" 2>&1 || rc=$? ;;
      pipeline)  # the whole server (configs/gpu.yaml, dummy weights) + the probe at N sessions
        # shellcheck disable=SC2086  # PIPE_SESSIONS / PIPE_ARGS are word lists
        python3 benchmarks/pipeline_gpu.py run --config configs/gpu.yaml --gpu-dummy \
          --llm-dir "$qwen" --whisper-dir "$whisper" --voice "$HOME/tts/voice" \
          --audio "$audio"/librivox_08*.wav "$audio"/librivox_09*.wav "$audio"/goforward.wav \
          --sessions ${PIPE_SESSIONS:-16 32 64 128 256 512} --max-wall-s "${PIPE_WALL_S:-540}" ${PIPE_ARGS:-} \
          --out "$out/pipeline" >> "$out/pipeline.log" 2>&1 || rc=$? ;;
      llm-server)  # the scale-out LLM server, detached (pipeline-multi finds it in OUT/llm-server)
        python3 benchmarks/pipeline_gpu.py llm-server --config configs/gpu.yaml --gpu-dummy --llm-dir "$qwen" \
          --llm-memory "${PIPE_LLM_MEMORY:-0.45}" --out "$out/llm-server" >> "$out/llm_server_part.log" 2>&1 || rc=$? ;;
      pipeline-multi)  # one LLM server + K frontends; one run per K in PIPE_FRONTENDS
        local llm_url="" k
        [ -f "$out/llm-server/llm_server.json" ] && llm_url="$out/llm-server/llm_server.json"
        for k in ${PIPE_FRONTENDS:-1 4}; do
          # shellcheck disable=SC2086  # word lists
          python3 benchmarks/pipeline_gpu.py run --config configs/gpu.yaml --gpu-dummy --remote-llm --frontends "$k" \
            ${llm_url:+--llm-url "$llm_url"} --llm-memory "${PIPE_LLM_MEMORY:-0.45}" \
            --whisper-memory "${PIPE_WHISPER_MEMORY:-0.10}" --whisper-feature-workers $(( k > 1 ? 4 : 8 )) \
            --llm-dir "$qwen" --whisper-dir "$whisper" --voice "$HOME/tts/voice" \
            --audio "$audio"/librivox_08*.wav "$audio"/librivox_09*.wav "$audio"/goforward.wav \
            --sessions ${PIPE_MULTI_SESSIONS:-16 32 48 64 96 128} --max-wall-s "${PIPE_WALL_S:-540}" ${PIPE_ARGS:-} \
            --out "$out/pipeline-multi-k$k" >> "$out/pipeline_multi.log" 2>&1 || rc=$?
        done ;;
      asr-server)  # the ONE shared ASR service, detached (pipeline-asr finds it in OUT/asr-server); it
        # starts once a recorded LLM server is up (two vLLM engines starting at once mis-size GPU memory)
        # shellcheck disable=SC2046
        python3 benchmarks/pipeline_gpu.py asr-server --config configs/gpu-asr-service.yaml --gpu-dummy \
          $( [ -f "$out/llm-server/llm_server.json" ] && echo --after "$out/llm-server/llm_server.json" ) \
          --whisper-dir "$whisper" --whisper-memory "${PIPE_WHISPER_MEMORY:-0.15}" \
          ${PIPE_ASR_SLOTS:+--asr-slots "$PIPE_ASR_SLOTS"} ${PIPE_ASR_ARGS:-} \
          --out "$out/asr-server" >> "$out/asr_server_part.log" 2>&1 || rc=$? ;;
      tts-server)  # the ONE shared TTS service, detached (pipeline-asr finds it in OUT/tts-server); Piper
        # from ~/tts/voice as the other parts, unless PIPE_TTS_ARGS says otherwise (--set tts.engine=kokoro)
        local after=""
        [ -f "$out/llm-server/llm_server.json" ] && after="$out/llm-server/llm_server.json"
        [ -f "$out/asr-server/asr_server.json" ] && after="$out/asr-server/asr_server.json"
        # shellcheck disable=SC2086  # PIPE_TTS_ARGS is a word list
        python3 benchmarks/pipeline_gpu.py tts-server --config configs/gpu-asr-service.yaml --gpu-dummy \
          ${after:+--after "$after"} --start-timeout-s 600 --voice "$HOME/tts/voice" ${PIPE_TTS_ARGS:-} \
          --out "$out/tts-server" >> "$out/tts_server_part.log" 2>&1 || rc=$? ;;
      pipeline-asr)  # one LLM server + ONE ASR service (+ ONE TTS service) + K frontends; one run per K
        local llm_url="" asr_url="" tts_url="" k
        [ -f "$out/llm-server/llm_server.json" ] && llm_url="$out/llm-server/llm_server.json"
        [ -f "$out/asr-server/asr_server.json" ] && asr_url="$out/asr-server/asr_server.json"
        [ -f "$out/tts-server/tts_server.json" ] && tts_url="$out/tts-server/tts_server.json"
        for k in ${PIPE_FRONTENDS:-1 4}; do
          # shellcheck disable=SC2086  # word lists
          python3 benchmarks/pipeline_gpu.py run --config configs/gpu-asr-service.yaml --gpu-dummy \
            --remote-llm --remote-asr --frontends "$k" \
            ${llm_url:+--llm-url "$llm_url"} ${asr_url:+--asr-url "$asr_url"} \
            ${tts_url:+--remote-tts --tts-url "$tts_url"} \
            --llm-memory "${PIPE_LLM_MEMORY:-0.45}" --whisper-memory "${PIPE_WHISPER_MEMORY:-0.15}" \
            ${PIPE_ASR_SLOTS:+--asr-slots "$PIPE_ASR_SLOTS"} \
            --llm-dir "$qwen" --whisper-dir "$whisper" --voice "$HOME/tts/voice" \
            --audio "$audio"/librivox_08*.wav "$audio"/librivox_09*.wav "$audio"/goforward.wav \
            --sessions ${PIPE_ASR_SESSIONS:-16 32 64 128 256 512} --max-wall-s "${PIPE_WALL_S:-540}" ${PIPE_ARGS:-} \
            --out "$out/pipeline-asr-k$k" >> "$out/pipeline_asr.log" 2>&1 || rc=$?
        done ;;
      llm-stop)
        python3 benchmarks/pipeline_gpu.py stop --out "$out/llm-server" || rc=$?
        [ -d "$out/asr-server" ] && python3 benchmarks/pipeline_gpu.py stop --out "$out/asr-server"
        [ -d "$out/tts-server" ] && python3 benchmarks/pipeline_gpu.py stop --out "$out/tts-server"
        for d in "$out"/pipeline-multi-k*/ "$out"/pipeline-asr-k*/; do
          [ -d "$d" ] && python3 benchmarks/pipeline_gpu.py stop --out "$d"
        done
        mps_quit ;;
      remote-tier)  # issue 10 on one GPU (both servers share it)
        if [ -d .whl ] || [ -d ../../.whl ]; then
          python3 -m pip install -q --no-index --no-deps --no-compile "$( [ -d .whl ] && echo .whl || echo ../../.whl )"/*.whl || rc=$?
        fi
        # shellcheck disable=SC2086
        python3 benchmarks/gpu_remote_tier.py --model-dir "$qwen" --memory "${TIER_MEMORY:-0.40}" \
          --sessions ${TIER_SESSIONS:-64 256} --duration-s "${TIER_DURATION_S:-20}" --logdir "$out/remote-tier-logs" \
          --json "$out/remote_tier.json" > "$out/remote_tier.log" 2>&1 || rc=$? ;;
      *) echo "unknown part $part" >&2; return 2 ;;
    esac
    mps_status "after $part"
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
