"""Rank every feasible layout of a spec by its predicted max SLO rate per server.

The enumeration uses the same rules as `model-release validate` (heads split over tp, experts
over ep, memory for weights + KV); each candidate's max rate comes from the scheduler simulation
on the step-time model, with the hardware profile's one set of efficiency factors. MoE models
also get data-parallel attention + expert-parallel candidates (tp x dp ranks, ep = tp x dp).

Every prediction is a central value and an interval (planner/uncertainty.py): from the assumed
figures' ranges on a datasheet plan, from the fit's residuals on a profiled one. Where two layouts'
intervals overlap the plan says their order is undetermined, and top_k measures both.
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path

from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.specs import (
    HardwareProfile,
    Layout,
    LoadedSpec,
    ReleaseSpec,
    feasibility_problems,
    feasible_shapes,
    hardware_path,
)
from pipeline.planner import host, step_time, uncertainty
from pipeline.planner import simulate as sim
from pipeline.planner.profile import Profile

log = logging.getLogger(__name__)
BRACKETED = 8  # intervals for the spec's layouts and this many best others (each costs two more searches)


class Estimate(BaseModel):
    """What the step-time model says of one layout: its max SLO rate per replica, server and device,
    and what holds it there. The run's prediction (`records.plan.LayoutPrediction`) is this, calibrated
    by earlier measurements."""

    layout: Layout
    in_spec: bool
    devices: int
    rate_per_replica: float
    rate_per_server: float
    rate_per_device: float
    p90_ttft_ms: float | None
    p90_tpot_ms: float | None
    binding_slo: str  # which limit the rate stops at: p90 TTFT or p90 TPOT
    bound: str  # what the replica spends its time on at that rate, or the scheduler limit it hits
    time_shares: dict[str, float]
    mean_step_ms: float | None
    tokens_per_step: float | None
    fixed_step_ms: float  # a step with no tokens: overhead, weight reads, all-reduce latency
    engine_notes: list[str]
    simulations: int
    expert_imbalance: float | None = Field(
        None, description="busiest expert rank's routed tokens / the mean, at the mean step of that rate"
    )
    rate_low: float | None = Field(None, description="req/s per server at the pessimistic end of the interval")
    rate_high: float | None = Field(None, description="req/s per server at the optimistic end of the interval")


class Plan(BaseModel):
    spec: str
    hardware: str
    input_len: int
    output_len: int
    max_p90_ttft_ms: float
    max_p90_tpot_ms: float
    coefficients: str = Field(description="where the step-time figures come from: the datasheet or a profiling run")
    predictions: list[Estimate]  # best first
    interval: str = Field("", description="where the intervals come from: the assumed figures' ranges or the fit")
    figures: list[uncertainty.Figure] = Field(default_factory=list, description="the ranged figures")
    margins: list[uncertainty.Margin] = Field(
        default_factory=list, description="the best of the spec's layouts against each other, with what it turns on"
    )


def predict(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    input_len: int,
    output_len: int,
    in_spec: bool = False,
    start: float | None = None,
    resolution: float = 0.01,
    factor: float = 2.0,
) -> Estimate:
    """`start`: a per-server rate to start the search from (a nearby prediction's), bracketed by `factor`,
    to save simulations; `resolution`: the search's relative step (an interval's ends need less)."""
    if layout.pp > 1 or (layout.dp > 1 and (layout.ep <= 1 or not spec.model.architecture.is_moe)):
        return Estimate(
            layout=layout, in_spec=in_spec, devices=layout.devices, rate_per_replica=0.0, rate_per_server=0.0,
            rate_per_device=0.0, p90_ttft_ms=None, p90_tpot_ms=None, binding_slo="-",
            bound=f"not modeled: the planner models tp x ep and tp x dp x ep replicas (pp={layout.pp}, dp={layout.dp})",
            time_shares={}, mean_step_ms=None, tokens_per_step=None, fixed_step_ms=0.0, engine_notes=[],
            simulations=0,
        )  # fmt: skip
    model = step_time.step_model(spec, layout, hw)
    limits = step_time.engine_limits(spec, layout, hw, model)
    if limits.infeasible:
        return Estimate(
            layout=layout, in_spec=in_spec, devices=layout.devices, rate_per_replica=0.0, rate_per_server=0.0,
            rate_per_device=0.0, p90_ttft_ms=None, p90_tpot_ms=None, binding_slo="-", bound=limits.infeasible,
            time_shares={}, mean_step_ms=None, tokens_per_step=None, fixed_step_ms=0.0, engine_notes=limits.notes,
            simulations=0,
        )  # fmt: skip
    slo = sim.Slo(p90_ttft_s=spec.slo.max_p90_ttft_ms / 1e3, p90_tpot_s=spec.slo.max_p90_tpot_ms / 1e3)
    hosted = host.share(hw, layout)
    dp = layout.dp  # dp > 1: the replica's dp ranks are simulated together, stepping in lockstep

    run = sim.workload(model, limits, slo, input_len, output_len, spec.workload.seed, hosted.slowdown, ranks=dp)
    search = (
        sim.max_slo_rate(run, slo, start=start / layout.replicas, resolution=resolution, factor=factor)
        if start
        else sim.max_slo_rate(run, slo, resolution=resolution)
    )
    shares: dict[str, float] = {}
    ttft = tpot = step_ms = per_step = None
    binding, bound = "-", "no rate meets the SLO"
    imbalance = None
    if math.isinf(hosted.slowdown(0.0)):  # the replicas' own host work fills its cores before any request
        bound = f"no rate: {hosted.describe(0.0)}"
    if search.rate > 0:
        at = run(search.rate, model.bounds)
        total = sum(at.seconds_by_bound.values()) or 1.0
        shares = {k: round(v / total, 3) for k, v in sorted(at.seconds_by_bound.items(), key=lambda kv: -kv[1])}
        ttft, tpot = at.p("ttft_s", 90) * 1e3, at.p("tpot_s", 90) * 1e3
        step_ms = round(at.busy_s / at.steps * 1e3, 2) if at.steps else None
        per_step = round(at.tokens / at.steps, 1) if at.steps else None  # every dp rank's together
        if per_step and spec.model.architecture.is_moe and layout.ep > 1:
            imbalance = round(model.expert_load(max(1, round(per_step / dp))).imbalance, 3)
        binding = "p90 TTFT" if ttft / spec.slo.max_p90_ttft_ms >= tpot / spec.slo.max_p90_tpot_ms else "p90 TPOT"
        if hosted.binds(search.rate):
            bound = hosted.describe(search.rate)
        elif at.blocked_by_seqs > 0.2:
            bound = f"batch limit (max-num-seqs {limits.max_num_seqs})"
        elif at.blocked_by_kv > 0.2:
            bound = f"KV capacity ({limits.kv_capacity_tokens} tokens)"
        else:
            bound = {"compute": "compute", "memory": "HBM", "link": "interconnect", "overhead": "step overhead"}[
                next(iter(shares))
            ]
    per_server = search.rate * layout.replicas
    return Estimate(
        layout=layout,
        in_spec=in_spec,
        devices=layout.devices,
        rate_per_replica=round(search.rate, 4),
        rate_per_server=round(per_server, 4),
        rate_per_device=round(per_server / layout.devices, 4),
        p90_ttft_ms=None if ttft is None else round(ttft, 1),
        p90_tpot_ms=None if tpot is None else round(tpot, 2),
        binding_slo=binding,
        bound=bound,
        time_shares=shares,
        mean_step_ms=step_ms,
        tokens_per_step=per_step,
        fixed_step_ms=round(model.seconds(step_time.Batch(tokens=1, pairs=1, context=0, sampled=1)) * 1e3, 2),
        engine_notes=limits.notes,
        simulations=search.runs + 1,
        expert_imbalance=imbalance,
    )


def coefficients(hw: HardwareProfile, profile: Profile | None) -> str:
    """Where a plan's step times come from, said on every output."""
    if profile:
        return f"fitted on the engine at hand ({profile.summary()})"
    return f"{hw.name}'s datasheet figures with its efficiency factors (no profiling run: `model-release profile`)"


