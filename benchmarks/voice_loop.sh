#!/usr/bin/env bash
# Voice-to-voice benchmark of the whole pipeline: start the server on a config, probe it
# at several concurrency levels with real recorded speech, stop the server.
#
#   benchmarks/voice_loop.sh [CONFIG] [OUT_DIR] [extra probe args...]
#   e.g. benchmarks/voice_loop.sh configs/default.yaml artifacts/v2v --sessions 1 2 4 --turns 3
#
# Audio: every WAV in ../shared/audio (jfk.wav included) unless AUDIO is set.
# SERVER_ARGS: extra `voicebot serve` options, e.g. SERVER_ARGS="--set vad.min_silence_ms=500".
# PROTOCOL: native (default), realtime, twilio or webrtc.
# TRACE=1: serve through benchmarks/trace_serve.py, which writes $OUT/trace.jsonl (what ran
#   on the cores when; `benchmarks/trace_serve.py --report $OUT/trace.jsonl` splits each TTFT).
# PORT: the server's port (8090).
#
# Output, in OUT_DIR: probe.json (the probe's report: every turn, voice-to-voice p50/p90/p95/p99
# measured from the audio, the server's turn.timings), probe.png, stages.json (where the
# milliseconds went, benchmarks/v2v_stages.py, in the one JSON shape of benchmarks/bench_util.py),
# server.log and metrics.txt (/metrics after the run).
set -euo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/default.yaml}; OUT=${2:-artifacts/v2v}; shift $(( $# > 2 ? 2 : $# ))
PORT=${PORT:-8090}
AUDIO=${AUDIO:-$(ls ../shared/audio/*.wav)}
mkdir -p "$OUT"
SERVE=(.venv/bin/voicebot)
if [ -n "${TRACE:-}" ]; then
  rm -f "$OUT/trace.jsonl"
  export TRACE_OUT="$OUT/trace.jsonl"
  SERVE=(.venv/bin/python benchmarks/trace_serve.py)
fi
# shellcheck disable=SC2086
"${SERVE[@]}" serve --config "$CONFIG" --port "$PORT" ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server died; see $OUT/server.log"; exit 1; }
  sleep 1
done
PROTOCOL=${PROTOCOL:-native}
case $PROTOCOL in
  native) URL="ws://127.0.0.1:$PORT/ws" ;;
  realtime) URL="ws://127.0.0.1:$PORT/v1/realtime" ;;
  twilio) URL="ws://127.0.0.1:$PORT/twilio" ;;
  webrtc) URL="http://127.0.0.1:$PORT" ;;
  *) echo "unknown PROTOCOL=$PROTOCOL"; exit 2 ;;
esac
# shellcheck disable=SC2086
.venv/bin/voicebot probe --protocol "$PROTOCOL" --url "$URL" --audio $AUDIO \
  --json "$OUT/probe.json" --plot "$OUT/probe.png" --timeout-s 60 "$@"
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"
.venv/bin/python benchmarks/v2v_stages.py "$OUT/probe.json" --json "$OUT/stages.json" || true
