"""Judged stand-in probes: what the SLO search sees from an engine, without one. The search's tests
and benchmarks/slo_search.py run it against the M/M/1 queue, whose true answer is known
(`simserver.true_max_rate`)."""

from __future__ import annotations

import math
import random

from pipeline.core.specs import SloSpec
from pipeline.records.benchmark import Probe
from pipeline.stages import benchmark
from pipeline.stages.benchmark import steady


def fixed_probe(
    rate: float, n: int, p90: float, slo: SloSpec, achieved: float | None = None, trend: float | None = None
) -> Probe:
    """A judged probe whose p90 TTFT is `p90` ms (TPOT 5 ms), as a stand-in engine would give; with
    `trend` (ms/s), that TTFT trend carried over the SLO's confirmation floor as the client does."""
    achieved = rate if achieved is None else achieved
    probe = Probe(
        rate=rate,
        num_prompts=n,
        achieved_rate=achieved,
        completed=n,
        failed=0,
        failed_fraction=0.0,
        duration_s=n / max(achieved, 1e-9),
        output_tok_s=0.0,
        p50_ttft_ms=p90 / 3,
        p90_ttft_ms=p90,
        p99_ttft_ms=p90 * 2,
        p50_tpot_ms=5,
        p90_tpot_ms=5,
        p99_tpot_ms=5,
        p90_itl_ms=5,
        p90_e2el_ms=p90,
        ttft_trend_ms_per_s=trend,
        projected_p90_ttft_ms=steady.projected(p90, trend, slo.confirm_floor_seconds),
    )
    benchmark.judge(probe, slo)
    return probe


def mm1_run(mu: float, slo: SloSpec, noise: float = 0.0, seed: int = 0):
    """A probe from the M/M/1 model itself (p90 TTFT = ln 10 / (mu - rate)), with optional noise."""
    rng = random.Random(seed)

    def run(rate: float, n: int, _seed: int) -> Probe:
        achieved = min(rate, mu * 0.98) if not math.isinf(rate) else mu
        p90 = math.log(10) / max(mu - rate, 1e-3) * 1000 if rate < mu else 1e6
        p90 *= 1 + rng.uniform(-noise, noise)
        return fixed_probe(rate, n, p90, slo, achieved)

    return run
