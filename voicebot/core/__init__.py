"""The call's control plane, without I/O: see :mod:`voicebot.core.call`."""

from voicebot.core.background import Background, History
from voicebot.core.call import CallCore

__all__ = ["Background", "CallCore", "History"]
