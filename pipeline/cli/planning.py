"""Planning without a benchmark: capacity and cost, the planner's prediction and its profiling run,
a rollout's steps on paper."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import emit, need_dir, positive_float, positive_int
from pipeline.core.errors import ReleaseError


def _given_rates(values: list[str], layouts: list[str], default: str | None) -> dict[str, float]:
    """`R` (for --layout or the spec's first layout) or `LAYOUT=R`, each a positive req/s per server."""
    rates: dict[str, float] = {}
    for value in values:
        name, _, number = value.rpartition("=")
        name = name or default or layouts[0]
        if name not in layouts:
            raise ReleaseError(
                f"--rate-per-server {value}: no layout {name!r} in the spec (known: {', '.join(layouts)})"
            )
        try:
            rate = float(number)
        except ValueError:
            raise ReleaseError(f"--rate-per-server {value}: expected R or LAYOUT=R with R in req/s") from None
        if not rate > 0:
            raise ReleaseError(f"--rate-per-server {value}: must be a positive req/s")
        rates[name] = rate
    return rates


def _capacity(args: argparse.Namespace) -> int:
    """Fleet and cost for planning, from a given rate or the newest measured one; no benchmark runs."""
    from pipeline.core.specs import load_spec
    from pipeline.release import registry
    from pipeline.stages import capacity

    loaded = load_spec(args.spec)
    spec = loaded.spec
    if spec.capacity is None:
        raise ReleaseError(f"{loaded.path}: capacity: missing; give peak_rps and mean_rps (see configs/releases/)")
    reg = registry.Registry()
    live = reg.live(spec.name, spec.promotion.target)
    versus = capacity.versus_live(live.id, live.data.chosen, live.data.capacity, loaded.hardware) if live else None
    if args.rate_per_server:
        rates = _given_rates(args.rate_per_server, [layout.name for layout in spec.layouts], args.layout)
        best = max(rates, key=lambda name: rates[name])  # what the SLO selection would choose
        loads = dict.fromkeys(rates, args.load_seconds) if args.load_seconds else None
        plan = capacity.plan(loaded, rates, best, versus, source="given", load_seconds=loads, load_source="given")
        given = ", ".join(f"{name} {rate:g}" for name, rate in rates.items())
        origin = f"rates per server given on the command line ({given} req/s); candidate: {best}"
    else:
        measured = next((r for r in reg.releases(name=spec.name) if capacity.recorded_rate(r.data.chosen)), None)
        if measured is None:
            raise ReleaseError(
                f"{spec.name}: no release in {reg.safe_url} has a measured rate per server; give --rate-per-server R"
            )
        layout = measured.data.layout or "?"
        rate = capacity.recorded_rate(measured.data.chosen) or 0.0
        same = live is not None and measured.id == live.id
        recorded_load = measured.data.slowest_load()
        load = args.load_seconds or recorded_load
        plan = capacity.plan(
            loaded,
            {layout: rate},
            layout,
            None if same else versus,
            source="recorded",
            load_seconds={layout: load} if load else None,
            load_source="given" if args.load_seconds else f"measured by release {measured.id}",
        )
        origin = f"rate per server {rate:.4g} req/s measured by release {measured.id} ({measured.status}, {layout})"
    assert plan is not None  # the spec has capacity:
    emit(f"{spec.name}: {origin}")
    emit(capacity.table(plan))
    if args.json:
        emit(plan.model_dump_json(indent=2))
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Predict every feasible layout's max SLO rate from the step-time model (fitted by the newest
    profiling run of this hardware and engine image, else the datasheet's); no engine starts."""
    from pipeline.core.paths import home
    from pipeline.core.specs import load_spec
    from pipeline.planner import plan as planner
    from pipeline.release.registry import cached

    loaded = load_spec(args.spec)
    fitted = None if args.datasheet else cached().profile(loaded.hardware.name, loaded.spec.serving.engine_image)
    result = planner.plan(loaded, args.input_len, args.output_len, profile=fitted)
    emit(planner.table(result, limit=None if args.all else 8))
    for line in planner.comparisons(result):
        emit(line)
    if not args.datasheet:  # the spec's layouts as the release DAG's plan would predict them
        from pipeline.entry import flow

        for line in flow.calibrated_plan(loaded, result, fitted):
            emit(line)
    png = Path(args.png) if args.png else home() / "plans" / f"{result.spec}-{result.input_len}-{result.output_len}.png"
    emit(f"chart: {planner.chart(result, png)}")
    if args.json:
        emit(result.model_dump_json(indent=2))
    return 0


def _profile(args: argparse.Namespace) -> int:
    """Fit the planner's step-time coefficients on this machine's engine; kept in the registry."""
    from pipeline.entry import flow
    from pipeline.planner import profile as profiling

    need_dir(args.model, "--model")
    profiled = flow.profile_engine(args.spec, args.layout, args.model, save=not args.no_save)
    emit(profiling.table(profiled))
    emit(profiled.summary() + ("" if args.no_save else " (kept in the registry: `model-release plan` uses it)"))
    if args.json:
        emit(profiled.model_dump_json(indent=2))
    return 0


def _rollout_plan(args: argparse.Namespace) -> int:
    """What a rollout would run at each step, from the registry or given rates; changes nothing."""
    from pipeline.core.specs import load_spec
    from pipeline.release import registry, rollout_plan

    loaded = load_spec(args.spec)
    spec = loaded.spec
    if args.release is not None:
        reg = registry.Registry()
        live = reg.live(spec.name, spec.promotion.target)
        plan = rollout_plan.for_release(loaded, reg.get(args.release), live, args.live_servers)
    else:
        if args.rate_per_server is None:
            raise ReleaseError("give --release ID (a release in the registry) or --rate-per-server R")
        layout = args.layout or spec.layouts[0].name
        loaded.layout(layout)  # an unknown name fails here, naming the spec's layouts
        new = rollout_plan.Side(layout=layout, rate_per_server=args.rate_per_server, load_seconds=args.load_seconds)
        old = (
            rollout_plan.Side(
                layout=args.live_layout, rate_per_server=args.live_rate_per_server, load_seconds=args.live_load_seconds
            )
            if args.live_rate_per_server
            else None
        )
        plan = rollout_plan.plan(loaded, new, old, args.live_servers)
    emit(rollout_plan.table(plan))
    if args.json:
        emit(plan.model_dump_json(indent=2))
    return 0 if plan.feasible else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "capacity", help="servers the spec's peak needs and $/M tokens, from a given or recorded rate (no benchmark)"
    )
    p.add_argument("spec", help="release spec YAML with a capacity: section")
    p.add_argument(
        "--rate-per-server",
        action="append",
        metavar="[LAYOUT=]R",
        help="max SLO req/s per server of a layout; repeat to compare layouts (default: the newest measured rate)",
    )
    p.add_argument("--layout", help="the layout a bare R is for (default: the spec's first)")
    p.add_argument(
        "--load-seconds",
        type=positive_float,
        help="a replica's load time, engine start to healthy: the scale-up lead time (default: the measured one)",
    )
    p.add_argument("--json", action="store_true", help="also print the plan as JSON")
    p.set_defaults(func=_capacity)

    p = sub.add_parser(
        "plan", help="predict each feasible layout's max SLO rate per server (step-time model + scheduler simulation)"
    )
    p.add_argument("spec")
    p.add_argument("--input-len", type=positive_int, help="prompt tokens (default: the spec's workload)")
    p.add_argument("--output-len", type=positive_int, help="output tokens (default: the spec's workload)")
    p.add_argument("--all", action="store_true", help="print every feasible layout, not the best 8")
    p.add_argument("--datasheet", action="store_true", help="the hardware profile's own figures, not a profiling run's")
    p.add_argument("--png", help="where to write the chart (default: $MODEL_RELEASE_HOME/plans/SPEC-IN-OUT.png)")
    p.add_argument("--json", action="store_true", help="also print the plan as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser(
        "profile",
        help="fit the planner's step-time coefficients on this machine's engine: a few fixed batch shapes"
        " through vLLM's client (about a minute and a half on cpu-local, engine start included)",
    )
    p.add_argument("spec")
    p.add_argument("--layout", help="a layout of one replica (default: the spec's first)")
    p.add_argument("--model", help="model directory the engine loads (default: the spec's model source)")
    p.add_argument("--no-save", action="store_true", help="print the fit, keep nothing in the registry")
    p.add_argument("--json", action="store_true", help="also print the profile as JSON")
    p.set_defaults(func=_profile)

    p = sub.add_parser(
        "rollout-plan", help="a progressive rollout's steps: servers old/new, capacity vs peak, expected duration"
    )
    p.add_argument("spec")
    p.add_argument("--release", type=int, help="the release to roll out (registry); else give its rate")
    p.add_argument("--rate-per-server", type=positive_float, help="the new release's max SLO req/s per server")
    p.add_argument("--layout", help="the new release's layout (default: the spec's first)")
    p.add_argument("--load-seconds", type=positive_float, help="its replicas' load time, process start to healthy")
    p.add_argument("--live-rate-per-server", type=positive_float, help="the live release's rate (none: nothing live)")
    p.add_argument("--live-layout", help="the live release's layout")
    p.add_argument(
        "--live-load-seconds", type=positive_float, help="the live release's load time: what an abort reloads"
    )
    p.add_argument(
        "--live-servers",
        type=positive_int,
        help="servers the live fleet runs now (KEDA may have grown it): the new fleet gets at least as many",
    )
    p.add_argument("--json", action="store_true", help="also print the plan as JSON")
    p.set_defaults(func=_rollout_plan)
