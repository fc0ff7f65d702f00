"""voicebot: a self-hosted real-time voice agent server."""

__version__ = "0.1.0"
