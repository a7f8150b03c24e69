"""A profile's records and its fit, pure: the shapes, the coefficients fitted to their times, the
host figures read from steady loads, the simulated max they imply (planner/profile.py runs them).

Why apart: what a profile concludes from its measurements is arithmetic a test can check on numbers
it chose (tests/test_planner.py fits known coefficients back); the loads that measure need an engine."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator
from scipy.optimize import nnls

from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.specs import (
    DevicePerformance,
    HardwareProfile,
    Layout,
    ReleaseSpec,
    SloSpec,
    arg_number,
)
from pipeline.planner import host, step_time
from pipeline.planner import simulate as sim
from pipeline.stages import benchmark

log = logging.getLogger(__name__)


DECODE_PROMPT, DECODE_TOKENS = 16, 64  # short prompts, enough tokens for a steady decode


PREFILL_REQUESTS = 8


UNJUDGED = SloSpec(max_p90_ttft_ms=600_000, max_p90_tpot_ms=600_000)  # a shape is timed, not judged


class Shape(BaseModel):
    """One fixed batch: `batch` requests of `input_len` prompt tokens, sent at once."""

    kind: Literal["prefill", "decode"]
    batch: int = Field(ge=1)
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)

    @property
    def name(self) -> str:
        return f"prefill {self.input_len}" if self.kind == "prefill" else f"decode x{self.batch}"

    def step(self) -> step_time.Batch:
        """The engine step the shape's measurement reads: the whole prompt, or one token for each of `batch`
        sequences at the decode's mean context."""
        if self.kind == "prefill":
            n = self.input_len
            return step_time.Batch(tokens=n, pairs=n * (n + 1) / 2, context=0, sampled=1)
        context = self.input_len + self.output_len // 2
        return step_time.Batch(
            tokens=self.batch, pairs=self.batch * context, context=self.batch * context, sampled=self.batch
        )


def expected_ms(model: step_time.StepModel, shape: Shape) -> float:
    """What the shape's measurement should read under `model`: a prefill's TTFT carries the request's way in and out."""
    return (model.seconds(shape.step()) + (model.request_overhead_s if shape.kind == "prefill" else 0.0)) * 1e3


class Measured(BaseModel):
    shape: Shape
    measured_ms: float = Field(description="median TTFT (prefill) or median inter-token latency (decode)")
    fitted_ms: float | None = None
    datasheet_ms: float = Field(description="the step-time model with the profile's own figures")
    client_cpu_s: float | None = Field(None, description="the client's CPU for the shape's run (wait4)")


class Coefficients(BaseModel):
    step_overhead_ms: float
    sequence_overhead_us: float = Field(0.0, description="per sequence a step samples")
    request_overhead_ms: float = Field(0.0, description="on every TTFT: the server's way in and out")
    admission_ms: float = Field(0.0, description="the part of a request's overhead its admitting step pays")
    host_ms_per_request: float = Field(0.0, description="CPU outside the engine: API server, client (planner/host.py)")
    host_busy_cores: float = Field(0.0, description="host CPU a replica costs while it serves, whatever the rate")
    host_colocated_cost: float = Field(1.0, description="x that CPU an engine core loses when it runs there")
    host_carried_rps: float = Field(0.0, description="a rate the host work carried on its own cores (`HostCheck`)")
    compute_scale: float = Field(description="x the profile's peak_tflops x compute efficiency")
    memory_scale: float = Field(description="x the profile's memory_gb_s x memory efficiency")

    def apply(self, perf: DevicePerformance) -> DevicePerformance:
        return perf.model_copy(
            update={
                "peak_tflops": {k: v * self.compute_scale for k, v in perf.peak_tflops.items()},
                "memory_gb_s": perf.memory_gb_s * self.memory_scale,
                "step_overhead_ms": self.step_overhead_ms,
                "sequence_overhead_us": self.sequence_overhead_us,
                "request_overhead_ms": self.request_overhead_ms,
                "admission_ms": self.admission_ms,
                "host_ms_per_request": self.host_ms_per_request,
                "host_busy_cores": self.host_busy_cores,
                "host_colocated_cost": self.host_colocated_cost,
                "host_carried_rps": self.host_carried_rps,
            }
        )


