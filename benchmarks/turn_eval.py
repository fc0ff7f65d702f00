"""End-of-turn detection: VAD silence alone vs Smart Turn, on real recordings.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/turn_eval.py --json artifacts/turn_eval.json

Utterances (all real speech; /work/shared/audio, or --audio DIR):
- complete: each recording as it is (5 LibriVox clips, goforward, jfk), then 3 s of
  room tone. Every end of turn before the speech is over is a false one;
- paused: the same recordings with one pause of 0.5, 0.75 or 1.0 s inserted at a gap
  between two words, as a caller reading out a list or thinking mid-sentence. The
  gaps are where Whisper's word timestamps put a word boundary, cut at the quietest
  10 ms there; the pause is filled with the recording's own room tone (its lead-in
  before the first word), so only the timing changes, never the speech.

Each utterance is streamed through Silero VAD in 32 ms windows and the detector under
test, exactly as a session drives it (voicebot/session/turns.py). The Smart Turn
model runs for real on each check; its answer arrives after its measured inference
time (rounded up to the next VAD window, as the session polls per window), so the
end-of-turn delay includes it. Reported per detector:

- false end of turn: share of utterances cut before the caller finished (paused and
  complete sets separately);
- end-of-turn delay: from the end of the last word (last 10 ms frame above -40 dBFS)
  to the END signal, over utterances that were not cut early.

The Smart Turn variants also run with the end-of-turn policy's other signals
(voicebot/core/turn_policy.py): "+ words" hears, at each pause, the transcript of the
audio so far (Whisper, ``--words-model``, as the session's speculative final), which
arrives after its measured decode time (a whole-window file decode, slower than the
session's streamed final: ``--words-delay-ms`` sets a fixed one instead, e.g. the ASR
final's p50 from the voice loop); "+ history" also remembers the pauses the
caller went on after (the utterances made from one recording are the turns of one
call, in order). One run compares what each signal adds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from bench_util import JSON_EPILOG, summarise_ms, write_result  # benchmarks/, beside this file

from voicebot.audio import ASR_RATE, read_wav
from voicebot.config import ModelsConfig, VadConfig
from voicebot.core.turn_policy import PauseHistory
from voicebot.engines.turn.smart_turn import SmartTurn
from voicebot.engines.turn.vad import WINDOW, SileroVad
from voicebot.provision import resolve_model
from voicebot.session.turns import SemanticTurnDetector, Signal, SilenceTurnDetector, TurnDetector

SHARED_AUDIO = Path(__file__).resolve().parents[1].parent / "shared" / "audio"
WINDOW_MS = 1000 * WINDOW / ASR_RATE  # 32 ms
FRAME = ASR_RATE // 100  # 10 ms energy frames
SPEECH_DBFS = -40.0  # the probe's end-of-speech threshold (voicebot/probe/measure.py)
LEAD_S, TAIL_S = 0.5, 3.0


@dataclass
class Utterance:
    name: str
    kind: str  # complete | paused
    audio: np.ndarray
    speech_end_s: float  # end of the last word
    pause_at_s: float | None = None  # where a pause was inserted
    pause_s: float = 0.0


@dataclass
class Outcome:
    name: str
    kind: str
    ends_s: list[float] = field(default_factory=list)  # audio times of END signals
    false_end: bool = False
    delay_ms: float | None = None
    checks: int = 0


# ------------------------------------------------------------------ utterances
def frame_db(audio: np.ndarray) -> np.ndarray:
    n = audio.size // FRAME
    frames = audio[: n * FRAME].reshape(n, FRAME).astype(np.float64)
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1e-12)


def speech_end(audio: np.ndarray) -> float:
    loud = np.flatnonzero(frame_db(audio) > SPEECH_DBFS)
    return float((loud[-1] + 1) * FRAME / ASR_RATE) if loud.size else 0.0


def room_tone(audio: np.ndarray, seconds: float) -> np.ndarray:
    """The recording's own background: its lead-in before the first word, tiled."""
    db = frame_db(audio)
    first = int(np.argmax(db > SPEECH_DBFS))
    lead = audio[: max(FRAME, first * FRAME - FRAME)]
    n = int(seconds * ASR_RATE)
    return np.tile(lead, n // lead.size + 1)[:n].astype(np.float32)


def word_gaps(whisper: object, audio: np.ndarray, min_edge_s: float = 0.35) -> list[float]:
    """Cut points (seconds) between words: the quietest 10 ms frame around each
    boundary Whisper reports, kept only where the signal really dips."""
    segments, _ = whisper.transcribe(audio, language="en", word_timestamps=True, beam_size=1)  # type: ignore[attr-defined]
    words = [w for s in segments for w in (s.words or [])]
    db = frame_db(audio)
    floor = float(np.percentile(db, 5))
    end = speech_end(audio)
    cuts: list[float] = []
    for a, b in zip(words, words[1:], strict=False):
        lo = int(max(0.0, min(a.end, b.start) - 0.06) * 100)
        hi = int(min(end, max(a.end, b.start) + 0.06) * 100)
        if hi <= lo:
            continue
        k = lo + int(np.argmin(db[lo:hi]))
        t = k / 100 + 0.005
        # A real gap: near the floor (a stop closure inside a word rarely gets this low
        # for long), and not at the very start or end of the speech.
        if db[k] < floor + 12 and min_edge_s < t < end - min_edge_s:
            cuts.append(t)
    return cuts


def build_set(audio_dir: Path, whisper: object, pauses: list[float], per_clip: int) -> list[Utterance]:
    names = sorted(p.stem for p in audio_dir.glob("librivox_*.wav")) + ["goforward", "jfk"]
    out: list[Utterance] = []
    for name in names:
        path = audio_dir / f"{name}.wav"
        if not path.is_file():
            continue
        audio, _ = read_wav(path, ASR_RATE)
        lead, tail = room_tone(audio, LEAD_S), room_tone(audio, TAIL_S)
        full = np.concatenate([lead, audio, tail])
        out.append(Utterance(name, "complete", full, LEAD_S + speech_end(audio)))
        cuts = word_gaps(whisper, audio)
        # Spread the chosen gaps over the utterance.
        chosen = [cuts[i] for i in np.linspace(0, len(cuts) - 1, min(per_clip, len(cuts))).round().astype(int)] if cuts else []
        for cut in dict.fromkeys(chosen):
            k = int(cut * ASR_RATE)
            for pause in pauses:
                audio_p = np.concatenate([lead, audio[:k], room_tone(audio, pause), audio[k:], tail])
                out.append(Utterance(f"{name}@{cut:.2f}+{pause:.2f}", "paused", audio_p,
                                     LEAD_S + speech_end(audio) + pause, LEAD_S + cut, pause))
    return out


# ------------------------------------------------------------------ detectors
class TimedModel:
    """Smart Turn answering after its measured inference time, on the audio clock."""

    def __init__(self, model: SmartTurn) -> None:
        self.model = model
        self.clock_ms = 0.0
        self.pending: list[tuple[float, Future[float], float]] = []
        self.latencies_ms: list[float] = []
        self._cache: dict[tuple[str, int], tuple[float, float]] = {}
        self.key = ""

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        key = (self.key, audio16k.size)
        if key not in self._cache:
            t0 = time.perf_counter()
            p = self.model.predict(audio16k)
            self._cache[key] = (p, 1000 * (time.perf_counter() - t0))
            self.latencies_ms.append(self._cache[key][1])
        p, ms = self._cache[key]
        fut: Future[float] = Future()
        self.pending.append((self.clock_ms + ms, fut, p))
        return fut

    def tick(self, clock_ms: float) -> None:
        self.clock_ms = clock_ms
        for due, fut, p in list(self.pending):
            if due <= clock_ms:
                self.pending.remove((due, fut, p))
                if not fut.cancelled():
                    fut.set_result(p)


class TimedWords:
    """The transcript of the audio up to a pause, as the session's speculative final:
    decoded for real, heard after its measured decode time on the audio clock."""

    def __init__(self, whisper: object, delay_ms: float | None = None) -> None:
        self.whisper = whisper
        self.delay_ms = delay_ms  # None: each decode's measured time
        self.pending: list[tuple[float, int, str]] = []
        self._cache: dict[tuple[str, int], tuple[str, float]] = {}
        self.latencies_ms: list[float] = []
        self.key = ""

    def ask(self, audio: np.ndarray, token: int, clock_ms: float) -> None:
        key = (self.key, audio.size)
        if key not in self._cache:
            t0 = time.perf_counter()
            segments, _ = self.whisper.transcribe(audio, language="en", beam_size=1)  # type: ignore[attr-defined]
            text = " ".join(seg.text.strip() for seg in segments)
            self._cache[key] = (text, 1000 * (time.perf_counter() - t0))
            self.latencies_ms.append(self._cache[key][1])
        text, ms = self._cache[key]
        self.pending.append((clock_ms + (ms if self.delay_ms is None else self.delay_ms), token, text))

    def tick(self, det: TurnDetector, clock_ms: float) -> None:
        for item in list(self.pending):
            if item[0] <= clock_ms:
                self.pending.remove(item)
                det.hear_words(item[1], item[2])


def run_one(det: TurnDetector, utt: Utterance, probs: np.ndarray, model: TimedModel | None,
            words: TimedWords | None = None) -> Outcome:
    det.reset()
    if words is not None:
        words.pending = []
    out = Outcome(utt.name, utt.kind)
    clock = 0.0
    for i, p in enumerate(probs):
        det.feed(utt.audio[i * WINDOW : (i + 1) * WINDOW])
        clock += WINDOW_MS
        if model is not None:
            model.tick(clock)  # answers due by the start of this window are in
        if words is not None:
            words.tick(det, clock)
        for sig in det.update(float(p), WINDOW_MS):
            if sig is Signal.END:
                out.ends_s.append(clock / 1000)
            elif sig is Signal.PAUSE and words is not None:
                # The session decodes the turn so far at each pause (its speculative final).
                start = max(0, int((det.turn_start_ms or 0.0) * ASR_RATE / 1000) - ASR_RATE // 2)
                words.ask(utt.audio[start : (i + 1) * WINDOW], det.expect_words(), clock)
    out.checks = getattr(det, "checks", 0)
    # Cut early: an END before the last word is over (one VAD window of slack).
    out.false_end = any(t < utt.speech_end_s - WINDOW_MS / 1000 for t in out.ends_s)
    final = [t for t in out.ends_s if t >= utt.speech_end_s - WINDOW_MS / 1000]
    if not out.false_end and final:
        out.delay_ms = round(1000 * (final[0] - utt.speech_end_s), 1)
    return out


def summarise(name: str, outcomes: list[Outcome]) -> dict[str, object]:
    paused = [o for o in outcomes if o.kind == "paused"]
    complete = [o for o in outcomes if o.kind == "complete"]
    # Delays over the turns not cut early: a detector that cuts more keeps fewer of them,
    # so the complete recordings (the same set for every detector) are the fair comparison.
    dc = [o.delay_ms for o in complete if o.delay_ms is not None]
    dp = [o.delay_ms for o in paused if o.delay_ms is not None]
    return {
        "detector": name,
        "false_end_paused": round(sum(o.false_end for o in paused) / max(1, len(paused)), 3),
        "false_end_complete": round(sum(o.false_end for o in complete) / max(1, len(complete)), 3),
        "n_paused": len(paused),
        "n_complete": len(complete),
        "delay_complete_ms": summarise_ms(dc, 0),
        "delay_paused_ms": summarise_ms(dp, 0),
        "n_delay_paused": len(dp),
        "no_end": sum(1 for o in outcomes if not o.ends_s),
        "checks_per_utterance": round(statistics.fmean(o.checks for o in outcomes), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    ap.add_argument("--audio", type=Path, default=SHARED_AUDIO, help="folder of the recordings")
    ap.add_argument("--json", type=Path, default=Path("artifacts/turn_eval.json"))
    ap.add_argument("--pauses", default="0.5,0.75,1.0", help="inserted pause lengths, seconds")
    ap.add_argument("--gaps-per-clip", type=int, default=3)
    ap.add_argument("--silence-ms", default="400,800,1200", help="VAD-only variants (min_silence_ms)")
    ap.add_argument("--words-model", default="bundle:whisper-base", help="the recogniser of the '+ words' variants")
    ap.add_argument("--words-delay-ms", type=float, help="the pause's transcript arrives this long after the "
                    "pause (default: after its measured decode time)")
    ap.add_argument("--policy", default="192:1500:0.5", help="Smart Turn variants run with + words and + history too")
    ap.add_argument("--smart", default="192:1500:0.5,128:1500:0.5,256:1500:0.5,192:1000:0.5,192:2000:0.5,"
                    "192:1500:0.7,192:1500:0.85,128:1500:0.85",
                    help="Smart Turn variants, check_ms:max_silence_ms:threshold")
    args = ap.parse_args()
    if not args.audio.is_dir():
        sys.exit(f"turn_eval: no folder {args.audio} (use --audio DIR)")

    from faster_whisper import WhisperModel

    models = ModelsConfig()
    whisper = WhisperModel(resolve_model("bundle:whisper-tiny.en", models), device="cpu", compute_type="int8", cpu_threads=2)
    utterances = build_set(args.audio, whisper, [float(p) for p in args.pauses.split(",")], args.gaps_per_clip)
    del whisper
    words = TimedWords(WhisperModel(resolve_model(args.words_model, models), device="cpu", compute_type="int8",
                                    cpu_threads=2), args.words_delay_ms)
    print(f"{len(utterances)} utterances: {sum(u.kind == 'complete' for u in utterances)} complete, "
          f"{sum(u.kind == 'paused' for u in utterances)} with an inserted pause")

    vad = SileroVad()
    probs = {u.name: vad.stream().process(u.audio) for u in utterances}
    smart = SmartTurn(resolve_model("bundle:smart-turn-v3.2", models))
    timed = TimedModel(smart)

    rows: list[dict[str, object]] = []
    details: dict[str, list[dict[str, object]]] = {}
    base = VadConfig()
    variants: list[tuple[str, TurnDetector, TimedModel | None, TimedWords | None]] = []
    for ms in (int(x) for x in args.silence_ms.split(",")):
        cfg = base.model_copy(update={"min_silence_ms": ms})
        variants.append((f"VAD silence {ms} ms", SilenceTurnDetector(cfg), None, None))
    policy = set(args.policy.split(",")) if args.policy else set()
    for spec in args.smart.split(",") + [p for p in policy if p not in args.smart.split(",")]:
        check_s, cap_s, thr_s = spec.split(":")
        check, cap, thr = int(check_s), int(cap_s), float(thr_s)
        smart_cfg = base.model_copy(update={"turn_detector": "smart_turn", "smart_turn_check_ms": check,
                                            "smart_turn_max_silence_ms": cap, "smart_turn_threshold": thr,
                                            "smart_turn_words": False, "smart_turn_history": False})
        name = f"Smart Turn {check}/{cap} ms, p>={thr:g}"
        variants.append((name, SemanticTurnDetector(smart_cfg, timed), timed, None))
        if spec in policy:
            with_words = smart_cfg.model_copy(update={"smart_turn_words": True})
            variants.append((name + " + words", SemanticTurnDetector(with_words, timed), timed, words))
            both = with_words.model_copy(update={"smart_turn_history": True})
            variants.append((name + " + history", SemanticTurnDetector(both, timed), timed, words))
    for name, det, model, heard in variants:
        outcomes = []
        calls: dict[str, PauseHistory] = {}  # one call per recording: its utterances are turns of one caller
        for u in utterances:
            if model is not None:
                model.key, model.clock_ms, model.pending = u.name, 0.0, []
            if heard is not None:
                heard.key = u.name
            if isinstance(det, SemanticTurnDetector):
                det.history = calls.setdefault(u.name.split("@")[0], PauseHistory())
            outcomes.append(run_one(det, u, probs[u.name], model, heard))
        rows.append(summarise(name, outcomes))
        details[name] = [asdict(o) for o in outcomes]

    lat = timed.latencies_ms
    print()
    print(f"{'detector':<46} {'false EOT':>9} {'false EOT':>9} {'delay, complete':>17} {'delay, paused':>14}")
    print(f"{'':<46} {'paused':>9} {'complete':>9} {'p50/mean/max ms':>17} {'p50 ms (n)':>14}")
    for r in rows:
        dc = r["delay_complete_ms"]  # type: ignore[assignment]
        print(f"{r['detector']:<46} {100 * float(r['false_end_paused']):>8.0f}% {100 * float(r['false_end_complete']):>8.0f}% "  # type: ignore[arg-type]
              f"{dc.get('p50')!s:>5}/{dc.get('mean')!s:>5}/{dc.get('max')!s:>5} "
              f"{r['delay_paused_ms'].get('p50')!s:>8} ({r['n_delay_paused']})")  # type: ignore[union-attr]
    inference = summarise_ms(lat)
    decode = summarise_ms(words.latencies_ms)
    print(f"Words (the pause's transcript): {len(words.latencies_ms)} decodes, p50 {decode.get('p50')} ms")
    print(f"\nSmart Turn inference: {len(lat)} runs, p50 {inference.get('p50')} ms, p95 {inference.get('p95')} ms (one thread)")
    results = json.loads(json.dumps({
        "utterances": [{"name": u.name, "kind": u.kind, "seconds": round(u.audio.size / ASR_RATE, 2),
                        "speech_end_s": round(u.speech_end_s, 3), "pause_at_s": u.pause_at_s, "pause_s": u.pause_s}
                       for u in utterances],
        "inference_ms": inference,
        "words_decode_ms": decode,
        "summary": rows,
        "outcomes": details,
        "probability_note": "delays include the model's inference time, rounded up to the next 32 ms VAD window",
    }, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    write_result(args.json, "turn_eval", args, results)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
