"""Hold the planner to what earlier releases measured on the same hardware and engine.

The step-time model runs on a hardware profile's datasheet figures and efficiency factors; what
it misses on a given machine and engine build is mostly in its overhead figures (the engine core's
scheduling per step, per worker, per layer's launch, per sampled sequence, a request's way in and
the host's CPU): a datasheet cannot know them. So calibration corrects those figures, not the
answer: each benchmarked layout leaves the one multiplier on them that makes the planner's rate meet
its measurement (solved by bisection, `solve`), keyed by what changes those figures (hardware,
engine image, the engine args and env but the limits the planner models itself, profile:
`figure_key`); the next plan runs every layout whose figure key has multipliers on its figures x
their median, shapes never measured included. A measurement whose rate hardly moves with the
overheads gives no multiplier (any multiplier would fit it, `SENSITIVE`), and the reach is x1/4..x4
(`REACH`).

The older calibration stays beside it: per layout shape (hardware | engine image | shape |
profile), the median ratio of measured to the planner's rate. It applies where no multiplier does,
and overrules one for a shape whose own measurements the figures miss by more than `OVERRULE`.
The planner's own rate is kept beside the calibrated one, so every later ratio is taken against
the model, never against an earlier calibration.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, Field

from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec
from pipeline.planner.uncertainty import Predict
from pipeline.records.plan import FigureFit, PredictionCheck

LAST = 5  # ratios per key: recent enough to follow an engine's changes, enough to damp one noisy run
REACH = 4.0
"""A multiplier lies within x1/REACH..xREACH: a 4x miss on an overhead is a plausible datasheet error;
a measurement that needs more says the model is wrong elsewhere (a bound it misses), and a multiplier
stretched to fit it would carry that error to every layout of the key: a measurement beyond the reach
gives no multiplier (its shape keeps its own ratio)."""
SENSITIVE = 0.2
"""A measured layout gives a multiplier only where |d ln rate / d ln multiplier| >= SENSITIVE at the
answer: its rate moves at least 0.2% per 1% of overhead. Below, the overheads are a small part of its
steps, the measurement's own noise (a few %) moves the answer by more than x2, and the answer runs to
the reach's end; carried to an overhead-dominated layout (a one-sequence, 4-token-chunk one, near 1),
that error lifts it tenfold. Such a layout keeps the per-shape ratio."""
OVERRULE = 0.2  # the per-shape ratio overrules the figures where the shape's measurements differ by more
BISECTIONS = 9  # halvings of ln(REACH^2): the answer within 0.3% of its ratio, under the rate search's 1%
STEEPEST = 10.0  # a sensitivity kept at most this (a rate that vanishes within x NUDGE: as steep as it gets)
NUDGE = 1.2  # sensitivity: the rate at the answer x and / this, a span the rate search's 1% grid resolves
MODELED_LIMITS = frozenset(
    {"max-num-seqs", "max-num-batched-tokens", "max-model-len", "gpu-memory-utilization", "kv-cache-dtype"}
)  # engine args the planner models itself: they do not change an overhead figure, so not the figure key
OVERHEADS = (
    "step_overhead_ms",
    "step_overhead_per_rank_ms",
    "piecewise_layer_us",
    "sequence_overhead_us",
    "request_overhead_ms",
    "admission_ms",
    "host_ms_per_request",
    "host_busy_cores",
)  # the figures the multiplier scales: the engine's and the host's time outside the roofline


class CalibrationKey(BaseModel):
    """What a ratio transfers across: the machine, the engine build, the layout's shape (not its name)
    and the step-time figures the planner ran on (a profiling run's, or the datasheet's): a ratio
    taken against one set of figures says nothing about another. Kept in the registry as its text."""

    hardware: str
    engine: str
    shape: str
    profile: int | None = Field(None, description="the profiling run's id; None: the datasheet's figures")

    def __str__(self) -> str:
        return f"{self.hardware} | {self.engine} | {self.shape}" + (
            f" | profile {self.profile}" if self.profile else ""
        )

    @classmethod
    def parse(cls, text: str) -> CalibrationKey:
        parts = text.split(" | ")
        if len(parts) not in (3, 4) or (len(parts) == 4 and not parts[3].startswith("profile ")):
            raise ValueError(f"not a calibration key: {text!r}")
        profile = int(parts[3].removeprefix("profile ")) if len(parts) == 4 else None
        return cls(hardware=parts[0], engine=parts[1], shape=parts[2], profile=profile)


def key(hardware: str, engine: str, layout: Layout, profile: int | None = None) -> str:
    """The text of the layout's CalibrationKey."""
    shape = f"tp{layout.tp}-ep{layout.ep}-pp{layout.pp}-dp{layout.dp}-x{layout.replicas}"
    return str(CalibrationKey(hardware=hardware, engine=engine, shape=shape, profile=profile))


