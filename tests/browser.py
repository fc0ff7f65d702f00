"""A real headless Chromium for the web page's tests (Playwright, Debian's ``chromium``).

Playwright's own browser downloads are not used: CI installs the distribution's
Chromium (``apt-get install chromium``) and Playwright drives it by path. A missing
browser or package fails the test with the command that fixes it; it never skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from voicebot.audio import ASR_RATE

CHROMIUM = os.environ.get("VOICEBOT_CHROMIUM", "/usr/bin/chromium")
# Offline and quiet: nothing may reach beyond 127.0.0.1.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


def write_mic_wav(path: Path, audio: np.ndarray, *, lead_s: float, tail_s: float) -> Path:
    """16 kHz 16-bit mono WAV for ``--use-file-for-fake-audio-capture``.

    Chromium starts the file when the page opens the microphone, before the call is
    connected, and loops it: leading silence covers the connection set-up, trailing
    silence lets the VAD end the turn and the reply play before the speech comes again.
    """

    def silence(s: float) -> np.ndarray:
        return np.zeros(int(s * ASR_RATE), np.float32)

    padded = np.concatenate([silence(lead_s), audio, silence(tail_s)])
    sf.write(path, padded, ASR_RATE, subtype="PCM_16")
    return path


@dataclass
class PageLog:
    """Console errors and uncaught exceptions of one page."""

    errors: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))


def _require() -> Any:
    """Playwright's entry point, or a failure that names the missing piece."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("Playwright is missing: .venv/bin/pip install playwright", pytrace=False)
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: apt-get install chromium (or set VOICEBOT_CHROMIUM)",
            pytrace=False,
        )
    return async_playwright


@contextlib.asynccontextmanager
async def chromium(mic: Path | None = None, *, no_mic: bool = False) -> AsyncIterator[Any]:
    """A browser whose microphone plays ``mic`` (a WAV; default: Chromium's beeps), or
    that has no microphone to give (``no_mic``)."""
    async_playwright = _require()
    args = list(FLAGS)
    if no_mic:
        # No fake device; should the machine have a real one, the permission is refused.
        args.append("--use-fake-ui-for-media-stream=deny")
    else:
        args += ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
        if mic is not None:
            args.append(f"--use-file-for-fake-audio-capture={mic}")
    async with async_playwright() as pw:
        # launch() runs on a fresh temporary profile of its own.
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            yield browser
        finally:
            await browser.close()
