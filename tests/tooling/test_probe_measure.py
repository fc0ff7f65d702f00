"""The probe's pure parts (onsets, percentiles, clips, the turn state machine,
the report) and one real-socket run of the driver against a scripted fake server."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from voicebot.errors import ConfigError
from voicebot.probe.clips import load_clip
from voicebot.probe.measure import OnsetDetector, block_levels, percentiles, speech_span
from voicebot.probe.report import build_report, format_table, write_plot
from voicebot.probe.turn import TurnRecord, TurnTracker

RATE = 16000


def tone(seconds: float, dbfs: float, rate: int = RATE) -> np.ndarray:
    """A 440 Hz sine whose RMS is ``dbfs``."""
    t = np.arange(int(seconds * rate)) / rate
    amp = np.sqrt(2) * 10 ** (dbfs / 20)
    return (amp * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), dtype=np.float32)


def pcm(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()


# ---------------------------------------------------------------- onsets
def test_block_levels_read_the_rms_of_each_10ms_block() -> None:
    levels = block_levels(np.concatenate([silence(0.05), tone(0.05, -20.0)]), RATE)
    assert levels.shape == (10,)
    assert np.all(np.isneginf(levels[:5]))
    assert np.allclose(levels[5:], -20.0, atol=0.2)


def test_speech_span_uses_the_minus_40_dbfs_threshold() -> None:
    audio = np.concatenate([silence(0.3), tone(0.2, -45.0), tone(0.5, -35.0), tone(0.4, -45.0)])
    assert speech_span(audio, RATE) == (int(0.5 * RATE), int(1.0 * RATE))
    assert speech_span(tone(1.0, -45.0), RATE) is None
    assert speech_span(tone(1.0, -45.0), RATE, threshold_dbfs=-50.0) == (0, RATE)


def test_streaming_detector_fires_on_the_chunk_that_completes_the_first_loud_block() -> None:
    audio = np.concatenate([silence(0.205), tone(0.1, -30.0)])  # loud from 205 ms
    det = OnsetDetector(RATE)
    chunk = 7 * RATE // 1000  # 7 ms chunks straddle the 10 ms blocks
    fired = [i for i, s in enumerate(range(0, audio.size, chunk)) if det.feed(audio[s : s + chunk])]
    # block 200-210 ms holds 5 ms of tone at -30 dBFS: -33 dBFS, above -40; it completes in
    # the chunk covering 203-210 ms, index 29
    assert fired[0] == 29


def test_detector_ignores_quiet_audio_and_reset_drops_the_partial_block() -> None:
    det = OnsetDetector(RATE)
    assert not det.feed(tone(0.5, -41.0))
    det.feed(tone(0.005, -10.0))  # half a block, loud
    det.reset()
    assert not det.feed(silence(0.005))


# ---------------------------------------------------------------- percentiles
def test_percentiles() -> None:
    p = percentiles(float(v) for v in range(1, 101))
    assert p == {
        "n": 100,
        "p50": 50.5,
        "p90": 90.1,
        "p95": 95.0,
        "p99": 99.0,
        "mean": 50.5,
        "min": 1.0,
        "max": 100.0,
    }
    assert percentiles([250.0, float("nan")])["p99"] == 250.0
    assert percentiles([]) == dict.fromkeys(
        ("n", "p50", "p90", "p95", "p99", "mean", "min", "max")
    ) | {"n": 0}


# ---------------------------------------------------------------- clips
@pytest.mark.parametrize("rate", [8000, 44100, 48000])
def test_wav_of_another_rate_is_resampled_and_framed(tmp_path: Path, rate: int) -> None:
    path = tmp_path / f"clip_{rate}.wav"
    stereo = np.concatenate([silence(0.5, rate), tone(0.5, -20.0, rate), silence(0.31, rate)])
    sf.write(path, np.stack([stereo, stereo], axis=1), rate)
    clip = load_clip(str(path), RATE)
    assert clip.rate == RATE
    assert all(len(f) == 640 for f in clip.frames)  # 20 ms of PCM16 at 16 kHz
    assert len(clip.frames) == 66  # 1.31 s, the last frame padded
    assert abs(clip.first_speech_frame - 25) <= 1
    assert abs(clip.last_speech_frame - 49) <= 1


def test_clip_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_clip(str(tmp_path / "missing.wav"), RATE)
    quiet = tmp_path / "quiet.wav"
    sf.write(quiet, tone(1.0, -50.0), RATE)
    with pytest.raises(ConfigError, match="no audio above"):
        load_clip(str(quiet), RATE)
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not a wav")
    with pytest.raises(ConfigError, match="cannot read"):
        load_clip(str(junk), RATE)


# ---------------------------------------------------------------- turn state machine
def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def test_turn_measures_from_end_of_speech_to_first_audible_reply() -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE)
    tr.speech_ended(10.0)
    tr.on_event(ev("transcript.final", item_id="i1", text="hello"), 10.2)
    tr.on_event(ev("response.started", response_id="r1", item_id="i1"), 10.25)
    tr.on_event(ev("response.audio.started", response_id="r1", item_id="i1"), 10.3)
    tr.on_audio(pcm(silence(0.02)), 10.3)  # lead-in silence does not count
    tr.on_audio(pcm(tone(0.02, -30.0)), 10.45)
    tr.on_audio(pcm(tone(0.02, -30.0)), 10.47)
    assert not tr.finished(10.5)
    tr.on_event(
        ev(
            "response.done",
            response_id="r1",
            item_id="i1",
            status="completed",
            text="hi",
            full_text="hi there",
        ),
        11.0,
    )
    assert not tr.finished(11.0)  # waits briefly for turn.timings
    tr.on_event(ev("turn.timings", response_id="r1", llm_ttft_ms=80.0), 11.01)
    assert tr.finished(11.01)
    rec = tr.finish(11.01)
    assert rec.status == "ok", rec.errors
    assert rec.voice_to_voice_ms == pytest.approx(450.0)
    assert (rec.transcript, rec.reply_text, rec.heard_text) == ("hello", "hi there", "hi")
    assert rec.timings == {"llm_ttft_ms": 80.0}


def test_a_turn_says_when_the_caller_stopped_speaking_on_the_wall_clock(monkeypatch: Any) -> None:
    """Turns of one level come from several probe processes: a stall of the server shows as
    a window of slow turns only on a clock they share (benchmarks/results/burst-h200-2026-11-29
    had to infer it from the callers' order)."""
    import voicebot.probe.turn as turn_mod

    monkeypatch.setattr(turn_mod.time, "time", lambda: 1_000_000.0)
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=0.0)
    tr.speech_ended(10.0)
    rec = tr.finish(12.5, timed_out=True)
    assert rec.speech_end_at == pytest.approx(1_000_000.0 - 2.5)  # 2.5 s before the finish, on the wall clock
    assert TurnTracker(TurnRecord(0, 1, "a.wav"), RATE).finish(3.0, timed_out=True).speech_end_at is None


