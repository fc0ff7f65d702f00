"""What /metrics serves before and at the slow end of a call (voicebot/metrics.py)."""

from __future__ import annotations

from voicebot.config import Config
from voicebot.metrics import Metrics
from voicebot.server.state import ServerState


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_each_served_protocol_counts_calls_from_zero_before_its_first_call() -> None:
    # A counter that appears only at its first event is missed by rate() for that event,
    # and a dashboard panel over it reads "No data" on a healthy server.
    cfg = Config.model_validate({"server": {"transports": ["native", "realtime", "twilio"]}})
    metrics = ServerState(cfg).metrics
    for transport in ("native", "realtime", "twilio"):
        assert sample(metrics, "voicebot_sessions_total", transport=transport) == 0.0, transport
        assert sample(metrics, "voicebot_active_sessions", transport=transport) == 0.0, transport
    assert sample(metrics, "voicebot_sessions_total", transport="webrtc") is None  # not served


def test_slow_turns_fall_in_buckets_that_tell_them_apart() -> None:
    # 2.2 s, 3.5 s and 7 s turns: each its own bucket, so p95/p99 above 2 s read true.
    metrics = Metrics()
    for seconds in (2.2, 3.5, 7.0):
        metrics.voice_to_voice.observe(seconds)
    below = [sample(metrics, "voicebot_voice_to_voice_seconds_bucket", le=le) for le in ("2.5", "4.0", "8.0")]
    assert below == [1.0, 2.0, 3.0]
