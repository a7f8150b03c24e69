"""What a prediction is worth: intervals, the figures a ranking turns on, and which layouts to measure.

A datasheet plan's interval comes from the assumed figures' ranges (the hardware profile's
`performance.ranges`, the model's `expert_imbalance_range`): every figure at the end that lowers
the rate, then every figure at the end that raises it. Each figure moves a rate one way only, so
those two runs bound the rate over the ranges' box. A profiled plan's interval comes from the
fit's largest residual on the step times. A margin between two layouts is read one figure at a
time (the others central), each rate searched to a fine resolution over the same simulated arrivals
(common random numbers: one sample path, its time scaled by the rate, for every rate, layout and
figure), so a figure that moves the margin by a fraction of a percent shows that; the simulation's own
noise (the margin under other seeds) is one more swing. The figures whose ends swing it most, and
those that flip its sign, are what the ranking depends on. The swings are independent figures, so
the interval adds them in quadrature (the linear sum, a bound, is kept beside it); an interval wider
than MAX_WIDTH is reported as too wide to rank on: a check that passes inside it proves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field

from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec

if TYPE_CHECKING:
    from pipeline.planner.profile import Profile


class EstimateLike(Protocol):
    """What this module reads and sets of plan.Estimate (plan imports this module, not the reverse)."""

    layout: Layout
    rate_per_server: float
    rate_low: float | None
    rate_high: float | None
    simulations: int


# figures whose higher value lowers every rate (the rest raise it)
COSTS = {
    "link_latency_us",
    "step_overhead_ms",
    "step_overhead_per_rank_ms",
    "sequence_overhead_us",
    "piecewise_layer_us",
    "host_ms_per_request",
    "efficiency.gemm_half_rows",
    "efficiency.gemm_half_cols",
    "expert_imbalance",
}
MAX_WIDTH = 1.0  # a margin interval wider than this (high - low, as a fraction) is too wide to rank on
MARGIN_RESOLUTION = 0.002  # the rate search's relative step for a margin's swings
NOISE_SEEDS = (1, 2)  # other seeds the margin is simulated with: the simulation's noise


def is_cost(name: str) -> bool:
    """Whether a higher value of the figure lowers every rate."""
    return name in COSTS or name.startswith("all_reduce_latency_us.")


OVERLAP_BOUND = 4  # top_k measures at most this many more layouts whose intervals overlap the best one's

Predict = Callable[..., EstimateLike]


class Figure(BaseModel):
    """One figure the step-time model runs on, with the range it may take and where it comes from."""

    name: str
    central: float
    low: float
    high: float
    source: str = ""


class Swing(BaseModel):
    figure: str
    at_low: float = Field(description="the margin with this figure at its low end, the others central")
    at_high: float
    flips: bool = Field(description="one end of this figure alone reverses the ranking")


class Margin(BaseModel):
    """How much more per server `better` holds than `worse`, as a fraction, and how sure that is."""

    better: str
    worse: str
    central: float
    low: float
    high: float
    swings: list[Swing] = Field(description="largest first")
    bound_low: float | None = Field(None, description="the swings' linear sum, low end: a bound")
    bound_high: float | None = Field(None, description="the swings' linear sum, high end: a bound")

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def determined(self) -> bool:
        return self.low > 0 or self.high < 0

    @property
    def too_wide(self) -> bool:
        return self.width > MAX_WIDTH

    def describe(self) -> str:
        turns = ", ".join(
            f"{s.figure} {s.at_low:+.0%}..{s.at_high:+.0%}" + (" (flips it)" if s.flips else "")
            for s in self.swings[:4]
        )
        verdict = "" if self.determined else "; the ranking is undetermined within the figures' ranges"
        if self.too_wide:
            verdict += f"; wider than {MAX_WIDTH:.0%}: too wide to rank on, measure both"
        bound = (
            f" (linear sum, a bound: {self.bound_low:+.0%} to {self.bound_high:+.0%})"
            if self.bound_low is not None and self.bound_high is not None
            else ""
        )
        return (
            f"{self.better} over {self.worse}: {self.central:+.0%} req/s per server, interval {self.low:+.0%} to"
            f" {self.high:+.0%}, width {self.width:.0%}{bound}{verdict}. "
            + (
                f"It turns on (margin at each figure's low..high end): {turns}"
                if turns
                else "It turns on the fit's error on each rate (no ranged figures on a profiled plan)"
            )
        )


def _get(spec: ReleaseSpec, hw: HardwareProfile, name: str) -> float:
    if name == "expert_imbalance":
        return spec.model.architecture.expert_imbalance
    perf = hw.performance
    assert perf is not None
    if name.startswith("efficiency."):
        return float(getattr(perf.efficiency, name.removeprefix("efficiency.")))
    if name.startswith("all_reduce_latency_us."):
        size = int(name.rpartition(".")[2])
        return float(perf.all_reduce_latency_us.get(size, 2 * perf.link_latency_us))
    return float(getattr(perf, name))


def at(spec: ReleaseSpec, hw: HardwareProfile, values: dict[str, float]) -> tuple[ReleaseSpec, HardwareProfile]:
    """The spec and hardware with some figures set to other values."""
    arch, perf = spec.model.architecture, hw.performance
    assert perf is not None
    eff = {k.removeprefix("efficiency."): v for k, v in values.items() if k.startswith("efficiency.")}
    sized = {int(k.rpartition(".")[2]): v for k, v in values.items() if k.startswith("all_reduce_latency_us.")}
    own = {k: v for k, v in values.items() if "." not in k and k != "expert_imbalance"}
    if sized:
        own["all_reduce_latency_us"] = {**perf.all_reduce_latency_us, **sized}  # type: ignore[assignment]
    perf = perf.model_copy(update={**own, "efficiency": perf.efficiency.model_copy(update=eff)})
    if "expert_imbalance" in values:
        arch = arch.model_copy(update={"expert_imbalance": values["expert_imbalance"]})
    model = spec.model.model_copy(update={"architecture": arch})
    return spec.model_copy(update={"model": model}), hw.model_copy(update={"performance": perf})


def figures(spec: ReleaseSpec, hw: HardwareProfile) -> list[Figure]:
    """The ranged figures of a datasheet plan: the hardware's `ranges`, and the model's imbalance where it has
    a range and experts are placed by rank."""
    perf = hw.performance
    assert perf is not None
    found = [
        Figure(
            name=name,
            central=_get(spec, hw, name),
            low=low,
            high=high,
            source=perf.sources.get(name) or perf.sources.get(name.split(".")[0], ""),
        )
        for name, (low, high) in perf.ranges.items()
    ]
    arch = spec.model.architecture
    if arch.is_moe and arch.expert_imbalance_range:
        low, high = arch.expert_imbalance_range
        found.append(
            Figure(
                name="expert_imbalance", central=arch.expert_imbalance, low=low, high=high,
                source=arch.expert_imbalance_source,
            )
        )  # fmt: skip
    return found


def corner(found: list[Figure], pessimistic: bool) -> dict[str, float]:
    return {f.name: (f.high if is_cost(f.name) == pessimistic else f.low) for f in found}


def fit_residual(profile: Profile) -> float:
    """The fit's largest |fitted / measured - 1| over the profiled shapes (its median where none is kept)."""
    residuals = [abs(m.fitted_ms / m.measured_ms - 1) for m in profile.shapes if m.fitted_ms and m.measured_ms]
    return min(0.9, max(residuals, default=profile.fit_error))


