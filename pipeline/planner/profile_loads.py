"""The loads a profile runs on a real engine (`profile.run`): each shape by vLLM's client, steady
loads of the workload with their host CPU, the host work moved onto the engine's cores, the host
check at the simulated max and the refit on it.

Why apart from the fit: these need an engine and a client, and each one's figure is read under the
placement the layout runs with (`serving.Placement`); the arithmetic is `profile_model`'s."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import (
    HardwareProfile,
    Layout,
    ReleaseSpec,
    WorkloadSpec,
)
from pipeline.planner import step_time
from pipeline.planner.profile_model import (
    COLOCATED_PAIRS,
    PREFILL_REQUESTS,
    UNJUDGED,
    Coefficients,
    Colocated,
    HostCheck,
    Measured,
    Shape,
    Steady,
    at_hand,
    colocated_cost,
    expected_ms,
    max_rate,
    split_request_overhead,
)
from pipeline.records.benchmark import Probe
from pipeline.stages import benchmark, interference, serving

log = logging.getLogger(__name__)


WARM_UP_SEED = 9  # the shapes use 0, the steady loads 1 and 3, the host check 2: no run repeats another's prompts


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


STEADY_SECONDS = 8


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
