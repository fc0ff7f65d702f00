#!/usr/bin/env bash
# Whisper on vLLM with and without the LLM under voice load on the same GPU, no server process.
#
#   benchmarks/gpu_share.sh OUT QWEN_DIR WHISPER_DIR CLIPS_DIR
#
# The whole pipeline (pipeline_gpu.py) found ASR finals 5-10x slower inside the server than
# the same engine alone. Two causes fit: the server process (one GIL for the loop, Piper threads,
# Whisper's feature threads and both vLLM output handlers) or two vLLM engines time-slicing one
# GPU. This runs the second alone: llm_load.py (LLM in its own process, `gpu.yaml`'s llm section at
# 70% of memory as in the pipeline) and, once it is up, gpu_asr.py beside it with the pipeline's
# ASR settings; then gpu_asr.py again with the GPU to itself. JSON: OUT/asr_with_llm.json,
# OUT/asr_alone.json, OUT/share_llm.json. Dummy weights, as everywhere on the GPU machines.
# Needs vLLM staged (gpu_suite.sh stage) and PYTHONPATH=REPO:$HOME/vllm-site:STUBS, where STUBS holds
# import-only soundfile.py / soxr.py (a version string and empty available_formats() /
# available_subtypes()): voicebot.audio imports them, and they arrive only with the Piper bundle.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_share.sh OUT QWEN_DIR WHISPER_DIR CLIPS_DIR}
qwen=${2:?} whisper=${3:?} clips=${4:?}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
# shellcheck disable=SC2206  # SHARE_STREAMS is a word list
streams=(${SHARE_STREAMS:-32 64})
asr=(python3 benchmarks/gpu_asr.py --model-dir "$whisper" --clips "$clips" --streams "${streams[@]}"
     --partial-ms 2000 --duration-s "${SHARE_ASR_S:-20}" --burst 0 --tokens-per-s 3
     --gpu-memory-utilization 0.15 --max-num-batched-tokens 48000 --feature-workers 8)
python3 benchmarks/llm_load.py --model-dir "$qwen" --sessions "${SHARE_LLM_SESSIONS:-32}" --bg-requests 0 \
  --phases main --duration-s "${SHARE_LLM_S:-170}" --warmup-s 3 --drain-s 5 \
  --llm-set gpu_memory_utilization=0.70 --max-wall-s 420 --json "$out/share_llm.json" > "$out/share_llm.log" 2>&1 &
llm=$!
for _ in $(seq 300); do  # the ASR engine starts once the LLM's has its memory (see pipeline_gpu.py)
  grep -q "engine up" "$out/share_llm.log" 2>/dev/null && break
  kill -0 "$llm" 2>/dev/null || break
  sleep 1
done
"${asr[@]}" --max-wall-s 240 --json "$out/asr_with_llm.json" > "$out/asr_with_llm.log" 2>&1
wait "$llm"
"${asr[@]}" --max-wall-s 200 --json "$out/asr_alone.json" > "$out/asr_alone.log" 2>&1
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("asr_with_llm", "asr_alone"):
    try:
        rep = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError) as exc:
        print(name, "missing:", exc)
        continue
    for r in rep.get("scenarios", []):
        f = r["final_after_eos_ms"]
        print(f"{name:>13} {r['streams']:>3} streams: final after EOS p50/p95/p99 {f.get('p50')}/{f.get('p95')}/{f.get('p99')} ms,"
              f" {r['decodes_per_s']} decodes/s, API CPU {r.get('api_process_cpu')}, engine start {rep.get('engine_start_s')} s")
try:
    llm = json.loads((out / "share_llm.json").read_text())
    for s in llm["scenarios"]:
        print(f"llm {s['name']}: TTFT {s['ttft_ms']} TT10 p95 {s['tt10_ms'].get('p95')}")
except (OSError, ValueError, KeyError) as exc:
    print("llm json:", exc)
PY
