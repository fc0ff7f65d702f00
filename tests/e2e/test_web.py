"""The browser client (web/) in a real headless Chromium against the real server.

Chromium's fake microphone plays a LibriVox clip into the page; the page talks WebRTC
to the in-process server (real ASR, LLM and TTS); the test reads what the page shows.
Needs ``pip install playwright`` and ``apt-get install chromium`` (see tests/browser.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jiwer
import pytest
from browser import PageLog, chromium, write_mic_wav
from servers import FAST_SPEECH, EnginePool, RunningServer, running_server
from speech import Clip

from voicebot.config import ModelsConfig, load_config

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
CLIP = "sense_and_sensibility_01_austen_64kb-0890"  # 5.3 s, 14 words
TIMEOUT_MS = 60_000  # two shared CPU cores run ASR, the LLM and TTS for the call

pytestmark = pytest.mark.engines


def norm(text: str) -> str:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).strip()


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig) -> AsyncIterator[RunningServer]:
    cfg = load_config(
        REPO / "configs/test.yaml",
        [
            f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH,
            "llm.max_tokens=12",
            f"server.web_root={REPO / 'web'}",
            "server.transports=[webrtc]",
        ],
    )
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


async def snapshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=ARTIFACTS / f"web-{name}.png")


async def body_state(page: Any, state: str) -> None:
    await page.wait_for_selector(
        f"body[data-state='{state}']", state="attached", timeout=TIMEOUT_MS
    )


async def test_conversation_in_the_browser(
    server: RunningServer, speech_clips: list[Clip], tmp_path: Path
) -> None:
    clip = next(c for c in speech_clips if c.name == CLIP)
    mic = write_mic_wav(tmp_path / "mic.wav", clip.audio, lead_s=3.0, tail_s=6.0)
    log = PageLog()
    async with chromium(mic) as browser:
        page = await browser.new_page(viewport={"width": 1200, "height": 760})
        log.attach(page)
        await page.goto(server.http + "/")
        assert await page.title() == "voicebot"
        await page.get_by_role("button", name="Connect").click()
        await body_state(page, "connected")

        # The user's words, as the server transcribed them from the browser's audio. The
        # first utterance heard from its start (a set-up slower than the WAV's leading
        # silence cuts the first one, which then starts at 0 ms) is the one judged.
        item = await page.wait_for_function(
            """() => window.voicebot.events.find(e =>
                   e.type === "input_audio_buffer.speech_started" && e.audio_start_ms > 0)?.item_id""",
            timeout=TIMEOUT_MS,
        )
        final = page.locator(f".msg.user[data-item='{await item.json_value()}'][data-final] .text")
        await final.wait_for(timeout=TIMEOUT_MS)
        heard = await final.inner_text()
        wer = jiwer.wer(norm(clip.text), norm(heard) or "<empty>")
        assert wer <= 0.30, f"WER {wer:.0%}: page shows {heard!r}, reference {clip.text!r}"

        # Reply audio reached the page's speaker: the remote track's level, measured
        # in the page, rose above -40 dBFS, and a turn latency was taken from it.
        await page.wait_for_function(
            "window.voicebot.turns.length > 0 && window.voicebot.remote.audible_frames >= 5",
            timeout=TIMEOUT_MS,
        )
        vb = await page.evaluate("window.voicebot")
        turn = vb["turns"][0]
        assert 0 < turn["latency_ms"] < TIMEOUT_MS / 2, turn  # measured from the caller's end of speech
        assert vb["remote"]["max_db"] > -40, vb["remote"]
        assert await page.locator("#median").inner_text() != "–"
        types = {e["type"] for e in vb["events"]}
        assert {"session.created", "output_audio_buffer.started"} <= types, sorted(types)
        assert await page.locator(".msg.bot .text").first.inner_text(), "no reply text shown"

        await snapshot(page, "conversation")
        await page.get_by_role("button", name="Hang up").click()
        await body_state(page, "idle")
    assert not log.errors, log.errors


async def test_no_microphone(server: RunningServer) -> None:
    log = PageLog()
    async with chromium(no_mic=True) as browser:
        page = await browser.new_page()
        log.attach(page)
        await page.goto(server.http + "/")
        await page.get_by_role("button", name="Connect").click()
        await body_state(page, "no-mic")
        alert = page.get_by_role("alert")
        assert "Microphone" in await alert.inner_text()
        await snapshot(page, "no-mic")
    assert not log.errors, log.errors


async def test_auth_required(server: RunningServer) -> None:
    server.state.cfg.server.api_key = "sk-test-web"  # check_auth reads it per request
    log = PageLog()
    try:
        async with chromium() as browser:
            page = await browser.new_page()
            log.attach(page)
            await page.goto(server.http + "/")
            await page.get_by_role("button", name="Connect").click()
            await body_state(page, "auth")
            assert "requires an API key" in await page.get_by_role("alert").inner_text()
            key = page.get_by_label("API key or ephemeral token")
            assert await key.is_visible()  # the access section opened itself
            await snapshot(page, "auth")

            await key.fill("wrong")
            await page.get_by_role("button", name="Try again").click()
            await page.wait_for_function(
                "document.body.dataset.state === 'auth' && "
                "document.getElementById('banner-text').textContent.includes('did not accept')"
            )

            await key.fill("sk-test-web")
            await page.get_by_role("button", name="Try again").click()
            await body_state(page, "connected")
            await page.get_by_role("button", name="Hang up").click()
            await body_state(page, "idle")
    finally:
        server.state.cfg.server.api_key = None
    # The browser logs each refused request ("status of 401"); nothing else may go wrong.
    assert [e for e in log.errors if "401" not in e] == [], log.errors


async def test_capacity_retries(server: RunningServer) -> None:
    slots = server.state.cfg.server.max_sessions
    server.state.cfg.server.max_sessions = 1
    log = PageLog()
    try:
        async with chromium() as browser:
            page = await browser.new_page()
            log.attach(page)
            await page.goto(server.http + "/")
            async with server.state.open_session("test"):  # takes the only slot
                await page.get_by_role("button", name="Connect").click()
                await body_state(page, "capacity")
                assert "Retrying in" in await page.get_by_role("alert").inner_text()
                assert await page.get_by_role("button", name="Reconnect now").is_visible()
                await snapshot(page, "capacity")
            # The slot is free again: an automatic retry gets in.
            await body_state(page, "connected")
            await page.get_by_role("button", name="Hang up").click()
            await body_state(page, "idle")
    finally:
        server.state.cfg.server.max_sessions = slots
    assert [e for e in log.errors if "429" not in e] == [], log.errors


async def test_reconnects_after_lost_connection(server: RunningServer) -> None:
    log = PageLog()
    async with chromium() as browser:
        page = await browser.new_page()
        log.attach(page)
        await page.goto(server.http + "/")
        await page.get_by_role("button", name="Connect").click()
        await body_state(page, "connected")
        # The server side of the call goes away; the page notices and dials again.
        for session in list(server.state.sessions.values()):
            await session.aclose("test: connection lost")
        await page.wait_for_function(
            "window.voicebot.states.slice(-3).join() === 'lost,connecting,connected'",
            timeout=TIMEOUT_MS,
        )
        await page.get_by_role("button", name="Hang up").click()
        await body_state(page, "idle")
    assert not log.errors, log.errors