class Steady(BaseModel):
    """The workload's own requests at a steady Poisson rate: the one shape in which requests arrive while
    others decode, so it shows what a request costs the engine's steps (not only its own latency)."""

    rate: float
    requests: int
    achieved: float = Field(0.0, description="req/s the client completed: a load that fell behind measures a queue")
    measured_tpot_ms: float = Field(description="median TPOT, vLLM's client")
    host_ms_per_request: float = Field(0.0, description="CPU of the API server(s) and the client, per request")
    client_fixed_s: float = Field(0.0, description="the client's CPU per run, left out of the per-request figure")
    fitted_tpot_ms: float | None = None


class Colocated(BaseModel):
    """The same load twice: the host work beside the engine (on its own core), then on the engine's core,
    as where a layout's engines take every core; in `COLOCATED_PAIRS` pairs, their means compared. The
    TPOT it costs, per unit of the host work's own share of that core, is `cost` (planner/host.py:
    steps slowed by 1 / (1 - cost x share))."""

    rate: float
    requests: int
    share: float = Field(description="cores of host work at this rate, per engine core")
    beside_host_ms_per_request: float = Field(0.0, description="the host's CPU a request at this rate, beside it")
    beside_tpot_ms: float = Field(description="the mean of `beside_tpots_ms`")
    shared_tpot_ms: float = Field(description="the mean of `shared_tpots_ms`")
    beside_tpots_ms: list[float] = Field(default_factory=list, description="each pair's median TPOT beside")
    shared_tpots_ms: list[float] = Field(default_factory=list, description="... and on the engine's core")
    cost: float


class HostCheck(BaseModel):
    """The workload at the profiled layout's simulated max rate, its host work on cores of its own, judged
    on pace only (failures within the SLO's share, achieved within the client's keep-up share of
    offered): a rate the host carried, the offered one as a search reports its answer, is one it
    carries, whatever its CPU read there. A polling API server and client take most of their core long
    before they fall behind: in the four runs of benchmarks/planner.py whose bound was the line through
    their CPU, `single` held 25-60% more than that line's cap (README)."""

    rate: float
    requests: int
    achieved: float
    p90_ttft_ms: float
    median_tpot_ms: float = Field(0.0, description="what the request overhead's split is refitted on, if carried")
    fitted_tpot_ms: float | None = Field(None, description="the simulated median TPOT there after the refit")
    carried: bool
    reasons: list[str] = Field(default_factory=list, description="why it did not keep up, if it did not")


def at_hand(hw: HardwareProfile, coefficients: Coefficients) -> HardwareProfile:
    """`hw` with its performance figures as `coefficients` make them."""
    if hw.performance is None:
        raise ReleaseError(f"hardware {hw.name!r}: no performance: section for the step-time model")
    return hw.model_copy(update={"performance": coefficients.apply(hw.performance)})


class Profile(BaseModel):
    """A profiling run's fit, what the planner reads back (registry `profiles`)."""

    hardware: str
    engine_image: str
    layout: str
    measured_at: datetime
    coefficients: Coefficients
    shapes: list[Measured]
    steady: Steady | None = Field(None, description="what split the request overhead into latency and engine time")
    colocated: Colocated | None = Field(None, description="what the host work costs an engine whose core it shares")
    host_checks: list[HostCheck] = Field(
        default_factory=list, description="loads at the simulated max: whether the host kept up, the split's refit"
    )
    fit_error: float = Field(description="median |fitted / measured - 1| over the shapes")
    seconds: float = Field(description="the run, engine start included")
    id: int | None = Field(None, description="the registry's row, once kept")

    @model_validator(mode="before")
    @classmethod
    def _one_check(cls, data: object) -> object:
        """A profile kept before the refit (2026-12-04) holds its one check as `host_check`."""
        if isinstance(data, dict) and "host_check" in data and "host_checks" not in data:
            one = data.get("host_check")
            return {**{k: v for k, v in data.items() if k != "host_check"}, "host_checks": [one] if one else []}
        return data

    def hardware_at_hand(self, hw: HardwareProfile) -> HardwareProfile:
        return at_hand(hw, self.coefficients)

    def summary(self) -> str:
        c = self.coefficients
        return (
            f"profile {self.id or '(unsaved)'} of {self.measured_at:%Y-%m-%d %H:%M} UTC on layout {self.layout}:"
            f" step overhead {c.step_overhead_ms:.3g} ms + {c.sequence_overhead_us:.3g} us per sequence,"
            f" request overhead {c.request_overhead_ms:.3g} ms + {c.admission_ms:.3g} ms of its admitting step,"
            f" host CPU {c.host_ms_per_request:.3g} ms a request + {c.host_busy_cores:.2g} cores a replica"
            f" (x{c.host_colocated_cost:.3g} on an engine's core"
            + (f"; carried {c.host_carried_rps:.3g} req/s on its own" if c.host_carried_rps else "")
            + "),"
            f" compute x{c.compute_scale:.3g},"
            f" memory x{c.memory_scale:.3g} of the profile's figures; fit within {self.fit_error:.1%} (median)"
        )


