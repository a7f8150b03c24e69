"""The engine's own view of a probe, from vLLM's Prometheus endpoint (`/metrics`).

Why: the client's percentiles include everything between it and the engine core (the API
server's tokenizing and streaming, the proxy, the client's own event loop). vLLM's request
histograms split a request into queue, prefill and decode time as the engine saw them. Read
before and after a probe, their difference is that probe alone; a client p90 TTFT far above
the engine's says the time went outside the engine. Parsed with prometheus-client's parser.
"""

from __future__ import annotations

import logging
import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pipeline.records.benchmark import EngineView

log = logging.getLogger(__name__)

# vLLM request histograms (seconds), by the name this module reports them under
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}

Snapshot = dict[str, tuple[dict[float, float], float, float]]  # name -> (cumulative buckets, sum, count)


def _metrics_text(url: str, timeout: float) -> str | None:
    """The replica's Prometheus text, or None (logged) when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
            return response.read().decode()
    except OSError as exc:
        log.warning("cannot read %s/metrics: %s", url, exc)
        return None


def scrape(url: str, timeout: float = 5) -> Snapshot:
    """One replica's request histograms; empty when the endpoint cannot be read (never fatal)."""
    text = _metrics_text(url, timeout)
    if text is None:
        return {}
    wanted = {v: k for k, v in HISTOGRAMS.items()}
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        if key is None or family.type != "histogram":
            continue
        buckets: dict[float, float] = {}
        total = count = 0.0
        for sample in family.samples:  # summed over label sets (one per model / engine)
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
        out[key] = (buckets, total, count)
    return out


def merge(snapshots: list[Snapshot]) -> Snapshot:
    """Replicas behind one endpoint count as one engine."""
    out: Snapshot = {}
    for snap in snapshots:
        for key, (buckets, total, count) in snap.items():
            b0, t0, c0 = out.get(key, ({}, 0.0, 0.0))
            out[key] = (
                {le: b0.get(le, 0.0) + buckets.get(le, 0.0) for le in set(b0) | set(buckets)},
                t0 + total,
                c0 + count,
            )
    return out


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """`histogram_quantile` as PromQL computes it: linear within the bucket that holds rank q."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lower, below = 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower  # past the last finite bucket: its upper edge is all PromQL knows
            inside = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, buckets[le]
    return None


def view(before: Snapshot, after: Snapshot) -> EngineView:
    """The difference of two snapshots: what happened between them."""

    def delta(key: str) -> tuple[dict[float, float], float, float] | None:
        if key not in after:
            return None
        b1, t1, c1 = after[key]
        b0, t0, c0 = before.get(key, ({}, 0.0, 0.0))
        return {le: v - b0.get(le, 0.0) for le, v in b1.items()}, t1 - t0, c1 - c0

    def mean_ms(key: str) -> float | None:
        d = delta(key)
        return round(d[1] / d[2] * 1000, 2) if d and d[2] > 0 else None

    def p90_ms(key: str) -> float | None:
        d = delta(key)
        value = quantile(d[0], 0.9) if d and d[2] > 0 else None
        return round(value * 1000, 2) if value is not None else None

    e2e = delta("e2e")
    return EngineView(
        requests=int(e2e[2]) if e2e else 0,
        p90_ttft_ms=p90_ms("ttft"),
        mean_queue_ms=mean_ms("queue"),
        mean_prefill_ms=mean_ms("prefill"),
        mean_decode_ms=mean_ms("decode"),
        p90_itl_ms=p90_ms("itl"),
        mean_e2e_ms=mean_ms("e2e"),
    )
