"""Benchmark stage: per layout, the highest Poisson request rate that holds the p90 SLO.

Load comes from vLLM's own client (`vllm bench serve`, random prompts at the spec's input and
output lengths, `--ignore-eos`, Poisson arrivals); this module only decides which rates to
probe and reads the JSON it saves. The search keeps its whole state as typed records
(`Probe`, `LayoutResult`): they feed the report, the plot, the gate and the tests alike.

Why this search: latency against offered load is flat, then bends up sharply near capacity.
A saturation probe (every request at once) measures that capacity, which brackets the
answer from above; a secant on each probe's latency margin (safeguarded by bisection) then
needs a few probes instead of a sweep's 1/resolution. Why order statistics: a p90 from n
requests is itself a random quantity; when the SLO limit falls inside its 95% interval the
verdict is noise, so the probe is repeated with more requests before it is trusted.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.spec import HardwareProfile, Layout, ReleaseSpec, SloSpec, WorkloadSpec
from pipeline.stages import engine_metrics, interference, served_accuracy, serving
from pipeline.stages.engine_metrics import EngineView
from pipeline.stages.evaluate import EvalResult
from pipeline.stages.interference import Interference
from pipeline.stages.served_accuracy import ServedAccuracy

log = logging.getLogger(__name__)

KEEP_UP = 0.90  # achieved throughput must be at least this share of the offered rate (less sampling noise)
MAX_PROMPT_DOUBLINGS = 2


class Probe(BaseModel):
    """One `vllm bench serve` run at one offered rate."""

    # the saturation probe's rate is inf; JSON (XCom, files) carries it as the string "Infinity"
    model_config = ConfigDict(ser_json_inf_nan="strings")

    rate: float = Field(description="offered Poisson rate, req/s (inf for the saturation probe)")
    num_prompts: int
    achieved_rate: float = Field(description="completed requests / duration")
    completed: int
    failed: int
    failed_fraction: float
    duration_s: float
    output_tok_s: float
    goodput: float | None = None
    p50_ttft_ms: float
    p90_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p90_tpot_ms: float
    p99_tpot_ms: float
    p90_itl_ms: float
    p90_e2el_ms: float
    p90_ttft_ci_ms: tuple[float, float] | None = Field(None, description="95% order-statistic interval of the p90")
    p90_tpot_ci_ms: tuple[float, float] | None = None
    passed: bool = False
    conclusive: bool = Field(True, description="false when a limit still fell inside a p90 interval")
    reasons: list[str] = Field(default_factory=list)
    result_file: str = ""
    interference: Interference | None = Field(None, description="CPU use of the engine, the client and others")
    engine: EngineView | None = Field(None, description="the engine's own histograms for this probe (/metrics)")
    clean: bool = Field(True, description="other processes stayed under the interference limit")
    superseded: bool = Field(
        False, description="run again at the same rate (inconclusive, unclean, or unsteady at the answer); not counted"
    )
    client_lag_p90_ms: float | None = Field(
        None,
        description="p90 of how late the client sent each request against its schedule (vLLM's client: its "
        "queue_times, from the schedule's release of a request to its send)",
    )
    client_lag_end_ms: float | None = Field(
        None, description="how far the client's last send fell behind the schedule's end, at least (span less n / rate)"
    )
    client_cpu_ms_per_request: float | None = Field(
        None, description="the client's CPU time per request (its whole process, start-up included)"
    )
    client_bound: bool = Field(
        False,
        description="the client sent late by more than workload.max_client_lag of the p90 TTFT limit: the "
        "latencies may be the client's as much as the engine's",
    )
    client_note: str = Field("", description="why the probe is client-bound (its lags against the limit)")


class LayoutResult(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    layout: str
    tp: int
    dp: int
    ep: int
    pp: int
    replicas: int
    devices: int
    status: str = Field(
        description="ok; failed (engine did not start, died, client errors); cancelled (an engine was stopped "
        "from outside by SIGTERM/SIGINT: a shutdown or a cancelled task)"
    )
    error: str | None = None
    load_seconds: list[float] = Field(default_factory=list, description="per replica, process start to healthy")
    capacity_rps: float | None = None
    max_slo_rate: float | None = Field(None, description="req/s at the layout's endpoint (all its replicas)")
    per_server: float | None = None
    per_device: float | None = None
    bound_only: bool = Field(
        False,
        description="the answer is a lower bound (no probe above it failed, or the probe budget ran out before "
        "it was narrowed), not a narrowed value; with no answer, the search ran out of probes while the SLO failed",
    )
    extrapolated: bool = Field(
        False,
        description="a lower bound that the line through the two highest passes puts within half the resolution "
        "below the SLO's edge (no probe above it failed): as near the edge as a narrowed answer by the search's "
        "own model, which calibration trusts and the report does not",
    )
    stop_reason: str = ""
    burst_rps: float | None = Field(None, description="throughput of the opening burst (the search's scale only)")
    deciding_p90_ttft_ms: list[float] = Field(default_factory=list, description="p90 TTFT of each run at the answer")
    spread: float | None = Field(None, description="max/min - 1 of the runs at the answer")
    unsteady: bool = Field(
        False,
        description="the runs at the answer differ by more than workload.max_spread even with probes twice as "
        "long: the answer holds in its worst run, but the edge is not known that well",
    )
    client_bound: bool = Field(
        False, description="a run at the answer, or the fail that capped it, was client-bound (Probe.client_bound)"
    )
    client_bound_rates: list[float] = Field(default_factory=list, description="rates with a client-bound run")
    unclean_rates: list[float] = Field(default_factory=list, description="rates never measured without interference")
    placement: dict[str, str] = Field(default_factory=dict, description="what ran on which cores (cpu profile)")
    predicted_max_slo_rate: float | None = Field(
        None,
        description="the planner's max SLO rate at this endpoint, written before the measurement; the search's prior",
    )
    prediction_error: float | None = Field(None, description="measured / predicted - 1")
    planner_rate: float | None = Field(None, description="the planner's own rate, before calibration")
    calibration_key: str | None = Field(None, description="hardware | engine image | layout shape")
    calibration: str | None = Field(None, description="how the prediction was calibrated (None: it was not)")
    served_accuracy: ServedAccuracy | None = Field(
        None, description="lm-eval at this layout's endpoint after its search; a failure fails the layout"
    )
    probes: list[Probe] = Field(default_factory=list)
    seconds: float = 0.0


class Selection(BaseModel):
    best: str | None
    passed: bool
    reason: str
    layouts: list[LayoutResult]


# ---------------------------------------------------------------- statistics


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


def per_request_tpot_ms(data: dict[str, Any]) -> list[float]:
    out = []
    columns = (data.get("ttfts", []), data.get("latencies", []), data.get("output_lens", []))
    for ttft, latency, n in zip(*columns, strict=True):
        if n and n > 1 and latency:
            out.append((latency - ttft) / (n - 1) * 1000)
    return out


# ---------------------------------------------------------------- running vLLM's client


def bench_command(
    base: list[str],
    url: str,
    model_dir: str,
    workload: WorkloadSpec,
    slo: SloSpec,
    rate: float,
    num_prompts: int,
    seed: int,
    result_dir: Path,
    name: str,
) -> list[str]:
    return [
        *base,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "model",
        "--tokenizer",
        model_dir,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf" if math.isinf(rate) else f"{rate:.4f}",
        "--burstiness",
        "1.0" if workload.arrival == "poisson" else "1000",
        "--seed",
        str(seed),
        "--metric-percentiles",
        "50,90,99",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--goodput",
        f"ttft:{slo.p90_ttft_ms:g}",
        f"tpot:{slo.p90_tpot_ms:g}",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        name,
        "--disable-tqdm",
        "--num-warmups",
        "2",
        "--ready-check-timeout-sec",
        "0",
    ]


def client_lag_ms(data: dict[str, Any], rate: float) -> tuple[float | None, float | None]:
    """(p90 per-request send lag, last send's lag against the schedule's end), ms, from a client's
    detailed result. vLLM's client records per request `queue_times` (from its schedule releasing the
    request to the send: its event loop's backlog) and `start_times` (the sends). Its Poisson schedule
    is scaled to end n / rate after it starts, so on schedule the sends span n / rate less the first
    one's wait (1 / rate on average): a client that cannot keep up sends the last ones late, and the
    span less n / rate is a lower bound of that lag (never an alarm at a low rate's long waits)."""
    lags = sorted(q * 1000 for q in data.get("queue_times") or [] if q is not None)
    p90 = lags[min(len(lags) - 1, math.ceil(0.9 * len(lags)) - 1)] if lags else None
    starts = [t for t in data.get("start_times") or [] if t is not None]
    end = None
    if len(starts) > 1 and not math.isinf(rate) and rate > 0:
        end = max(0.0, (max(starts) - min(starts) - len(starts) / rate) * 1000)
    return (None if p90 is None else round(p90, 2)), (None if end is None else round(end, 2))


def mark_client_bound(probe: Probe, slo: SloSpec, workload: WorkloadSpec) -> None:
    """Client-bound: the client sent late by more than `workload.max_client_lag` of the p90 TTFT
    limit. Why lag: a client whose single event loop is busy (its CPU per request times the rate
    nears a core, or it shares a core) sends late and reads the first tokens late by about as much,
    so its lag says how much of a latency may be the client's own. A burst has no schedule to lag."""
    limit = workload.max_client_lag * slo.p90_ttft_ms
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


def parse_result(
    path: Path, rate: float, num_prompts: int, slo: SloSpec, workload: WorkloadSpec | None = None
) -> Probe:
    """A probe from a client's saved result (vLLM's `--save-detailed` keys); with `workload`, marked
    client-bound by the client's send lag (`mark_client_bound`)."""
    data = json.loads(path.read_text())
    completed, failed = int(data.get("completed", 0)), int(data.get("failed", 0) or 0)
    total = max(completed + failed, num_prompts)
    probe = Probe(
        rate=rate,
        num_prompts=num_prompts,
        achieved_rate=float(data["request_throughput"]),
        completed=completed,
        failed=failed,
        failed_fraction=(total - completed) / total,
        duration_s=float(data["duration"]),
        output_tok_s=float(data.get("output_throughput", 0.0)),
        goodput=data.get("request_goodput"),
        **{f"p{p}_{m}_ms": float(data.get(f"p{p}_{m}_ms", math.nan)) for p in (50, 90, 99) for m in ("ttft", "tpot")},
        p90_itl_ms=float(data.get("p90_itl_ms", math.nan)),
        p90_e2el_ms=float(data.get("p90_e2el_ms", math.nan)),
        result_file=str(path),
    )
    ttfts = [t * 1000 for t in data.get("ttfts", []) if t]
    probe.p90_ttft_ci_ms = quantile_ci(ttfts)
    probe.p90_tpot_ci_ms = quantile_ci(per_request_tpot_ms(data))
    probe.client_lag_p90_ms, probe.client_lag_end_ms = client_lag_ms(data, rate)
    if data.get("client_cpu_s") is not None:  # a client that measures its own CPU (the Prober's is from wait4)
        probe.client_cpu_ms_per_request = round(float(data["client_cpu_s"]) * 1000 / max(num_prompts, 1), 3)
    judge(probe, slo)
    if workload is not None:
        mark_client_bound(probe, slo, workload)
    return probe


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
    if probe.p90_ttft_ms > slo.p90_ttft_ms:
        reasons.append(f"p90 TTFT {probe.p90_ttft_ms:.1f} ms > {slo.p90_ttft_ms:g}")
    if probe.p90_tpot_ms > slo.p90_tpot_ms:
        reasons.append(f"p90 TPOT {probe.p90_tpot_ms:.1f} ms > {slo.p90_tpot_ms:g}")
    if probe.failed_fraction > slo.max_failed_fraction:
        reasons.append(f"failed {probe.failed_fraction:.1%} > {slo.max_failed_fraction:.1%}")
    if not kept_up(probe.rate, probe.achieved_rate, probe.num_prompts):
        share = keep_up_share(probe.num_prompts)
        reasons.append(f"achieved {probe.achieved_rate:.2f} req/s < {share:.0%} of offered {probe.rate:.2f}")
    probe.reasons = reasons
    probe.passed = not reasons
    inside = [
        (ci, limit)
        for ci, limit in ((probe.p90_ttft_ci_ms, slo.p90_ttft_ms), (probe.p90_tpot_ci_ms, slo.p90_tpot_ms))
        if ci is not None and ci[0] <= limit <= ci[1]
    ]
    probe.conclusive = not inside


# ---------------------------------------------------------------- the search


RunProbe = Callable[[float, int, int], Probe]  # (rate, num_prompts, seed) -> Probe

UP, UP_WITH_PRIOR = 2.0, 1.25  # first bracket steps: from a burst's rough scale, or from a known answer
MAX_STEP = 4.0
FLOOR = 0.02  # below this share of the starting rate the SLO is called missed
AIM = 0.25  # share of the resolution a probe aims past the estimated edge, on the side it should land on
NEAR_MISS = 0.99  # the margin a failed probe counts with when its latencies held (counted as a fail, inconclusive)
LONGER = 2  # how many times longer the probes are that measure an unsteady answer again


def margin(probe: Probe, slo: SloSpec) -> float:
    """limit / p90 of the latency nearest its limit: above 1 inside the SLO, 1 at its edge.

    Why this scale: for a queue it falls about linearly with the offered rate up to the knee
    (M/M/1: p90 TTFT = ln 10 / (mu - rate), so limit / p90 is linear in the rate), so a line
    through two probes lands near the edge where halving the bracket needs several probes more."""
    return min(
        slo.p90_ttft_ms / max(probe.p90_ttft_ms, 1e-9),
        slo.p90_tpot_ms / max(probe.p90_tpot_ms, 1e-9),
    )


def hopeless(probe: Probe) -> bool:
    """Failed on errors or on pace: more requests would not change the verdict."""
    return any("achieved" in r or "failed" in r for r in probe.reasons)


def crossing(points: list[tuple[float, float]]) -> float | None:
    """The rate at which the line through two (rate, margin) points reaches margin 1; None unless
    the margin falls as the rate rises (noise can make two probes say otherwise)."""
    (r1, y1), (r2, y2) = points
    if r1 == r2 or (y2 - y1) / (r2 - r1) >= 0:
        return None
    return r1 + (1 - y1) * (r2 - r1) / (y2 - y1)


class SearchOutcome(BaseModel):
    """What one SLO search found, and the evidence for it."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    probes: list[Probe]
    burst_rps: float | None = Field(None, description="throughput of the opening burst: the scale, never a bracket")
    capacity: float | None = Field(None, description="highest throughput any probe achieved, req/s")
    max_slo_rate: float | None = None
    bound_only: bool = Field(False, description="the answer is a lower bound (see LayoutResult.bound_only)")
    extrapolated: bool = Field(False, description="a lower bound closed by the passes' line (LayoutResult's)")
    stop_reason: str = ""
    deciding_p90_ttft_ms: list[float] = Field(
        default_factory=list, description="p90 TTFT of every counted run at the answer"
    )
    spread: float | None = Field(None, description="max/min - 1 of those p90s: how well repeats agree")
    unsteady: bool = Field(False, description="see LayoutResult.unsteady")
    client_bound: bool = Field(False, description="see LayoutResult.client_bound")
    client_bound_rates: list[float] = Field(default_factory=list, description="rates with a client-bound run")
    unclean_rates: list[float] = Field(
        default_factory=list, description="rates where interference stayed above the limit on every try"
    )


def spread(runs: Sequence[Probe]) -> float | None:
    """max / min - 1 of the p90 TTFTs of runs at one rate (None for fewer than two)."""
    p90s = [p.p90_ttft_ms for p in runs]
    if len(p90s) < 2 or min(p90s) <= 0:
        return None
    return round(max(p90s) / min(p90s) - 1, 3)


def is_clean(probe: Probe, workload: WorkloadSpec) -> bool:
    seen = probe.interference
    return seen is None or (seen.other <= workload.max_interference and seen.steal <= workload.max_interference)


def slo_search(
    run: RunProbe, workload: WorkloadSpec, slo: SloSpec, max_probes: int = 16, prior: float | None = None
) -> SearchOutcome:
    """Bracket the highest rate that holds the SLO with steady-state probes, narrow, confirm.

    Without a prior, a burst of `num_prompts` requests gives only the scale (a burst measures
    start-up as much as the engine); the bracket comes from steady probes at half that rate and
    up or down by 2x (then 4x) until the verdict flips. With a prior (a prediction, or the rate a
    release was promoted at) the first probe is at the prior and the steps start at 1.25x. From
    two probes on one side, the next goes where the line through their margins (`margin`) meets
    the SLO's edge, within those steps (just below it from two passes: a pass there whose line
    puts the edge within half the resolution above it is the answer, as a queue's edge lies at
    or below that line; so it is inside a bracket, where the passes are those below its fail; with
    no fail above it, that answer is a lower bound, `bound_only`, as every answer no fail caps is).
    Inside a bracket each probe aims just past the secant's edge (a quarter of the resolution),
    on the side the last probe did not land on, and bisects when one side won twice running,
    until the bracket is half the resolution wide, or no wider than the resolution with the
    secant's edge within half the resolution above the pass (near the edge a verdict is a coin
    toss within the latencies' noise: narrowing further buys little but probes); the answer
    is repeated `workload.repeats` times: a repeat that fails moves the answer down. A probe
    whose interference (CPU used by other processes) exceeds `workload.max_interference` cores
    is run again. Runs at the answer whose p90 TTFTs differ by more than `workload.max_spread` are
    measured again, once, with probes `LONGER` times as long (the short ones no longer count): a
    longer run that fails moves the answer down, as a failing repeat does, so the gate takes the
    lower of the two measurements; an answer whose longer runs still differ that much is marked
    `unsteady` (it holds in its worst run). Probes whose client sent late (`mark_client_bound`) are
    kept and counted, and the answer is marked `client_bound` when they decided it.
    """
    out = SearchOutcome(probes=[])
    runs: dict[float, list[Probe]] = {}  # counted runs per rate
    lengthened: set[float] = set()  # rates measured again with longer probes for their spread
    seed = workload.seed

    def probe(rate: float, longer: int = 1) -> Probe:
        nonlocal seed
        # short runs never build a queue and flatter high rates: send at least min_probe_seconds of load
        n = (
            workload.num_prompts
            if math.isinf(rate)
            else max(workload.num_prompts, math.ceil(rate * workload.min_probe_seconds)) * longer
        )
        doublings = dirty = 0
        while True:
            seed += 1  # a fresh prompt set each run: cached prefixes must not flatter later probes
            result = run(rate, n, seed)
            out.probes.append(result)
            result.clean = is_clean(result, workload)
            seen = result.interference
            log.info(
                "probe %.3g req/s x %d: achieved %.3g, p90 TTFT %.1f ms (engine %s), p90 TPOT %.1f ms -> %s%s%s",
                rate,
                n,
                result.achieved_rate,
                result.p90_ttft_ms,
                f"{result.engine.p90_ttft_ms:.1f} ms"
                if result.engine and result.engine.p90_ttft_ms is not None
                else "-",
                result.p90_tpot_ms,
                "pass" if result.passed else "fail (" + "; ".join(result.reasons) + ")",
                "" if result.conclusive else " [limit inside the p90 interval]",
                f" [other processes {seen.other:.2f} cores, steal {seen.steal:.2f}]" if seen else "",
            )
            if result.client_bound:
                log.warning("probe at %.3g req/s: %s", rate, result.client_note)
            if not result.clean and dirty < workload.interference_retries:
                dirty += 1
                result.superseded = True
                log.warning(
                    "probe at %.3g req/s: other processes used %.2f cores (limit %.2f): %s; measuring again",
                    rate,
                    seen.other if seen else 0,
                    workload.max_interference,
                    ", ".join(f"{name} {c:.2f}" for name, c in (seen.top_other if seen else [])),
                )
                continue
            if not result.clean:
                out.unclean_rates.append(rate)
                log.warning(
                    "probe at %.3g req/s: no clean measurement after %d tries; its verdict is kept, flagged",
                    rate,
                    dirty + 1,
                )
            if result.conclusive or math.isinf(rate) or hopeless(result):
                break
            if doublings == MAX_PROMPT_DOUBLINGS:
                log.warning("probe at %.3g req/s stays inconclusive with %d requests; counting it as a fail", rate, n)
                result.passed = False
                result.reasons.append("inconclusive: SLO limit inside the p90 interval")
                break
            result.superseded = True
            doublings += 1
            n *= 2
        if not math.isinf(rate):
            runs.setdefault(rate, []).append(result)
        return result

    def holds(rate: float) -> bool:
        return all(p.passed for p in runs.get(rate, [])) and bool(runs.get(rate))

    def spent() -> bool:
        return len(out.probes) >= max_probes

    def finish(answer: float | None, reason: str, bound: bool = False, extrapolated: bool = False) -> SearchOutcome:
        counted = [p for p in out.probes if not p.superseded]
        out.capacity = max((p.achieved_rate for p in counted), default=None)
        out.max_slo_rate, out.stop_reason, out.bound_only = answer, reason, bound
        out.extrapolated = extrapolated
        out.client_bound_rates = sorted({p.rate for p in counted if p.client_bound})
        if answer is not None:
            out.deciding_p90_ttft_ms = [round(p.p90_ttft_ms, 2) for p in runs.get(answer, [])]
            out.spread = spread(runs.get(answer, []))
            if out.spread is not None and out.spread > workload.max_spread:
                out.unsteady = True
                out.stop_reason += (
                    f"; the runs at the answer differ by {out.spread:.0%} (allowance {workload.max_spread:.0%})"
                    + (" with probes twice as long too" if answer in lengthened else "")
                    + ": unsteady, it holds in its worst run"
                )
            capping = [r for r in runs if r > answer and not holds(r)]
            deciding = runs.get(answer, []) + (runs[min(capping)] if capping else [])
            out.client_bound = any(p.client_bound for p in deciding)
        if out.client_bound_rates:
            out.stop_reason += f"; client-bound at {', '.join(f'{r:.3g}' for r in out.client_bound_rates)} req/s" + (
                " (deciding the answer: the figure may be the client's, not the engine's)" * out.client_bound
            )
        if out.unclean_rates:
            out.stop_reason += f"; no clean measurement at {', '.join(f'{r:.3g}' for r in out.unclean_rates)} req/s"
        return out

    def point(rate: float) -> tuple[float, float]:
        """(rate, margin) of the counted runs at a rate: the worst margin, on its verdict's side; 0 where
        requests failed or the engine fell behind (no latency says how far off that is)."""
        if any(hopeless(p) for p in runs[rate]):
            return rate, 0.0
        worst = min(margin(p, slo) for p in runs[rate])
        return rate, max(worst, 1.0) if holds(rate) else min(worst, NEAR_MISS)

    def secant_close(lo: float, hi: float) -> bool:
        """The line from the pass to the fail meets the edge within half the resolution above the pass."""
        edge = crossing([point(lo), point(hi)])
        return edge is not None and edge <= lo * (1 + res / 2)

    def closed_between(lo: float, hi: float) -> bool:
        """A bracket no wider than the resolution whose line (pass to fail) meets the edge within half
        the resolution above the pass: the pass is the answer, as when closing from below; narrowing
        further would spend probes on verdicts within the latencies' noise of the edge."""
        return (hi - lo) / hi <= res and secant_close(lo, hi)

    if prior:
        start, step = prior, UP_WITH_PRIOR
    else:
        burst = probe(math.inf)
        out.burst_rps = burst.achieved_rate
        if burst.achieved_rate <= 0:
            return finish(None, "no request completed in the opening burst")
        start, step = burst.achieved_rate / 2, UP
    res = slo.resolution
    probe(start)
    verdicts: list[bool] = []  # of the probes inside a bracket: the same verdict twice means the secant stalls
    while True:
        # fails trump passes above them: a rate that failed (a repeat, noise) caps the answer
        failed = [r for r in runs if not holds(r)]
        hi = min(failed, default=None)
        lo = max((r for r in runs if holds(r) and (hi is None or r < hi)), default=None)
        passes = sorted(r for r in runs if holds(r) and (hi is None or r < hi))[-2:]
        # where the line through the two highest passes (below any fail) meets the edge. A queue's
        # margin falls at least linearly with the rate (`margin`), so the edge lies at or below that
        # line's crossing: within half the resolution above lo, lo is the answer (once repeated),
        # whether or not a fail above brackets it
        edge_above = crossing([point(r) for r in passes]) if len(passes) == 2 else None
        # with a fail above, its line must agree: two noisy passes close together can put the edge just
        # above them when fails near the edge were noise (an answer 5.7% low in the benchmark)
        closed_below = (
            edge_above is not None
            and lo is not None
            and edge_above <= lo * (1 + res / 2)
            and (hi is None or secant_close(lo, hi))
        )
        if hi is None and not closed_below:
            # all passed: step up, or go just below where the line through the two highest passes
            # meets the edge (a pass there closes the search from below; a fail brackets it)
            assert lo is not None
            if spent():
                return finish(
                    lo, f"probe budget ({max_probes}) spent while bracketing; {lo:.3g} is a lower bound", True
                )
            # where latency grows at least in proportion to the rate (near the knee it grows faster),
            # the edge lies below lo x its margin: no step beyond that
            cap = lo * min(step, max(point(lo)[1], 1 + res / 2))
            aimed = None if edge_above is None else edge_above * (1 - AIM * res)  # just below the line's edge
            if aimed is None or aimed >= cap:
                # no edge in sight, or one past the step (flat latencies at a low load: a line through
                # two of them reaches the edge far off or never): keep widening the step, as from a
                # low prior the search would otherwise climb by its first step to the end of its budget
                rate, step = cap, min(step * step, MAX_STEP)
            else:
                rate = min(max(aimed, lo * (1 + res / 2)), cap)
        elif lo is None:
            # all failed: step down, or to where the line through the two lowest fails meets the edge
            assert hi is not None  # with no fail, some rate passed
            fails = sorted(failed)[:2]
            edge = crossing([point(r) for r in fails]) if len(fails) == 2 else None
            # the same reasoning puts the edge above hi x its margin
            floor = hi * max(1 / step, min(point(hi)[1], 1 - res / 2))
            if edge is None:
                rate, step = floor, min(step * step, MAX_STEP)
            else:
                rate = max(min(edge * (1 - AIM * res), hi * (1 - res / 2)), floor)
            if rate < start * FLOOR:
                return finish(None, f"SLO missed even at {hi:.3g} req/s")
            if spent():
                return finish(None, f"probe budget ({max_probes}) spent; the SLO fails down to {hi:.3g} req/s", True)
        elif hi is not None and (hi - lo) / hi > res / 2 and not closed_below and not closed_between(lo, hi):
            # narrow the bracket to half the resolution, so the reported (last passing) rate is within
            # the resolution of the true edge even when the edge sits at the top of the bracket: aim just
            # past the secant's edge, on the side the last probe did not land on, so that two probes
            # close a bracket around a good estimate; bisect when the same side won twice running
            if spent():
                return finish(lo, f"probe budget ({max_probes}) spent; {lo:.3g} is a lower bound", True)
            edge = crossing([point(lo), point(hi)])
            width = hi - lo
            last_passed = [p for p in out.probes if not p.superseded][-1].passed
            if edge is None or verdicts[-2:] in ([True, True], [False, False]):
                rate = (lo + hi) / 2
            else:
                rate = edge * (1 + AIM * res if last_passed else 1 - AIM * res)
                rate = min(max(rate, lo + width / 10), hi - width / 10)
            verdicts.append(probe(rate).passed)
            continue
        elif len(runs[lo]) < 1 + workload.repeats:
            # confirm: the answer must pass again; a failing repeat makes it a fail and the loop goes on below it
            if spent():
                return finish(
                    lo,
                    f"probe budget ({max_probes}) spent before the answer was repeated; {lo:.3g} is a lower bound",
                    True,
                )
            if not probe(lo).passed:
                log.warning("the answer %.3g req/s failed its repeat; searching below it", lo)
                verdicts.clear()
            continue
        elif (
            lo not in lengthened
            and (spread(runs[lo]) or 0) > workload.max_spread
            and len(out.probes) + 1 + workload.repeats <= max_probes
        ):
            # the runs at the answer disagree: short probes may not have reached the queue's steady state;
            # measure it again with longer ones, which alone count (a fail among them moves the answer down)
            lengthened.add(lo)
            log.warning(
                "the runs at %.3g req/s differ by %.0f%% (allowance %.0f%%); measuring again, probes %dx as long",
                lo,
                (spread(runs[lo]) or 0) * 100,
                workload.max_spread * 100,
                LONGER,
            )
            for p in runs.pop(lo):
                p.superseded = True
            for _ in range(1 + workload.repeats):
                if not probe(lo, LONGER).passed:
                    log.warning("a longer run at %.3g req/s failed; searching below it", lo)
                    verdicts.clear()
                    break
            continue
        elif closed_below:
            # the line says where the edge is; only a probe that failed above the answer shows it: without
            # one the answer is what it measured, a rate that holds the SLO, and the engine may hold more
            return finish(
                lo,
                f"passes at {lo:.3g} ({len(runs[lo])} runs); the line through the two highest passes meets "
                f"the SLO's edge within {res / 2:.1%} above it, at {edge_above:.3g}"
                + (
                    f"; fails at {hi:.3g}"
                    if hi is not None
                    else f"; no probe above it failed: {lo:.3g} is a lower bound"
                ),
                bound=hi is None,
                extrapolated=hi is None,
            )
        elif hi is not None and (hi - lo) / hi > res / 2:
            return finish(
                lo,
                f"narrowed to {(hi - lo) / hi:.1%}: passes at {lo:.3g} ({len(runs[lo])} runs), fails at {hi:.3g}; "
                f"the line between them meets the SLO's edge within {res / 2:.1%} above the pass, "
                f"at {crossing([point(lo), point(hi)]):.3g}",
            )
        else:
            return finish(
                lo, f"narrowed to {res / 2:.1%}: passes at {lo:.3g} ({len(runs[lo])} runs), fails at {hi:.3g}"
            )
        probe(rate)


