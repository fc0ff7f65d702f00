"""The telephony bridge: Twilio Media Streams at /twilio, TwiML at /twilio/voice.

Pure tests of :mod:`voicebot.transports.twilio_protocol` first, then real calls
against the real app (real engines, real sockets) with a scripted Twilio: μ-law
8 kHz in real-time 20 ms frames, a playback clock that echoes marks once their audio
has "played", and a clear that drops what is buffered. The test LLM is random: its
words are nonsense, so nothing here reads them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from running_time import until
from servers import FAST_SPEECH, EnginePool, RunningServer, running_server, server_errors
from speech import Clip

from voicebot.audio import dbfs, resample
from voicebot.config import ModelsConfig, TelephonyConfig, load_config
from voicebot.errors import BadAudio, BadMessage
from voicebot.probe.client import ProbeConfig, run_level
from voicebot.probe.clips import load_clip
from voicebot.session import events as ev
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings
from voicebot.transports import twilio_protocol as tp
from voicebot.transports.pacing import Pacer
from voicebot.wire import twilio_media as tm

PACER_LEAD_MS = 40  # what the transport sends ahead of real time (twilio._PACER_LEAD_S)


def _sine(n: int, rate: int = 8000, hz: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(n) / rate)).astype(np.float32)


# ============================================================ protocol, pure
def test_parse_twilio_messages() -> None:
    assert isinstance(tp.parse_message('{"event": "connected", "protocol": "Call", "version": "1.0.0"}'), tp.Connected)
    start = tp.parse_message(json.dumps({
        "event": "start", "sequenceNumber": "1", "streamSid": "MZ1",
        "start": {"streamSid": "MZ1", "callSid": "CA1", "tracks": ["inbound"],
                  "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                  "customParameters": {"voice": "en-us"}},
    }))
    assert start == tp.Start("MZ1", "CA1", "audio/pcmu", {"voice": "en-us"}, "twilio")
    assert tp.call_details(start) == {"carrier": "twilio", "carrier_call_id": "CA1", "stream_id": "MZ1",
                                      "from": "", "to": ""}
    with_numbers = tp.Start("MZ1", "CA1", "audio/pcmu", {"From": "+15550100001", "To": "+15550100002"}, "twilio")
    assert tp.call_details(with_numbers)["from"] == "+15550100001" and tp.call_details(with_numbers)["to"] == "+15550100002"
    payload = bytes(range(160))
    media = tp.parse_message(json.dumps({"event": "media", "media": {
        "track": "inbound", "chunk": "1", "timestamp": "0", "payload": base64.b64encode(payload).decode()}}))
    assert media == tp.Media(payload, "inbound")
    assert tp.parse_message('{"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": "#"}}') == tp.DtmfPress("#")
    assert tp.parse_message('{"event": "mark", "mark": {"name": "r_1:100"}}') == tp.MarkEcho("r_1:100")
    assert isinstance(tp.parse_message('{"event": "stop", "stop": {"callSid": "CA1"}}'), tp.Stop)
    assert tp.parse_message('{"event": "error", "payload": {}}') == tp.Other("error")


def test_parse_telnyx_start_and_alaw() -> None:
    start = tp.parse_message(json.dumps({
        "event": "start", "sequence_number": "1", "stream_id": "32DE",
        "start": {"call_control_id": "v3:abc", "media_format": {"encoding": "PCMA", "sample_rate": 8000, "channels": 1},
                  "custom_parameters": [{"name": "voice", "value": "en-us"}]},
    }))
    assert start == tp.Start("32DE", "v3:abc", "audio/pcma", {"voice": "en-us"}, "telnyx")
    out = tp.Outbound("32DE", "telnyx")
    assert json.loads(out.clear()) == {"event": "clear"}  # Telnyx takes no stream id


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("not json", BadMessage),
        ('["event"]', BadMessage),
        ('{"event": "media", "media": {"payload": "***"}}', BadAudio),
        ('{"event": "media"}', BadMessage),
        ('{"event": "dtmf", "dtmf": {"digit": "x"}}', BadMessage),
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": {"encoding": "audio/x-l16", "sampleRate": 16000}}}', BadMessage),
        ('{"event": "start", "start": {"mediaFormat": {}}}', BadMessage),
        # Each of these used to escape as ValueError / AttributeError / RecursionError
        # and drop the call with a traceback.
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": "fast"}}}', BadMessage),
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": {"sampleRate": [8000]}}}', BadMessage),
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": "audio/x-mulaw"}}', BadMessage),
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": {"encoding": 7}}}', BadMessage),
        # A Unicode digit passes str.isdigit() but not int(): found by benchmarks/fuzz_live.py.
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": {"sampleRate": "\u277b"}}}', BadMessage),
        ('{"event": "media", "media": ' + "[" * 100_000 + "]" * 100_000 + "}", BadMessage),
    ],
)
def test_parse_rejects(text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        tp.parse_message(text)


def test_outbound_twilio_messages() -> None:
    out = tp.Outbound("MZ9", "twilio")
    media = json.loads(out.media(b"\xff" * 160))
    assert media == {"event": "media", "streamSid": "MZ9", "media": {"payload": base64.b64encode(b"\xff" * 160).decode()}}
    assert json.loads(out.mark("r:100")) == {"event": "mark", "streamSid": "MZ9", "mark": {"name": "r:100"}}
    assert json.loads(out.clear()) == {"event": "clear", "streamSid": "MZ9"}


def test_framer_cuts_exact_frames_and_keeps_every_sample() -> None:
    framer = tm.Framer()
    audio = _sine(1234)
    frames: list[np.ndarray] = []
    for size in (7, 300, 1, 160, 500, 266):  # sums to 1234
        chunk, audio = audio[:size], audio[size:]
        frames += framer.push(chunk)
    assert all(f.size == 160 for f in frames) and len(frames) == 7
    tail = framer.flush()
    assert len(tail) == 1 and tail[0].size == 160 and not tail[0][1234 - 7 * 160 :].any()
    np.testing.assert_array_equal(np.concatenate(frames + tail)[:1234], _sine(1234))
    assert framer.flush() == []


def test_g711_codecs_round_trip() -> None:
    audio = _sine(8000)
    for fmt in ("audio/pcmu", "audio/pcma"):
        data = tm.encode_audio(fmt, audio)
        assert isinstance(data, bytes) and len(data) == audio.size  # one byte per sample
        back = tm.decode_audio(fmt, data)
        assert back.dtype == np.float32
        snr = 10 * np.log10(np.sum(audio**2) / np.sum((audio - back) ** 2))
        assert snr > 30, snr  # G.711 gives ~38 dB on a loud tone
    assert tm.encode_audio("audio/pcmu", np.zeros(4, dtype=np.float32)) == b"\xff" * 4  # μ-law silence


def test_playout_marks_track_what_was_heard() -> None:
    marks = tp.PlayoutMarks(interval_ms=100)
    assert marks.begin("resp_1") == "resp_1:0"
    sent = [marks.sent_samples(160) for _ in range(12)]
    assert [m for m in sent if m] == ["resp_1:100", "resp_1:200"]  # every 5 frames
    assert marks.echoed("resp_1:0") is None  # nothing heard yet: no change
    assert marks.echoed("resp_1:100") == 100
    assert marks.echoed("resp_0:900") is None  # an older reply's late echo
    assert marks.echoed("garbage") is None
    assert marks.cut() == 100
    assert marks.echoed("resp_1:200") is None  # dropped by the clear, not heard
    marks.begin("resp_2")
    marks.sent_samples(400)
    assert marks.end() == "resp_2:50:end"
    assert tm.parse_mark("resp_2:50:end") == ("resp_2", 50, True)
    assert tm.parse_mark("a:b:c") is None
    assert tm.parse_mark("resp_2:\u00b2") is None  # superscript two: isdigit(), yet no int


def test_pacer_sends_in_real_time_without_catch_up_bursts() -> None:
    pacer = Pacer(lead_s=0.06)
    sent: list[float] = []
    now = 100.0
    for _ in range(20):  # frames all queued at once: the lead goes at once, then 20 ms each
        now += pacer.delay(now)
        sent.append(now)
        pacer.sent()
    assert sent[:4] == [100.0] * 4 and np.allclose(np.diff(sent[3:]), 0.02)
    now = sent[-1] + 1.0  # an underrun: the clock restarts, no burst of the missed second
    assert pacer.delay(now) == 0.0
    for _ in range(3):
        pacer.sent()
    assert pacer.delay(now) == 0.0  # the lead again...
    pacer.sent()
    assert pacer.delay(now) == pytest.approx(0.02)  # ...then real time


def test_dtmf_collector() -> None:
    keys = tp.DtmfCollector(TelephonyConfig(hangup_digit="*", dtmf_terminator="#", dtmf_timeout_s=2.0, dtmf_max_digits=3))
    assert keys.press("1", 0.0) is None and keys.press("2", 0.5) is None
    assert keys.deadline() == 2.5
    entry = keys.press("#", 1.0)
    assert entry == tp.KeypadEntry("12") and entry.text == "The caller pressed 1 2 on the keypad."
    assert keys.press("#", 1.1) is None  # a bare terminator sends nothing
    keys.press("9", 3.0)
    assert keys.poll(4.9) is None and keys.poll(5.0) == tp.KeypadEntry("9")
    assert [keys.press(d, 6.0) for d in "456"][-1] == tp.KeypadEntry("456")  # max digits
    assert keys.press("*", 7.0) == tp.Hangup()
    quiet = tp.DtmfCollector(TelephonyConfig(dtmf_to_llm=False))
    assert quiet.press("1", 0.0) is None and quiet.deadline() is None
    with pytest.raises(ValueError):
        TelephonyConfig(hangup_digit="#", dtmf_terminator="#")


def test_call_settings_validate_custom_parameters() -> None:
    base = SessionSettings(system_prompt="base")
    s = tp.call_settings(base, {"voice": "en-us+f3", "speed": "1.5", "system_prompt": "Be brief.", "tenant": "x"})
    assert (s.voice, s.speed, s.system_prompt) == ("en-us+f3", 1.5, "Be brief.")
    with pytest.raises(BadMessage, match="speed"):
        tp.call_settings(base, {"speed": "fast"})
    with pytest.raises(BadMessage, match="max_tokens"):
        tp.call_settings(base, {"max_tokens": "0"})


def test_twiml_and_stream_url() -> None:
    assert tp.stream_url(None, {}, "http", "example.com:8080") == "ws://example.com:8080/twilio"
    fwd = {"x-forwarded-proto": "https", "x-forwarded-host": "voice.example.com"}
    assert tp.stream_url(None, fwd, "http", "127.0.0.1:8080") == "wss://voice.example.com/twilio"
    assert tp.stream_url("wss://bot.example.com/vb/", fwd, "http", "h") == "wss://bot.example.com/vb/twilio"
    xml = tp.twiml_connect("wss://h/twilio", {"system_prompt": 'Say "hi" & <go>'})
    assert xml.startswith('<?xml version="1.0" encoding="UTF-8"?><Response><Connect><Stream url="wss://h/twilio">')
    assert '<Parameter name="system_prompt" value="Say &quot;hi&quot; &amp; &lt;go&gt;"/>' in xml


def _twilio_signature(token: str, url: str, params: dict[str, str]) -> str:
    """Written here from Twilio's docs (twilio.com/docs/usage/security), not imported: the
    full URL, then each POST field's name and value in name order, HMAC-SHA1, base64."""
    import hashlib
    import hmac

    message = url + "".join(name + params[name] for name in sorted(params))
    return base64.b64encode(hmac.new(token.encode(), message.encode(), hashlib.sha1).digest()).decode()