def shapes_for(spec: ReleaseSpec, layout: Layout) -> list[Shape]:
    """Prompts from a few dozen tokens up to the workload's (or what the context allows), decode batches
    from 1 up to the layout's max-num-seqs: what a step of the real load carries, bracketed."""
    args = {**spec.serving.engine_args, **layout.engine_args}
    max_len = int(arg_number(args, "max-model-len") or 4 * spec.workload.input_len)
    seqs = int(arg_number(args, "max-num-seqs") or 256)
    # a quarter of the context spare: vLLM's random prompts re-tokenize to a few more tokens than asked
    longest = max(16, min((max_len - 2) * 3 // 4, 4 * spec.workload.input_len))
    prompts = sorted({max(8, longest // 8), max(8, longest // 4), max(8, longest // 2), longest})
    batches = sorted({b for b in (1, 4, 16, 64) if b <= seqs} | {seqs if seqs <= 64 else 64})
    return [Shape(kind="prefill", batch=1, input_len=p, output_len=2) for p in prompts] + [
        Shape(kind="decode", batch=b, input_len=DECODE_PROMPT, output_len=DECODE_TOKENS) for b in batches
    ]


def fit(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, measured: list[Measured]) -> Coefficients:
    """The coefficients whose times are nearest the measured ones (relative least squares): a grid over the
    two roofline scales, and at each the three overheads (per step, per sampled sequence, per request's
    first token) by non-negative least squares on what the roofline leaves unexplained."""
    steps = [m.shape.step() for m in measured]
    seconds = np.array([m.measured_ms / 1e3 for m in measured])
    prefill = np.array([1.0 if m.shape.kind == "prefill" else 0.0 for m in measured])
    design = np.column_stack([np.ones(len(steps)), np.array([b.sampled for b in steps], float), prefill])
    weighted = design / seconds[:, None]
    scales = [10 ** (k / 20) for k in range(-60, 41)]  # 1e-3 .. 1e2 in 12% steps
    best: tuple[float, Coefficients] | None = None
    for cs in scales:
        for ms in scales[::2]:
            trial = Coefficients(step_overhead_ms=0.0, compute_scale=cs, memory_scale=ms)
            model = step_time.step_model(spec, layout, at_hand(hw, trial))
            variable = np.array([model.seconds(s) for s in steps])
            if np.any(variable >= seconds * 1.5):
                continue  # the roofline alone is far slower than measured: no overhead can fix that
            (step_s, sequence_s, request_s), _ = nnls(weighted, (seconds - variable) / seconds)
            total = variable + design @ np.array([step_s, sequence_s, request_s])
            error = float(np.sum(np.log(np.maximum(total, 1e-9) / seconds) ** 2))
            if best is None or error < best[0]:
                found = trial.model_copy(
                    update={
                        "step_overhead_ms": round(float(step_s) * 1e3, 3),
                        "sequence_overhead_us": round(float(sequence_s) * 1e6, 2),
                        "request_overhead_ms": round(float(request_s) * 1e3, 3),
                    }
                )
                best = (error, found)
    if best is None:
        raise ReleaseError("profile: no coefficients fit the measured step times (every roofline is slower)")
    return best[1]


STEADY_SHARE = 0.6  # of the shapes' predicted max rate: loaded enough that admissions overlap decodes


SPLIT_HALVINGS = 6  # between two tenths of the request overhead: to 1/640 of it


def _workload(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout) -> tuple[Callable[..., sim.SimResult], sim.Slo]:
    """One replica of `layout` under `hw`'s figures and the spec's workload, as a function of the rate."""
    model = step_time.step_model(spec, layout, hw)
    limits = step_time.engine_limits(spec, layout, hw, model)
    slo = sim.Slo(p90_ttft_s=spec.slo.max_p90_ttft_ms / 1e3, p90_tpot_s=spec.slo.max_p90_tpot_ms / 1e3)
    wl = spec.workload
    return sim.workload(model, limits, slo, wl.input_len, wl.output_len, wl.seed, host.share(hw, layout).slowdown), slo


def max_rate(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout) -> float:
    """The simulated max SLO rate of one replica under `hw`'s figures and the spec's workload."""
    run, slo = _workload(spec, hw, layout)
    return sim.max_slo_rate(run, slo).rate


def steady_tpot_ms(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, rate: float) -> float:
    """The simulated median TPOT of the workload at `rate`."""
    run, _ = _workload(spec, hw, layout)
    return run(rate).p("tpot_s", 50) * 1e3


def kept_pace(steady: Steady) -> bool:
    """Whether a steady load's client completed its requests about as fast as it sent them."""
    return benchmark.kept_up(steady.rate, steady.achieved, steady.requests)


def client_fixed_seconds(measured: list[Measured]) -> float:
    """The client's CPU for a run of next to no requests (its start: tokenizer, prompts, session): the median
    over the prefill shapes' runs, 8 requests of 2 output tokens each. A steady run's per-request figure leaves it out:
    on the tiny model it was 0.33-0.5 s a run, most of what a 40-200 request probe's client spent."""
    runs = [m.client_cpu_s for m in measured if m.shape.kind == "prefill" and m.client_cpu_s is not None]
    return statistics.median(runs) if runs else 0.0


# of the engine's core the host work takes in the co-located check, by the steady load's per-request
# figure; the load's own CPU is more a request (0.43 of the core measured for a 0.25 aim), and k is
# priced on that. What it costs is not proportional to it (README, "The host's share"), so it is read
# near where a layout of replicas that take every core runs (0.3-0.55 of each core at two-replicas' max;
# a 0.1 aim read 0.16-0.29, and k 1.0-2.5 where the truth called for 1.25-1.97)
COLOCATED_SHARE = 0.25


# pairs of loads (beside, then on the engine's core): one pair's k moved 1.31-2.24 within one run
COLOCATED_PAIRS = 2


def colocated_rate(top: float, engine_cores: int, host_ms_per_request: float) -> float:
    """The co-located check's load: host work of `COLOCATED_SHARE` of every engine core by the steady
    load's figure, and never more than 0.3 of the predicted max rate (the engine's own queue stays out)."""
    return min(0.3 * top, COLOCATED_SHARE * max(1, engine_cores) * 1e3 / max(host_ms_per_request, 1e-3))


def colocated_cost(beside_tpot_ms: float, shared_tpot_ms: float, share: float) -> float:
    """k in 1 / (1 - k x share) that makes the TPOT beside the engine the one on its core: how many times
    its own CPU time the host work costs an engine core it shares (at least 1, at most what saturates it)."""
    if share <= 0 or shared_tpot_ms <= beside_tpot_ms:
        return 1.0
    return round(max(1.0, min((1 - beside_tpot_ms / shared_tpot_ms) / share, host.SATURATED / share)), 3)


def host_line(loads: list[tuple[float, float]]) -> tuple[float, float]:
    """(cores a replica busy, ms a request): the non-negative line through the host CPU of steady loads
    given as (rate, ms a request), its cores being rate x ms / 1e3. The API server read 14.9 ms a request
    at 13 req/s and 4.5 ms at 138 (its loop turns once per engine step whatever the step carries): a
    figure read at one rate overcharges every faster one. One load (or none): all of it per request."""
    points = [(rate, ms) for rate, ms in loads if rate > 0]
    if len({rate for rate, _ in points}) < 2:
        return 0.0, points[0][1] if points else 0.0
    design = np.array([[1.0, rate / 1e3] for rate, _ in points])
    cores = np.array([rate * ms / 1e3 for rate, ms in points])
    (busy, per_request), _ = nnls(design, cores)
    return round(float(busy), 4), round(float(per_request), 3)


def split_request_overhead(
    spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, coefficients: Coefficients, rate: float, tpot_ms: float
) -> tuple[Coefficients, float]:
    """How much of the request overhead the engine pays (in the step that admits the request) rather
    than the request alone (latency): the share whose simulated median TPOT at `rate` is nearest the
    measured `tpot_ms`. Tenths first, then halving between the two tenths the measured TPOT lies
    between: near the simulated knee the TPOT doubles from one tenth to the next (5.1 to 10.3 ms at
    295 req/s here). -> (the coefficients split so, their simulated TPOT there)."""
    total = coefficients.request_overhead_ms + coefficients.admission_ms
    target = tpot_ms

    def split(share: float) -> Coefficients:
        return coefficients.model_copy(
            update={"admission_ms": round(total * share, 3), "request_overhead_ms": round(total * (1 - share), 3)}
        )

    def tpot(share: float) -> float:
        return steady_tpot_ms(spec, at_hand(hw, split(share)), layout, rate)

    def error(value: float) -> float:
        return abs(math.log(max(value, 1e-6) / target))

    shares = [tenth / 10 for tenth in range(11)]
    tpots = [tpot(share) for share in shares]
    best = min(range(len(shares)), key=lambda i: error(tpots[i]))
    share, found = shares[best], tpots[best]
    for i in (best - 1, best):
        if 0 <= i < len(shares) - 1 and min(tpots[i], tpots[i + 1]) <= target <= max(tpots[i], tpots[i + 1]):
            lo, hi, lo_below = shares[i], shares[i + 1], tpots[i] < target
            for _ in range(SPLIT_HALVINGS):
                mid = (lo + hi) / 2
                value = tpot(mid)
                if error(value) < error(found):
                    share, found = mid, value
                if (value < target) == lo_below:
                    lo = mid
                else:
                    hi = mid
            break
    return split(share), round(found, 3)


def table(profile: Profile) -> str:
    rows = [f"{'shape':16} {'measured ms':>12} {'fitted ms':>10} {'datasheet ms':>13}"]
    for m in profile.shapes:
        rows.append(f"{m.shape.name:16} {m.measured_ms:12.3g} {m.fitted_ms or math.nan:10.3g} {m.datasheet_ms:13.3g}")
    if profile.steady:
        st = profile.steady
        rows.append(
            f"{f'steady {st.rate:.3g}/s':16} {st.measured_tpot_ms:12.3g} {st.fitted_tpot_ms or math.nan:10.3g}"
            f" {'-':>13}  (median TPOT of the workload)"
        )
    if profile.colocated:
        co = profile.colocated
        rows.append(
            f"{f'on its core {co.rate:.3g}/s':16} {co.shared_tpot_ms:12.3g} {'-':>10} {'-':>13}  (median TPOT with"
            f" the host work on the engine's core; {co.beside_tpot_ms:.3g} ms beside it: x{co.cost:.3g})"
        )
    for hc in profile.host_checks:
        verdict = (
            "not kept up" if not hc.carried else "carried, the split refitted on it" if hc.fitted_tpot_ms else "carried"
        )
        fitted = f"{hc.fitted_tpot_ms:10.3g}" if hc.fitted_tpot_ms else f"{'-':>10}"
        rows.append(
            f"{f'host check {hc.rate:.3g}/s':16} {hc.median_tpot_ms:12.3g} {fitted}"
            f" {'-':>13}  (median TPOT; p90 TTFT {hc.p90_ttft_ms:.4g} ms, achieved {hc.achieved:.3g} req/s: {verdict})"
        )
    return "\n".join(rows)


def write(profile: Profile, path: Path) -> Path:
    atomic_write(path, profile.model_dump_json(indent=2))
    return path
