"""A call's audio (telemetry.record_audio): both sides placed on the call's clock, a
reply cut at what the caller heard, written as the call goes in bounded memory, and
files that are valid WAVs at every moment; then a whole call with fakes of the
engines, whose WAV sits beside its record."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fakes import Caller, clock_of, make_engines, until

from voicebot.config import TelemetryConfig
from voicebot.errors import ConfigError
from voicebot.metrics import Metrics
from voicebot.observe import audio_files
from voicebot.observe.audio_files import AudioFiles
from voicebot.observe.call_audio import BLOCK_S, HOLD_S, RATE, StereoTimeline
from voicebot.observe.telemetry import CallTelemetry, Telemetry
from voicebot.session import events as ev
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings

FRAME = RATE // 50  # 20 ms
T0 = 100.0  # the call's start on its clock


def frames(seconds: float, level: float) -> list[np.ndarray]:
    return [np.full(FRAME, level, dtype=np.float32) for _ in range(int(round(seconds * 50)))]


def runs(channel: np.ndarray) -> list[tuple[float, float]]:
    """(start s, end s) of each stretch of sound in one channel."""
    loud = np.concatenate([[False], np.abs(channel) > 0, [False]])
    edges = np.flatnonzero(np.diff(loud.astype(np.int8)))
    return [(a / RATE, b / RATE) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def whole(timeline: StereoTimeline, blocks: list[np.ndarray]) -> np.ndarray:
    last = timeline.take(None)
    return np.concatenate([*blocks, *([last] if last is not None else [])]).astype(np.float32) / 32768


def test_both_sides_land_where_they_happened_on_the_calls_clock() -> None:
    tl = StereoTimeline(T0)
    blocks: list[np.ndarray] = []
    # The caller: silence, 1 s of speech from 0.5 s, each frame arriving as it ends;
    # a client that sends nothing while the bot speaks (1.6-2.6 s), then 0.4 s more.
    for i, frame in enumerate(frames(1.6, 0.0)):
        tl.caller(frame + (0.3 if 25 <= i < 75 else 0.0), T0 + (i + 1) * 0.02)
    for i, frame in enumerate(frames(0.4, 0.3)):
        tl.caller(frame, T0 + 2.6 + (i + 1) * 0.02)
    # The bot: a reply from 1.6 s, its first 120 ms sent at once (the playout lead),
    # then a frame every 20 ms.
    reply = frames(0.6, 0.5)
    for i, frame in enumerate(reply):
        tl.bot("resp_1", frame, T0 + 1.6 + max(0, i - 6) * 0.02)
    audio = whole(tl, blocks)
    assert runs(audio[:, 0]) == [(0.5, 1.5), (2.6, 3.0)]
    assert runs(audio[:, 1]) == [(1.6, 2.2)]
    assert audio.shape[0] == 3 * RATE


def test_network_jitter_is_closed_up_and_a_long_gap_is_silence() -> None:
    tl = StereoTimeline(T0)
    for i, frame in enumerate(frames(1.0, 0.3)):
        jitter = 0.06 if i % 10 == 5 else 0.0  # a frame late now and then
        tl.caller(frame, T0 + (i + 1) * 0.02 + jitter)
    for i, frame in enumerate(frames(0.5, 0.3)):
        tl.caller(frame, T0 + 2.0 + (i + 1) * 0.02)  # nothing for a second
    audio = whole(tl, [])
    assert runs(audio[:, 0]) == [(0.0, 1.0), (2.0, 2.5)]


def test_a_cut_reply_keeps_what_the_caller_heard_and_the_next_reply_plays_after() -> None:
    tl = StereoTimeline(T0)
    blocks: list[np.ndarray] = []
    # 2 s of reply audio sent ahead by 0.12 s, from 1 s; cut at 2.0 s, 0.9 s heard
    # (what the call reports: played less the lead the client still held).
    for i, frame in enumerate(frames(1.12, 0.5)):
        tl.bot("resp_1", frame, T0 + 1.0 + max(0, i - 6) * 0.02)
    tl.cut("resp_1", 0.9)
    for i, frame in enumerate(frames(0.5, 0.25)):
        tl.bot("resp_2", frame, T0 + 3.0 + i * 0.02)
        if (block := tl.take(T0 + 3.0 + i * 0.02)) is not None:
            blocks.append(block)
    audio = whole(tl, blocks)
    assert runs(audio[:, 1]) == [(1.0, 1.9), (3.0, 3.5)]
    assert np.allclose(audio[int(1.0 * RATE) : int(1.9 * RATE), 1], 0.5, atol=1e-4)


def test_a_reply_truncated_after_it_ended_loses_only_its_own_unheard_audio() -> None:
    # A Realtime client truncates a reply it played from its own buffer once the next
    # reply's audio was already sent: the next reply stays whole.
    tl = StereoTimeline(T0)
    for frame in frames(1.0, 0.5):
        tl.bot("resp_1", frame, T0 + 1.0)  # sent at once: plays 1.0-2.0 s
    for frame in frames(0.5, 0.25):
        tl.bot("resp_2", frame, T0 + 1.1)  # plays 2.0-2.5 s
    tl.cut("resp_1", 0.4)
    tl.cut("resp_1", 0.6)  # a later, longer truncate takes nothing back
    tl.cut("resp_0", 0.0)  # a reply never placed: nothing to do
    audio = whole(tl, [])
    assert runs(audio[:, 1]) == [(1.0, 1.4), (2.0, 2.5)]
    assert np.allclose(audio[int(2.0 * RATE) : int(2.5 * RATE), 1], 0.25, atol=1e-4)


def test_a_hang_up_drops_the_reply_audio_sent_ahead_of_it() -> None:
    tl = StereoTimeline(T0)
    for frame in frames(0.5, 0.5):
        tl.bot("resp_1", frame, T0 + 1.0)  # sent at once: plays 1.0-1.5 s
    tl.hang_up(T0 + 1.2)
    assert runs(whole(tl, [])[:, 1]) == [(1.0, 1.2)]


def test_a_long_call_is_written_as_it_goes_and_memory_stays_bounded() -> None:
    tl = StereoTimeline(T0)
    written = 0
    pending_max = 0
    for i in range(600 * 50):  # ten minutes of 20 ms frames, both sides talking
        now = T0 + (i + 1) * 0.02
        tl.caller(np.full(FRAME, 0.1, dtype=np.float32), now)
        tl.bot(f"resp_{i // 500}", np.full(FRAME, 0.2, dtype=np.float32), now)
        if (block := tl.take(now, int(BLOCK_S * RATE))) is not None:
            written += block.shape[0]
        pending = sum(a.size for ch in (tl.left, tl.right) for _, a in ch.segments)
        pending_max = max(pending_max, pending)
        assert written >= (now - T0 - HOLD_S - BLOCK_S) * RATE - FRAME, "written as it goes"
    assert pending_max <= 2 * (HOLD_S + BLOCK_S) * RATE + 4 * FRAME


def test_a_caller_far_ahead_of_the_clock_is_written_anyway() -> None:
    tl = StereoTimeline(T0)
    written = 0
    for frame in frames(60.0, 0.1):  # a minute of audio in one instant
        tl.caller(frame, T0 + 0.02)
        if (block := tl.take(T0 + 0.02, int(BLOCK_S * RATE))) is not None:
            written += block.shape[0]
    pending = sum(a.size for _, a in tl.left.segments)
    assert pending <= (2 * HOLD_S + BLOCK_S) * RATE and written + pending == 60 * RATE


def test_a_call_longer_than_max_s_keeps_its_first_seconds() -> None:
    tl = StereoTimeline(T0, max_s=2.0)
    for i, frame in enumerate(frames(5.0, 0.1)):
        tl.caller(frame, T0 + (i + 1) * 0.02)
    audio = whole(tl, [])
    assert audio.shape[0] == 2 * RATE and tl.truncated


# ------------------------------------------------------------------- the files
def wait_for_size(path: Path, size: int) -> None:
    deadline = time.monotonic() + 5
    while not (path.exists() and path.stat().st_size == size):
        assert time.monotonic() < deadline, f"{path} never reached {size} bytes"
        time.sleep(0.01)


def test_a_wav_is_valid_while_it_is_written_and_the_oldest_rotate_out(tmp_path: Path) -> None:
    outcomes: list[str] = []
    files = AudioFiles(str(tmp_path), rate=RATE, channels=2, max_files=2, max_bytes=1 << 30,
                       on_outcome=outcomes.append)
    block = (np.arange(2 * RATE, dtype=np.int16) % 1000).astype("<i2").tobytes()  # 1 s of frames
    names = [f"2026112{i}T000000.000Z_sess_{i}.wav" for i in range(3)]
    first = files.open(names[0])
    assert first.write(block) and first.write(block)
    wait_for_size(tmp_path / names[0], 44 + 2 * len(block))
    audio, rate = sf.read(tmp_path / names[0], dtype="int16")  # mid-call: whole as it stands
    assert rate == RATE and audio.shape == (2 * RATE, 2)
    assert audio.reshape(-1).tobytes() == 2 * block
    first.close()
    for name in names[1:]:
        stream = files.open(name)
        stream.write(block)
        stream.close()
    files.close(5.0)
    assert outcomes == ["written"] * 3
    assert sorted(os.listdir(tmp_path)) == names[1:], "the oldest went beyond record_max_files"


def test_an_unwritable_directory_costs_the_file_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    outcomes: list[str] = []
    files = AudioFiles(str(blocker / "calls"), rate=RATE, channels=2, max_files=10, max_bytes=1 << 30,
                       on_outcome=outcomes.append)
    for i in range(2):
        stream = files.open(f"x_{i}.wav")
        stream.write(b"\0" * 4000)
        stream.close()
    files.close(5.0)
    assert outcomes == ["failed", "failed"]
    assert len([r for r in caplog.records if "cannot be written" in r.getMessage()]) == 1, "logged once"


def test_a_writer_behind_drops_blocks_instead_of_growing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audio_files, "_MAX_PENDING", 10_000)
    outcomes: list[str] = []
    files = AudioFiles(str(tmp_path), rate=RATE, channels=2, max_files=10, max_bytes=1 << 30,
                       on_outcome=outcomes.append)
    stuck = threading.Event()
    opening = files._open
    monkeypatch.setattr(files, "_open", lambda path: stuck.wait(5) and opening(path))  # the disk hangs
    stream = files.open("slow.wav")
    accepted = [stream.write(b"\0" * 4000) for _ in range(4)]
    stuck.set()
    stream.close()
    files.close(5.0)
    assert accepted == [True, True, False, False] and outcomes == ["dropped"]


def test_record_audio_needs_a_record_dir() -> None:
    with pytest.raises(ConfigError, match="record_dir"):
        Telemetry(TelemetryConfig(record_audio=True), Metrics(), environ={})


# ------------------------------------------------------------- a whole call
def the_record(directory: Path) -> tuple[str, dict]:
    """The one call record in ``directory``: its file name and its JSON."""
    (name,) = [n for n in os.listdir(directory) if n.endswith(".json")]
    return name, json.loads((directory / name).read_text(encoding="utf-8"))


async def test_a_calls_wav_sits_beside_its_record_with_the_barge_in_cut(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    metrics = Metrics()
    telemetry = Telemetry(TelemetryConfig(record_dir=str(tmp_path), record_audio=True), metrics, environ={})
    observer = telemetry.observer()
    assert isinstance(observer, CallTelemetry) and observer.audio is not None
    engines = make_engines(tokenizer, word_delay=0.01)
    clock = clock_of(engines)
    session = Session(engines, SessionSettings.from_config(engines.cfg), clock=clock, observer=observer)
    async with session:
        t0 = clock.monotonic()
        c = Caller(session, clock)
        await c.speak(600)
        await c.silence(500)
        await c.wait_for(ev.ResponseAudioStarted)
        await c.pause(0.6)
        talks_over = clock.monotonic() - t0
        await c.speak(400)  # the caller talks over the reply
        session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]  # words: a barge-in
        await c.wait_for(ev.BargeIn)
        await c.silence(600)
        await until(clock, lambda: len(c.of(ev.ResponseDone)) == 2, timeout=20)
        await c.silence(200)
        await c.close()
    await telemetry.aclose()

    record_name, record = the_record(tmp_path)
    ref = record["audio"]
    assert ref["file"] == record_name.replace(".json", ".wav") and ref["complete"]
    assert ref["sample_rate"] == RATE and ref["channels"] == ["caller", "bot"]
    audio, rate = sf.read(tmp_path / ref["file"], dtype="float32")
    assert rate == RATE and audio.shape[1] == 2
    assert abs(audio.shape[0] / RATE - record["duration_s"]) < 0.05 and audio.shape[0] / RATE == ref["duration_s"]
    caller, bot = runs(audio[:, 0]), runs(audio[:, 1])
    # The caller's two utterances where they were said.
    assert len(caller) == 2 and caller[0][0] < 0.05 and abs(caller[0][1] - caller[0][0] - 0.6) < 0.03
    assert abs(caller[1][0] - talks_over) < 0.03 and abs(caller[1][1] - caller[1][0] - 0.4) < 0.03
    # The bot: the first reply from before the caller talked over it, for what the
    # caller heard of it; the second one whole.
    first, second = (d for d in c.of(ev.ResponseDone))
    assert first.status == "interrupted" and second.status == "completed"
    assert bot[0][0] < talks_over < bot[0][1] < caller[1][1]
    assert abs(bot[0][1] - bot[0][0] - first.played_ms / 1000) < 0.021
    assert abs(sum(b - a for a, b in bot[1:]) - second.played_ms / 1000) < 0.021
    assert metrics.call_audio.labels("written")._value.get() == 1


async def test_a_reply_the_client_truncates_after_it_ended_is_recorded_as_heard(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # An OpenAI Realtime client plays the reply from its own buffer and, when its
    # caller talks over it, truncates the item at what was played: the reply had long
    # been sent (and done) on the server's side.
    telemetry = Telemetry(TelemetryConfig(record_dir=str(tmp_path), record_audio=True), Metrics(), environ={})
    engines = make_engines(tokenizer, word_delay=0.01)
    clock = clock_of(engines)
    session = Session(engines, SessionSettings.from_config(engines.cfg), clock=clock, observer=telemetry.observer())
    async with session:
        t0 = clock.monotonic()
        c = Caller(session, clock)
        await c.speak(600)
        await c.silence(500)
        started = await c.wait_for(ev.ResponseAudioStarted)
        audio_at = clock.monotonic() - t0
        done = await c.wait_for(ev.ResponseDone, timeout=20)
        assert done.status == "completed" and done.played_ms > 600
        end_ms = done.played_ms // 2
        heard = session.truncate(started.item_id, end_ms)
        assert heard and heard != done.full_text
        await c.silence(200)
        await c.close()
    await telemetry.aclose()

    _, record = the_record(tmp_path)
    (reply,) = [r for t in record["turns"] for r in t["replies"]]
    assert reply["text"] == done.full_text
    assert reply["heard"] == heard and reply["played_ms"] == end_ms
    assert reply["truncated"]["audio_end_ms"] == end_ms
    audio, _ = sf.read(tmp_path / record["audio"]["file"], dtype="float32")
    (bot,) = runs(audio[:, 1])
    assert abs(bot[0] - audio_at) < 0.03 and abs(bot[1] - bot[0] - end_ms / 1000) < 0.021
