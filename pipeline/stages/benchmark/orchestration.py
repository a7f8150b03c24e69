"""One layout, for real: its engines started and isolated, a `Prober` (vLLM's client with the CPU
accounting and the engine's histograms around it), the search against it, the served-answers check."""

from __future__ import annotations

import itertools
import logging
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pipeline.core.errors import EngineStopped, ReleaseError
from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec
from pipeline.records.benchmark import LayoutResult, LoadSplit, Probe, SearchOutcome
from pipeline.records.evaluate import EvalResult
from pipeline.records.plan import LayoutPrediction
from pipeline.stages import engine_metrics, interference, served_accuracy, serving
from pipeline.stages.benchmark.client import BenchClient, bench_client, bench_command, parse_result
from pipeline.stages.benchmark.confirm import confirm
from pipeline.stages.benchmark.search import RunProbe, slo_search
from pipeline.stages.benchmark.selection import finish

log = logging.getLogger(__name__)


class Prober:
    """One probe against a running layout: vLLM's client at a rate, with the CPU accounting and
    the engine's histograms around it. What the search calls, and what a fixed-rate check calls."""

    def __init__(self, spec: ReleaseSpec, engine: Any, model_dir: Path, out_dir: Path, bench: BenchClient):
        self.spec, self.engine, self.model_dir, self.out_dir = spec, engine, model_dir, out_dir
        self.bench = bench
        self.client = bench.base
        self.numbers = itertools.count(1)
        self.done: list[Probe] = []  # every probe, kept when the engine dies mid-search

    def __call__(self, rate: float, n: int, seed: int, client_args: Sequence[str] = ()) -> Probe:
        """client_args: extra flags for vLLM's client (a benchmark's --max-concurrency, say)."""
        if not self.engine.alive():
            raise self.engine.exit_error("during the benchmark")
        name = f"probe-{next(self.numbers):02d}.json"
        cmd = bench_command(
            self.client,
            self.engine.url,
            str(self.model_dir),
            self.spec.workload,
            self.spec.slo,
            rate,
            n,
            seed,
            self.out_dir,
            name,
        ) + list(client_args)
        before = engine_metrics.merge([engine_metrics.scrape(u) for u in self.engine.replica_urls])
        self.bench.ensure()  # its one-time start-up (the vLLM import) stays outside the probe's window
        window = interference.Window(engine_groups=set(self.engine.groups), client_group=self.bench.group)
        path, client_s = self.bench.serve(cmd[len(self.client) :], self.out_dir, name)
        seen = window.close(client_s)
        after = engine_metrics.merge([engine_metrics.scrape(u) for u in self.engine.replica_urls])
        probe = parse_result(path, rate, n, self.spec.slo, self.spec.workload)
        probe.client_cpu_ms_per_request = round(client_s * 1000 / max(n, 1), 3)
        probe.interference = seen
        probe.engine = engine_metrics.view(before, after)
        self.done.append(probe)
        return probe