def test_twilio_signature_matches_twilios_published_vectors() -> None:
    # From twilio-python's tests (tests/unit/test_request_validator.py).
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {"CallSid": "CA1234567890ABCDE", "Digits": "1234", "From": "+14158675309",
              "To": "+18005551212", "Caller": "+14158675309"}
    assert tp.signature("12345", url, params.items()) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    assert tp.signature_valid("12345", url, params.items(), "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    # A proxy adding or dropping the port must not break it (Twilio's validator tries both).
    assert tp.signature_valid("12345", url.replace(".com", ".com:1234"), params.items(), "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert tp.signature_valid("12345", url, params.items(), "kvajT1Ptam85bY51eRf/AJRuM3w=")  # signed with :443
    dup = [("Sid", "CA123"), ("SidAccount", "AC123"), ("Digits", "5678"), ("Digits", "1234")]
    assert tp.signature("12345", url, dup) == "IK+Dwps556ElfBT0I3Rgjkr1wJU="
    assert not tp.signature_valid("12345", url, params.items(), None)
    assert not tp.signature_valid("12346", url, params.items(), "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not tp.signature_valid("12345", url + "&x=1", params.items(), "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert _twilio_signature("12345", url, params) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="


def test_request_url_as_twilio_saw_it() -> None:
    fwd = {"x-forwarded-proto": "https", "x-forwarded-host": "bot.example.com"}
    assert tp.request_url(None, fwd, "http", "127.0.0.1:8080", "/twilio/voice", "a=1") == \
        "https://bot.example.com/twilio/voice?a=1"
    assert tp.request_url(None, fwd, "ws", "127.0.0.1:8080", "/twilio", "") == "wss://bot.example.com/twilio"
    assert tp.request_url("wss://bot.example.com/vb", {}, "http", "h", "/twilio/voice", "") == \
        "https://bot.example.com/vb/twilio/voice"
    assert tp.request_url("wss://bot.example.com/vb", {}, "ws", "h", "/twilio", "") == "wss://bot.example.com/vb/twilio"
    busy = tp.twiml_busy("Busy <now> & later")
    assert busy.endswith("<Response><Say>Busy &lt;now&gt; &amp; later</Say><Hangup/></Response>")


# ================================================================ real calls
@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig) -> AsyncIterator[RunningServer]:
    cfg = load_config(
        "configs/test.yaml",
        [
            f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH,
            "llm.max_tokens=12",
            "telephony.hangup_digit='*'",
            "telephony.dtmf_terminator='#'",
        ],
    )
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


@dataclass
class Received:
    t: float
    data: dict[str, Any]


@dataclass
class FakeTwilio:
    """A scripted Twilio: real-time caller audio out, a playback clock for reply audio."""

    ws: Any
    sid: str = field(default_factory=lambda: "MZ" + uuid.uuid4().hex)
    log: list[Received] = field(default_factory=list)
    echoed: list[tuple[float, str]] = field(default_factory=list)
    speech: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # 8 kHz, to play
    _play_end: float = 0.0
    _echoes: list[tuple[float, str]] = field(default_factory=list)

    async def send(self, event: str, **body: Any) -> None:
        await self.ws.send(json.dumps({"event": event, "streamSid": self.sid, **body}))

    async def start(self, **custom: str) -> None:
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        fmt = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
        await self.send("start", start={"streamSid": self.sid, "callSid": "CA1", "tracks": ["inbound"],
                                        "mediaFormat": fmt, "customParameters": custom})

    def say(self, clip: Clip) -> None:
        self.speech = resample(clip.audio, 16000, 8000)

    async def _caller(self) -> None:
        """Caller audio (speech, else silence) in 20 ms μ-law frames on a real-time clock."""
        t, chunk = time.monotonic(), 0
        while True:
            frame = np.zeros(160, dtype=np.float32)
            n = min(160, self.speech.size)
            frame[:n], self.speech = self.speech[:n], self.speech[n:]
            chunk += 1
            payload = base64.b64encode(tm.encode_audio("audio/pcmu", frame)).decode()
            await self.send("media", media={"track": "inbound", "chunk": str(chunk), "timestamp": str(20 * chunk), "payload": payload})
            now = time.monotonic()
            while self._echoes and self._echoes[0][0] <= now:  # marks whose audio has played
                name = self._echoes.pop(0)[1]
                self.echoed.append((now, name))
                await self.send("mark", mark={"name": name})
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.monotonic()))

    async def caller(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):  # the server hung up
            await self._caller()

    async def listen(self) -> None:
        async for raw in self.ws:
            now = time.monotonic()
            data = json.loads(raw)
            self.log.append(Received(now, data))
            if data["event"] == "media":
                self._play_end = max(self._play_end, now) + len(base64.b64decode(data["media"]["payload"])) / 8000
            elif data["event"] == "mark":
                self._echoes.append((max(self._play_end, now), data["mark"]["name"]))
            elif data["event"] == "clear":  # Twilio drops its buffer and returns the marks
                self._echoes = [(now, name) for _, name in self._echoes]
                self._play_end = now

    def media_of(self, rid: str) -> list[Received]:
        """The media messages between reply ``rid``'s opening mark and its end."""
        out, inside = [], False
        for r in self.log:
            if r.data["event"] == "mark":
                parsed = tm.parse_mark(r.data["mark"]["name"])
                if parsed and parsed[0] == rid:
                    inside = not parsed[2]
                elif parsed:
                    inside = False
            elif r.data["event"] == "clear":
                inside = False
            elif r.data["event"] == "media" and inside:
                out.append(r)
        return out

    def replies(self, *, ended: bool) -> list[str]:
        names = [tm.parse_mark(r.data["mark"]["name"]) for r in self.log if r.data["event"] == "mark"]
        return list(dict.fromkeys(p[0] for p in names if p and (p[2] if ended else p[1] == 0)))