def describe(found: list[Figure], profile: Profile | None) -> str:
    if profile is not None:
        return f"the fit's largest step-time residual, {fit_residual(profile):.0%}, on every rate"
    if not found:
        return "none: the hardware profile gives no ranges (performance.ranges), so every rate is a point"
    return "the assumed figures' ranges, all at their worse then all at their better ends: " + ", ".join(
        f"{f.name} {f.low:g}-{f.high:g}" for f in found
    )


def bracket(
    prediction: EstimateLike,
    spec: ReleaseSpec,
    hw: HardwareProfile,
    input_len: int,
    output_len: int,
    found: list[Figure],
    profile: Profile | None,
    predict: Predict,
) -> None:
    """Set the prediction's interval (rate_low, rate_high per server)."""
    rate = prediction.rate_per_server
    if rate <= 0 or prediction.simulations == 0:
        prediction.rate_low = prediction.rate_high = rate
        return
    if profile is not None:
        r = fit_residual(profile)
        prediction.rate_low, prediction.rate_high = round(rate / (1 + r), 4), round(rate / (1 - r), 4)
        return
    if not found:
        prediction.rate_low = prediction.rate_high = rate
        return
    ends = []
    for pessimistic in (True, False):
        s, h = at(spec, hw, corner(found, pessimistic))
        ends.append(
            predict(s, h, prediction.layout, input_len, output_len, start=rate, resolution=0.05).rate_per_server
        )
    prediction.rate_low, prediction.rate_high = round(min(ends[0], rate), 4), round(max(ends[1], rate), 4)


