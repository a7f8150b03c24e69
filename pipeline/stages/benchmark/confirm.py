"""The confirmation, pure (a probe is a callable): a run a resolution under the search's answer, long
enough to show a queue, before the answer is reported; where it fails, the answer steps down and is
confirmed again.

Why: the capacity plan, the autoscaler's target and the rollout's steps all multiply the answer; a
rate above what the engine sustains passes a probe that ends before its queue shows (#61). The run
lasts `workload.confirm_seconds` (at least `SloSpec.confirm_floor_seconds`, which `validate`
enforces: long enough for a queue growing at the resolution's overload to push the p90 TTFT past
its limit), and is judged like every probe, its TTFT trend included (`steady`).

Why under the answer: the search puts the edge within its resolution on the instance it measured,
and sits on the engine's knee there (a 30 s run at it passed at p90 200 ms on one instance and
failed at 524 ms on the next, #61); two instances of one engine sustained rates 4-10% apart. A rate
the fleet is sized on must hold on every instance, so the answer reported is the one confirmed a
resolution (`slo.resolution`) under the search's edge: a lower bound, not the edge.

Why a fresh engine is warmed first: the search's engine is warm from the search's runs, and a cold
one stalls in its first seconds under load (a demo's fresh engine: p90 TTFT 74 ms in its first 2 s,
then a 1 s queue it never drained at 98% of its capacity, while a third engine held more for 30 s
at 86 ms); the confirmation compares the instances' steady state, and a cold start is the rollout's
concern (readiness, its first step's analysis)."""

from __future__ import annotations

import logging
import math

from pipeline.core.specs import SloSpec, WorkloadSpec
from pipeline.records.benchmark import Probe, SearchOutcome
from pipeline.stages.benchmark.search import RunProbe, is_clean, slo_search
from pipeline.stages.benchmark.steady import confirm_seconds

log = logging.getLogger(__name__)

WARMUP_SECONDS = 5.0  # a fresh engine's warm-up run lasts at least this (or workload.min_probe_seconds)
MAX_STEP_DOWNS = 3  # a failed confirmation moves the answer down at most this many times, then there is none
SEED_OFFSET = 50_000  # confirmations draw prompt sets apart from the search's (seed + 1, + 2, ...)


def step_down(rate: float, failed: Probe, slo: SloSpec) -> float:
    """Where to confirm next: a resolution below the lower of the rate and what the failed run served
    (an engine that fell behind served about its capacity, whatever it was offered)."""
    served = failed.achieved_rate if failed.achieved_rate > 0 else rate
    return min(rate, served) * (1 - slo.resolution)


def under_the_edge(searched: float, slo: SloSpec) -> float:
    """Where the confirmation starts: a resolution under the search's answer (see the module's why)."""
    return searched * (1 - slo.resolution)


def warm_up(run: RunProbe, rate: float, workload: WorkloadSpec, seed: int) -> Probe:
    """A cold engine's first run at `rate`, kept in the record but not counted (`warmup`, `superseded`)."""
    seconds = max(WARMUP_SECONDS, workload.min_probe_seconds)
    probe = run(rate, math.ceil(rate * seconds), seed)
    probe.warmup = probe.superseded = True
    log.info(
        "warm-up of the fresh engine at %.3g req/s x %d (%.0f s, not counted): p90 TTFT %.1f ms",
        rate,
        probe.num_prompts,
        seconds,
        probe.p90_ttft_ms,
    )
    return probe


def confirm(
    run: RunProbe,
    outcome: SearchOutcome,
    workload: WorkloadSpec,
    slo: SloSpec,
    where: str = "",
    cold: bool = False,
) -> SearchOutcome:
    """Confirm `outcome`'s answer with a `confirm_seconds` run a resolution under it (`under_the_edge`;
    appended to its probes, marked `confirmation`); where it fails, step down (`step_down`, at most
    `MAX_STEP_DOWNS` times) and confirm again. A run that other processes disturbed is run again, as
    the search's probes are (`workload.interference_retries`). The outcome's answer becomes the rate
    that held, or None; the search's is kept as `searched_rate`. `where`: the engine instance `run`
    measures, for the verdict's text (" on a fresh engine"); `cold`: it has served nothing yet, and is
    warmed first (`warm_up`)."""
    if outcome.max_slo_rate is None:
        return outcome
    seconds = confirm_seconds(workload, slo)
    searched = outcome.searched_rate = outcome.max_slo_rate
    rate = first = under_the_edge(searched, slo)
    under = f"{slo.resolution:.0%} under the search's {searched:.3g}"
    outcome.confirm_seconds = round(seconds, 2)
    seed = workload.seed + SEED_OFFSET
    if cold:
        outcome.probes.append(warm_up(run, rate, workload, seed))
    for downs in range(MAX_STEP_DOWNS + 1):
        for tries in range(workload.interference_retries + 1):
            seed += 1
            probe = run(rate, max(workload.num_prompts, math.ceil(rate * seconds)), seed)
            probe.confirmation, probe.clean = True, is_clean(probe, workload)
            outcome.probes.append(probe)
            if probe.clean or tries == workload.interference_retries:
                break
            probe.superseded = True
        log.info(
            "confirmation%s at %.3g req/s x %d (%.0f s): p90 TTFT %.1f ms, trend %s ms/s, backlog %s -> %s",
            where,
            rate,
            probe.num_prompts,
            seconds,
            probe.p90_ttft_ms,
            probe.ttft_trend_ms_per_s,
            probe.backlog_end,
            "pass" if probe.passed else "fail (" + "; ".join(probe.reasons) + ")",
        )
        if probe.passed:
            outcome.confirmed, outcome.step_downs, outcome.max_slo_rate = True, downs, rate
            outcome.capacity = max(outcome.capacity or 0.0, probe.achieved_rate)
            outcome.deciding_p90_ttft_ms, outcome.spread = [round(probe.p90_ttft_ms, 2)], None
            if downs:
                outcome.stop_reason += (
                    f"; the confirmation failed at {first:.3g} req/s ({under}): stepped down {downs}x to "
                    f"{rate:.3g}, which held for {seconds:.0f} s{where}"
                )
            else:
                outcome.stop_reason += f"; confirmed by {seconds:.0f} s at {rate:.3g} req/s ({under}){where}"
            return outcome
        if downs < MAX_STEP_DOWNS:
            log.warning("the confirmation at %.3g req/s failed; stepping down", rate)
            rate = step_down(rate, probe, slo)
    outcome.confirmed, outcome.step_downs, outcome.max_slo_rate = False, MAX_STEP_DOWNS, None
    outcome.deciding_p90_ttft_ms, outcome.spread = [], None
    outcome.stop_reason += (
        f"; the confirmation failed at {first:.3g} req/s ({under}) and at {MAX_STEP_DOWNS} steps down to {rate:.3g} "
        f"({seconds:.0f} s each{where}): no rate is confirmed"
    )
    return outcome


def confirmed_search(
    run: RunProbe, workload: WorkloadSpec, slo: SloSpec, max_probes: int = 16, prior: float | None = None
) -> SearchOutcome:
    """`slo_search`, then its answer confirmed (`confirm`): what a release and a re-benchmark report."""
    return confirm(run, slo_search(run, workload, slo, max_probes, prior=prior), workload, slo)