def test_a_turn_says_how_far_into_its_reply_the_longest_gap_came() -> None:
    """A reply that stalls: the record says how much of its audio had arrived when its
    longest gap began, so a level's stalls show which clause was late (after a short first
    clause, or before a long later one: benchmarks/results/mps-own-gpu-h200-x2-2026-11-30)."""
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=0.0)
    tr.speech_ended(10.0)
    t = 10.4
    for gap in (0.0, 0.1, 0.1, 0.35, 0.1):  # 100 ms chunks; the 4th arrives 250 ms late
        t += gap
        tr.on_audio(pcm(tone(0.1, -30.0)), t)
    rec = tr.finish(12.0, timed_out=True)
    assert rec.reply_max_gap_ms == pytest.approx(350.0)
    assert rec.reply_max_gap_at_ms == pytest.approx(300.0)  # three chunks had come
    from voicebot.probe.report import summarize

    other = TurnRecord(0, 1, "a.wav", reply_max_gap_ms=100.0, reply_max_gap_at_ms=900.0)  # no stall
    assert summarize([rec, other])["stall_at_ms"]["p50"] == pytest.approx(300.0)  # stalled replies only
    assert "stall_at_ms" not in summarize([other])


def test_the_reply_token_counts_come_from_its_response_done() -> None:
    """A remote LLM tier reports usage with its last chunk, after the first audio that
    turn.timings goes out with: the counts are read from response.done, as sent at the end."""
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=0.0)
    tr.speech_ended(10.0)
    tr.on_event(ev("response.started", response_id="r1", item_id="i1"), 10.25)
    tr.on_event(ev("response.audio.started", response_id="r1", item_id="i1"), 10.3)
    tr.on_audio(pcm(tone(0.02, -30.0)), 10.45)
    tr.on_event(ev("turn.timings", response_id="r1", prompt_tokens=None, cached_prompt_tokens=None), 10.46)
    tr.on_event(ev("response.done", response_id="r1", item_id="i1", status="completed", text="hi",
                   full_text="hi", input_tokens=540, cached_tokens=512), 11.0)
    rec = tr.finish(11.0)
    assert (rec.prompt_tokens, rec.cached_tokens) == (540, 512)


