"""``voicebot probe``: a latency probe and load generator that talks to the server
like a caller would.

Data flow: ``clips`` (WAV -> real-time PCM frames) -> a protocol client (``base``
interface; ``native`` today) -> ``turn`` (a synchronous per-turn state machine that
timestamps what comes back) -> ``report`` (percentiles, table, JSON, plot).
``client`` is the only asyncio code: it moves frames between those parts.
"""
