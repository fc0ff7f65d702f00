"""What a vLLM server says of its own requests over a span: read from its ``/metrics``.

The frontend measures TTFT from its call of ``generate`` to the first token, so a slow
first token could be the engine's (waiting for a batch slot, prefill) or the way to it
(HTTP, the API server's own loop, the frontend's loop). vLLM's histograms split it:
``vllm:request_queue_time_seconds`` (waiting to be scheduled), ``vllm:request_prefill_time_seconds``
(scheduled to first token) and ``vllm:time_to_first_token_seconds`` (arrival at the API
server to first token). Two scrapes, before and after a level, give that level's share of
each histogram: its mean (exact, from the sums) and its quantiles, interpolated within
buckets as Prometheus's ``histogram_quantile`` does. vLLM's queue and prefill buckets start
at 0.3 s, so below that only their means say anything; TTFT's start at 1 ms. The prefix cache's queries and hits give the level's hit rate
in tokens, as the engine counted them (every request, including the ones a barge-in cut).
"""

from __future__ import annotations

import math
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# A level's row key (in ms) -> vLLM's histogram (in seconds).
HISTOGRAMS = {
    "ttft_ms": "vllm:time_to_first_token_seconds",
    "queue_ms": "vllm:request_queue_time_seconds",
    "prefill_ms": "vllm:request_prefill_time_seconds",
    "decode_step_ms": "vllm:inter_token_latency_seconds",
}
COUNTERS = {
    "requests": "vllm:request_success",
    "prompt_tokens": "vllm:prompt_tokens",
    "cache_queries": "vllm:prefix_cache_queries",
    "cache_hits": "vllm:prefix_cache_hits",
}

FIRST_BUCKET_RESOLVES_S = 0.05

Snapshot = dict[str, Any]  # name -> {le: count} for histograms, float for counters


def parse(text: str) -> Snapshot:
    """Histogram buckets and counters of interest, summed over label sets (engines, models)."""
    snap: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in HISTOGRAMS.values():
                buckets = snap.setdefault(sample.name[: -len("_bucket")], {})
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum") and sample.name[: -len("_sum")] in HISTOGRAMS.values():
                snap[sample.name] = snap.get(sample.name, 0.0) + sample.value
            elif sample.name.endswith("_total") and sample.name[: -len("_total")] in COUNTERS.values():
                name = sample.name[: -len("_total")]
                snap[name] = snap.get(name, 0.0) + sample.value
    return snap


def scrape(url: str, timeout_s: float = 5.0) -> Snapshot:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as resp:
        return parse(resp.read().decode())


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative ``buckets`` (le -> count): linear
    within the bucket the rank falls in; the +Inf bucket answers its lower bound. A rank in
    a first bucket wider than 50 ms answers None: "somewhere under 300 ms" is no figure."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_le, prev_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if prev_count == 0 and le > FIRST_BUCKET_RESOLVES_S:
                return None
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def level(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The span between two snapshots: each histogram's mean, p50/p95/p99 (ms) and count, the
    requests finished, and the prefix cache's hit rate over the tokens it was asked for."""
    row: dict[str, Any] = {}
    for key, name in HISTOGRAMS.items():
        b0, b1 = before.get(name, {}), after.get(name)
        if not b1:
            continue
        delta = {le: c - b0.get(le, 0.0) for le, c in b1.items()}
        n = max(delta.values(), default=0.0)
        total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
        qs = {"mean": total / n if n else None, **{f"p{round(q * 100)}": quantile(q, delta) for q in (0.5, 0.95, 0.99)}}
        row[key] = {"n": int(n), **{k: None if v is None else round(1000 * v, 1) for k, v in qs.items()}}
    counts = {key: after[name] - before.get(name, 0.0) for key, name in COUNTERS.items() if name in after}
    row.update({k: int(v) for k, v in counts.items() if k in ("requests", "prompt_tokens")})
    if counts.get("cache_queries"):
        row["prefix_cache_hit"] = round(counts.get("cache_hits", 0.0) / counts["cache_queries"], 3)
    return row