def figure_key(
    hardware: str, engine: str, args: Mapping[str, object], env: Mapping[str, str], profile: int | None = None
) -> str:
    """What an overhead multiplier transfers across: the machine, the engine build, the engine args
    (but the limits the planner models itself: `MODELED_LIMITS`) and env that may change what a step
    costs outside its kernels (enforce-eager, compilation-config, dtype, ...), and the figures the
    planner ran on (a profiling run's, or the datasheet's)."""
    kept = {k: v for k, v in args.items() if k not in MODELED_LIMITS}
    text = (
        f"{hardware} | {engine} | args {json.dumps(kept, sort_keys=True, default=str)}"
        f" | env {json.dumps(dict(env), sort_keys=True)}"
    )
    return text + (f" | profile {profile}" if profile else "")


def layout_figure_key(spec: ReleaseSpec, hardware: str, layout: Layout, profile: int | None = None) -> str:
    """figure_key() of a layout as the spec serves it: the spec's engine args and env under the layout's."""
    args = {**spec.serving.engine_args, **layout.engine_args}
    return figure_key(hardware, spec.serving.engine_image, args, {**spec.serving.env, **layout.env}, profile)


def scaled(hw: HardwareProfile, multiplier: float) -> HardwareProfile:
    """`hw` with its overhead figures (`OVERHEADS`) x `multiplier`; the roofline's figures as they are."""
    perf = hw.performance
    if perf is None or multiplier == 1:
        return hw
    figures = {name: getattr(perf, name) * multiplier for name in OVERHEADS}
    return hw.model_copy(update={"performance": perf.model_copy(update=figures)})


def solve(rate_at: Callable[[float], float], measured: float, key: str) -> FigureFit:
    """The multiplier on the overhead figures at which `rate_at` (the planner's rate, decreasing in
    it) meets `measured`: bisection on its log within the reach, the reach's end where the measurement
    lies beyond it. The multiplier is kept only where the rate is sensitive to it there (`SENSITIVE`) and
    the measurement lies within the reach (`REACH`: one beyond it is the model wrong elsewhere)."""
    lo, hi = -math.log(REACH), math.log(REACH)
    capped = False
    if measured >= rate_at(REACH**-1):
        answer, capped = lo, True
    elif measured <= rate_at(REACH):
        answer, capped = hi, True
    else:
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate_at(math.exp(mid)) > measured else (lo, mid)
        answer = (lo + hi) / 2
    solved = round(math.exp(answer), 4)
    rate = rate_at(solved)
    sensitivity = _sensitivity(rate_at(solved / NUDGE), rate_at(solved * NUDGE))
    return FigureFit(
        figure_key=key,
        multiplier=solved if sensitivity >= SENSITIVE and not capped else None,
        solved=solved,
        rate=round(rate, 4),
        sensitivity=round(sensitivity, 4),
        capped=capped,
    )


def _sensitivity(below: float, above: float) -> float:
    """|d ln rate / d ln multiplier| from the rates at the answer / and x NUDGE (a rate of 0: the
    layout meets the SLO at no rate there, as sensitive as can be)."""
    if below <= 0 and above <= 0:
        return 0.0
    if below <= 0 or above <= 0:
        return STEEPEST
    return min(STEEPEST, abs(math.log(below / above)) / (2 * math.log(NUDGE)))


def fit_figures(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    measured: float,
    key: str,
    predict: Predict,
) -> FigureFit:
    """solve() on the planner's own rate for `layout` at its endpoint on `hw` (the figures the plan
    ran on), each search started from the last rate found."""
    last = [measured]

    def rate_at(multiplier: float) -> float:
        found = predict(
            spec,
            scaled(hw, multiplier),
            layout,
            spec.workload.input_len,
            spec.workload.output_len,
            start=last[0] or measured,
            factor=1.5,
        )
        last[0] = found.rate_per_server  # a server's: the layout's endpoint
        return found.rate_per_server

    return solve(rate_at, measured, key)