def test_a_reply_without_counts_records_none_not_zero() -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=0.0)
    tr.speech_ended(10.0)
    tr.on_event(ev("response.started", response_id="r1", item_id="i1"), 10.25)
    tr.on_audio(pcm(tone(0.02, -30.0)), 10.45)
    tr.on_event(ev("response.done", response_id="r1", item_id="i1", status="completed", text="", full_text=""), 11.0)
    rec = tr.finish(11.0)
    assert (rec.prompt_tokens, rec.cached_tokens) == (None, None)


def test_a_cancelled_speculative_reply_does_not_end_the_turn() -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=0.5)
    tr.speech_ended(1.0)
    tr.on_event(ev("response.started", response_id="spec"), 1.1)
    tr.on_event(
        ev("response.done", response_id="spec", status="cancelled", text="", full_text=""), 1.2
    )
    assert not tr.finished(5.0)
    rec = tr.finish(30.0, timed_out=True)
    assert rec.status == "timeout"
    assert rec.voice_to_voice_ms is None


def test_a_reply_heard_while_the_caller_still_speaks_fails_the_turn_and_says_why() -> None:
    # The server took the caller's pause for the end of the turn: it sent a transcript
    # and reply audio before the clip was over, and the caller's next words barged in.
    tr = TurnTracker(TurnRecord(0, 0, "jfk.wav"), RATE, timings_grace_s=0.0)
    tr.speech_started(0.5)
    tr.on_event(ev("transcript.final", item_id="i1", text="And so my fellow Americans"), 3.0)
    tr.on_event(ev("response.started", response_id="r1"), 3.1)
    tr.on_event(ev("response.audio.started", response_id="r1"), 3.2)
    tr.on_audio(pcm(silence(0.1)), 3.2)  # inaudible audio is not talking over anyone
    tr.on_audio(pcm(tone(0.3, -20.0)), 3.3)
    tr.on_event(ev("barge_in", response_id="r1", played_ms=300, heard_text="I"), 3.6)
    tr.on_event(ev("response.done", response_id="r1", status="interrupted", text="I", full_text="I am"), 3.61)
    tr.speech_ended(8.0)
    tr.on_event(ev("transcript.final", item_id="i2", text="ask what you can do"), 8.3)
    tr.on_event(ev("response.started", response_id="r2"), 8.35)
    tr.on_event(ev("response.audio.started", response_id="r2"), 8.4)
    tr.on_audio(pcm(tone(0.02, -20.0)), 8.5)
    tr.on_event(ev("response.done", response_id="r2", status="completed", text="ok", full_text="ok"), 9.0)
    assert tr.finished(9.0)
    rec = tr.finish(9.0)
    assert rec.status == "failed"
    assert rec.voice_to_voice_ms == pytest.approx(500.0)
    assert (rec.early_ends, rec.overlap_ms, rec.replies_while_speaking) == (1, 300.0, ["r1"])
    assert rec.errors == [
        "talked over the caller: 300 ms of reply audio while they were still speaking, from 2.8 s into "
        "their speech (4.7 s before its end); the server had ended their turn after 'And so my fellow Americans'"
    ]
    assert any("1 barge-in(s) the probe did not make" in n for n in rec.notes)


