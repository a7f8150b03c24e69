"""Fit the step-time model to the engine at hand: a short profiling run of fixed batch shapes.

A hardware profile's figures are a datasheet's (on cpu-local, orders of magnitude) with
efficiency factors guessed once; what a given machine and engine build spend on a step
(scheduling, launches, kernels slower than the roofline, a frontend streaming every token) only a
running engine shows. A handful of fixed shapes, each run by vLLM's own client against one
replica: one prompt of a given length at a time (its time to first token is a prefill step of
that many tokens, plus the frontend's way in and out) and B requests at once that then decode
together (their inter-token latency is a decode step of B). Five coefficients are fitted to
those times: the step overhead, a cost per sequence sampled in a step, a request overhead on every
TTFT, and scales on the profile's compute and memory figures (relative least squares, so a 2 ms
and a 40 ms step count alike). They are kept in the registry per hardware profile and engine
image, and the planner uses them in place of the datasheet's. Steady loads of the workload then
split the request overhead between latency and engine time, and measure the host's CPU per request
and what it costs an engine whose core it shares (planner/host.py); a last load at the fitted
model's max rate checks whether the host work keeps pace there on its own cores, and the split is
fitted again on its TPOT (a load at the operating point; one more where that moves the max past it).
What they do not capture yet: other costs that only appear under load (README, "Fitted on the
engine at hand").
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator
from scipy.optimize import nnls

from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.spec import (
    DevicePerformance,
    HardwareProfile,
    Layout,
    ReleaseSpec,
    SloSpec,
    WorkloadSpec,
    arg_number,
)
from pipeline.planner import host, step_time
from pipeline.planner import simulate as sim
from pipeline.records.benchmark import Probe
from pipeline.stages import benchmark, interference, serving

log = logging.getLogger(__name__)

DECODE_PROMPT, DECODE_TOKENS = 16, 64  # short prompts, enough tokens for a steady decode
PREFILL_REQUESTS = 8
UNJUDGED = SloSpec(max_p90_ttft_ms=600_000, max_p90_tpot_ms=600_000)  # a shape is timed, not judged
WARM_UP_SEED = 9  # the shapes use 0, the steady loads 1 and 3, the host check 2: no run repeats another's prompts


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


def requests(shape: Shape) -> int:
    """A decode shape's batch at once; a prefill shape's prompts one after another, for a median."""
    return shape.batch if shape.kind == "decode" else PREFILL_REQUESTS


def bench_args(shape: Shape, url: str, model_dir: Path, out_dir: Path, name: str, seed: int = 0) -> list[str]:
    """`vllm bench serve` for one shape: its requests at once, at most `batch` in flight."""
    workload = WorkloadSpec(input_len=shape.input_len, output_len=shape.output_len, num_prompts=1, seed=seed)
    n = requests(shape)
    cmd = benchmark.bench_command([], url, str(model_dir), workload, UNJUDGED, math.inf, n, seed, out_dir, name)
    return [*cmd, "--max-concurrency", str(shape.batch)]


def measure(
    bench: benchmark.BenchClient,
    url: str,
    model_dir: Path,
    out_dir: Path,
    shapes: list[Shape],
    model: step_time.StepModel,
) -> list[Measured]:
    """Each shape through vLLM's client against the running server at `url`, beside `model`'s time for it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # the first requests after an engine starts pay one-time costs (a first prefill 23 read 9.73 ms where
    # prefill 47 then read 6.94): the first shape once, unrecorded
    warm_up = bench_args(shapes[0], url, model_dir, out_dir, "warm-up.json", WARM_UP_SEED)  # not the shape's prompts
    bench.serve(warm_up, out_dir, "warm-up.json", " (warm-up)")
    measured: list[Measured] = []
    for i, shape in enumerate(shapes, 1):
        name = f"shape-{i:02d}.json"
        path, client_s = bench.serve(
            bench_args(shape, url, model_dir, out_dir, name), out_dir, name, f" on {shape.name}"
        )
        data = json.loads(path.read_text())
        if int(data.get("completed", 0)) < requests(shape):
            raise ReleaseError(f"profile: {shape.name}: only {data.get('completed')} requests completed ({name})")
        value = float(data["median_ttft_ms"] if shape.kind == "prefill" else data["median_itl_ms"])
        measured.append(
            Measured(
                shape=shape,
                measured_ms=round(value, 3),
                datasheet_ms=round(expected_ms(model, shape), 3),
                client_cpu_s=round(client_s, 4),
            )
        )
        log.info(
            "profile %d/%d: %s: %.3g ms (the profile's figures: %.3g ms)",
            i,
            len(shapes),
            shape.name,
            value,
            measured[-1].datasheet_ms,
        )
    return measured