class Observation(BaseModel):
    """One earlier measurement of a layout against the planner's own (uncalibrated) rate."""

    release_id: int
    layout: str
    planner_rate: float = Field(gt=0, description="req/s the step-time model predicted, before calibration")
    measured: float = Field(gt=0, description="the max SLO rate the search measured, req/s")
    predicted: float | None = Field(None, description="the rate the search started at (calibrated where it was)")
    calibrated: bool = False
    multiplier: float | None = Field(None, description="the overhead multiplier solved from it; None: none")
    solved: float | None = Field(None, description="the bisection's answer (kept where it gave no multiplier)")
    solved_rate: float | None = Field(None, description="the planner's rate at `solved`, req/s")
    sensitivity: float | None = Field(None, description="|d ln rate / d ln multiplier| at `solved`")

    def miss(self, multiplier: float, ratio: float) -> float:
        """How far the figures x `multiplier` would have missed this measurement (measured / predicted
        - 1): from its own rate near the solved multiplier (log-linear in it, the slope its sensitivity);
        without a solved one (a record from before), against `ratio`, the figures' factor on the
        planner's rate of the layout at hand."""
        if self.solved is None or self.solved_rate is None or self.sensitivity is None or self.solved_rate <= 0:
            return self.ratio / ratio - 1
        return self.measured / (self.solved_rate * (multiplier / self.solved) ** -self.sensitivity) - 1

    @property
    def ratio(self) -> float:
        return self.measured / self.planner_rate

    @property
    def prediction_error(self) -> float | None:
        return self.measured / self.predicted - 1 if self.predicted else None


class Calibration(BaseModel):
    """The factor applied to the planner's rate for one key, and the measurements it comes from."""

    key: str
    factor: float
    observations: list[Observation]

    def summary(self) -> str:
        evidence = ", ".join(f"release {o.release_id} {o.layout} {o.ratio:.3g}" for o in self.observations)
        return f"x{self.factor:.3g}: median of measured / planner ({evidence})"


class FigureCalibration(BaseModel):
    """The multiplier on the overhead figures for one figure key, and the measurements it comes from."""

    key: str
    multiplier: float
    observations: list[Observation]

    def summary(self) -> str:
        evidence = ", ".join(
            f"release {o.release_id} {o.layout} x{o.multiplier:.3g} (sensitivity {o.sensitivity:.2g})"
            for o in self.observations
        )
        return f"overheads x{self.multiplier:.3g}: median of the multipliers solved from ({evidence})"


class Measurements(BaseModel):
    """Every usable measurement of a layout against the planner, per calibration key, oldest first:
    what the next plan calibrates on and the report's planner table shows."""

    by_key: dict[str, list[Observation]] = Field(
        default_factory=dict, description="calibration key -> its measurements"
    )
    by_figures: dict[str, list[Observation]] = Field(
        default_factory=dict, description="figure key -> its measurements that gave a multiplier"
    )

    def of(self, key: str) -> list[Observation]:
        return self.by_key.get(key, [])

    def of_figures(self, key: str) -> list[Observation]:
        return self.by_figures.get(key, [])


def usable(check: PredictionCheck) -> bool:
    """Whether a measurement teaches the planner anything (observations())."""
    predicted = check.prediction
    if predicted is None or (check.bound_only and not check.extrapolated) or check.client_bound:
        return False
    return predicted.planner_rate > 0 and (check.max_slo_rate or 0) > 0


def observations(releases: Iterable[tuple[int, list[PredictionCheck]]]) -> Measurements:
    """Per key, the usable measurements in the registry's release records (release id, its
    `predictions`), oldest first. A layout that failed, whose answer is only a bound (probe budget,
    capacity), that the load client bound (it sent late in the runs that decided it: the ratio would be
    the client's, not the engine's) or that was recorded without a prediction (none was made, or the
    registry's record predates the one prediction record) teaches nothing and is skipped. A
    lower bound that the line through its two highest passes puts within half the resolution of the
    SLO's edge (`extrapolated`: no probe above it failed) is kept: the search's own model puts it as
    near the edge as a narrowed answer, and a factor from it errs low, where the next search climbs."""
    found: dict[str, list[Observation]] = {}
    figures: dict[str, list[Observation]] = {}
    for release_id, checks in sorted(releases, key=lambda r: r[0]):
        for check in checks:
            predicted = check.prediction
            if predicted is None or not usable(check):
                continue
            fit = check.figure_fit
            seen = Observation(
                release_id=release_id,
                layout=check.layout,
                planner_rate=predicted.planner_rate,
                measured=check.max_slo_rate,
                predicted=predicted.predicted_max_slo_rate,
                calibrated=predicted.calibrated,
                multiplier=fit.multiplier if fit else None,
                solved=fit.solved if fit else None,
                solved_rate=fit.rate if fit else None,
                sensitivity=fit.sensitivity if fit else None,
            )
            found.setdefault(predicted.calibration_key, []).append(seen)
            if fit is not None and fit.multiplier is not None:
                figures.setdefault(fit.figure_key, []).append(seen)
    return Measurements(by_key=found, by_figures=figures)