def plan(
    loaded: LoadedSpec,
    input_len: int | None = None,
    output_len: int | None = None,
    every_layout: bool = True,
    profile: Profile | None = None,
    intervals: bool = True,
) -> Plan:
    """Predict the spec's layouts and (with `every_layout`) every other feasible one, best first, with
    the step-time coefficients a profiling run fitted when one is given."""
    spec, hw = loaded.spec, loaded.hardware
    if hw.performance is None:
        raise ReleaseError(
            f"{hardware_path(spec.hardware, loaded.path)}: performance: missing; the planner needs peak_tflops,"
            " memory_gb_s, link_gb_s and step_overhead_ms (see configs/hardware/mi325x-8.yaml)"
        )
    source = coefficients(hw, profile)
    hw = profile.hardware_at_hand(hw) if profile else hw
    input_len = input_len or spec.workload.input_len
    output_len = output_len or spec.workload.output_len
    own = {(layout.tp, layout.ep, layout.replicas, layout.dp, layout.pp) for layout in spec.layouts}
    layouts: list[tuple[Layout, bool]] = [(layout, True) for layout in spec.layouts]
    if every_layout:
        shapes = feasible_shapes(spec, hw) + data_parallel_shapes(spec, hw)
        layouts += [(c, False) for c in shapes if (c.tp, c.ep, c.replicas, c.dp, c.pp) not in own]
    predictions = []
    for i, (layout, in_spec) in enumerate(layouts, 1):
        prediction = predict(spec, hw, layout, input_len, output_len, in_spec)
        log.info(
            "plan: %d/%d %s: %.4g req/s per server (%s)",
            i,
            len(layouts),
            layout.name,
            prediction.rate_per_server,
            prediction.bound,
        )
        predictions.append(prediction)
    predictions.sort(key=lambda p: (-p.rate_per_server, p.devices))
    figures = uncertainty.figures(spec, hw) if profile is None else []
    margins: list[uncertainty.Margin] = []
    if intervals:
        near = {id(p) for p in predictions[:BRACKETED]} | {id(p) for p in predictions if p.in_spec}
        for prediction in (p for p in predictions if id(p) in near):
            uncertainty.bracket(prediction, spec, hw, input_len, output_len, figures, profile, predict)
        own_best = [p for p in predictions if p.in_spec and p.rate_per_server > 0]
        margins = [
            uncertainty.margin(own_best[0], other, spec, hw, input_len, output_len, figures, predict)
            if profile is None
            else uncertainty.margin_of_intervals(own_best[0], other)
            for other in own_best[1:]
        ]
    return Plan(
        spec=spec.name,
        hardware=hw.name,
        input_len=input_len,
        output_len=output_len,
        max_p90_ttft_ms=spec.slo.max_p90_ttft_ms,
        max_p90_tpot_ms=spec.slo.max_p90_tpot_ms,
        coefficients=source,
        predictions=predictions,
        interval=uncertainty.describe(figures, profile) if intervals else "",
        figures=figures,
        margins=margins,
    )