STEADY_SHARE = 0.6  # of the shapes' predicted max rate: loaded enough that admissions overlap decodes
STEADY_SECONDS = 8
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


def measure_steady(
    bench: benchmark.BenchClient,
    url: str,
    model_dir: Path,
    out_dir: Path,
    spec: ReleaseSpec,
    rate: float,
    engine_groups: Iterable[int] = (),
    client_fixed_s: float = 0.0,
    name: str = "steady.json",
    seed: int = 1,
) -> Steady:
    """The workload at a steady rate: its median TPOT, and the host's CPU per request (the API server,
    the processes of `engine_groups` other than vLLM's engine core and workers, plus the client's
    beyond its `client_fixed_s` a run)."""
    n = max(100, math.ceil(rate * STEADY_SECONDS))
    cmd = benchmark.bench_command([], url, str(model_dir), spec.workload, UNJUDGED, rate, n, seed, out_dir, name)
    before = interference.frontend_seconds(engine_groups)
    path, client_s = bench.serve(cmd, out_dir, name, f" on the steady load ({name})")
    frontend_s = interference.frontend_seconds(engine_groups) - before
    data = json.loads(path.read_text())
    client_s = max(0.0, client_s - client_fixed_s)
    steady = Steady(
        rate=round(rate, 3),
        requests=n,
        achieved=round(float(data.get("request_throughput", 0.0)), 3),
        measured_tpot_ms=round(float(data["median_tpot_ms"]), 3),
        host_ms_per_request=round((frontend_s + client_s) / n * 1e3, 3),
        client_fixed_s=round(client_fixed_s, 4),
    )
    log.info(
        "profile: steady load at %.3g req/s (%s): median TPOT %.3g ms; host CPU %.3g ms a request (API server"
        " %.3g, client %.3g beyond its %.2f s a run)",
        rate,
        name,
        steady.measured_tpot_ms,
        steady.host_ms_per_request,
        frontend_s / n * 1e3,
        client_s / n * 1e3,
        client_fixed_s,
    )
    return steady


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


@contextmanager
def host_on_engine_cores(engine: serving.LocalEngine, bench: benchmark.BenchClient) -> Iterator[bool]:
    """The API server(s) and the client (the server its probes fork from) on the engine's cores for the
    block, then back on the frontend's. Yields False where the placement keeps nothing apart."""
    plan = engine.placement
    cores = plan.all_engine_cores
    if not cores or not plan.frontend_cores or bench.group is None:
        yield False
        return
    frontend = [
        pid
        for group in engine.groups
        for pid, comm in serving.group_members(group).items()
        if not comm.startswith(serving.ENGINE_TITLES)
    ]
    before: dict[int, set[int]] = {}
    try:
        for pid in [*frontend, bench.group]:
            with suppress(OSError):  # gone since: nothing to move, nothing to restore
                before[pid] = os.sched_getaffinity(pid)
                serving.pin(pid, cores)
        yield True
    finally:
        for pid, was in before.items():
            with suppress(OSError):
                serving.pin(pid, sorted(was))