def test_an_early_end_of_turn_the_caller_never_heard_is_noted_not_failed() -> None:
    # A turn ended early but its reply was dropped before any audio: the caller heard
    # nothing over their speech, so the turn passes with a note.
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=0.0)
    tr.on_event(ev("transcript.final", item_id="i1", text="I would like"), 1.0)
    tr.speech_ended(3.0)
    tr.on_event(ev("response.started", response_id="r1"), 3.2)
    tr.on_event(ev("response.audio.started", response_id="r1"), 3.3)
    tr.on_audio(pcm(tone(0.02, -20.0)), 3.4)
    tr.on_event(ev("response.done", response_id="r1", status="completed", text="x", full_text="x"), 4.0)
    rec = tr.finish(4.0)
    assert rec.status == "ok", rec.errors
    assert (rec.early_ends, rec.overlap_ms) == (1, 0.0)
    assert rec.notes == ["the server ended the turn 1 time(s) before the caller finished, after 'I would like'"]


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ([], "turn timed out: no reply after the end of speech (no response.started)"),
        ([("started", 1.1)], "turn timed out: a reply started but no audible reply came after the end of speech"),
        (
            [("started", 1.1), ("audio", 1.5)],
            "turn timed out: the reply was still playing (0.5 s of reply audio so far; too long a reply)",
        ),
    ],
)
def test_a_timed_out_turn_says_what_it_was_waiting_for(script: list[tuple[str, float]], reason: str) -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE)
    tr.speech_ended(1.0)
    for what, t in script:
        if what == "started":
            tr.on_event(ev("response.started", response_id="r1"), t)
        else:
            tr.on_event(ev("response.audio.started", response_id="r1"), t)
            tr.on_audio(pcm(tone(0.5, -20.0)), t)
    rec = tr.finish(31.0, timed_out=True)
    assert (rec.status, rec.errors) == ("timeout", [reason])


def test_barge_in_measures_event_and_playout_stop() -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, barge_after_s=0.6)
    tr.speech_ended(1.0)
    tr.on_event(ev("response.started", response_id="r1"), 1.2)
    tr.on_event(ev("response.audio.started", response_id="r1"), 1.3)
    tr.on_audio(pcm(tone(0.02, -20.0)), 1.3)
    assert not tr.barge_due(1.8)
    assert tr.barge_due(1.91)
    assert not tr.barge_due(2.0)  # once
    tr.barge_speech_started(2.0)
    tr.on_audio(pcm(tone(0.02, -20.0)), 2.1)
    tr.on_event(ev("barge_in", response_id="r1", played_ms=700, heard_text="x"), 2.25)
    tr.on_audio(pcm(tone(0.02, -20.0)), 2.3)  # still the old reply: playout has not stopped
    tr.on_event(
        ev("response.done", response_id="r1", status="interrupted", text="x", full_text="x y"), 2.31
    )
    tr.barge_clip_ended(3.0)
    assert not tr.finished(3.0)
    tr.on_event(ev("response.started", response_id="r2"), 3.5)
    tr.on_event(ev("response.audio.started", response_id="r2"), 3.6)
    tr.on_audio(pcm(tone(0.02, -20.0)), 3.6)  # the new reply is not the barged one
    tr.on_event(
        ev("response.done", response_id="r2", status="completed", text="z", full_text="z"), 4.0
    )
    tr.on_event(ev("turn.timings", response_id="r1"), 4.0)
    assert tr.finished(4.0)
    rec = tr.finish(4.0)
    assert rec.status == "ok", rec.errors
    assert rec.barge_in == {
        "event_ms": pytest.approx(250.0),
        "playout_stop_ms": pytest.approx(300.0),
    }
    assert rec.reply_text == "x y"
    assert [r["status"] for r in rec.replies] == ["interrupted", "completed"]