def data_parallel_shapes(spec: ReleaseSpec, hw: HardwareProfile) -> list[Layout]:
    """MoE only: data-parallel attention with expert parallelism over every rank (ep = tp x dp), as
    `--data-parallel-size dp --enable-expert-parallel`, in replicas that fill the node and validate."""
    arch = spec.model.architecture
    if not arch.is_moe:
        return []
    found = []
    tp = 1
    while tp < hw.devices:
        dp = 2
        while tp * dp <= hw.devices:
            replicas = hw.devices // (tp * dp)
            name = f"tp{tp}-dp{dp}-ep{tp * dp}" + (f"-x{replicas}" if replicas > 1 else "")
            layout = Layout(name=name, tp=tp, dp=dp, ep=tp * dp, replicas=replicas)
            trial = spec.model_copy(update={"layouts": [layout]})
            if not [q for q in feasibility_problems(trial, hw) if q[0].startswith("layouts")]:
                found.append(layout)
            dp *= 2
        tp *= 2
    return found


def margin(plan: Plan, better: str, worse: str) -> float | None:
    """How much more per server `better` is predicted to hold than `worse`, as a fraction."""
    rates = {p.layout.name: p.rate_per_server for p in plan.predictions}
    if not rates.get(worse) or better not in rates:
        return None
    return rates[better] / rates[worse] - 1


def table(plan: Plan, limit: int | None = None) -> str:
    rows = plan.predictions[:limit] if limit else plan.predictions
    lines = [
        f"{plan.spec} on {plan.hardware}: {plan.input_len} in / {plan.output_len} out, SLO p90 TTFT "
        f"{plan.max_p90_ttft_ms:g} ms and p90 TPOT {plan.max_p90_tpot_ms:g} ms",
        f"predicted, not measured; step times: {plan.coefficients}",
        f"{'#':>2}  {'layout':16} {'devices':>7} {'req/s/server':>12} {'interval':>13} {'req/s/device':>12} "
        f"{'p90 TTFT ms':>11} {'p90 TPOT ms':>11}  {'stops at':9} bound",
    ]
    for i, p in enumerate(rows, 1):
        name = p.layout.name + (" *" if p.in_spec else "")
        ttft = "-" if p.p90_ttft_ms is None else f"{p.p90_ttft_ms:.0f}"
        tpot = "-" if p.p90_tpot_ms is None else f"{p.p90_tpot_ms:.1f}"
        span = "-" if p.rate_low is None or p.rate_high is None else f"{p.rate_low:.3g}-{p.rate_high:.3g}"
        shares = ", ".join(f"{k} {v:.0%}" for k, v in p.time_shares.items())
        if p.expert_imbalance:
            shares += f"; busiest expert rank x{p.expert_imbalance:.2f} the mean"
        lines.append(
            f"{i:>2}  {name:16} {p.devices:>7} {p.rate_per_server:>12.4g} {span:>13} {p.rate_per_device:>12.4g} "
            f"{ttft:>11} {tpot:>11}  {p.binding_slo:9} {p.bound}" + (f" ({shares})" if shares else "")
        )
    if len(rows) < len(plan.predictions):
        lines.append(f"... {len(plan.predictions) - len(rows)} more (--all)")
    lines.append("* in the spec's layouts; time shares are of the replica's step time at that rate (link: all-reduces")
    lines.append(f"  and dp dispatch); intervals (req/s per server) from {plan.interval or 'nothing: not computed'}")
    lines.extend(undetermined(plan))
    return "\n".join(lines)


