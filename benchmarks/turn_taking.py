"""Turn-taking on real speech, end to end: does the server talk over the caller, end
their turn early, answer fast when they are done, and answer briefly?

    flock /tmp/heavy.lock .venv/bin/python benchmarks/turn_taking.py --json artifacts/turn_taking.json \\
        --variant "audio only=vad.smart_turn_words=false,vad.smart_turn_history=false" --variant "policy="

Prompts (real recorded speech from ../shared/audio, or --audio DIR):
- natural: each recording as it is (LibriVox read speech: several sentences with the
  reader's own pauses between them; jfk: a ~1 s pause after "And so my fellow
  Americans"; goforward);
- paused: the same recordings with ``--pause-s`` (0.7 s) of their own room tone
  inserted at a gap between two words in the middle of the speech (where Whisper's
  word timestamps put a boundary: benchmarks/turn_eval.py's cut points).

Each variant (``NAME=KEY=VALUE,...``: config overrides on ``--config``) gets its own
server (started here), and one probe call speaks every prompt as a turn, in real time,
as README's probe example does (voicebot/probe). Reported per turn and per variant:

- committed early: the server ended the turn (sent a final transcript) before the
  caller's clip was over;
- overlap: reply audio heard while the caller was still speaking (ms; a turn with any
  fails the probe);
- voice to voice: from the end of the caller's speech to the first audible reply
  audio (ms, p50/p95), over the turns that were not talked over;
- words per reply (p50/p95) and replies that end mid-sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import JSON_EPILOG, pct, summarise_ms, write_result  # noqa: E402  (benchmarks/, beside this file)

ROOT = Path(__file__).resolve().parent.parent
SHARED_AUDIO = ROOT.parent / "shared" / "audio"
_SENTENCE_MARK = re.compile(r"[.!?…][\"')\]]*$")


def build_prompts(audio_dir: Path, out: Path, pause_s: float, names: list[str]) -> list[tuple[str, Path]]:
    """The natural recordings and, for each, one with a pause inserted mid-speech."""
    from faster_whisper import WhisperModel
    from turn_eval import LEAD_S, room_tone, word_gaps

    from voicebot.audio import ASR_RATE, read_wav
    from voicebot.config import ModelsConfig
    from voicebot.provision import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    whisper = None
    prompts: list[tuple[str, Path]] = []
    paused: list[tuple[str, Path]] = []
    for name in names:
        src = audio_dir / f"{name}.wav"
        if not src.is_file():
            raise SystemExit(f"turn_taking: no recording {src}")
        prompts.append((f"{name} (natural)", src))
        dst = out / f"{name}_pause{int(pause_s * 1000)}.wav"
        if not dst.exists():
            if whisper is None:
                whisper = WhisperModel(resolve_model("bundle:whisper-tiny.en", ModelsConfig()), device="cpu",
                                       compute_type="int8", cpu_threads=2)
            audio, _ = read_wav(src, ASR_RATE)
            cuts = word_gaps(whisper, audio)
            if not cuts:
                continue
            cut = cuts[len(cuts) // 2]  # the middle of the speech
            k = int(cut * ASR_RATE)
            lead = room_tone(audio, LEAD_S)
            sf.write(dst, np.concatenate([lead, audio[:k], room_tone(audio, pause_s), audio[k:]]), ASR_RATE,
                     subtype="PCM_16")
        paused.append((f"{name} (+{pause_s:g} s mid-sentence)", dst))
    return prompts + paused


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (loopback)
            return bool(r.status == 200)
    except OSError:
        return False


def serve(config: str, sets: list[str], port: int, log: Path, verbose: bool) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "voicebot.cli", *(["-vv"] if verbose else []), "serve", "--config", config,
           "--port", str(port)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"turn_taking: the server exited ({proc.returncode}); see {log}")
        if _healthy(f"http://127.0.0.1:{port}/healthz"):
            return proc
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"turn_taking: the server was not ready in 240 s; see {log}")


def probe(port: int, prompts: list[tuple[str, Path]], timeout_s: float) -> list[dict[str, Any]]:
    from voicebot.probe.client import ProbeConfig, run_level
    from voicebot.probe.clips import load_clip

    clips = tuple(load_clip(str(path), 16000) for _, path in prompts)
    cfg = ProbeConfig(url=f"ws://127.0.0.1:{port}/ws", clips=clips, turns=len(clips), timeout_s=timeout_s,
                      gap_s=1.0)
    records = asyncio.run(run_level(cfg, 1))
    out = []
    for (name, _), rec in zip(prompts, records, strict=True):
        row = asdict(rec)
        row["prompt"] = name
        row["reply_words"] = len(rec.reply_text.split())
        row["ends_mid_sentence"] = bool(rec.reply_text.strip()) and not _SENTENCE_MARK.search(rec.reply_text.strip())
        out.append(row)
    return out


def summarise(turns: list[dict[str, Any]]) -> dict[str, Any]:
    heard = [t for t in turns if t["voice_to_voice_ms"] is not None and not t["overlap_ms"]]
    words = [t["reply_words"] for t in turns if t["reply_text"]]
    paused = [t for t in turns if "mid-sentence" in t["prompt"]]
    return {
        "turns": len(turns),
        "answered": sum(t["status"] == "ok" for t in turns),
        "talked_over": sum(bool(t["overlap_ms"]) for t in turns),
        "committed_early": sum(t["early_ends"] > 0 for t in turns),
        "committed_early_paused": sum(t["early_ends"] > 0 for t in paused),
        "n_paused": len(paused),
        "voice_to_voice_ms": summarise_ms([t["voice_to_voice_ms"] for t in heard], 0),
        "reply_words_p50": statistics.median(words) if words else None,
        "reply_words_p95": pct([float(w) for w in words], 95),
        "ends_mid_sentence": sum(t["ends_mid_sentence"] for t in turns),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=JSON_EPILOG)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="a configuration to compare (repeatable; default: the config as is)")
    p.add_argument("--audio", type=Path, default=SHARED_AUDIO)
    p.add_argument("--recordings", default="librivox_0870,librivox_0890,librivox_0920,jfk",
                   help="recordings (stems in --audio) to speak")
    p.add_argument("--pause-s", type=float, default=0.7, help="silence inserted mid-sentence")
    p.add_argument("--out", type=Path, default=ROOT / "artifacts" / "turn_taking")
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--timeout-s", type=float, default=30.0, help="the probe's limit per turn")
    p.add_argument("--json", type=Path)
    p.add_argument("--verbose", action="store_true", help="debug logs in the server logs (why each turn ended)")
    args = p.parse_args()

    prompts = build_prompts(args.audio, args.out / "prompts", args.pause_s, args.recordings.split(","))
    variants = []
    for spec in args.variant or ["config="]:
        name, _, sets = spec.partition("=")
        variants.append((name, [s for s in sets.split(",") if s]))
    results = []
    for name, sets in variants:
        print(f"=== {name}: {' '.join(sets) or '(the config as is)'}", file=sys.stderr, flush=True)
        slug = re.sub(r"\W+", "_", name)
        proc = serve(args.config, sets, args.port, args.out / f"server-{slug}.log", args.verbose)
        try:
            turns = probe(args.port, prompts, args.timeout_s)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        results.append({"variant": name, "set": sets, "summary": summarise(turns), "turns": turns})
        for t in turns:
            print(f"  {t['prompt']:<36} {t['status']:<7} early={t['early_ends']} overlap={t['overlap_ms']:>5.0f} ms "
                  f"v2v={t['voice_to_voice_ms']} words={t['reply_words']}: {t['reply_text'][:70]!r}")
    print()
    print(f"{'variant':<16} {'answered':>8} {'talked over':>11} {'early':>6} {'early/+pause':>12} "
          f"{'v2v p50':>8} {'p95':>6} {'words p50':>9} {'p95':>5} {'mid-sent.':>9}")
    for r in results:
        s = r["summary"]
        v = s["voice_to_voice_ms"]
        print(f"{r['variant']:<16} {s['answered']:>4}/{s['turns']:<3} {s['talked_over']:>11} {s['committed_early']:>6} "
              f"{s['committed_early_paused']:>8}/{s['n_paused']:<3} {v.get('p50')!s:>8} {v.get('p95')!s:>6} "
              f"{s['reply_words_p50']!s:>9} {s['reply_words_p95']!s:>5} {s['ends_mid_sentence']:>9}")
    if args.json:
        write_result(args.json, "turn_taking", args, {"prompts": [n for n, _ in prompts], "variants": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