def backchannel_turn(*, cut: bool) -> TurnRecord:
    """A reply heard from 1.3 s; "mm-hmm" spoken over it at 1.9 s; the server pauses its
    audio 0.7 s and resumes (or takes it as a barge-in)."""
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, barge_after_s=0.6, backchannel=True, timings_grace_s=0.0)
    tr.speech_ended(1.0)
    tr.on_event(ev("response.started", response_id="r1"), 1.2)
    tr.on_event(ev("response.audio.started", response_id="r1"), 1.3)
    for t in (1.3, 1.5, 1.7, 1.9, 2.0):
        tr.on_audio(pcm(tone(0.02, -20.0)), t)
    assert tr.barge_due(2.0)
    tr.barge_speech_started(2.0)
    tr.barge_clip_ended(2.5)
    if cut:
        tr.on_event(ev("barge_in", response_id="r1", played_ms=700, heard_text="x"), 2.6)
        tr.on_event(ev("response.done", response_id="r1", status="interrupted", text="x", full_text="x y"), 2.6)
        tr.on_event(ev("response.started", response_id="r2"), 3.0)
        tr.on_event(ev("response.audio.started", response_id="r2"), 3.1)
        tr.on_audio(pcm(tone(0.02, -20.0)), 3.1)
        tr.on_event(ev("response.done", response_id="r2", status="completed", text="z", full_text="z"), 3.5)
    else:
        for t in (2.7, 2.9, 3.1):  # paused from 2.0 to 2.7
            tr.on_audio(pcm(tone(0.02, -20.0)), t)
        tr.on_event(ev("response.done", response_id="r1", status="completed", text="x y", full_text="x y"), 3.5)
    assert tr.finished(3.5)
    return tr.finish(3.5)


def test_a_backchannel_that_the_reply_goes_on_after_is_measured_as_a_pause() -> None:
    rec = backchannel_turn(cut=False)
    assert rec.status == "ok", rec.errors
    assert rec.backchannel == {"resumed": True, "paused_ms": pytest.approx(700.0)}
    assert rec.barge_in is None


def test_a_backchannel_that_cut_the_reply_fails_the_turn() -> None:
    rec = backchannel_turn(cut=True)
    assert rec.status == "failed"
    assert rec.backchannel is not None and rec.backchannel["resumed"] is False
    assert any("backchannel" in e for e in rec.errors), rec.errors


def test_the_report_says_how_often_replies_went_on_and_how_long_they_paused() -> None:
    report = build_report({"url": "ws://x"}, [(1, [backchannel_turn(cut=False), backchannel_turn(cut=True)])])
    level = report["levels"][0]
    assert level["backchannel"]["resumed"] == 1 and level["backchannel"]["n"] == 2
    assert level["backchannel"]["paused_ms"]["p50"] == pytest.approx(700.0)
    assert "reply went on 1 of 2, paused p50 700" in format_table(report)


def test_fatal_error_ends_the_turn_as_failed() -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE)
    tr.on_event(ev("error", code="capacity_exceeded", message="full", fatal=True), 0.5)
    assert tr.finished(0.5)
    rec = tr.finish(0.5)
    assert rec.status == "failed"
    assert rec.errors == ["capacity_exceeded: full"]


# ---------------------------------------------------------------- report
def test_report_keeps_levels_and_the_merged_view(tmp_path: Path) -> None:
    def rec(s: int, v2v: float | None) -> TurnRecord:
        return TurnRecord(
            s,
            0,
            "a.wav",
            status="ok" if v2v else "failed",
            voice_to_voice_ms=v2v,
            timings={"llm_ttft_ms": 50.0},
        )

    report = build_report(
        {"url": "ws://x"}, [(1, [rec(0, 400.0)]), (2, [rec(0, 500.0), rec(1, None)])]
    )
    assert report["voice_to_voice_ms"]["n"] == 2
    assert report["voice_to_voice_ms"]["max"] == 500.0
    assert [lv["sessions"] for lv in report["levels"]] == [1, 2]
    assert report["levels"][1]["counts"] == {"turns": 2, "ok": 1, "failed": 1, "timeout": 0, "talked_over": 0, "early_ends": 0}
    assert report["stages_ms"]["llm_ttft_ms"]["n"] == 3
    assert [t["sessions"] for t in report["turns"]] == [1, 2, 2]
    json.dumps(report)
    assert "400" in format_table(report)
    write_plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- scale: cheap per session