def host_apart(plan: serving.Placement) -> bool:
    """Whether the placement keeps the host work (API servers, client) on cores no engine uses."""
    engine_cores = set(plan.all_engine_cores)
    apart = not plan.shared and not engine_cores & set(plan.frontend_cores)
    return bool(plan.frontend_cores and engine_cores and apart)


HOST_CHECK_SEED = 2  # not the steady loads' 1 and 3: fresh prompts, no cached prefix flatters the check
# of the simulated max: where the simulation is optimistic (it put one at 492 req/s where the layout held
# 384) the first falls behind on the engine and says nothing of the host; the second is a rate it can carry
HOST_CHECK_STEPS = (1.0, 0.8)


def measure_host_check(
    probe: Callable[[float, int, int], Probe],
    plan: serving.Placement,
    rate: float,
    steps: tuple[float, ...] = HOST_CHECK_STEPS,
) -> HostCheck | None:
    """A load of the workload at each of `steps` x `rate` in turn (`STEADY_SECONDS` of it, through the
    release's own prober) until one keeps pace, judged on pace (`HostCheck`): the last one run. None
    where the placement keeps nothing apart (the host shares the engines' cores, and its cost there is
    priced instead) or there is no rate to check."""
    if not host_apart(plan) or rate <= 0:
        return None
    check = None
    for step in steps:
        n = max(100, math.ceil(rate * step * STEADY_SECONDS))
        found = probe(rate * step, n, HOST_CHECK_SEED)
        behind = benchmark.hopeless(found)
        check = HostCheck(
            rate=round(rate * step, 3),
            requests=n,
            achieved=round(found.achieved_rate, 3),
            p90_ttft_ms=round(found.p90_ttft_ms, 1),
            median_tpot_ms=round(found.p50_tpot_ms, 3) if math.isfinite(found.p50_tpot_ms) else 0.0,
            carried=not behind,
            reasons=found.reasons if behind else [],
        )
        log.info(
            "profile: host check at %.3g req/s (%.0f%% of the rate asked): achieved %.3g, p90 TTFT %.1f ms -> %s",
            check.rate,
            step * 100,
            check.achieved,
            check.p90_ttft_ms,
            "carried (the host is no bound up to it)" if check.carried else "not kept up: " + "; ".join(check.reasons),
        )
        if check.carried:
            break
    return check


def measure_colocated(
    bench: benchmark.BenchClient,
    engine: serving.LocalEngine,
    model_dir: Path,
    out_dir: Path,
    spec: ReleaseSpec,
    rate: float,
    client_fixed_s: float,
) -> Colocated | None:
    """The load beside the engine, then with the host work on its cores, in pairs (see `Colocated`); None
    where the placement keeps nothing apart (nothing to compare)."""
    plan = engine.placement
    engine_cores = set(plan.all_engine_cores)
    if not host_apart(plan):
        return None  # the host work already shares the engines' cores: "beside" would not be
    bench.ensure()
    if bench.group is None:
        return None

    def load(name: str) -> Steady:
        return measure_steady(bench, engine.url, model_dir, out_dir, spec, rate, engine.groups, client_fixed_s, name)

    besides: list[Steady] = []
    shared: list[float] = []
    for pair in range(1, COLOCATED_PAIRS + 1):
        suffix = "" if pair == 1 else f"-{pair}"
        besides.append(load(f"beside{suffix}.json"))
        with host_on_engine_cores(engine, bench) as moved:
            if not moved:
                return None
            on = load(f"colocated{suffix}.json")
        shared.append(on.measured_tpot_ms)
    beside_ms = statistics.mean(b.host_ms_per_request for b in besides)
    beside_tpot = statistics.mean(b.measured_tpot_ms for b in besides)
    share = rate * beside_ms / 1e3 / len(engine_cores)
    found = Colocated(
        rate=round(rate, 3),
        requests=besides[0].requests,
        share=round(share, 4),
        beside_host_ms_per_request=round(beside_ms, 3),
        beside_tpot_ms=round(beside_tpot, 3),
        shared_tpot_ms=round(statistics.mean(shared), 3),
        beside_tpots_ms=[b.measured_tpot_ms for b in besides],
        shared_tpots_ms=shared,
        cost=colocated_cost(beside_tpot, statistics.mean(shared), share),
    )
    log.info(
        "profile: host work on the engine's core at %.3g req/s (%.2f of it): median TPOT %.3g ms vs %.3g ms"
        " beside it: x%.3g its own CPU time",
        rate,
        share,
        found.shared_tpot_ms,
        found.beside_tpot_ms,
        found.cost,
    )
    return found


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