@contextlib.asynccontextmanager
async def twilio_call(server: RunningServer, **custom: str) -> AsyncIterator[tuple[FakeTwilio, Session]]:
    before = set(server.state.sessions)
    async with websockets.connect(server.ws("/twilio")) as ws:
        call = FakeTwilio(ws)
        await call.start(**custom)
        await until(lambda: set(server.state.sessions) - before, 10, "the session")
        session = server.state.sessions[(set(server.state.sessions) - before).pop()]
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(call.caller()), tg.create_task(call.listen())]
            try:
                yield call, session
            finally:
                for task in tasks:
                    task.cancel()


class Seen(list):
    """The events a session emitted, in order, and when (``at``, time.monotonic())."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    def when(self, event: object) -> float:
        return self.at[next(i for i, e in enumerate(self) if e is event)]


def spy(session: Session) -> Seen:
    """Every event the session emits (the transport still gets them all)."""
    seen = Seen()
    emit = session.emit

    def recording(event: ev.SessionEvent) -> None:
        seen.append(event)
        seen.at.append(time.monotonic())
        emit(event)

    session.emit = recording  # type: ignore[method-assign]
    return seen


def check_paced_mulaw(frames: list[Received]) -> None:
    """Valid 8 kHz μ-law in 160-byte frames, sent in real time, not in one burst."""
    payloads = [base64.b64decode(r.data["media"]["payload"]) for r in frames]
    assert len(payloads) >= 25, f"reply too short to judge pacing: {len(payloads)} frames"
    assert {len(p) for p in payloads} == {160}
    audio = tm.decode_audio("audio/pcmu", b"".join(payloads))
    assert dbfs(audio) > -40, "reply audio is silent"
    assert np.abs(audio).max() < 1.0
    # Paced, not one burst: the frames' arrivals span about the reply's length. Load on
    # the cores only delays frames (the pacer restarts after a stall, never catches up),
    # so this bound holds however busy the machine is; how the pacer spreads frames
    # (the lead, the restart) is checked on a clock the test moves (test_pacing.py).
    t = np.array([r.t for r in frames])
    span, length = float(t[-1] - t[0]), 0.02 * (len(t) - 1)
    assert span >= length - (PACER_LEAD_MS + 100) / 1000, (
        f"{len(t)} frames ({length:.2f} s of audio) arrived within {span:.2f} s: sent in a burst"
    )


@pytest.mark.engines
async def test_full_call_barge_in_dtmf_hangup(server: RunningServer, speech_clips: list[Clip]) -> None:
    clips = {c.name[-4:]: c for c in speech_clips}
    async with twilio_call(server, system_prompt="You are a phone assistant.", max_tokens="20") as (call, session):
        events = spy(session)
        # Turn 1: the caller speaks; a reply starts playing.
        call.say(clips["0880"])
        await until(lambda: call.replies(ended=False), 40, "a reply")
        first = call.replies(ended=False)[0]
        await until(lambda: len(call.media_of(first)) >= 40, 20, "0.8 s of reply audio")
        # Barge-in: speak over it. The server must clear, and cut history at the marks.
        call.say(clips["0930"])
        await until(lambda: any(r.data["event"] == "clear" for r in call.log), 20, "clear")
        barge = next(e for e in events if isinstance(e, ev.BargeIn))
        assert barge.response_id == first
        heard = [(t, p[1]) for t, n in call.echoed if n.startswith(first + ":") and (p := tm.parse_mark(n))]
        heard_ms = sorted({ms for _t, ms in heard})
        assert barge.played_ms in heard_ms or barge.played_ms == 0, (barge.played_ms, heard_ms)
        # Marks echoed before the barge-in (later ones are the caller playing on until the
        # clear reached it): the server counted all but an echo in flight.
        barged_at = events.when(barge)
        heard_before = [ms for t, ms in heard if t < barged_at]
        assert barge.played_ms >= max(heard_before, default=0) - 200, (barge.played_ms, heard_before)
        done = next(e for e in events if isinstance(e, ev.ResponseDone) and e.response_id == first)
        assert done.status == "interrupted" and done.played_ms == barge.played_ms
        # History keeps what was heard (nothing, if no word was heard whole).
        said = [m.content for m in session.conversation.messages if m.item_id == done.item_id]
        assert said == ([barge.heard_text.strip()] if barge.heard_text.strip() else [])
        assert len(barge.heard_text) < len(done.full_text)
        # Turn 2: the reply to the barge-in plays out whole: check its wire format.
        await until(lambda: [r for r in call.replies(ended=True) if r != first], 60, "a completed reply")
        second = [r for r in call.replies(ended=True) if r != first][0]
        check_paced_mulaw(call.media_of(second))
        # Keypad: digits reach the session and, at the terminator, the assistant.
        replies_before = len(call.replies(ended=False))
        for digit in "42#":
            await call.send("dtmf", dtmf={"track": "inbound_track", "digit": digit})
        await until(lambda: len(call.replies(ended=False)) > replies_before, 30, "a reply to the keypad")
        assert [e.digit for e in events if isinstance(e, ev.Dtmf)] == ["4", "2", "#"]
        assert any(m.role == "user" and m.content == "The caller pressed 4 2 on the keypad." for m in session.conversation.messages)
        # The hang-up digit ends the call: the server closes the stream.
        await call.send("dtmf", dtmf={"track": "inbound_track", "digit": "*"})
        await until(lambda: session.closed_reason is not None, 10, "hang-up")
        assert session.closed_reason == "hangup digit"
        await asyncio.wait_for(call.ws.wait_closed(), 10)


@pytest.mark.engines
async def test_stop_ends_the_session(server: RunningServer) -> None:
    async with twilio_call(server) as (call, session):
        await asyncio.sleep(0.3)
        await call.send("stop", stop={"callSid": "CA1"})
        await asyncio.wait_for(call.ws.wait_closed(), 10)
    await until(lambda: session.id not in server.state.sessions, 5, "session closed")
    assert session.closed_reason == "call ended"


@pytest.mark.engines
async def test_carrier_messages_beyond_the_control_rate_are_dropped(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Media has the audio gate; every other message (marks, keys) had no limit at all.
    cfg = server.state.cfg.server
    caplog.set_level(logging.WARNING)
    async with twilio_call(server) as (call, session):
        for i in range(cfg.control_burst + 100):  # echoes of marks never sent: no effect but the cost
            await call.send("mark", mark={"name": f"flood{i}"})
        await until(lambda: "message_rate_exceeded" in caplog.text, 10, "the refusal in the log")
        await asyncio.sleep(2 / cfg.control_rate)  # a token or two back
        await call.send("stop", stop={"callSid": "CA1"})  # still heard: the call ends as asked
        await asyncio.wait_for(call.ws.wait_closed(), 10)
    await until(lambda: session.id not in server.state.sessions, 5, "session closed")
    assert session.closed_reason == "call ended"


@pytest.mark.engines
async def test_bad_custom_parameters_refuse_the_call(server: RunningServer) -> None:
    for custom, code in (({"voice": "klingon"}, "invalid_voice"), ({"voice": "/etc/passwd"}, "invalid_voice"), ({"speed": "warp"}, "invalid_value")):
        async with websockets.connect(server.ws("/twilio")) as ws:
            await FakeTwilio(ws).start(**custom)
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_reason.startswith(code), ws.close_reason
    async with httpx.AsyncClient() as http:  # the server is still fine
        assert (await http.get(server.http + "/healthz")).json()["ready"]


@pytest.mark.engines
async def test_voice_webhook_and_auth(server: RunningServer) -> None:
    server_cfg = server.state.cfg.server
    async with httpx.AsyncClient(base_url=server.http) as http:
        r = await http.post("/twilio/voice?voice=en-us&junk=1", headers={"X-Forwarded-Proto": "https", "X-Forwarded-Host": "bot.example.com"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
        assert '<Stream url="wss://bot.example.com/twilio"><Parameter name="voice" value="en-us"/></Stream>' in r.text
        # Twilio's call fields: the numbers go on to the stream (for the call's record).
        r = await http.post("/twilio/voice", data={"CallSid": "CA1", "From": "+15550100001", "To": "+15550100002"})
        assert '<Parameter name="From" value="+15550100001"/><Parameter name="To" value="+15550100002"/>' in r.text
        r = await http.get("/twilio/voice", params={"From": "+15550100003"})
        assert '<Parameter name="From" value="+15550100003"/>' in r.text and "CallSid" not in r.text
        server_cfg.api_key = "sekrit"
        try:
            assert (await http.post("/twilio/voice")).status_code == 401
            r = await http.post("/twilio/voice", auth=("twilio", "sekrit"))  # https://twilio:KEY@host/...
            assert r.status_code == 200 and '<Parameter name="token" value="ek_' in r.text
            secret = r.text.split('name="token" value="')[1].split('"')[0]
            async with websockets.connect(server.ws("/twilio")) as ws:  # Twilio can't send headers
                await FakeTwilio(ws).start(token="wrong")
                await asyncio.wait_for(ws.wait_closed(), 10)
                assert ws.close_code == 1008 and ws.close_reason.startswith("unauthorized")
            async with websockets.connect(server.ws("/twilio")) as ws:
                call = FakeTwilio(ws)
                await call.start(token=secret)
                with pytest.raises(TimeoutError):  # accepted: the stream stays open
                    await asyncio.wait_for(ws.wait_closed(), 0.5)
                await call.send("stop")
                await asyncio.wait_for(ws.wait_closed(), 10)
        finally:
            server_cfg.api_key = None


@pytest.mark.engines
async def test_probe_speaks_twilio(server: RunningServer, speech_clips: list[Clip]) -> None:
    clip = next(c for c in speech_clips if c.name.endswith("0880"))
    cfg = ProbeConfig(
        url=server.ws("/twilio"),
        clips=(load_clip(str(clip.path), 16000),),  # resampled to 8 kHz μ-law by the client
        turns=1,
        protocol="twilio",
        sample_rate=16000,
        timeout_s=60,
    )
    [record] = await run_level(cfg, 1)
    assert record.status == "ok", record
    assert record.voice_to_voice_ms is not None and record.voice_to_voice_ms > 0
    assert record.replies and record.replies[0]["status"] == "completed"


@pytest.mark.engines
async def test_caller_hanging_up_logs_no_traceback(server: RunningServer) -> None:
    with server_errors() as errors:
        for _ in range(3):
            async with twilio_call(server) as (call, session):
                await asyncio.sleep(0.3)
            # twilio_call closed the socket from our side: a hang-up without 'stop'.
            await until(lambda s=session: s.id not in server.state.sessions, 10, "session closed")
        await asyncio.sleep(0.5)
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]


@pytest.mark.engines
async def test_twilio_signature_on_webhook_and_stream(server: RunningServer) -> None:
    tel = server.state.cfg.telephony
    token = "tw-auth-token-test"
    tel.auth_token = token
    try:
        async with httpx.AsyncClient(base_url=server.http) as http:
            form = {"CallSid": "CA1", "From": "+15550100", "To": "+15550199", "AccountSid": "AC1"}
            url = f"{server.http}/twilio/voice?voice=en-us"
            good = _twilio_signature(token, url, form)
            r = await http.post("/twilio/voice?voice=en-us", data=form, headers={"X-Twilio-Signature": good})
            assert r.status_code == 200 and "<Connect><Stream" in r.text, r.text
            for sig in (None, _twilio_signature("wrong", url, form), _twilio_signature(token, url, {**form, "To": "+1"})):
                r = await http.post("/twilio/voice?voice=en-us", data=form,
                                    headers={"X-Twilio-Signature": sig} if sig else {})
                assert r.status_code == 403, (sig, r.status_code)
            # Behind a proxy: Twilio signed the public https URL.
            public = "https://bot.example.com/twilio/voice"
            r = await http.post("/twilio/voice", data=form, headers={
                "X-Twilio-Signature": _twilio_signature(token, public, form),
                "X-Forwarded-Proto": "https", "X-Forwarded-Host": "bot.example.com"})
            assert r.status_code == 200, r.text
        # The stream's upgrade request is signed over the wss URL, without parameters.
        stream_url = server.ws("/twilio")
        for headers, accepted in (({"X-Twilio-Signature": _twilio_signature(token, stream_url, {})}, True),
                                  ({"X-Twilio-Signature": _twilio_signature("nope", stream_url, {})}, False),
                                  ({}, False)):
            async with websockets.connect(stream_url, additional_headers=headers) as ws:
                call = FakeTwilio(ws)
                with contextlib.suppress(websockets.ConnectionClosed):  # refused at the upgrade
                    await call.start()
                if accepted:
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(ws.wait_closed(), 0.5)
                    await call.send("stop")
                await asyncio.wait_for(ws.wait_closed(), 10)
                if not accepted:
                    assert ws.close_code == 1008 and ws.close_reason.startswith("unauthorized"), ws.close_reason
    finally:
        tel.auth_token = None


@pytest.mark.engines
async def test_no_free_line_says_so_and_hangs_up(server: RunningServer) -> None:
    cfg = server.state.cfg.server
    old, cfg.max_sessions = cfg.max_sessions, 1
    server.state.siblings.opened(None)  # a call in progress: the one line is taken
    try:
        async with httpx.AsyncClient(base_url=server.http) as http:
            r = await http.post("/twilio/voice")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
        assert "<Say>Sorry, all our lines are busy." in r.text and r.text.endswith("<Hangup/></Response>")
        async with websockets.connect(server.ws("/twilio")) as ws:  # a stream anyway: 1013
            await FakeTwilio(ws).start()
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 1013 and ws.close_reason.startswith("capacity_exceeded")
    finally:
        server.state.siblings.closed(None)
        cfg.max_sessions = old