def test_pcm16_detector_agrees_with_the_float_detector() -> None:
    rng = np.random.default_rng(0)
    audio = np.concatenate([silence(0.1), tone(0.3, -41.0), tone(0.2, -39.0), silence(0.1), tone(0.2, -20.0)])
    a, b = OnsetDetector(RATE), OnsetDetector(RATE)
    pos, fired_float, fired_pcm = 0, [], []
    while pos < audio.size:
        n = int(rng.integers(1, 900))
        chunk = audio[pos : pos + n]
        # the float path sees what the wire carries: PCM16 back to float
        wire = pcm(chunk)
        fired_float.append(a.feed(np.frombuffer(wire, "<i2").astype(np.float32) / 32768.0))
        fired_pcm.append(b.feed_pcm16(wire))
        pos += n
    assert fired_pcm == fired_float
    assert any(fired_pcm) and not all(fired_pcm)


def test_next_decision_is_the_barge_time_or_the_timings_grace() -> None:
    tr = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, barge_after_s=0.6, timings_grace_s=1.0)
    assert tr.next_decision(5.0) == float("inf")  # only an event or audio can change anything
    tr.speech_ended(1.0)
    tr.on_event(ev("response.audio.started", response_id="r1"), 1.2)
    tr.on_audio(pcm(tone(0.02, -20.0)), 1.3)
    assert tr.next_decision(1.4) == pytest.approx(1.9)
    tr2 = TurnTracker(TurnRecord(0, 0, "a.wav"), RATE, timings_grace_s=1.0)
    tr2.speech_ended(1.0)
    tr2.on_event(ev("response.done", response_id="r1", status="completed"), 2.0)
    assert tr2.next_decision(2.1) == pytest.approx(3.0)
    assert tr2.next_decision(3.5) == 3.5  # already due


def test_the_cli_takes_hundreds_of_sessions_over_several_processes() -> None:
    import argparse

    from voicebot.probe.cli import add_probe_parser, auto_workers

    parser = argparse.ArgumentParser()
    add_probe_parser(parser.add_subparsers())
    args = parser.parse_args(["probe", "--audio", "a.wav", "--sessions", "512", "1024", "--workers", "4"])
    assert (args.sessions, args.workers) == ([512, 1024], 4)
    assert [auto_workers(n, cpus=16) for n in (1, 128, 129, 512, 4096)] == [1, 1, 2, 4, 16]
    assert auto_workers(512, cpus=2) == 2


class _HeldClient:
    """A client whose socket can be full: frames are held back, never lost."""

    output_rate = RATE

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.full = False

    def send_audio_nowait(self, frame: bytes) -> bool:
        if self.full:
            return False
        self.sent.append(frame)
        return True


def test_frame_clock_holds_a_frame_back_while_the_socket_is_full(tmp_path: Path) -> None:
    from voicebot.probe.client import ProbeConfig, _Session

    wav = tmp_path / "say.wav"
    sf.write(wav, np.concatenate([tone(0.06, -20.0), silence(0.04)]), RATE)
    clip = load_clip(str(wav), RATE)
    session = _Session(ProbeConfig(url="ws://127.0.0.1:9/ws", clips=(clip,)), 0, 1)
    client = _HeldClient()
    session.client = client  # type: ignore[assignment]
    ends: list[float] = []
    session.play(clip, None, ends.append)
    assert session.tick() and session.tick()
    client.full = True
    assert not session.tick()  # held back: the clip does not move on
    client.full = False
    while session.tick() and session._clip is not None:
        pass
    assert client.sent[: len(clip.frames)] == list(clip.frames)
    assert len(ends) == 1  # end of speech stamped once, when its frame went out
    assert session.tick() and client.sent[-1] == bytes(len(clip.frames[0]))  # then silence