REFIT_ROUNDS = 2  # host checks at most: the second where the first's refit moved the max past it
REFIT_MOVE = 0.1  # ... by more than this share of its rate


def refit_at_max(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    coefficients: Coefficients,
    probe: Callable[[float, int, int], Probe],
    plan: serving.Placement,
    top: float,
) -> tuple[Coefficients, list[HostCheck]]:
    """The host check at the simulated max, and the request overhead's split refitted on the median
    TPOT of each check that carried: a load at the operating point, where the steady load at 0.6 of a
    first guess sits on the simulation's knee and called for a split that made the simulated engine
    ~30% slower under load than the real one (TPOT 13 ms simulated at 326 req/s where 9.6 was measured;
    refitted on the check's TPOT, 15 of the 18 single-layout predictions of six saved profiles came within
    15% of their truth, 11 before; README).
    Where a refit moves the max past the checked rate by more than `REFIT_MOVE`, one more check there
    (the host is only known to carry what a check carried), unless the first stepped down to 80% (a load
    fell behind at the max: it is under it); if the second falls behind, the refit before it stands.
    -> (coefficients, the checks in order)."""
    checks: list[HostCheck] = []
    rate = top
    for attempt in range(REFIT_ROUNDS):
        # a later round's check at the refitted max only: one that falls behind says the max is under it, and
        # 80% of it says nothing the carried check before it did not (in one run it read 274 req/s right after
        # an overload at 342, TPOT 11 ms where 278 read 6.56 a minute before, and its refit took 13% off)
        asked = rate
        check = measure_host_check(probe, plan, asked, HOST_CHECK_STEPS if attempt == 0 else (1.0,))
        if check is None:
            break
        checks.append(check)
        if not check.carried or check.median_tpot_ms <= 0:
            break  # a load that fell behind measured a queue, not the engine's steps
        coefficients, check.fitted_tpot_ms = split_request_overhead(
            spec, hw, layout, coefficients, check.rate, check.median_tpot_ms
        )
        total = coefficients.admission_ms + coefficients.request_overhead_ms
        rate = max_rate(spec, at_hand(hw, coefficients), layout)
        log.info(
            "profile: split refitted on the host check at %.3g req/s (median TPOT %.3g ms, simulated %.3g):"
            " %.2f of the request overhead in the admitting step; the engine's max now %.3g req/s",
            check.rate,
            check.median_tpot_ms,
            check.fitted_tpot_ms,
            coefficients.admission_ms / total if total else 0.0,
            rate,
        )
        if check.rate < asked:
            break  # it stepped down: a load at `asked` fell behind, the max is under it, no rate above to check
        if rate <= check.rate * (1 + REFIT_MOVE):
            break
    return coefficients, checks


def fitted_profile(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    measured: list[Measured],
    seconds: float,
    coefficients: Coefficients | None = None,
    steady: Steady | None = None,
    colocated: Colocated | None = None,
    host_checks: list[HostCheck] | None = None,
) -> Profile:
    coefficients = coefficients or fit(spec, hw, layout, measured)
    fitted = step_time.step_model(spec, layout, at_hand(hw, coefficients))
    for m in measured:
        m.fitted_ms = round(expected_ms(fitted, m.shape), 3)
    error = statistics.median(abs((m.fitted_ms or 0) / m.measured_ms - 1) for m in measured)
    profile = Profile(
        hardware=hw.name,
        engine_image=spec.serving.engine_image,
        layout=layout.name,
        measured_at=datetime.now(UTC),
        coefficients=coefficients,
        shapes=measured,
        steady=steady,
        colocated=colocated,
        host_checks=host_checks or [],
        fit_error=round(error, 4),
        seconds=round(seconds, 1),
    )
    log.info("profile: %s", profile.summary())
    return profile