def uniform_sweep(
    run: RunProbe, capacity: float, workload: WorkloadSpec, slo: SloSpec
) -> tuple[list[Probe], float | None]:
    """The reference a search is compared with: every rate on a grid of `resolution` x capacity."""
    probes, best = [], None
    steps = int(round(1 / slo.resolution))
    for i in range(1, steps + 1):
        rate = capacity * i / steps
        result = run(rate, workload.num_prompts, workload.seed + i)
        probes.append(result)
        if result.passed:
            best = rate
    return probes, best


# ---------------------------------------------------------------- results


def finish(result: LayoutResult, hw: HardwareProfile) -> LayoutResult:
    if result.max_slo_rate is not None:
        # GPU layouts tile the node; a CPU engine takes the whole machine whatever its core binding
        copies = max(1, hw.devices // result.devices) if hw.kind == "gpu" else 1
        result.per_server = round(result.max_slo_rate * copies, 4)
        result.per_device = round(result.per_server / hw.devices, 4)
        if result.predicted_max_slo_rate:
            result.prediction_error = round(result.max_slo_rate / result.predicted_max_slo_rate - 1, 4)
    return result


def rate_text(
    rate: float | None, bound: bool | None = False, unsteady: bool | None = False, client_bound: bool | None = False
) -> str:
    """A measured max SLO rate as a reader must take it: 'at least 373' where it is a lower bound
    (`bound_only`), '373' where a failing probe above it capped it, '-' for none; '(unsteady)' where
    its runs disagreed (`unsteady`), '(client-bound)' where the client's lag decided it."""
    if rate is None:
        return "-"
    marks = [m for m, on in (("unsteady", unsteady), ("client-bound", client_bound)) if on]
    return (f"at least {rate:.3g}" if bound else f"{rate:.3g}") + (f" ({', '.join(marks)})" if marks else "")


def select(results: list[LayoutResult], slo: SloSpec) -> Selection:
    ok = [r for r in results if r.status == "ok" and r.per_server is not None]
    if not ok:
        return Selection(best=None, passed=False, reason="no layout met the SLO at any rate", layouts=results)
    best = max(ok, key=lambda r: r.per_server or 0)
    if (best.per_server or 0) < slo.min_rate_per_server:
        return Selection(
            best=best.layout,
            passed=False,
            layouts=results,
            reason=f"best layout {best.layout} holds the SLO {'at least ' if best.bound_only else ''}up to "
            f"{rate_text(best.per_server, False, best.unsteady, best.client_bound)} req/s per server, "
            f"below the required {slo.min_rate_per_server:g}",
        )
    return Selection(
        best=best.layout,
        passed=True,
        layouts=results,
        reason=f"{best.layout}: {rate_text(best.per_server, best.bound_only, best.unsteady, best.client_bound)} "
        f"req/s per server ({best.per_device:.3g} per device)",
    )


def table(results: list[LayoutResult]) -> str:
    rows = [
        f"{'layout':22} {'status':7} {'load s':>8} {'capacity':>9} {'max SLO':>9} {'predicted':>9} {'error':>6} "
        f"{'/server':>9} {'/device':>9} {'probes':>6} {'spread':>6} {'served acc':>10}  note"
    ]
    for r in results:
        fmt = lambda v: f"{v:9.3g}" if v is not None else f"{'-':>9}"  # noqa: E731
        spread_cell = f"{r.spread:6.0%}" if r.spread is not None else f"{'-':>6}"
        error = f"{r.prediction_error:+6.0%}" if r.prediction_error is not None else f"{'-':>6}"
        served = r.served_accuracy
        acc = f"{'pass' if served.passed else 'FAIL'} {served.seconds:4.0f}s" if served else "-"
        rows.append(
            f"{r.layout:22} {r.status:7} {max(r.load_seconds, default=0):8.1f} {fmt(r.capacity_rps)} "
            f"{fmt(r.max_slo_rate)} {fmt(r.predicted_max_slo_rate)} {error} {fmt(r.per_server)} "
            f"{fmt(r.per_device)} {len(r.probes):6d} {spread_cell} {acc:>10}  "
            f"{r.error.splitlines()[0] if r.error else r.stop_reason}"
        )
    return "\n".join(rows)


def write_outputs(
    results: list[LayoutResult], slo: SloSpec, out_dir: Path, selection: Selection | None = None
) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, png_path = (
        out_dir / "benchmark.json",
        out_dir / "benchmark.csv",
        out_dir / "latency_vs_rate.png",
    )
    atomic_write(
        json_path,
        json.dumps(
            {
                "layouts": [json.loads(r.model_dump_json()) for r in results],  # strict JSON: inf/nan as strings
                "selection": json.loads(selection.model_dump_json(exclude={"layouts"})) if selection else None,
            },
            indent=2,
        ),
    )
    fields = [
        "layout",
        "rate",
        "num_prompts",
        "achieved_rate",
        "completed",
        "failed",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p90_tpot_ms",
        "p99_tpot_ms",
        "p90_itl_ms",
        "p90_e2el_ms",
        "goodput",
        "output_tok_s",
        "passed",
        "conclusive",
        "clean",
        "superseded",
        "client_lag_p90_ms",
        "client_lag_end_ms",
        "client_cpu_ms_per_request",
        "client_bound",
    ]
    with open(csv_path, "w", newline="") as handle:
        extra = ["cpu_engine", "cpu_client", "cpu_other", "cpu_steal", "cpu_load_avg_1m", "engine_p90_ttft_ms"]
        writer = csv.DictWriter(handle, fieldnames=fields + extra)
        writer.writeheader()
        for r in results:
            for p in r.probes:
                seen = (
                    p.interference.model_dump(include={"engine", "client", "other", "steal", "load_avg_1m"})
                    if p.interference
                    else {}
                )
                writer.writerow(
                    {
                        "layout": r.layout,
                        **p.model_dump(include=set(fields)),
                        **{f"cpu_{k}": v for k, v in seen.items()},
                        "engine_p90_ttft_ms": p.engine.p90_ttft_ms if p.engine else None,
                    }
                )
    plot(results, slo, png_path)
    return {"json": str(json_path), "csv": str(csv_path), "png": str(png_path)}


def plot(results: list[LayoutResult], slo: SloSpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, limit, title in (
        (axes[0], "p90_ttft_ms", slo.p90_ttft_ms, "p90 TTFT"),
        (axes[1], "p90_tpot_ms", slo.p90_tpot_ms, "p90 TPOT"),
    ):
        for r in results:
            # runs measured again (inconclusive, unclean) are not counted; a repeated rate draws its
            # line through the last run and shows the others as dots, so the spread is visible
            counted = [p for p in r.probes if not math.isinf(p.rate) and not p.superseded]
            decisive = {p.rate: p for p in counted}
            points = sorted((rate, getattr(p, metric)) for rate, p in decisive.items())
            if not points:
                continue
            (line,) = ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=r.layout)
            repeats = [p for p in counted if decisive[p.rate] is not p]
            if repeats:
                ax.plot(
                    [p.rate for p in repeats],
                    [getattr(p, metric) for p in repeats],
                    linestyle="none",
                    marker="o",
                    markersize=4,
                    alpha=0.6,
                    color=line.get_color(),
                )
            if r.max_slo_rate in decisive:
                ax.plot(
                    [r.max_slo_rate],
                    [getattr(decisive[r.max_slo_rate], metric)],
                    marker="*",
                    markersize=16,
                    color=line.get_color(),
                    markeredgecolor="black",
                )
        ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs load (star: max rate within SLO)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- one layout, for real


class BenchClient:
    """vLLM's bench client, imported once (`vllm_cli.py bench-server`) and forked per probe.

    Each probe still runs `vllm bench serve` in a fresh process, on `cores`; the server answers
    with its exit code and CPU seconds (wait4), which the probe's accounting counts as the
    client's. Started on first use; `close()` (or our death: PDEATHSIG) ends it and any probe."""

    def __init__(self, base: list[str], env: dict[str, str], cores: list[int] | None = None):
        self.base, self.env, self.cores = base, env, cores or []
        self.proc: subprocess.Popen[str] | None = None
        self.ready = False

    def launch(self, cores: list[int] | None = None) -> None:
        """Start the server without waiting for its vLLM import (~20 s here), on `cores` meanwhile
        (default: its own): a layout's benchmark launches it on cores its engines leave idle while
        they load, so the import costs no probe and no engine time. `ensure()` waits for it."""
        if self.proc is not None and self.proc.poll() is None:
            return
        start_cores = cores or self.cores

        def preexec() -> None:
            serving.die_with_parent()
            if start_cores:
                os.sched_setaffinity(0, start_cores)

        self.ready = False
        self.proc = subprocess.Popen(
            [*self.base, "bench-server"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            preexec_fn=preexec,
        )

    def ensure(self) -> None:
        """A started server, ready for a probe, on its own cores."""
        if self.proc is None or self.proc.poll() is not None:
            self.launch()
        assert self.proc is not None
        if self.ready:
            return
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip().startswith("{"):
            self.close()
            raise ReleaseError(f"vllm bench client did not start ({' '.join(self.base)} bench-server)")
        if self.cores:
            serving.pin(self.proc.pid, self.cores)  # from the cores it loaded on (or was confined to)
        self.ready = True

    @property
    def group(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def run(self, argv: list[str], log_path: Path, timeout: float = 1800) -> tuple[int, float]:
        """`vllm bench serve` with `argv` (after `bench serve`... as on the command line), output
        to `log_path`. -> (exit code, CPU seconds it used)."""
        self.ensure()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
        self.proc.stdin.flush()
        answer: list[str] = []
        stdout = self.proc.stdout
        reader = threading.Thread(target=lambda: answer.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not answer or not answer[0].strip():
            self.close()  # a probe past its time, or a dead server: nothing of it may outlive the probe
            raise ReleaseError(f"vllm bench serve gave no answer within {timeout:.0f} s (see {log_path})")
        result = json.loads(answer[0])
        return int(result["rc"]), float(result["cpu_s"])

    def serve(self, argv: list[str], out_dir: Path, name: str, what: str = "") -> tuple[Path, float]:
        """`run`, with its result file `out_dir/name` (log beside it) required. -> (result file, CPU
        seconds); a failed run is a ReleaseError with the log's tail (`what`: what it measured)."""
        code, cpu_s = self.run(argv, out_dir / f"{name}.log")
        if code != 0 or not (out_dir / name).exists():
            text = (out_dir / f"{name}.log").read_text(errors="replace")
            raise ReleaseError(f"vllm bench serve failed{what} ({code}):\n{text[-2000:]}")
        return out_dir / name, cpu_s

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            self.ready = False


def bench_client(hw: HardwareProfile, engine_env: dict[str, str], cores: list[int] | None = None) -> BenchClient:
    """vLLM's own client, through vllm_cli.py (its SSE fix matters behind nginx): the engine venv's
    python here, the worker image's own python (which has vLLM) in a benchmark pod."""
    python = str(serving.SERVE_PYTHON) if hw.kind == "cpu" else sys.executable
    env = {**os.environ, **engine_env}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return BenchClient([python, str(serving.VLLM_CLI)], env, cores)


class Prober:
    """One probe against a running layout: vLLM's client at a rate, with the CPU accounting and
    the engine's histograms around it. What the search calls, and what a fixed-rate check calls."""

    def __init__(self, spec: ReleaseSpec, engine: Any, model_dir: Path, out_dir: Path, bench: BenchClient):
        self.spec, self.engine, self.model_dir, self.out_dir = spec, engine, model_dir, out_dir
        self.bench = bench
        self.client = bench.base
        self.numbers = itertools.count(1)
        self.done: list[Probe] = []  # every probe, kept when the engine dies mid-search

    def __call__(self, rate: float, n: int, seed: int, client_args: Sequence[str] = ()) -> Probe:
        """client_args: extra flags for vLLM's client (a benchmark's --max-concurrency, say)."""
        if not self.engine.alive():
            raise self.engine.exit_error("during the benchmark")
        name = f"probe-{next(self.numbers):02d}.json"
        cmd = bench_command(
            self.client,
            self.engine.url,
            str(self.model_dir),
            self.spec.workload,
            self.spec.slo,
            rate,
            n,
            seed,
            self.out_dir,
            name,
        ) + list(client_args)
        before = engine_metrics.merge([engine_metrics.scrape(u) for u in self.engine.replica_urls])
        self.bench.ensure()  # its one-time start-up (the vLLM import) stays outside the probe's window
        window = interference.Window(engine_groups=set(self.engine.groups), client_group=self.bench.group)
        path, client_s = self.bench.serve(cmd[len(self.client) :], self.out_dir, name)
        seen = window.close(client_s)
        after = engine_metrics.merge([engine_metrics.scrape(u) for u in self.engine.replica_urls])
        probe = parse_result(path, rate, n, self.spec.slo, self.spec.workload)
        probe.client_cpu_ms_per_request = round(client_s * 1000 / max(n, 1), 3)
        probe.interference = seen
        probe.engine = engine_metrics.view(before, after)
        self.done.append(probe)
        return probe


@contextmanager
def running_layout(
    spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, model_dir: Path, out_dir: Path, base_port: int | None = None
) -> Iterator[tuple[Any, Prober]]:
    """The layout's engines, started and healthy, with every other process kept off their cores
    for as long as they are measured; always torn down. Yields (engine, prober)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = base_port or serving.free_port()
    commands = serving.build_commands(spec, hw, layout, str(model_dir), port)
    if hw.kind == "cpu":
        # pick free ports for every replica
        for cmd in commands:
            new = serving.free_port()
            cmd.argv[cmd.argv.index("--port") + 1] = str(new)
            cmd.port = new
    plan = serving.placement(hw, layout)
    engine = serving.LocalEngine(commands, out_dir / "logs", placement=plan)
    bench = bench_client(hw, commands[0].env, plan.frontend_cores)
    # the client's vLLM import runs while the engines load, on the engine cores: they stay idle
    # until each replica is up (it loads on the frontend cores), so neither waits for the other
    bench.launch(sorted(set(plan.all_engine_cores) - set(plan.frontend_cores)))
    try:
        with engine, serving.isolated(engine.groups, plan.other_cores):  # nothing else on the compute cores
            log.info("placement: %s", "; ".join(f"{k}: {v}" for k, v in plan.describe().items()))
            yield engine, Prober(spec, engine, model_dir, out_dir, bench)
    finally:
        bench.close()


def benchmark_layout(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model_dir: Path,
    out_dir: Path,
    base_port: int | None = None,
    max_probes: int = 16,
    prior: float | None = None,
    predicted: float | None = None,
    accuracy: tuple[EvalResult, EvalResult] | None = None,
    answers_without_slo: bool = False,
) -> LayoutResult:
    """Start the layout's engines, run the search against their one endpoint, always tear down.

    Each probe records who else used the CPU meanwhile and the engine's own histograms.
    `prior`: where the search starts (a re-benchmark's promoted rate, whose first probe is then
    the check at that rate). `predicted`: the planner's rate for this layout, kept beside the
    measurement; the search starts from it when no other prior is given. `accuracy`: the gate's
    (baseline, candidate) in-process results; with them, a layout that holds the SLO is then
    scored by lm-eval at its endpoint (`served_accuracy`) and fails when it answers worse;
    `answers_without_slo`: scored also when it holds the SLO at no rate (a re-benchmark's verdict
    names both faults; a release's layout without a rate has failed already, the check would be time lost).
    """
    started = time.monotonic()
    result = LayoutResult(
        layout=layout.name,
        tp=layout.tp,
        dp=layout.dp,
        ep=layout.ep,
        pp=layout.pp,
        replicas=layout.replicas,
        devices=layout.devices,
        status="ok",
        placement=serving.placement(hw, layout).describe(),
        predicted_max_slo_rate=predicted if predicted else None,
    )
    prior = prior or result.predicted_max_slo_rate
    prober: Prober | None = None
    try:
        with running_layout(spec, hw, layout, model_dir, out_dir, base_port) as (engine, prober):
            result.load_seconds = engine.load_seconds
            outcome = slo_search(prober, spec.workload, spec.slo, max_probes, prior=prior)
            result.probes = outcome.probes
            result.capacity_rps, result.max_slo_rate = outcome.capacity, outcome.max_slo_rate
            result.bound_only, result.extrapolated, result.stop_reason, result.burst_rps = (
                outcome.bound_only,
                outcome.extrapolated,
                outcome.stop_reason,
                outcome.burst_rps,
            )
            result.deciding_p90_ttft_ms, result.spread = outcome.deciding_p90_ttft_ms, outcome.spread
            result.unsteady, result.client_bound = outcome.unsteady, outcome.client_bound
            result.client_bound_rates = outcome.client_bound_rates
            result.unclean_rates = outcome.unclean_rates
            if (
                accuracy
                and spec.evaluation.served.enabled
                and (outcome.max_slo_rate is not None or answers_without_slo)
            ):
                checked = served_accuracy.check(
                    engine.url, model_dir, serving.SERVED_NAME, *accuracy, spec.evaluation, out_dir / "served-accuracy"
                )
                result.served_accuracy = checked
                log.info(
                    "layout %s: serving-path accuracy %s in %.0f s: %s",
                    layout.name,
                    "passed" if checked.passed else "FAILED",
                    checked.seconds,
                    checked.summary(),
                )
                if not checked.passed:
                    result.status = "failed"
                    result.error = "serving-path accuracy: " + "; ".join(checked.failures)
    except (ReleaseError, subprocess.TimeoutExpired) as exc:
        result.probes = result.probes or (prober.done if prober else [])
        result.status = "cancelled" if isinstance(exc, serving.EngineStopped) else "failed"
        result.error = str(exc)
        log.error("layout %s failed: %s", layout.name, exc)
    result.seconds = round(time.monotonic() - started, 1)
    finish(result, hw)
    if result.bound_only and result.status == "ok":
        log.warning("layout %s: %s", layout.name, result.stop_reason)
    return result