# ---------------------------------------------------------------- real sockets
@pytest.fixture(scope="module")
async def scripted_url() -> Any:
    """A fake native server that answers 300 ms after the caller's audio stops with
    100 ms of tone (5 chunks of 20 ms, sent at once), then done and timings."""
    from websockets.asyncio.server import ServerConnection, serve

    async def handler(ws: ServerConnection) -> None:
        start = json.loads(await ws.recv())
        await ws.send(
            json.dumps(
                {
                    "type": "session.started",
                    "session_id": "s",
                    "sample_rate": start["sample_rate"],
                    "output_sample_rate": RATE,
                }
            )
        )
        quiet_ms, spoke, turn = 0, False, 0
        async for msg in ws:
            if not isinstance(msg, bytes):
                continue
            loud = np.abs(np.frombuffer(msg, "<i2")).max() > 300
            spoke, quiet_ms = (True, 0) if loud else (spoke, quiet_ms + 20)
            if spoke and quiet_ms >= 300:
                spoke, rid = False, f"r{turn}"
                turn += 1
                await ws.send(
                    json.dumps({"type": "response.started", "response_id": rid, "item_id": "i"})
                )
                await ws.send(
                    json.dumps(
                        {"type": "response.audio.started", "response_id": rid, "item_id": "i"}
                    )
                )
                for _ in range(5):
                    await ws.send(pcm(tone(0.02, -20.0)))
                await ws.send(
                    json.dumps(
                        {
                            "type": "response.done",
                            "response_id": rid,
                            "item_id": "i",
                            "status": "completed",
                            "text": "ok",
                            "full_text": "ok",
                        }
                    )
                )
                await ws.send(
                    json.dumps({"type": "turn.timings", "response_id": rid, "llm_ttft_ms": 1.0})
                )

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/ws"


@pytest.fixture(scope="module")
def say_clip(tmp_path_factory: pytest.TempPathFactory) -> Any:
    wav = tmp_path_factory.mktemp("probe") / "say.wav"
    sf.write(wav, np.concatenate([tone(0.3, -20.0, 22050), silence(0.1, 22050)]), 22050)
    return load_clip(str(wav), RATE)


def _check_records(records: list[TurnRecord], sessions: int, turns: int) -> None:
    assert [(r.session, r.turn, r.status) for r in records] == [
        (s, t, "ok") for s in range(sessions) for t in range(turns)
    ], [r.errors for r in records]
    for r in records:
        # 300 ms of server-side silence counting (one frame of it is the last speech frame's).
        # A starved sender catches up with up to _RESYNC_S (0.2 s) of overdue frames in one
        # burst, which the server counts as silence at once: hence the lower bound's room.
        assert r.voice_to_voice_ms is not None and 80 <= r.voice_to_voice_ms <= 1000, r
        assert r.timings == {"llm_ttft_ms": 1.0}
        assert r.reply_audio_ms == pytest.approx(100.0)  # the 5 chunks after the end of speech


async def test_driver_against_a_scripted_server(scripted_url: str, say_clip: Any) -> None:
    from voicebot.probe.client import ProbeConfig, run_level

    cfg = ProbeConfig(url=scripted_url, clips=(say_clip,), turns=2, gap_s=0.1, timeout_s=5.0, stagger_s=0.05)
    records = await asyncio.wait_for(run_level(cfg, 2), 30)
    _check_records(records, 2, 2)


async def test_the_turn_limit_counts_from_the_end_of_the_clip(scripted_url: str, tmp_path: Path) -> None:
    # A clip longer than the limit is still answered in time: the caller's own speech is
    # not the server's time.
    from voicebot.probe.client import ProbeConfig, run_level

    wav = tmp_path / "long.wav"
    sf.write(wav, np.concatenate([tone(1.5, -20.0, 22050), silence(0.1, 22050)]), 22050)
    cfg = ProbeConfig(url=scripted_url, clips=(load_clip(str(wav), RATE),), turns=1, gap_s=0.0, timeout_s=1.0)
    records = await asyncio.wait_for(run_level(cfg, 1), 30)
    assert [(r.status, r.errors) for r in records] == [("ok", [])]


async def test_a_session_keeps_no_reply_audio_unless_it_is_saved(
    scripted_url: str, say_clip: Any, tmp_path: Path
) -> None:
    """60 s of float audio per turn and session were kept for --save-audio even without
    it: ~6 MB per session-turn, gigabytes at 512 sessions."""
    from voicebot.probe.client import FrameClock, ProbeConfig, _Session

    cfg = ProbeConfig(url=scripted_url, clips=(say_clip,), turns=1, timeout_s=5.0, gap_s=0.0)
    clock = FrameClock(0.02)
    ticker = asyncio.create_task(clock.run())
    try:
        plain = _Session(cfg, 0, 1)
        saved = _Session(replace(cfg, save_audio=tmp_path), 1, 1)
        await asyncio.wait_for(asyncio.gather(plain.run(clock), saved.run(clock)), 30)
    finally:
        ticker.cancel()
    assert plain.records[0].status == saved.records[0].status == "ok"
    assert plain.tracker is not None and plain.tracker.reply_audio().size == 0
    assert saved.tracker is not None and saved.tracker.reply_audio().size > 0
    assert (tmp_path / "n1_s1_t0.wav").is_file()
    assert clock.ticks > 0 and clock.skipped == 0  # frames went out through the one clock