@contextmanager
def running_layout(
    spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, model_dir: Path, out_dir: Path, base_port: int | None = None
) -> Iterator[tuple[Any, Prober]]:
    """The layout's engines, started and healthy, with every other process kept off their cores
    for as long as they are measured; always torn down. Yields (engine, prober)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = base_port or serving.free_port()
    commands = serving.build_commands(spec, hw, layout, str(model_dir), port)
    if hw.kind == "cpu":
        # pick free ports for every replica
        for cmd in commands:
            new = serving.free_port()
            cmd.argv[cmd.argv.index("--port") + 1] = str(new)
            cmd.port = new
    plan = serving.placement(hw, layout)
    engine = serving.LocalEngine(commands, out_dir / "logs", placement=plan)
    bench = bench_client(hw, commands[0].env, plan.frontend_cores)
    # the client's vLLM import runs while the engines load, on the engine cores: they stay idle
    # until each replica is up (it loads on the frontend cores), so neither waits for the other
    bench.launch(sorted(set(plan.all_engine_cores) - set(plan.frontend_cores)))
    try:
        with engine, serving.isolated(engine.groups, plan.other_cores):  # nothing else on the compute cores
            log.info("placement: %s", "; ".join(f"{k}: {v}" for k, v in plan.describe().items()))
            yield engine, Prober(spec, engine, model_dir, out_dir, bench)
    finally:
        bench.close()


def benchmark_layout(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model_dir: Path,
    out_dir: Path,
    base_port: int | None = None,
    max_probes: int = 16,
    prior: float | None = None,
    prediction: LayoutPrediction | None = None,
    accuracy: tuple[EvalResult, EvalResult] | None = None,
    answers_without_slo: bool = False,
) -> LayoutResult:
    """Start the layout's engines, run the search against their one endpoint and confirm its answer
    with a long run (`confirm`) on a fresh instance of the layout (the search's stopped first, unless
    `workload.confirm_on_fresh_engine` is off), always tear down.

    Each probe records who else used the CPU meanwhile and the engine's own histograms.
    `prior`: where the search starts (a re-benchmark's promoted rate, whose first probe is then
    the check at that rate). `prediction`: the planner's for this layout, kept beside the
    measurement; the search starts from its rate when no other prior is given. `accuracy`: the gate's
    (baseline, candidate) in-process results; with them, a layout that holds the SLO is then
    scored by lm-eval at its endpoint (`served_accuracy`) and fails when it answers worse;
    `answers_without_slo`: scored also when it holds the SLO at no rate (a re-benchmark's verdict
    names both faults; a release's layout without a rate has failed already, the check would be time lost).
    """
    started = time.monotonic()
    result = LayoutResult(
        layout=layout.name,
        tp=layout.tp,
        dp=layout.dp,
        ep=layout.ep,
        pp=layout.pp,
        replicas=layout.replicas,
        devices=layout.devices,
        status="ok",
        placement=serving.placement(hw, layout).describe(),
        prediction=prediction,
    )
    prior = prior or result.predicted_rate
    prober: Prober | None = None
    outcome: SearchOutcome | None = None
    workload, slo = spec.workload, spec.slo
    try:
        with running_layout(spec, hw, layout, model_dir, out_dir, base_port) as (engine, prober):
            result.load_seconds = engine.load_seconds
            result.load_splits = [LoadSplit.model_validate(split) for split in engine.load_splits()]
            result.weights_source = "local path"
            outcome = slo_search(prober, workload, slo, max_probes, prior=prior)
            answered = time.monotonic()
            fresh = workload.confirm_on_fresh_engine and outcome.max_slo_rate is not None
            if not fresh:
                outcome = confirmed(result, prober, outcome, spec, "searched", answered)
                check_answers(result, engine, model_dir, spec, out_dir, accuracy, answers_without_slo)
        if fresh:
            # the search's engine is stopped: its successor starts on the same cores, as a fleet's next
            # instance would, and the answer must hold there too
            log.info(
                "layout %s: confirming %.3g req/s on a fresh engine (the search's is stopped)",
                layout.name,
                outcome.max_slo_rate,
            )
            with running_layout(spec, hw, layout, model_dir, out_dir / "fresh-engine", base_port) as (again, run):
                outcome = confirmed(result, run, outcome, spec, "fresh", answered)
                check_answers(result, again, model_dir, spec, out_dir, accuracy, answers_without_slo)
    except (ReleaseError, subprocess.TimeoutExpired) as exc:
        if outcome is not None and not result.probes:
            # the search finished (its engine may have been stopped already, a fresh one failed to start):
            # its figures stay in the record, its answer only as the search's, since nothing confirmed it
            copy_outcome(result, outcome)
            result.searched_rate, result.max_slo_rate = outcome.max_slo_rate, None
        result.probes = result.probes or (outcome.probes if outcome else prober.done if prober else [])
        result.status = "cancelled" if isinstance(exc, EngineStopped) else "failed"
        result.error = str(exc)
        log.error("layout %s failed: %s", layout.name, exc)
    result.seconds = round(time.monotonic() - started, 1)
    finish(result, hw)
    if result.bound_only and result.status == "ok":
        log.warning("layout %s: %s", layout.name, result.stop_reason)
    return result


def confirmed(
    result: LayoutResult,
    run: RunProbe,
    searched: SearchOutcome,
    spec: ReleaseSpec,
    engine: Literal["searched", "fresh"],
    answered: float,
) -> SearchOutcome:
    """Confirm the search's answer (`confirm`) with `run`, a probe of the `engine` instance named, and
    copy the outcome into `result`; the wall time from the search's answer to the verdict is kept in
    `result.confirm_wall_s` (from `answered`, the search's end by the monotonic clock: a fresh engine's
    start included, what the confirmation adds to the release)."""
    where = " on a fresh engine" if engine == "fresh" else ""
    outcome = confirm(run, searched, spec.workload, spec.slo, where, cold=engine == "fresh")
    if outcome.confirmed is not None:
        result.confirm_engine, result.confirm_wall_s = engine, round(time.monotonic() - answered, 1)
    copy_outcome(result, outcome)
    return outcome


def copy_outcome(result: LayoutResult, outcome: SearchOutcome) -> None:
    """The search's (and its confirmation's) figures into the layout's record."""
    result.probes = outcome.probes
    result.capacity_rps, result.max_slo_rate = outcome.capacity, outcome.max_slo_rate
    result.bound_only, result.extrapolated, result.stop_reason, result.burst_rps = (
        outcome.bound_only,
        outcome.extrapolated,
        outcome.stop_reason,
        outcome.burst_rps,
    )
    result.deciding_p90_ttft_ms, result.spread = outcome.deciding_p90_ttft_ms, outcome.spread
    result.unsteady, result.client_bound = outcome.unsteady, outcome.client_bound
    result.client_bound_rates = outcome.client_bound_rates
    result.unclean_rates = outcome.unclean_rates
    result.confirm_seconds, result.confirmed = outcome.confirm_seconds, outcome.confirmed
    result.step_downs, result.searched_rate = outcome.step_downs, outcome.searched_rate


def check_answers(
    result: LayoutResult,
    engine: Any,
    model_dir: Path,
    spec: ReleaseSpec,
    out_dir: Path,
    accuracy: tuple[EvalResult, EvalResult] | None,
    answers_without_slo: bool,
) -> None:
    """lm-eval at the engine's endpoint (`served_accuracy`) when the layout holds the SLO (or
    `answers_without_slo`); a layout that answers worse than the in-process candidate fails."""
    if not (accuracy and spec.evaluation.served.enabled and (result.max_slo_rate is not None or answers_without_slo)):
        return
    checked = served_accuracy.check(
        engine.url, model_dir, serving.SERVED_NAME, *accuracy, spec.evaluation, out_dir / "served-accuracy"
    )
    result.served_accuracy = checked
    log.info(
        "layout %s: serving-path accuracy %s in %.0f s: %s",
        result.layout,
        "passed" if checked.passed else "FAILED",
        checked.seconds,
        checked.summary(),
    )
    if not checked.passed:
        result.status = "failed"
        result.error = "serving-path accuracy: " + "; ".join(checked.failures)
