"""voicebot/runtime/recent.py: the bounded window of recent work a batched engine reports."""

from __future__ import annotations

from voicebot.runtime.recent import RecentTimes, RecentWork, quantile_ms


def test_quantiles_are_the_nearest_rank_in_ms() -> None:
    ordered = [i / 1000 for i in range(1, 101)]  # 1 ... 100 ms
    assert quantile_ms(ordered, 0.5) == 51.0 and quantile_ms(ordered, 0.95) == 96.0
    assert quantile_ms([0.0123456], 0.95, digits=2) == 12.35  # one value: it, whatever the quantile


def test_the_window_keeps_the_last_units_and_names_its_figures() -> None:
    recent = RecentWork(3)
    assert recent.stats("step") == {}  # nothing run yet: nothing to report
    for seconds, rows in ((9.0, 100), (0.010, 2), (0.020, 4), (0.030, 6)):  # the first falls out
        recent.add(seconds, rows)
    assert recent.stats("step", digits=2) == {"step_ms_p50": 20.0, "step_ms_p95": 30.0, "step_rows_mean": 4.0}


def test_recent_times_name_their_percentiles_alone() -> None:
    recent = RecentTimes(2)
    assert recent.stats("queue") == {}
    for seconds in (5.0, 0.010, 0.030):  # the first falls out
        recent.add(seconds)
    assert recent.stats("queue") == {"queue_ms_p50": 30.0, "queue_ms_p95": 30.0}