def profilable(layout: Layout) -> bool:
    """One tp x ep replica: what the step-time model describes and one engine's shapes measure."""
    return layout.replicas == 1 and layout.pp == 1 and layout.dp == 1


def run(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model_dir: Path,
    out_dir: Path,
    shapes: list[Shape] | None = None,
) -> Profile:
    """Start `layout` (one replica is profiled), run each shape, fit; always tears the engine down."""
    if not profilable(layout):
        raise ReleaseError(f"layout {layout.name!r}: profile a layout of one tp x ep replica (replicas 1, pp 1, dp 1)")
    started = time.monotonic()
    shapes = shapes or shapes_for(spec, layout)
    model = step_time.step_model(spec, layout, hw)
    with benchmark.running_layout(spec, hw, layout, model_dir, out_dir) as (engine, prober):
        measured = measure(prober.bench, engine.url, model_dir, out_dir, shapes, model)
        coefficients = fit(spec, hw, layout, measured)
        top = max_rate(spec, at_hand(hw, coefficients), layout)
        fixed = client_fixed_seconds(measured)
        steady = measure_steady(
            prober.bench, engine.url, model_dir, out_dir, spec, STEADY_SHARE * top, engine.groups, fixed
        )
        if not kept_pace(steady):
            # the shapes' fit, its overhead all on latency, can put the max far too high (840 req/s where
            # the layout held 384): a load past the engine measures its queue, not its steps
            log.warning(
                "profile: the steady load fell behind (%.3g of %.3g req/s); at half of it", steady.achieved, steady.rate
            )
            steady = measure_steady(
                prober.bench,
                engine.url,
                model_dir,
                out_dir,
                spec,
                steady.rate / 2,
                engine.groups,
                fixed,
                name="steady-half.json",
                seed=3,
            )
            if not kept_pace(steady):
                log.warning(
                    "profile: the steady load fell behind at half the rate too (%.3g of %.3g req/s): the split of"
                    " the request overhead is fitted on a queue",
                    steady.achieved,
                    steady.rate,
                )
        coefficients, steady.fitted_tpot_ms = split_request_overhead(
            spec, hw, layout, coefficients, steady.rate, steady.measured_tpot_ms
        )
        top = max_rate(spec, at_hand(hw, coefficients), layout)  # the engine's, the host not yet counted
        at = colocated_rate(top, len(engine.placement.all_engine_cores), steady.host_ms_per_request)
        colocated = measure_colocated(prober.bench, engine, model_dir, out_dir, spec, at, fixed)
        coefficients, checks = refit_at_max(spec, hw, layout, coefficients, prober, engine.placement, top)
    loads = [(steady.rate, steady.host_ms_per_request)]
    if colocated:
        loads.append((colocated.rate, colocated.beside_host_ms_per_request))
    busy, per_request = host_line(loads)
    log.info(
        "profile: host CPU %.3g cores a replica while it serves + %.3g ms a request (%s)",
        busy,
        per_request,
        ", ".join(f"{ms:.3g} ms a request at {rate:.3g} req/s" for rate, ms in loads),
    )
    coefficients = coefficients.model_copy(
        update={
            "host_ms_per_request": per_request,
            "host_busy_cores": busy,
            "host_colocated_cost": colocated.cost if colocated else 1.0,
            "host_carried_rps": max((c.rate for c in checks if c.carried), default=0.0),
        }
    )
    return fitted_profile(
        spec, hw, layout, measured, time.monotonic() - started, coefficients, steady, colocated, checks
    )


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