def margin(
    better: EstimateLike,
    worse: EstimateLike,
    spec: ReleaseSpec,
    hw: HardwareProfile,
    input_len: int,
    output_len: int,
    found: list[Figure],
    predict: Predict,
) -> Margin:
    """`better`'s margin over `worse`, one figure at a time at each end of its range, every rate searched
    to MARGIN_RESOLUTION from the central one; the simulation's noise is the margin under NOISE_SEEDS.
    The interval adds the swings in quadrature (independent figures); their linear sum is the bound."""

    def rates(s: ReleaseSpec, h: HardwareProfile) -> float:
        a, b = (
            predict(s, h, p.layout, input_len, output_len, start=p.rate_per_server, resolution=MARGIN_RESOLUTION,
                    factor=1.3)
            for p in (better, worse)
        )  # fmt: skip
        return a.rate_per_server / b.rate_per_server - 1 if b.rate_per_server > 0 else float("inf")

    central = rates(spec, hw)
    swings = []
    for f in found:
        lo, hi = rates(*at(spec, hw, {f.name: f.low})), rates(*at(spec, hw, {f.name: f.high}))
        swings.append(
            Swing(figure=f.name, at_low=lo, at_high=hi, flips=(lo > 0) != (central > 0) or (hi > 0) != (central > 0))
        )
    noise = [rates(spec.model_copy(update={"workload": spec.workload.model_copy(update={"seed": seed})}), hw)
             for seed in NOISE_SEEDS]  # fmt: skip
    swings.append(
        Swing(
            figure="simulation noise (other seeds)", at_low=min(noise), at_high=max(noise),
            flips=any((n > 0) != (central > 0) for n in noise),
        )
    )  # fmt: skip
    swings.sort(key=lambda s: -abs(s.at_high - s.at_low))
    downs = [min(0.0, s.at_low - central, s.at_high - central) for s in swings]
    ups = [max(0.0, s.at_low - central, s.at_high - central) for s in swings]
    return Margin(
        better=better.layout.name,
        worse=worse.layout.name,
        central=central,
        low=central - sum(d * d for d in downs) ** 0.5,
        high=central + sum(u * u for u in ups) ** 0.5,
        swings=swings,
        bound_low=central + sum(downs),
        bound_high=central + sum(ups),
    )


def margin_of_intervals(better: EstimateLike, worse: EstimateLike) -> Margin:
    """A profiled plan's margin: the two rates' intervals taken as independent (a bound; one fit's error
    moves both layouts alike, so the true spread is narrower)."""
    a, b = better.rate_per_server, worse.rate_per_server
    a_low, a_high = (better.rate_low or a), (better.rate_high or a)
    b_low, b_high = (worse.rate_low or b), (worse.rate_high or b)
    return Margin(
        better=better.layout.name,
        worse=worse.layout.name,
        central=a / b - 1,
        low=a_low / b_high - 1,
        high=a_high / b_low - 1,
        swings=[],
    )


def overlaps(a: Any, b: Any) -> bool:
    """Two intervals (objects with rate_low / rate_high, or predicted_low / predicted_high) share a point."""
    a_low, a_high = _ends(a)
    b_low, b_high = _ends(b)
    return a_low <= b_high and b_low <= a_high


def _ends(p: Any) -> tuple[float, float]:
    if hasattr(p, "rate_per_server"):
        central, low, high = p.rate_per_server, p.rate_low, p.rate_high
    else:
        central, low, high = p.predicted_per_server, p.predicted_low, p.predicted_high
    return float(central if low is None else low), float(central if high is None else high)


class Choice(BaseModel):
    """The layouts top_k measures: the k best by central prediction, and every other whose interval
    overlaps the best one's (the planner cannot order them), up to OVERLAP_BOUND more."""

    best: list[str]
    overlapping: list[str]
    left_out: list[str] = Field(description="overlapping the best, but past the bound")

    @property
    def measure(self) -> list[str]:
        return self.best + self.overlapping

    def reason(self, top_k: int, of: int) -> str:
        text = f"top_k {top_k} of {of} by predicted req/s per server"
        if self.overlapping:
            text += (
                f", and {', '.join(self.overlapping)} whose interval overlaps the best one's (the planner cannot"
                f" rank them; at most {OVERLAP_BOUND} more)"
            )
        if self.left_out:
            text += f"; overlapping too but past that bound: {', '.join(self.left_out)}"
        return text


def choose(ranked: list[Any], top_k: int, name: Callable[[Any], str], bound: int = OVERLAP_BOUND) -> Choice:
    """`ranked`: predictions best first (rate_per_server or predicted_per_server, with their intervals)."""
    best = ranked[:top_k]
    rest = [p for p in ranked[top_k:] if best and overlaps(best[0], p)]
    return Choice(
        best=[name(p) for p in best],
        overlapping=[name(p) for p in rest[:bound]],
        left_out=[name(p) for p in rest[bound:]],
    )
