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

Split by job: `profile_model` (the records, the fit and the host arithmetic: pure) and
`profile_loads` (the loads on an engine); this module runs a profile and is the door callers import
both through.
"""

from __future__ import annotations

import logging
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import (
    HardwareProfile,
    Layout,
    ReleaseSpec,
)
from pipeline.planner import step_time
from pipeline.planner.profile_loads import (
    HOST_CHECK_SEED,
    HOST_CHECK_STEPS,
    REFIT_MOVE,
    REFIT_ROUNDS,
    STEADY_SECONDS,
    WARM_UP_SEED,
    bench_args,
    host_apart,
    host_on_engine_cores,
    measure,
    measure_colocated,
    measure_host_check,
    measure_steady,
    refit_at_max,
    requests,
)
from pipeline.planner.profile_model import (
    COLOCATED_PAIRS,
    COLOCATED_SHARE,
    DECODE_PROMPT,
    DECODE_TOKENS,
    PREFILL_REQUESTS,
    SPLIT_HALVINGS,
    STEADY_SHARE,
    UNJUDGED,
    Coefficients,
    Colocated,
    HostCheck,
    Measured,
    Profile,
    Shape,
    Steady,
    at_hand,
    client_fixed_seconds,
    colocated_cost,
    colocated_rate,
    expected_ms,
    fit,
    host_line,
    kept_pace,
    max_rate,
    shapes_for,
    split_request_overhead,
    steady_tpot_ms,
    table,
    write,
)
from pipeline.stages import benchmark

log = logging.getLogger(__name__)

__all__ = [
    "COLOCATED_PAIRS",
    "COLOCATED_SHARE",
    "Coefficients",
    "Colocated",
    "DECODE_PROMPT",
    "DECODE_TOKENS",
    "HOST_CHECK_SEED",
    "HOST_CHECK_STEPS",
    "HostCheck",
    "Measured",
    "PREFILL_REQUESTS",
    "Profile",
    "REFIT_MOVE",
    "REFIT_ROUNDS",
    "SPLIT_HALVINGS",
    "STEADY_SECONDS",
    "STEADY_SHARE",
    "Shape",
    "Steady",
    "UNJUDGED",
    "WARM_UP_SEED",
    "at_hand",
    "bench_args",
    "client_fixed_seconds",
    "colocated_cost",
    "colocated_rate",
    "expected_ms",
    "fit",
    "fitted_profile",
    "host_apart",
    "host_line",
    "host_on_engine_cores",
    "kept_pace",
    "max_rate",
    "measure",
    "measure_colocated",
    "measure_host_check",
    "measure_steady",
    "profilable",
    "refit_at_max",
    "requests",
    "run",
    "shapes_for",
    "split_request_overhead",
    "steady_tpot_ms",
    "table",
    "write",
]


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