async def test_sessions_spread_over_worker_processes(scripted_url: str, say_clip: Any) -> None:
    from voicebot.probe.client import ProbeConfig, run_level_measured
    from voicebot.probe.report import build_report

    cfg = ProbeConfig(url=scripted_url, clips=(say_clip,), turns=1, timeout_s=5.0, stagger_s=0.05, workers=2)
    result = await asyncio.wait_for(run_level_measured(cfg, 3), 60)
    _check_records(result.records, 3, 1)
    stats = result.stats.as_dict()
    assert (stats["workers"], stats["sessions"]) == (2, 3)
    assert stats["cpu_s"] > 0 and stats["ticks"] > 0 and stats["tick_late_ms"]["n"] > 0
    report = build_report({}, [(3, result.records)], probe=[stats])
    assert report["levels"][0]["probe"] == stats
    assert report["levels"][0]["stalled_replies"] == 0
    assert report["levels"][0]["reply_rtf_pct"]["n"] == 3


def test_sessions_spread_over_several_servers_by_index(say_clip: Any) -> None:
    """Scale-out runs (several frontends): session i calls urls[i % len(urls)]."""
    from voicebot.probe.client import ProbeConfig, _Session

    a, b = "ws://127.0.0.1:1/ws", "ws://127.0.0.1:2/ws"
    cfg = ProbeConfig(url=a, urls=(a, b), clips=(say_clip,))
    assert [_Session(cfg, i, 5).client.options.url for i in range(5)] == [a, b, a, b, a]  # type: ignore[attr-defined]
    assert _Session(replace(cfg, urls=()), 1, 5).client.options.url == a  # type: ignore[attr-defined]


def test_poisson_arrivals_are_a_seeded_schedule_of_the_same_mean_rate() -> None:
    """Independent callers' starts and waits: exponential, the same in every worker process
    for one seed, another for another seed; "even" keeps the fixed spacing."""
    from voicebot.probe.client import ProbeConfig, start_offsets, turn_gaps

    even = ProbeConfig(url="ws://x", clips=(), stagger_s=0.1, gap_s=0.5)
    assert start_offsets(even, 4) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert list(itertools.islice(turn_gaps(even, 3), 3)) == [0.5, 0.5, 0.5]

    poisson = replace(even, arrivals="poisson", seed=7)
    starts = start_offsets(poisson, 2000)
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert starts == start_offsets(poisson, 2000) != start_offsets(replace(poisson, seed=8), 2000)
    assert start_offsets(poisson, 10) == starts[:10]  # a worker with fewer sessions agrees
    intervals = np.diff(starts)
    assert intervals.mean() == pytest.approx(0.1, rel=0.1)
    assert intervals.std() == pytest.approx(0.1, rel=0.15)  # exponential: std = mean, not 0
    drawn = list(itertools.islice(turn_gaps(poisson, 3), 2000))
    assert np.mean(drawn) == pytest.approx(0.5, rel=0.1)
    assert drawn[:5] == list(itertools.islice(turn_gaps(poisson, 3), 5))
    assert drawn[:5] != list(itertools.islice(turn_gaps(poisson, 4), 5))  # callers differ


async def test_a_poisson_level_runs_against_a_scripted_server(scripted_url: str, say_clip: Any) -> None:
    from voicebot.probe.client import ProbeConfig, run_level

    cfg = ProbeConfig(url=scripted_url, clips=(say_clip,), turns=2, gap_s=0.1, timeout_s=5.0, stagger_s=0.05,
                      arrivals="poisson", seed=3)
    records = await asyncio.wait_for(run_level(cfg, 3), 30)
    _check_records(records, 3, 2)
