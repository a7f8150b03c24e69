"""A probe's verdict, pure: the p90's order-statistic interval, whether the client kept pace with
the offered rate, the SLO's reasons, and whether the client's own send lag marks it client-bound.

A probe also fails when its TTFT trend, carried over the confirmation's length, would take the p90
past the limit (`steady`, #61): a short probe above capacity ends before its queue shows.

Why order statistics: a p90 from n requests is itself a random quantity; when the SLO limit falls
inside its 95% interval the verdict is noise, so the search repeats the probe with more requests."""

from __future__ import annotations

import math

from pipeline.core.specs import SloSpec, WorkloadSpec
from pipeline.records.benchmark import Probe

KEEP_UP = 0.90  # achieved throughput must be at least this share of the offered rate (less sampling noise)
TREND = "TTFT trend"  # how the steady-state reason begins (`trend_only` reads it)


def quantile_ci(values: list[float], q: float = 0.9, confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the q-quantile from order statistics (binomial ranks)."""
    from scipy.stats import binom

    n = len(values)
    if n < 10:
        return None
    xs = sorted(values)
    alpha = (1 - confidence) / 2
    lo = int(binom.ppf(alpha, n, q))
    hi = int(binom.ppf(1 - alpha, n, q)) + 1
    return xs[max(lo - 1, 0)], xs[min(hi - 1, n - 1)]


def mark_client_bound(probe: Probe, slo: SloSpec, workload: WorkloadSpec) -> None:
    """Client-bound: the client sent late by more than `workload.max_client_lag` of the p90 TTFT
    limit. Why lag: a client whose single event loop is busy (its CPU per request times the rate
    nears a core, or it shares a core) sends late and reads the first tokens late by about as much,
    so its lag says how much of a latency may be the client's own. A burst has no schedule to lag."""
    limit = workload.max_client_lag * slo.max_p90_ttft_ms
    late = [
        f"{what} {lag:.0f} ms"
        for what, lag in (("p90 send lag", probe.client_lag_p90_ms), ("last send", probe.client_lag_end_ms))
        if lag is not None and lag > limit
    ]
    probe.client_bound = bool(late) and not math.isinf(probe.rate)
    probe.client_note = (
        f"client-bound: {', '.join(late)} late "
        f"(limit {limit:.0f} ms, {workload.max_client_lag:.0%} of the p90 TTFT SLO)"
        if probe.client_bound
        else ""
    )


def keep_up_share(num_prompts: int) -> float:
    """The least share of the offered rate a probe must achieve to count as keeping up.

    With Poisson arrivals the span in which n requests are sent varies by 1/sqrt(n) (relative
    standard deviation), so the achieved rate of an engine that kept up does too: 43 requests at
    42 req/s read 37.8 (89%) with a p90 TTFT of 52 ms in a CI run, and a fixed 90% bar failed
    it. The bar is 90% less two standard deviations (never below half): 60% for 43 requests,
    70% for 100, 84% for 1280. A saturated engine still fails, on TTFT if not on this."""
    return max(0.5, KEEP_UP - 2 / math.sqrt(max(num_prompts, 1)))


def kept_up(rate: float, achieved: float, num_prompts: int) -> bool:
    """Whether `achieved` req/s is within the keep-up share of the `rate` offered (a burst, inf, always is)."""
    return math.isinf(rate) or achieved >= keep_up_share(num_prompts) * rate


def judge(probe: Probe, slo: SloSpec) -> None:
    reasons = []
    if probe.p90_ttft_ms > slo.max_p90_ttft_ms:
        reasons.append(f"p90 TTFT {probe.p90_ttft_ms:.1f} ms > {slo.max_p90_ttft_ms:g}")
    projected = probe.projected_p90_ttft_ms
    if projected is not None and projected > slo.max_p90_ttft_ms >= probe.p90_ttft_ms:
        # the queue grows: a run as long as the confirmation would end past the limit (`steady`)
        reasons.append(
            f"{TREND} +{probe.ttft_trend_ms_per_s:.1f} ms/s: p90 {probe.p90_ttft_ms:.0f} ms "
            f"carried over the confirmation reaches {projected:.0f} ms > {slo.max_p90_ttft_ms:g}"
        )
    if probe.p90_tpot_ms > slo.max_p90_tpot_ms:
        reasons.append(f"p90 TPOT {probe.p90_tpot_ms:.1f} ms > {slo.max_p90_tpot_ms:g}")
    if probe.failed_fraction > slo.max_failed_fraction:
        reasons.append(f"failed {probe.failed_fraction:.1%} > {slo.max_failed_fraction:.1%}")
    if not kept_up(probe.rate, probe.achieved_rate, probe.num_prompts):
        share = keep_up_share(probe.num_prompts)
        reasons.append(f"achieved {probe.achieved_rate:.2f} req/s < {share:.0%} of offered {probe.rate:.2f}")
    probe.reasons = reasons
    probe.passed = not reasons
    inside = [
        (ci, limit)
        for ci, limit in ((probe.p90_ttft_ci_ms, slo.max_p90_ttft_ms), (probe.p90_tpot_ci_ms, slo.max_p90_tpot_ms))
        if ci is not None and ci[0] <= limit <= ci[1]
    ]
    probe.conclusive = not inside


def trend_only(probe: Probe) -> bool:
    """Failed on its TTFT trend alone, its p90s and pace within their limits: the trend of a short probe
    is a slope over a few seconds, so the search measures such a probe again longer before counting it."""
    return not probe.passed and bool(probe.reasons) and all(r.startswith(TREND) for r in probe.reasons)