def calibrate(found: Measurements, for_key: str, last: int = LAST) -> Calibration | None:
    """The median ratio of the last `last` measurements for `for_key`; None when there are none."""
    recent = found.of(for_key)[-last:]
    if not recent:
        return None
    return Calibration(key=for_key, factor=round(statistics.median(o.ratio for o in recent), 4), observations=recent)


def calibrate_figures(found: Measurements, for_key: str, last: int = LAST) -> FigureCalibration | None:
    """The median multiplier of the last `last` measurements that gave one for `for_key`; None: none."""
    recent = found.of_figures(for_key)[-last:]
    if not recent:
        return None
    multiplier = statistics.median(o.multiplier for o in recent if o.multiplier is not None)
    return FigureCalibration(key=for_key, multiplier=round(multiplier, 4), observations=recent)


def median_abs_errors(rows: list[Observation]) -> tuple[float | None, float | None]:
    """The planner's typical miss over `rows`: (its own rate, the rate each search started at)."""
    own = [abs(o.ratio - 1) for o in rows]
    used = [abs(e) for o in rows if (e := o.prediction_error) is not None]
    return (statistics.median(own) if own else None, statistics.median(used) if used else None)


class Applied(BaseModel):
    """Which calibration a layout's prediction takes: the factor on the planner's rate and why."""

    factor: float = 1.0
    kind: Literal["figures", "shape"] | None = None
    multiplier: float | None = None
    text: str | None = None


def choose(
    own: float, figures: FigureCalibration | None, figure_rate: float | None, shape: Calibration | None
) -> Applied:
    """The figures' multiplier where there is one (the planner's rate on them, `figure_rate`, over its
    own, `own`), unless the shape's own measurements differ from what those figures predict for them by
    more than OVERRULE (the median miss: Observation.miss); then, and where no multiplier applies, the
    per-shape ratio; else nothing."""
    if figures is not None and figure_rate is not None and own > 0:
        ratio = figure_rate / own
        miss = statistics.median(o.miss(figures.multiplier, ratio) for o in shape.observations) if shape else 0.0
        if shape is None or abs(miss) <= OVERRULE:
            return Applied(
                factor=ratio, kind="figures", multiplier=figures.multiplier, text=f"figures: {figures.summary()}"
            )
        return Applied(
            factor=shape.factor,
            kind="shape",
            text=f"per-shape ratio {shape.summary()}; it overrules the figures' overheads x{figures.multiplier:.3g},"
            f" which miss this shape's measurements by {miss:+.0%} (more than {OVERRULE:.0%})",
        )
    if shape is not None:
        return Applied(factor=shape.factor, kind="shape", text=f"per-shape ratio {shape.summary()}")
    return Applied()


class LayoutCalibration(BaseModel):
    applied: Applied
    key: str = Field(description="the per-shape key (`key`)")
    figure_key: str = Field(description="the figures' key (`layout_figure_key`)")


def for_layout(
    measured: Measurements,
    spec: ReleaseSpec,
    hardware: str,
    hw: HardwareProfile,
    layout: Layout,
    own: float,
    profile: int | None,
    rate_on: Callable[[HardwareProfile], float],
) -> LayoutCalibration:
    """What a plan applies to one layout's own rate `own` (req/s at its endpoint): its figure key's
    multiplier, with the planner run again on the overheads x it (`rate_on`), or the per-shape ratio
    (`choose`). The release DAG's plan and `model-release plan` both call this, so they agree."""
    shape_key = key(hardware, spec.serving.engine_image, layout, profile)
    figures_key = layout_figure_key(spec, hardware, layout, profile)
    by_figures = calibrate_figures(measured, figures_key)
    figure_rate = rate_on(scaled(hw, by_figures.multiplier)) if by_figures is not None and own > 0 else None
    applied = choose(own, by_figures, figure_rate, calibrate(measured, shape_key))
    return LayoutCalibration(applied=applied, key=shape_key, figure_key=figures_key)
