"""The ``vllm.general_plugins`` entry point (pyproject.toml).

vLLM runs every general plugin in each of its processes (API server, engine core,
workers), whatever model they serve, and calls the plugins outside any try block: an
exception here would stop an LLM server from starting. So this module imports nothing of
voicebot's, and registration is lazy (a "module:Class" string: vLLM imports the windowed
Whisper only when a config names it) and cannot raise.
"""

from __future__ import annotations

import logging

__all__ = ["ARCH", "register"]

log = logging.getLogger(__name__)

# The windowed Whisper's architecture name (voicebot/engines/asr/whisper_vllm_window.py).
ARCH = "VoicebotWindowedWhisper"


def register() -> None:
    """Register the windowed Whisper with vLLM; safe to call in every process, more than once."""
    try:
        from vllm import ModelRegistry

        if ARCH not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(ARCH, "voicebot.engines.asr.whisper_vllm_model:WindowedWhisper")
    except Exception:  # a changed vLLM API must not take the LLM server down with it
        log.exception("could not register %s with vLLM", ARCH)
