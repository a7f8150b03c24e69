"""The SLO search, pure (no I/O: a probe is a callable): the rates it probes, the spread of repeats,
and whether its answer is narrowed or only a bound.

Why this search: latency against offered load is flat, then bends up sharply near capacity.
A saturation probe (every request at once) measures that capacity, which brackets the
answer from above; a secant on each probe's latency margin (safeguarded by bisection) then
needs a few probes instead of a sweep's 1/resolution."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from pipeline.core.specs import SloSpec, WorkloadSpec
from pipeline.records.benchmark import Probe, SearchOutcome
from pipeline.stages.benchmark.verdict import trend_only

log = logging.getLogger(__name__)

MAX_PROMPT_DOUBLINGS = 2
TREND_DOUBLINGS = 1  # how many times a probe failed on its TTFT trend alone is measured again, twice as long
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
    through two probes lands near the edge where halving the bracket needs several probes more.
    The TTFT is the p90 with its trend carried over the confirmation (`steady`) where that is higher:
    what the verdict judges."""
    ttft = max(probe.p90_ttft_ms, probe.projected_p90_ttft_ms or 0.0)
    return min(
        slo.max_p90_ttft_ms / max(ttft, 1e-9),
        slo.max_p90_tpot_ms / max(probe.p90_tpot_ms, 1e-9),
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


def spread(runs: Sequence[Probe]) -> float | None:
    """max / min - 1 of the p90 TTFTs of runs at one rate (None for fewer than two)."""
    p90s = [p.p90_ttft_ms for p in runs]
    if len(p90s) < 2 or min(p90s) <= 0:
        return None
    return round(max(p90s) / min(p90s) - 1, 3)


def is_clean(probe: Probe, workload: WorkloadSpec) -> bool:
    seen = probe.interference
    return seen is None or (seen.other <= workload.max_interference and seen.steal <= workload.max_interference)


class SloSearch:
    """One SLO search's state, one method per phase (the loop in `run` picks the phase).

    Probes: `probe` runs one rate (again when other processes disturbed it, with twice the
    requests while its verdict is inside the p90 interval, and once so when it failed on its TTFT
    trend alone) and counts it in `runs`. Phases, from
    the counted runs: `open` (a burst's scale, or the prior); `widen` (all passed: step up, or go
    just below where the line through the two highest passes meets the edge); `lower` (all failed:
    step down, or to the line through the two lowest fails); `narrow` (a bracket wider than half
    the resolution: aim just past the secant's edge, on the side the last probe did not land on,
    bisecting when one side won twice running); `repeat` (the answer must pass
    `workload.repeats` more times); `lengthen` (runs at the answer that differ by more than
    `workload.max_spread` are measured again with `LONGER` probes, which alone count); `finish`
    (the answer, why the search stopped, and what marks it: bound, unsteady, client-bound)."""

    def __init__(
        self, run: RunProbe, workload: WorkloadSpec, slo: SloSpec, max_probes: int = 16, prior: float | None = None
    ):
        self.run_probe, self.workload, self.slo = run, workload, slo
        self.max_probes, self.prior, self.res = max_probes, prior, slo.resolution
        self.out = SearchOutcome(probes=[])
        self.runs: dict[float, list[Probe]] = {}  # counted runs per rate
        self.lengthened: set[float] = set()  # rates measured again with longer probes for their spread
        self.seed = workload.seed
        self.verdicts: list[bool] = []  # of the probes inside a bracket: the same verdict twice means the secant stalls
        self.start, self.step = 0.0, UP

    # ------------------------------------------------------------------ probes and what they say

    def probe(self, rate: float, longer: int = 1) -> Probe:
        """One counted run at `rate` (superseded tries stay in `out.probes`, marked)."""
        workload = self.workload
        # short runs never build a queue and flatter high rates: send at least min_probe_seconds of load
        n = (
            workload.num_prompts
            if math.isinf(rate)
            else max(workload.num_prompts, math.ceil(rate * workload.min_probe_seconds)) * longer
        )
        doublings = dirty = 0
        while True:
            self.seed += 1  # a fresh prompt set each run: cached prefixes must not flatter later probes
            result = self.run_probe(rate, n, self.seed)
            self.out.probes.append(result)
            result.clean = is_clean(result, workload)
            log_probe(rate, n, result)
            if not result.clean and dirty < workload.interference_retries:
                dirty += 1
                result.superseded = True
                seen = result.interference
                log.warning(
                    "probe at %.3g req/s: other processes used %.2f cores (limit %.2f): %s; measuring again",
                    rate,
                    seen.other if seen else 0,
                    workload.max_interference,
                    ", ".join(f"{name} {c:.2f}" for name, c in (seen.top_other if seen else [])),
                )
                continue
            if not result.clean:
                self.out.unclean_rates.append(rate)
                log.warning(
                    "probe at %.3g req/s: no clean measurement after %d tries; its verdict is kept, flagged",
                    rate,
                    dirty + 1,
                )
            if trend_only(result) and doublings < TREND_DOUBLINGS and not math.isinf(rate):
                # an 8 s probe's slope set two of three demos' edges at p90s under half the limit; a queue
                # that really grows still shows, its p90 with it, in a probe twice as long
                log.info("probe at %.3g req/s failed on its TTFT trend alone; measuring again with %d", rate, 2 * n)
            elif result.conclusive or math.isinf(rate) or hopeless(result):
                break
            elif doublings >= MAX_PROMPT_DOUBLINGS:
                log.warning("probe at %.3g req/s stays inconclusive with %d requests; counting it as a fail", rate, n)
                result.passed = False
                result.reasons.append("inconclusive: SLO limit inside the p90 interval")
                break
            result.superseded = True
            doublings += 1
            n *= 2
        if not math.isinf(rate):
            self.runs.setdefault(rate, []).append(result)
        return result

    def holds(self, rate: float) -> bool:
        return all(p.passed for p in self.runs.get(rate, [])) and bool(self.runs.get(rate))

    def spent(self) -> bool:
        return len(self.out.probes) >= self.max_probes

    def point(self, rate: float) -> tuple[float, float]:
        """(rate, margin) of the counted runs at a rate: the worst margin, on its verdict's side; 0 where
        requests failed or the engine fell behind (no latency says how far off that is)."""
        if any(hopeless(p) for p in self.runs[rate]):
            return rate, 0.0
        worst = min(margin(p, self.slo) for p in self.runs[rate])
        return rate, max(worst, 1.0) if self.holds(rate) else min(worst, NEAR_MISS)

    def below_served(self, rate: float, hi: float, least: float, aim: float) -> float:
        """`rate`, capped where the engine fell behind at `hi` (failed on pace or errors): it served no
        more than the highest rate any counted probe achieved, so the edge is near or below that, not
        where a line to the fail's zero margin puts it (after falling behind at 249 req/s when offered
        876, the line aimed at 706, 580, 399 and 309, each a client-bound fail, spending 4 probes of
        16). At most `aim` x that rate, never below `least`."""
        if not any(hopeless(p) for p in self.runs[hi]):
            return rate
        served = max(p.achieved_rate for r in self.runs for p in self.runs[r])
        return min(rate, max(served * aim, least))

    def secant_close(self, lo: float, hi: float) -> bool:
        """The line from the pass to the fail meets the edge within half the resolution above the pass."""
        edge = crossing([self.point(lo), self.point(hi)])
        return edge is not None and edge <= lo * (1 + self.res / 2)

    def closed_between(self, lo: float, hi: float) -> bool:
        """A bracket no wider than the resolution whose line (pass to fail) meets the edge within half
        the resolution above the pass: the pass is the answer, as when closing from below; narrowing
        further would spend probes on verdicts within the latencies' noise of the edge."""
        return (hi - lo) / hi <= self.res and self.secant_close(lo, hi)

    # ------------------------------------------------------------------ phases

    def open(self) -> SearchOutcome | None:
        """The first steady probe: at the prior, or at half a burst's rate (a burst measures start-up as
        much as the engine: only the scale). An outcome when the burst served nothing."""
        if self.prior:
            self.start, self.step = self.prior, UP_WITH_PRIOR
        else:
            burst = self.probe(math.inf)
            self.out.burst_rps = burst.achieved_rate
            if burst.achieved_rate <= 0:
                return self.finish(None, "no request completed in the opening burst")
            self.start, self.step = burst.achieved_rate / 2, UP
        self.probe(self.start)
        return None

    def widen(self, lo: float, edge_above: float | None) -> SearchOutcome | float:
        """All passed: the next rate up (or an outcome when the budget is spent)."""
        if self.spent():
            return self.finish(
                lo, f"probe budget ({self.max_probes}) spent while bracketing; {lo:.3g} is a lower bound", True
            )
        # where latency grows at least in proportion to the rate (near the knee it grows faster),
        # the edge lies below lo x its margin: no step beyond that
        cap = lo * min(self.step, max(self.point(lo)[1], 1 + self.res / 2))
        aimed = None if edge_above is None else edge_above * (1 - AIM * self.res)  # just below the line's edge
        if aimed is None or aimed >= cap:
            # no edge in sight, or one past the step (flat latencies at a low load: a line through
            # two of them reaches the edge far off or never): keep widening the step, as from a
            # low prior the search would otherwise climb by its first step to the end of its budget
            self.step = min(self.step * self.step, MAX_STEP)
            return cap
        return min(max(aimed, lo * (1 + self.res / 2)), cap)

    def lower(self, hi: float, failed: list[float]) -> SearchOutcome | float:
        """All failed: the next rate down (or an outcome when the SLO is missed or the budget spent)."""
        fails = sorted(failed)[:2]
        edge = crossing([self.point(r) for r in fails]) if len(fails) == 2 else None
        # the same reasoning puts the edge above hi x its margin
        floor = hi * max(1 / self.step, min(self.point(hi)[1], 1 - self.res / 2))
        if edge is None:
            rate, self.step = floor, min(self.step * self.step, MAX_STEP)
        else:
            rate = max(min(edge * (1 - AIM * self.res), hi * (1 - self.res / 2)), floor)
        rate = self.below_served(rate, hi, 0.0, 1 - AIM * self.res)  # the edge is below what it served
        if rate < self.start * FLOOR:
            return self.finish(None, f"SLO missed even at {hi:.3g} req/s")
        if self.spent():
            return self.finish(
                None, f"probe budget ({self.max_probes}) spent; the SLO fails down to {hi:.3g} req/s", True
            )
        return rate

    def narrow(self, lo: float, hi: float) -> SearchOutcome | None:
        """One probe inside the bracket, so the reported (last passing) rate is within the resolution of
        the true edge even when the edge sits at the top of the bracket: aim just past the secant's edge,
        on the side the last probe did not land on, so that two probes close a bracket around a good
        estimate; bisect when the same side won twice running."""
        if self.spent():
            return self.finish(lo, f"probe budget ({self.max_probes}) spent; {lo:.3g} is a lower bound", True)
        res = self.res
        edge = crossing([self.point(lo), self.point(hi)])
        width = hi - lo
        last_passed = [p for p in self.out.probes if not p.superseded][-1].passed
        if edge is None or self.verdicts[-2:] in ([True, True], [False, False]):
            rate = (lo + hi) / 2
        else:
            rate = edge * (1 + AIM * res if last_passed else 1 - AIM * res)
            rate = min(max(rate, lo + width / 10), hi - width / 10)
        rate = self.below_served(rate, hi, lo * (1 + res / 2), 1 + res / 2)
        self.verdicts.append(self.probe(rate).passed)
        return None

    def repeat(self, lo: float) -> SearchOutcome | None:
        """The answer must pass again; a failing repeat makes it a fail and the search goes on below it."""
        if self.spent():
            return self.finish(
                lo,
                f"probe budget ({self.max_probes}) spent before the answer was repeated; {lo:.3g} is a lower bound",
                True,
            )
        if not self.probe(lo).passed:
            log.warning("the answer %.3g req/s failed its repeat; searching below it", lo)
            self.verdicts.clear()
        return None

    def needs_lengthening(self, lo: float) -> bool:
        return (
            lo not in self.lengthened
            and (spread(self.runs[lo]) or 0) > self.workload.max_spread
            and len(self.out.probes) + 1 + self.workload.repeats <= self.max_probes
        )

    def lengthen(self, lo: float) -> None:
        """The runs at the answer disagree: short probes may not have reached the queue's steady state;
        measure it again with longer ones, which alone count (a fail among them moves the answer down)."""
        self.lengthened.add(lo)
        log.warning(
            "the runs at %.3g req/s differ by %.0f%% (allowance %.0f%%); measuring again, probes %dx as long",
            lo,
            (spread(self.runs[lo]) or 0) * 100,
            self.workload.max_spread * 100,
            LONGER,
        )
        for p in self.runs.pop(lo):
            p.superseded = True
        for _ in range(1 + self.workload.repeats):
            if not self.probe(lo, LONGER).passed:
                log.warning("a longer run at %.3g req/s failed; searching below it", lo)
                self.verdicts.clear()
                break

    def finish(
        self, answer: float | None, reason: str, bound: bool = False, extrapolated: bool = False
    ) -> SearchOutcome:
        """The outcome: the answer, why the search stopped, and the marks a reader must see."""
        out, runs = self.out, self.runs
        counted = [p for p in out.probes if not p.superseded]
        out.capacity = max((p.achieved_rate for p in counted), default=None)
        out.max_slo_rate, out.stop_reason, out.bound_only = answer, reason, bound
        out.extrapolated = extrapolated
        out.client_bound_rates = sorted({p.rate for p in counted if p.client_bound})
        if answer is not None:
            out.deciding_p90_ttft_ms = [round(p.p90_ttft_ms, 2) for p in runs.get(answer, [])]
            out.spread = spread(runs.get(answer, []))
            if out.spread is not None and out.spread > self.workload.max_spread:
                out.unsteady = True
                out.stop_reason += (
                    f"; the runs at the answer differ by {out.spread:.0%} (allowance {self.workload.max_spread:.0%})"
                    + (" with probes twice as long too" if answer in self.lengthened else "")
                    + ": unsteady, it holds in its worst run"
                )
            capping = [r for r in runs if r > answer and not self.holds(r)]
            deciding = runs.get(answer, []) + (runs[min(capping)] if capping else [])
            out.client_bound = any(p.client_bound for p in deciding)
        if out.client_bound_rates:
            out.stop_reason += f"; client-bound at {', '.join(f'{r:.3g}' for r in out.client_bound_rates)} req/s" + (
                " (deciding the answer: the figure may be the client's, not the engine's)" * out.client_bound
            )
        if out.unclean_rates:
            out.stop_reason += f"; no clean measurement at {', '.join(f'{r:.3g}' for r in out.unclean_rates)} req/s"
        return out

    # ------------------------------------------------------------------ the loop

    def run(self) -> SearchOutcome:
        """Probe until a phase returns the outcome."""
        if (opened := self.open()) is not None:
            return opened
        res, runs = self.res, self.runs
        while True:
            # fails trump passes above them: a rate that failed (a repeat, noise) caps the answer
            failed = [r for r in runs if not self.holds(r)]
            hi = min(failed, default=None)
            lo = max((r for r in runs if self.holds(r) and (hi is None or r < hi)), default=None)
            passes = sorted(r for r in runs if self.holds(r) and (hi is None or r < hi))[-2:]
            # where the line through the two highest passes (below any fail) meets the edge. A queue's
            # margin falls at least linearly with the rate (`margin`), so the edge lies at or below that
            # line's crossing: within half the resolution above lo, lo is the answer (once repeated),
            # whether or not a fail above brackets it
            edge_above = crossing([self.point(r) for r in passes]) if len(passes) == 2 else None
            # with a fail above, its line must agree: two noisy passes close together can put the edge just
            # above them when fails near the edge were noise (an answer 5.7% low in the benchmark)
            closed_below = (
                edge_above is not None
                and lo is not None
                and edge_above <= lo * (1 + res / 2)
                and (hi is None or self.secant_close(lo, hi))
            )
            step: SearchOutcome | float | None
            if hi is None and not closed_below:
                assert lo is not None
                step = self.widen(lo, edge_above)
            elif lo is None:
                assert hi is not None  # with no fail, some rate passed
                step = self.lower(hi, failed)
            elif hi is not None and (hi - lo) / hi > res / 2 and not closed_below and not self.closed_between(lo, hi):
                step = self.narrow(lo, hi)
            elif len(runs[lo]) < 1 + self.workload.repeats:
                step = self.repeat(lo)
            elif self.needs_lengthening(lo):
                self.lengthen(lo)
                step = None
            else:
                return self.answer(lo, hi, closed_below, edge_above)
            if isinstance(step, SearchOutcome):
                return step
            if step is not None:
                self.probe(step)

    def answer(self, lo: float, hi: float | None, closed_below: bool, edge_above: float | None) -> SearchOutcome:
        """The search closed at `lo`: say how."""
        res = self.res
        if closed_below:
            # the line says where the edge is; only a probe that failed above the answer shows it: without
            # one the answer is what it measured, a rate that holds the SLO, and the engine may hold more
            return self.finish(
                lo,
                f"passes at {lo:.3g} ({len(self.runs[lo])} runs); the line through the two highest passes meets "
                f"the SLO's edge within {res / 2:.1%} above it, at {edge_above:.3g}"
                + (
                    f"; fails at {hi:.3g}"
                    if hi is not None
                    else f"; no probe above it failed: {lo:.3g} is a lower bound"
                ),
                bound=hi is None,
                extrapolated=hi is None,
            )
        assert hi is not None
        if (hi - lo) / hi > res / 2:
            return self.finish(
                lo,
                f"narrowed to {(hi - lo) / hi:.1%}: passes at {lo:.3g} ({len(self.runs[lo])} runs), fails at {hi:.3g}; "
                f"the line between them meets the SLO's edge within {res / 2:.1%} above the pass, "
                f"at {crossing([self.point(lo), self.point(hi)]):.3g}",
            )
        return self.finish(
            lo, f"narrowed to {res / 2:.1%}: passes at {lo:.3g} ({len(self.runs[lo])} runs), fails at {hi:.3g}"
        )


def log_probe(rate: float, n: int, result: Probe) -> None:
    """One line per probe in the task log: the verdict and what disturbed it."""
    seen = result.interference
    log.info(
        "probe %.3g req/s x %d: achieved %.3g, p90 TTFT %.1f ms (engine %s), p90 TPOT %.1f ms -> %s%s%s",
        rate,
        n,
        result.achieved_rate,
        result.p90_ttft_ms,
        f"{result.engine.p90_ttft_ms:.1f} ms" if result.engine and result.engine.p90_ttft_ms is not None else "-",
        result.p90_tpot_ms,
        "pass" if result.passed else "fail (" + "; ".join(result.reasons) + ")",
        "" if result.conclusive else " [limit inside the p90 interval]",
        f" [other processes {seen.other:.2f} cores, steal {seen.steal:.2f}]" if seen else "",
    )
    if result.client_bound:
        log.warning("probe at %.3g req/s: %s", rate, result.client_note)


def slo_search(
    run: RunProbe, workload: WorkloadSpec, slo: SloSpec, max_probes: int = 16, prior: float | None = None
) -> SearchOutcome:
    """Bracket the highest rate that holds the SLO with steady-state probes, narrow, repeat (`SloSearch`).

    With a prior (a prediction, or the rate a release was promoted at) the first probe is at the
    prior and the steps start at 1.25x; without, at half a burst's rate and 2x (then 4x). A pass
    whose line (through the two highest passes) puts the edge within half the resolution above it
    is the answer, as a queue's edge lies at or below that line; with no fail above, it is a lower
    bound (`bound_only`). Runs at the answer that differ by more than `workload.max_spread` are
    measured again with longer probes; an answer whose longer runs still differ is `unsteady` (it
    holds in its worst run). Probes whose client sent late are kept, and the answer is marked
    `client_bound` when they decided it."""
    return SloSearch(run, workload, slo, max_probes, prior).run()


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