def undetermined(plan: Plan) -> list[str]:
    """Layouts the planner cannot rank against the best one: their intervals overlap it."""
    ranked = [p for p in plan.predictions if p.rate_per_server > 0 and p.rate_low is not None]
    if not ranked or ranked[0].rate_low == ranked[0].rate_high:
        return []
    best = ranked[0]
    tied = [p.layout.name for p in ranked[1:] if uncertainty.overlaps(best, p)]
    if not tied:
        return [f"{best.layout.name} is ranked first over every other bracketed layout: no interval overlaps its own"]
    return [
        f"ranking undetermined: {', '.join(tied)} overlap {best.layout.name}'s interval"
        f" ({best.rate_low:.3g}-{best.rate_high:.3g} req/s per server); top_k measures them too"
        f" (up to {uncertainty.OVERLAP_BOUND} more)"
    ]


def chart(plan: Plan, path: Path, limit: int = 12) -> Path:
    """Horizontal bars of predicted req/s per server, coloured by what bounds each layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.predictions[:limit][::-1]
    palette = {"compute": "#1f77b4", "HBM": "#2ca02c", "interconnect": "#d62728", "step overhead": "#9467bd"}
    colors = [palette.get(p.bound, "#7f7f7f") for p in rows]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.4))
    ax.barh(
        [p.layout.name + (" *" if p.in_spec else "") for p in rows], [p.rate_per_server for p in rows], color=colors
    )
    for i, p in enumerate(rows):
        ax.annotate(f" {p.rate_per_server:.3g} ({p.bound})", (p.rate_per_server, i), va="center", fontsize=8)
    ax.set_xlabel("predicted max req/s per server within the SLO")
    ax.set_title(f"{plan.spec}: {plan.input_len} in / {plan.output_len} out on {plan.hardware} (predicted)", fontsize=9)
    ax.margins(x=0.35)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return atomic_write(path, png.getvalue())


def comparisons(plan: Plan) -> list[str]:
    """The best of the spec's layouts against each other one: the margin, and the part of a step whose
    milliseconds differ most between them at their max rates (why one holds more than the other)."""
    own = [p for p in plan.predictions if p.in_spec]
    if len(own) < 2 or not own[0].rate_per_server:
        return []
    best, lines = own[0], []
    for other in own[1:]:
        if not other.rate_per_server:
            lines.append(f"{best.layout.name} meets the SLO; {other.layout.name} meets it at no rate")
            continue
        gain = best.rate_per_server / other.rate_per_server - 1
        stops = (
            f"both stop at {best.binding_slo}"
            if best.binding_slo == other.binding_slo
            else f"{best.layout.name} stops at {best.binding_slo}, {other.layout.name} at {other.binding_slo}"
        )
        line = (
            f"{best.layout.name} is predicted to hold {gain:+.0%} req/s per server over {other.layout.name}"
            f" ({best.rate_per_server:.4g} vs {other.rate_per_server:.4g}; {stops})"
        )
        if best.mean_step_ms and other.mean_step_ms and best.tokens_per_step and other.tokens_per_step:
            line += (
                f". Why: a one-token step costs {other.fixed_step_ms:.1f} ms on {other.layout.name} and"
                f" {best.fixed_step_ms:.1f} ms on {best.layout.name} (overhead, weight reads, all-reduce latency);"
                f" at those rates their steps take {other.mean_step_ms:.1f} and {best.mean_step_ms:.1f} ms carrying"
                f" {other.tokens_per_step:.0f} and {best.tokens_per_step:.0f} tokens, i.e."
                f" {_us_per_token(other):.1f} and {_us_per_token(best):.1f} us of a server per token"
            )
        lines.append(line)
    return lines + [m.describe() for m in plan.margins]


def _us_per_token(p: Estimate) -> float:
    """Server time per token: a step's time over the tokens all replicas of a server carry in it."""
    assert p.mean_step_ms and p.tokens_per_step
    return p.mean_step_ms * 1e3 / (p.tokens_per_step * p.layout.replicas)
