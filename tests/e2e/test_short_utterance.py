"""A one-word answer as the second turn of a call is heard and answered, on every protocol.

The word is real speech: WORD below, cut out of a LibriVox clip of the test set
(tests/speech.py) and made a telephone recording: 8 kHz, through G.711 μ-law and
back, 0.75 s in all. The caller first says a sentence, waits until the reply has
played out, then says the word. Each protocol is driven by its probe client
(voicebot/probe), which streams in real time with silence between turns, echoes
Twilio's marks, and sends Opus over a real WebRTC peer connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from servers import FAST_SPEECH, EnginePool, RunningServer, running_server
from speech import Clip

from voicebot.audio import ASR_RATE, Resampler, float_to_pcm16, pcm16_to_float, resample
from voicebot.config import ModelsConfig, VadConfig, load_config
from voicebot.engines.turn.vad import WINDOW, SileroVad
from voicebot.probe.client import ProbeConfig, run_level
from voicebot.probe.clips import load_clip
from voicebot.probe.turn import TurnRecord
from voicebot.session.turns import Signal, SilenceTurnDetector
from voicebot.wire import g711

pytestmark = [pytest.mark.engines, pytest.mark.timeout(400)]  # a hang guard; the module's server load counts to its first test

# (clip, start s, end s, the word): the last word of "... in his power to do for them",
# 0.75 s from the quiet gap after "for" to the end of the recording.
WORD = ("0870", 6.35, 7.10, "them")
UTTERANCE_S = 0.75
PEAK_DBFS = -8.0


def telephone_word(clips: list[Clip]) -> np.ndarray:
    """The word as a phone line carries it: 8 kHz float32 after a μ-law round trip."""
    name, start, end, _ = WORD
    clip = next(c for c in clips if c.name.endswith(name))
    audio = clip.audio[int(start * ASR_RATE) : int(end * ASR_RATE)].copy()
    fade = int(0.005 * ASR_RATE)  # no click at the cut
    audio[:fade] *= np.linspace(0.0, 1.0, fade, dtype=np.float32)
    audio[-fade:] *= np.linspace(1.0, 0.0, fade, dtype=np.float32)
    audio *= 10 ** (PEAK_DBFS / 20) / np.abs(audio).max()  # a phone line's gain control
    phone = resample(audio, ASR_RATE, g711.RATE)
    return pcm16_to_float(g711.decode("audio/pcmu", g711.encode("audio/pcmu", float_to_pcm16(phone))))


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig) -> AsyncIterator[RunningServer]:
    cfg = load_config("configs/test.yaml", [f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH, "llm.max_tokens=2"])
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


@pytest.fixture(scope="module")
def wavs(speech_clips: list[Clip], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("short")
    word = folder / "word-8k.wav"
    sf.write(word, telephone_word(speech_clips), g711.RATE, subtype="PCM_16")
    first = next(c for c in speech_clips if c.name.endswith("0880"))  # "he was not an ill disposed young man"
    return first.path, word


def word_starts_a_turn(vad: SileroVad, word: np.ndarray, silence_samples: int) -> bool:
    """The session's own path for phone audio (8 kHz chunks -> soxr -> Silero VAD ->
    turn detector) after ``silence_samples`` of silence (8 kHz)."""
    silence = np.zeros(silence_samples, dtype=np.float32)
    audio = np.concatenate([silence, word, np.zeros(g711.RATE // 2, dtype=np.float32)])
    resampler, stream, turns = Resampler(g711.RATE, ASR_RATE), vad.stream(), SilenceTurnDetector(VadConfig())
    for i in range(0, audio.size, 160):  # Twilio's 20 ms frames
        for p in stream.process(resampler.process(audio[i : i + 160])):
            if Signal.SPEECH_START in turns.update(float(p), 32.0):
                return True
    return False


def test_the_word_starts_a_turn_after_any_silence_at_any_window_phase(speech_clips: list[Clip]) -> None:
    """After the silence of a caller listening to a reply, at each of the 16 alignments
    of the word to the VAD's 32 ms windows. Silero's state drifted in long silence: the
    word started no turn at 14 of these 48 (vad.py now resets it)."""
    word = telephone_word(speech_clips)
    vad = SileroVad()
    lost = [
        (silence_s, phase)
        for silence_s in (1.0, 5.0, 19.0)
        for phase in range(0, WINDOW // 2, 16)  # in 8 kHz samples: 16 steps of 2 ms
        if not word_starts_a_turn(vad, word, int(silence_s * g711.RATE) + phase)
    ]
    assert not lost, f"no turn for the word after (silence s, phase) = {lost}"


def test_the_word_starts_a_turn_wherever_the_quiet_reset_falls(speech_clips: list[Clip]) -> None:
    """The state reset after ~1 s of quiet (vad.py) can fall anywhere before the word:
    every silence from 1 to 2 s in 2 ms steps covers each of its 31 window positions at
    16 phases. A reset that landed in the word's quiet lead-in, 1-5 windows before the
    speech, left the model cold: the word scored above 0.5 for fewer than
    ``min_speech_ms`` and was lost after 5 of these 500 silences (the call test below
    failed now and then that way). The state now restarts warmed on the last quiet
    windows."""
    word = telephone_word(speech_clips)
    vad = SileroVad()
    lost = [ms for ms in range(1000, 2000, 2) if not word_starts_a_turn(vad, word, ms * g711.RATE // 1000)]
    assert not lost, f"no turn for the word after these silences (ms): {lost}"


def test_the_recording_is_one_short_loud_word(speech_clips: list[Clip]) -> None:
    audio = telephone_word(speech_clips)
    assert abs(audio.size / g711.RATE - UTTERANCE_S) < 0.01
    peak = 20 * np.log10(np.abs(audio).max())
    assert -10 < peak < -6, peak


PROTOCOLS = {  # protocol: (path, rate the caller sends)
    "native": ("/ws", 16000),
    "realtime": ("/v1/realtime", 8000),  # G.711 μ-law on the wire, as a phone gateway sends
    "twilio": ("/twilio", 8000),
    "webrtc": ("", 16000),  # Opus at 48 kHz on the wire
}


async def call(server: RunningServer, wavs: tuple[Path, Path], protocol: str) -> list[TurnRecord]:
    path, rate = PROTOCOLS[protocol]
    first, word = (load_clip(str(p), rate) for p in wavs)
    url = server.http if protocol == "webrtc" else server.ws(path)
    # Two tokens: the test model's words are random, and long ones take seconds to say.
    tokens = {"max_output_tokens": 2} if protocol == "webrtc" else {"max_tokens": 2}
    cfg = ProbeConfig(url=url, clips=(first, word), turns=2, protocol=protocol, sample_rate=rate,
                      timeout_s=20, gap_s=0.3, start_fields=tokens)
    return await run_level(cfg, 1)


async def test_one_word_second_turn_is_answered_on_every_protocol(
    server: RunningServer, wavs: tuple[Path, Path]
) -> None:
    # One caller per protocol: the three WebSocket ones at once (the suite's time budget),
    # then WebRTC alone. With all four at once on 2 cores, WebRTC's word was lost in about
    # one run of five (a CI failure): no speech_started at the server, no error. That was
    # put down to the Python Opus and RTP paths starving; the VAD's cold restart found
    # later (test above) loses a word in just that way, at any load.
    sockets = [p for p in PROTOCOLS if p != "webrtc"]
    results = dict(zip(sockets, await asyncio.gather(*(call(server, wavs, p) for p in sockets)), strict=True))
    results["webrtc"] = await call(server, wavs, "webrtc")
    problems = []
    for protocol, (turn1, turn2) in results.items():
        if turn1.status != "ok" or not turn1.replies or turn1.replies[0]["status"] != "completed":
            problems.append(f"{protocol}: the first turn was not answered: {turn1}")
        # The word: transcribed (Twilio carries no transcript), answered with a reply that played.
        elif (protocol != "twilio" and not turn2.transcript.strip()) or turn2.status != "ok" or not any(
            r["status"] == "completed" for r in turn2.replies
        ):
            problems.append(f"{protocol}: the one-word turn: transcript {turn2.transcript!r}, "
                            f"status {turn2.status}, replies {turn2.replies}, errors {turn2.errors}")
    assert not problems, "\n".join(problems)
