"""What the configured LLM can do for a call, in one place."""

from __future__ import annotations

from voicebot.config import LlmConfig


def keeps_background_prefills(llm: LlmConfig) -> bool:
    """Background prefills are on, and a prefix cache keeps what they compute: only the
    in-process engine's cache can be switched off (a remote tier keeps its own)."""
    if not llm.warm_prefix or llm.background_concurrency == 0:
        return False
    return llm.backend != "inprocess" or llm.enable_prefix_caching
