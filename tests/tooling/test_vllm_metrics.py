"""benchmarks/vllm_metrics.py: a level's share of the LLM server's own histograms and
prefix-cache counters, from two scrapes of its /metrics (the exposition as vLLM writes it)."""

from __future__ import annotations

from types import ModuleType

import bench_scripts
import pytest


def vllm_metrics() -> ModuleType:
    return bench_scripts.load("vllm_metrics")


def exposition(ttft: dict[str, int], queries: int, hits: int, requests: int, ttft_sum: float = 1.0) -> str:
    """vLLM's shape: cumulative buckets per engine and model, counters with _total."""
    labels = 'engine="0",model_name="voicebot"'
    lines = ["# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
             "# TYPE vllm:time_to_first_token_seconds histogram"]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{le}"}} {n}' for le, n in ttft.items()]
    lines += [f"vllm:time_to_first_token_seconds_count{{{labels}}} {ttft['+Inf']}",
              f"vllm:time_to_first_token_seconds_sum{{{labels}}} {ttft_sum}",
              "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{{{labels}}} {queries}",
              "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{{{labels}}} {hits}",
              "# TYPE vllm:request_success counter",
              f'vllm:request_success_total{{{labels},finished_reason="stop"}} {requests}',
              f'vllm:request_success_total{{{labels},finished_reason="abort"}} 1']
    return "\n".join(lines) + "\n"


def test_a_level_is_the_difference_of_two_scrapes() -> None:
    m = vllm_metrics()
    before = m.parse(exposition({"0.05": 10, "0.25": 10, "0.5": 10, "+Inf": 10}, 1000, 900, 10))
    # 100 first tokens in the level: 50 under 50 ms, 40 in 50-250 ms, 10 in 250-500 ms
    after = m.parse(exposition({"0.05": 60, "0.25": 100, "0.5": 110, "+Inf": 110}, 5000, 3900, 110, ttft_sum=13.0))
    row = m.level(before, after)
    assert row["ttft_ms"]["n"] == 100
    assert row["ttft_ms"]["mean"] == pytest.approx(120.0)  # 12 s over 100, from the sums
    assert row["ttft_ms"]["p50"] == pytest.approx(50.0)  # rank 50 ends the first bucket
    assert row["ttft_ms"]["p95"] == pytest.approx(375.0)  # halfway through 250-500 ms
    assert row["requests"] == 100  # summed over finish reasons
    assert row["prefix_cache_hit"] == pytest.approx(0.75)  # 3000 of 4000 tokens asked for
    assert "queue_ms" not in row  # not exposed: not guessed


def test_a_rank_in_the_open_bucket_reads_its_lower_bound_and_an_empty_span_reads_none() -> None:
    m = vllm_metrics()
    assert m.quantile(0.99, {0.5: 90.0, float("inf"): 100.0}) == 0.5
    assert m.quantile(0.5, {0.5: 0.0, float("inf"): 0.0}) is None
    assert m.quantile(0.5, {0.3: 10.0, 0.5: 10.0, float("inf"): 10.0}) is None  # only "under 300 ms"
    assert m.quantile(0.5, {0.01: 10.0, float("inf"): 10.0}) == pytest.approx(0.005)
