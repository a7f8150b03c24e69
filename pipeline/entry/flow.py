"""What each DAG task calls: records in, a record out (`records.edge.call` turns them into the
JSON that XCom carries, and back).

Kept free of Airflow imports so the same calls run from the CLI, a pod or a test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.core import storage
from pipeline.core.errors import GateFailed, ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.paths import PROJECT_ROOT, home, run_dir
from pipeline.core.specs import HardwareProfile, Layout, LoadedSpec, ReleaseSpec, load_spec, local_source
from pipeline.planner import calibration, uncertainty
from pipeline.planner import plan as planner
from pipeline.planner import profile as profiling
from pipeline.planner.profile import Profile
from pipeline.records.benchmark import LayoutResult
from pipeline.records.cluster import ClusterReady
from pipeline.records.evaluate import EvalResult, EvaluationPair, GateDecision
from pipeline.records.events import AccuracyGate, LayoutsChosen, Predicted, ReportWritten, SloGate, Staged
from pipeline.records.plan import LayoutPrediction, MeasuredLayouts, PredictionCheck, Predictions
from pipeline.records.quantize import QuantizedArtifact
from pipeline.records.rebenchmark import Verdict
from pipeline.records.release import (
    ModelRef,
    Overrides,
    PromotionOutcome,
    ReleaseRef,
    ReportPage,
    ValidatedRelease,
    Verification,
)
from pipeline.records.rollout import StepReview
from pipeline.records.selection import ChosenFigures, LayoutSelection
from pipeline.records.served_accuracy import ServedSummary
from pipeline.records.sources import ModelSource
from pipeline.release import promote as promotion
from pipeline.release import rebenchmark as rebench
from pipeline.release import report as report_page
from pipeline.release import rollout_plan, step_review
from pipeline.release.promote import release_spec
from pipeline.release.registry import Registry, ReleaseData, cached, inputs_of
from pipeline.stages import benchmark, capacity, serving, sources
from pipeline.stages import evaluate as evaluate_stage
from pipeline.stages import quantize as quantize_stage

log = logging.getLogger(__name__)


def resolve_spec_path(path: str) -> Path:
    """Relative spec paths are relative to the project, so DAG params read the same everywhere."""
    candidate = Path(path)
    return candidate if candidate.is_absolute() else PROJECT_ROOT / candidate


def registry() -> Registry:
    return cached()


def validate_spec(path: str, run_key: str | None = None, overrides: Overrides | None = None) -> ValidatedRelease:
    """Check the spec; with `run_key`, open this run's release in the registry (status candidate).

    `overrides` (DAG params: layouts to try, SLO limits) are applied to a copy of the spec
    written into the run's directory, so every later task and the registry see the same spec.
    """
    spec_path = resolve_spec_path(path)
    if overrides and overrides.any() and run_key:
        spec_path = apply_overrides(spec_path, overrides, run_dir(run_key))
    loaded = load_spec(spec_path)
    spec = loaded.spec
    log.info(
        "spec %s valid: %s, layouts %s, hardware %s",
        loaded.path,
        spec.name,
        [layout.name for layout in spec.layouts],
        loaded.hardware.name,
    )
    out = ValidatedRelease(spec_path=str(loaded.path), name=spec.name, layouts=[lay.name for lay in spec.layouts])
    if run_key:
        rel = registry().open_release(
            run_key,
            spec.name,
            str(loaded.path),
            loaded.path.read_text(),
            spec.promotion.target,
            inputs_of(loaded),
        )
        out.release_id = rel.id
        log.info("release %d opened in the registry (%s)", rel.id, registry().safe_url)
    return out


def apply_overrides(spec_path: Path, overrides: Overrides, out_dir: Path) -> Path:
    """A copy of the spec with the trigger form's overrides; validated like any spec."""
    import yaml

    data = yaml.safe_load(spec_path.read_text())
    if layouts := overrides.layouts:
        known = {layout["name"]: layout for layout in data["layouts"]}
        if data.get("candidates"):  # generated layouts are named too: the loaded spec knows them
            generated = load_spec(spec_path).spec.layouts
            known.update(
                {lay.name: lay.model_dump(exclude_defaults=True) for lay in generated if lay.name not in known}
            )
        unknown = [name for name in layouts if name not in known]
        if unknown:
            raise ReleaseError(f"param layouts: {unknown} not in {spec_path} (known: {', '.join(known)})")
        data["layouts"] = [known[name] for name in layouts]
        data.pop("candidates", None)  # the layouts named are the ones measured: none generated, none skipped
    for key in ("max_p90_ttft_ms", "max_p90_tpot_ms"):
        if (limit := getattr(overrides, key)) is not None:
            data["slo"][key] = float(limit)
    # the copy lives in the run's directory: a relative local model source stays the original's
    source = (data.get("model") or {}).get("source")
    local = local_source(source, spec_path.parent) if isinstance(source, str) and source else None
    if local is not None:
        data["model"]["source"] = str(local.resolve())
    out = out_dir / "spec.yaml"
    note = overrides.model_dump_json(exclude_defaults=True)
    atomic_write(out, f"# {spec_path} with trigger overrides {note}\n" + yaml.safe_dump(data, sort_keys=False))
    return out


def materialize_model(release: ValidatedRelease) -> ModelSource:
    loaded = load_spec(release.spec_path)
    return sources.materialize(loaded.spec, loaded.path.parent)


def quantize(release: ValidatedRelease, source: ModelSource) -> QuantizedArtifact:
    loaded = load_spec(release.spec_path)
    return quantize_stage.quantize(loaded.spec, source).artifact()


def stage(release: ValidatedRelease, quantized: QuantizedArtifact | None = None) -> storage.StagedArtifact:
    """Stage the FP8 artifact; without `quantized`, quantize first (a finished output is reused)."""
    if quantized is None:
        quantized = quantize(release, materialize_model(release))
    return stage_artifact(release.spec_path, quantized.path, release.release_id)


def stage_artifact(spec_path: str, artifact_dir: str, release_id: int | None = None) -> storage.StagedArtifact:
    """Stage a published artifact directory by its manifest (`model-release stage --artifact`): a
    missing manifest, a missing, truncated or changed file is refused, naming it, before any
    manifest is committed anywhere."""
    loaded = load_spec(spec_path)
    artifact = Path(artifact_dir)
    staged = storage.stage(artifact, loaded.spec.staging, name=artifact.name)
    if release_id is not None:
        _record_staged(release_id, staged, str(artifact))
    return staged


def record_staged(release: ValidatedRelease, staged: storage.StagedArtifact) -> storage.StagedArtifact:
    """The Kubernetes DAG's record of what its stage pod staged (the local `stage` records its own)."""
    if release.release_id is not None:
        _record_staged(release.release_id, staged, None)
    return staged


def _record_staged(release_id: int, staged: storage.StagedArtifact, quantized_path: str | None) -> None:
    """Where the release's weights are, by manifest hash: what promotion re-verifies and deploys."""
    registry().record(
        release_id,
        Staged(**staged.model_dump(include={"s3_uri", "nfs_path", "manifest_hash", "bytes_sent"})),
        "pipeline",
        data=ReleaseData(
            s3_uri=staged.s3_uri,
            nfs_path=staged.nfs_path,
            manifest_hash=staged.manifest_hash,
            quantized_path=quantized_path,
        ),
    )


def evaluate(release: ValidatedRelease, model: ModelRef, *, baseline: bool) -> EvalResult:
    """lm-eval on one side, cached by (manifest hash, tasks, settings): a re-run or a second release of
    the same bytes (the quantize step reuses a finished output) is not measured again."""
    loaded = load_spec(release.spec_path)
    side = "baseline" if baseline else "candidate"
    result = evaluate_stage.evaluate(Path(model.path), model.manifest_hash, loaded.spec.evaluation, use_cache=True)
    log.info("evaluate %s: %s", side, "cached result (same bytes, tasks, settings)" if result.cached else "measured")
    return result


def accuracy_gate(release: ValidatedRelease, baseline: EvalResult, candidate: EvalResult, run_id: str) -> GateDecision:
    loaded = load_spec(release.spec_path)
    decision = evaluate_stage.gate(baseline, candidate, loaded.spec.evaluation, run_dir(run_id))
    log.info(
        "accuracy gate %s (GX validation: %s)\n%s",
        "PASSED" if decision.passed else "FAILED",
        decision.validation_html,
        decision.table(),
    )
    if release.release_id is not None:
        registry().record(
            release.release_id,
            AccuracyGate(passed=decision.passed, failures=decision.failures),
            "gate",
            status="candidate" if decision.passed else "gate_failed",
            only_from=("candidate", "gate_failed"),
            data=ReleaseData(
                accuracy=decision,
                evaluation=EvaluationPair(baseline=baseline, candidate=candidate),
                source_hash=baseline.model_manifest_hash,
                source_path=baseline.model_path,
                quantized_path=candidate.model_path,
            ),
        )
    if not decision.passed:
        raise GateFailed("accuracy gate failed:\n" + "\n".join(decision.failures) + "\n" + decision.table())
    return decision


def profile_engine(
    spec_path: str, layout: str | None = None, model_dir: str | None = None, save: bool = True
) -> Profile:
    """A profiling run on this machine's engine (`layout`, default the spec's first single-replica one)
    serving `model_dir` (default: the spec's model source), kept in the registry for the planner."""
    loaded = load_spec(spec_path)
    spec = loaded.spec
    if layout:
        chosen = loaded.layout(layout)
    else:
        single = [candidate for candidate in spec.layouts if profiling.profilable(candidate)]
        if not single:
            raise ReleaseError(f"{loaded.path}: no layout of one replica to profile; name one with --layout")
        chosen = single[0]
    model = Path(model_dir) if model_dir else Path(sources.materialize(spec, loaded.path.parent).path)
    out = home() / "profiles" / f"{loaded.hardware.name}-{datetime.now(UTC):%Y%m%dT%H%M%S}"
    profiled = profiling.run(spec, loaded.hardware, chosen, model, out)
    profiling.write(profiled, out / "profile.json")
    return registry().keep_profile(profiled) if save else profiled


def rate_on(spec: ReleaseSpec, layout: Layout, own: float) -> Callable[[HardwareProfile], float]:
    """The planner again for one layout on other figures (the overheads x a multiplier): req/s at its
    endpoint, searched from `own`."""

    def rate(hw: HardwareProfile) -> float:
        at = planner.predict(
            spec, hw, layout, spec.workload.input_len, spec.workload.output_len, True, start=own
        )  # fmt: skip
        return at.rate_per_replica * layout.replicas

    return rate


def calibrated_plan(loaded: LoadedSpec, found: planner.Plan, fitted: Profile | None) -> list[str]:
    """What the release DAG's plan would predict for the spec's layouts, calibrated on what earlier
    releases measured (the registry), one line each: `model-release plan` prints it under its table."""
    measured = registry().measured_predictions()
    spec = loaded.spec
    hw = fitted.hardware_at_hand(loaded.hardware) if fitted else loaded.hardware
    lines = []
    for p in (p for p in found.predictions if p.in_spec and p.rate_per_server > 0):
        own = round(p.rate_per_replica * p.layout.replicas, 4)
        applied = calibration.for_layout(
            measured, spec, loaded.hardware.name, hw, p.layout, own, fitted.id if fitted else None,
            rate_on(spec, p.layout, own),
        ).applied  # fmt: skip
        lines.append(
            f"calibrated (as the release's plan): {p.layout.name} {own * applied.factor:.4g} req/s"
            f" (x{applied.factor:.3g}; {applied.text})"
            if applied.kind
            else f"calibrated (as the release's plan): {p.layout.name} {own:.4g} req/s: no earlier measurement applies"
        )
    return lines


def plan_layouts(release: ValidatedRelease, run_id: str) -> Predictions:
    """Predict each layout's max SLO rate (the planner; seconds, no engine), calibrated on what earlier
    releases measured on the same hardware and engine, and publish it before any benchmark starts:
    each search starts there, and the result keeps it beside the measurement."""
    loaded = load_spec(release.spec_path)
    release_id = release.release_id
    spec = loaded.spec
    found = []
    if loaded.hardware.performance is None:
        log.warning(
            "plan: hardware %r has no performance: figures; the searches start without a prediction",
            loaded.hardware.name,
        )
    measured = registry().measured_predictions()
    fitted = registry().profile(loaded.hardware.name, spec.serving.engine_image)
    hw = fitted.hardware_at_hand(loaded.hardware) if fitted and loaded.hardware.performance else loaded.hardware
    if loaded.hardware.performance:
        log.info("plan: step times: %s", planner.coefficients(loaded.hardware, fitted))
    figures = uncertainty.figures(spec, hw) if loaded.hardware.performance and not fitted else []
    profile_id = fitted.id if fitted else None
    for layout in spec.layouts if loaded.hardware.performance else []:
        p = planner.predict(spec, hw, layout, spec.workload.input_len, spec.workload.output_len, True)
        uncertainty.bracket(
            p, spec, hw, spec.workload.input_len, spec.workload.output_len, figures, fitted, planner.predict
        )
        own = round(p.rate_per_replica * layout.replicas, 4)
        found_for = calibration.for_layout(
            measured, spec, loaded.hardware.name, hw, layout, own, profile_id, rate_on(spec, layout, own)
        )
        applied, key, figure_key = found_for.applied, found_for.key, found_for.figure_key
        factor = applied.factor
        found.append(
            LayoutPrediction(
                layout=layout.name,
                predicted_max_slo_rate=round(own * factor, 4),
                planner_rate=own,
                predicted_per_server=round(p.rate_per_server * factor, 4),
                predicted_low=None if p.rate_low is None else round(p.rate_low * factor, 4),
                predicted_high=None if p.rate_high is None else round(p.rate_high * factor, 4),
                binding_slo=p.binding_slo,
                bound=p.bound,
                calibrated=applied.kind is not None,
                calibration_key=key,
                calibration=applied.text,
                figure_key=figure_key,
                calibration_kind=applied.kind,
                multiplier=applied.multiplier,
            )
        )
        log.info(
            "plan: %s: predicted %.4g req/s (%s, %s; %s)",
            layout.name,
            found[-1].predicted_max_slo_rate,
            p.binding_slo,
            p.bound,
            f"calibrated by {applied.text}"
            if applied.kind
            else f"uncalibrated: no earlier measurement of {figure_key} gave a multiplier, nor of {key}",
        )
    path = run_dir(run_id) / "benchmark" / "predictions.json"
    out = Predictions(layouts=found, file=str(path), step_times=planner.coefficients(loaded.hardware, fitted))
    atomic_write(path, out.model_dump_json(indent=2))
    if release_id is not None:
        registry().record(release_id, Predicted(layouts=found, step_times=out.step_times), "planner")
    return out


def layouts_to_measure(release: ValidatedRelease, predictions: Predictions) -> list[str]:
    loaded = load_spec(release.spec_path)
    spec = loaded.spec
    names = [layout.name for layout in spec.layouts]
    top_k = spec.candidates.top_k if spec.candidates else None
    ranked = sorted(predictions.layouts, key=lambda p: -p.predicted_per_server)
    if top_k is None or top_k >= len(names):
        chosen = MeasuredLayouts(measure=names, reason="every layout of the spec")
    elif len(ranked) < len(names):
        chosen = MeasuredLayouts(measure=names, reason=f"top_k {top_k}, but not every layout has a prediction")
    else:
        live = registry().live(spec.name, spec.promotion.target)
        live_layout = live.data.layout if live else None
        choice = uncertainty.choose(ranked, top_k, lambda p: p.layout)
        best = choice.measure
        keep = set(best) | ({live_layout} if live_layout in names else set())
        chosen = MeasuredLayouts(
            measure=[n for n in names if n in keep],
            skipped={p.layout: p.predicted_per_server for p in ranked if p.layout not in keep},
            reason=choice.reason(top_k, len(names))
            + (f", and the live release's {live_layout}" if live_layout in names and live_layout not in best else ""),
        )
    log.info(
        "layouts measured: %s (%s); skipped: %s",
        ", ".join(chosen.measure),
        chosen.reason,
        ", ".join(f"{n} ({r:.4g} req/s/server predicted)" for n, r in chosen.skipped.items()) or "none",
    )
    if release.release_id is not None and chosen.skipped:
        registry().record(release.release_id, LayoutsChosen(**chosen.model_dump()), "planner")
    return chosen.measure


def benchmark_layout(
    release: ValidatedRelease,
    staged: storage.StagedArtifact,
    layout: str,
    run_id: str,
    predictions: Predictions | None = None,
    accuracy: EvaluationPair | None = None,
) -> LayoutResult:
    """`accuracy`: the evaluate tasks' in-process results; with them the layout's endpoint is scored on
    the same items after its search."""
    loaded = load_spec(release.spec_path)
    loaded.layout(layout)  # an unknown name fails before the serving copy is made
    model = serving.serving_copy(loaded, staged.manifest_hash, staged.s3_uri, staged.nfs_path)
    predicted = predictions.of(layout) if predictions else None
    reference = accuracy.pair() if accuracy else None
    return measure_layout(loaded, layout, model, run_id, predicted, reference)


def measure_layout(
    loaded: LoadedSpec,
    layout: str,
    model: Path,
    run_id: str,
    predicted: LayoutPrediction | None,
    accuracy: tuple[evaluate_stage.EvalResult, evaluate_stage.EvalResult] | None,
) -> LayoutResult:
    """One layout's search from its prediction (when there is one), kept beside the measurement;
    what the local task and the benchmark pod both run."""
    result = benchmark.benchmark_layout(
        loaded.spec,
        loaded.hardware,
        loaded.layout(layout),
        model,
        run_dir(run_id) / "benchmark" / layout,
        prediction=predicted,  # kept beside the measurement: what the next release's calibration compares with
        accuracy=accuracy,
    )
    log.info("layout %s: %s\n%s", layout, result.status, benchmark.table([result]))
    return result


def select_layout(release: ValidatedRelease, results: list[LayoutResult], run_id: str) -> LayoutSelection:
    loaded = load_spec(release.spec_path)
    layouts = results
    selection = benchmark.select(layouts, loaded.spec.slo)
    fleet = capacity_plan(loaded, layouts, selection.best)
    refusal = fleet.refusal() if fleet else None
    if selection.passed and refusal:
        selection = selection.model_copy(update={"passed": False, "reason": refusal})
    files = benchmark.write_outputs(layouts, loaded.spec.slo, run_dir(run_id) / "benchmark", selection)
    log.info("layouts measured:\n%s\nselection: %s\nfiles: %s", benchmark.table(layouts), selection.reason, files)
    if fleet:
        log.info("fleet and cost:\n%s", capacity.table(fleet))
    return LayoutSelection(
        best=selection.best,
        passed=selection.passed,
        reason=selection.reason,
        files=files,
        layouts=[r.model_copy(update={"probes": []}) for r in layouts],
        chosen=chosen_figures(next((r for r in layouts if r.layout == selection.best), None)),
        capacity=fleet,
    )


def capacity_plan(loaded: LoadedSpec, layouts: list[LayoutResult], best: str | None) -> capacity.CapacityPlan | None:
    """Fleet and cost of every measured layout, the chosen one against what is live (spec `capacity:`)."""
    if loaded.spec.capacity is None:
        return None
    rates = {r.layout: r.per_server for r in layouts if r.status == "ok" and r.per_server}
    live = registry().live(loaded.spec.name, loaded.spec.promotion.target)
    versus = capacity.versus_live(live.id, live.data.chosen, live.data.capacity, loaded.hardware) if live else None
    loads = {r.layout: max(r.load_seconds) for r in layouts if r.status == "ok" and r.load_seconds}
    return capacity.plan(loaded, rates, best, versus, load_seconds=loads, load_source="measured by this run")


def chosen_figures(best: LayoutResult | None) -> ChosenFigures | None:
    """What the registry, the approval and later re-benchmarks need of the chosen layout."""
    if best is None:
        return None
    probe = best.deciding_probe()
    return ChosenFigures(
        layout=best.layout,
        rate_per_server=best.per_server,
        per_device=best.per_device,
        max_slo_rate=best.max_slo_rate,
        bound_only=best.bound_only and best.max_slo_rate is not None,
        unsteady=best.unsteady and best.max_slo_rate is not None,
        client_bound=best.client_bound and best.max_slo_rate is not None,
        p90_ttft_ms=probe.p90_ttft_ms if probe else None,
        p90_tpot_ms=probe.p90_tpot_ms if probe else None,
        load_seconds=best.load_seconds,
        load_split=max(best.load_splits, key=lambda split: split.to_healthy_s, default=None),
        weights_source=best.weights_source or None,
    )


def slo_gate(release: ValidatedRelease, selection: LayoutSelection) -> LayoutSelection:
    fleet = selection.capacity
    if release.release_id is not None:
        gate = SloGate(passed=selection.passed, reason=selection.reason)  # what is not set is not shown
        if selection.chosen:
            gate.chosen = selection.chosen
        if fleet and fleet.candidate:
            gate.servers, gate.usd_per_hour = fleet.candidate.servers, fleet.candidate.usd_per_hour
            if fleet.change:
                gate.vs_live = fleet.change.summary()
        registry().record(
            release.release_id,
            gate,
            "gate",
            status="candidate" if selection.passed else "gate_failed",
            only_from=("candidate", "gate_failed"),
            data=ReleaseData(
                chosen=selection.chosen,
                benchmark_files=selection.files,
                capacity=fleet,
                predictions=figure_fits(
                    load_spec(release.spec_path), [r.prediction_check() for r in selection.layouts]
                ),
                served_accuracy=[
                    ServedSummary.of(r.layout, r.served_accuracy) for r in selection.layouts if r.served_accuracy
                ],
            ),
        )
    if not selection.passed:
        fleet_table = f"\n{capacity.table(fleet)}" if fleet else ""
        raise GateFailed(f"SLO gate failed: {selection.reason}\n{benchmark.table(selection.layouts)}{fleet_table}")
    return selection


def figure_fits(loaded: LoadedSpec, checks: list[PredictionCheck]) -> list[PredictionCheck]:
    """Each usable measurement with the overhead multiplier solved from it (calibration.solve), on the
    figures its prediction ran on: where the spec, the hardware's figures or the newest profile no longer
    give its figure key (a record made elsewhere, a profile kept since), none is solved."""
    hardware, spec = loaded.hardware, loaded.spec
    if hardware.performance is None:
        return checks
    fitted = registry().profile(hardware.name, spec.serving.engine_image)
    hw = fitted.hardware_at_hand(hardware) if fitted else hardware
    layouts = {layout.name: layout for layout in spec.layouts}
    out = []
    for check in checks:
        predicted, layout = check.prediction, layouts.get(check.layout)
        key = predicted.figure_key if predicted else None
        if key and layout and calibration.usable(check) and check.max_slo_rate:
            if key == calibration.layout_figure_key(spec, hardware.name, layout, fitted.id if fitted else None):
                fit = calibration.fit_figures(spec, hw, layout, check.max_slo_rate, key, planner.predict)
                log.info(
                    "calibration: %s: overheads x%.3g meet its %.4g req/s (sensitivity %.2g%s)%s",
                    check.layout, fit.solved, check.max_slo_rate, fit.sensitivity,
                    ", at the reach's end" if fit.capped else "",
                    "" if fit.multiplier is not None
                    else ": beyond the reach, no multiplier" if fit.capped
                    else f": under {calibration.SENSITIVE}, no multiplier",
                )  # fmt: skip
                check = check.model_copy(update={"figure_fit": fit})
            else:
                log.info("calibration: %s: its figure key is not the plan's now; no multiplier solved", check.layout)
        out.append(check)
    return out


def report(release: ReleaseRef | int, run_id: str) -> ReportPage:
    """Write the reviewer report; re-rendered later steps keep the same path."""
    release_id = _release_id(release)
    reg = registry()
    rel = reg.get(release_id)
    path = report_page.write(reg, rel, release_spec(rel), run_dir(run_id))
    if rel.data.report != str(path):
        reg.record(release_id, ReportWritten(path=str(path)), "pipeline", data=ReleaseData(report=str(path)))
    log.info("reviewer report: %s", path)
    return ReportPage(release_id=release_id, path=str(path))


def _release_id(release: ReleaseRef | int) -> int:
    """The registry id of a run's release: a task has a record naming it, the CLI the number."""
    return release if isinstance(release, int) else release.release_id


def promote(
    release: ReleaseRef | int, run_id: str, step_reviews: bool = False, first_try: bool = True
) -> PromotionOutcome:
    """`first_try` False (the task's retry): only a rollout whose controller died is picked up."""
    release_id = _release_id(release)
    reg = registry()
    try:
        rel = promotion.promote(reg, release_id, step_reviews=step_reviews, first_try=first_try)
    finally:
        report(release_id, run_id)  # the audit trail in the report includes the outcome
    log.info("release %d is %s at %s", rel.id, rel.status, rel.data.endpoint)
    return PromotionOutcome(release_id=rel.id, name=rel.name, status=rel.status, endpoint=rel.data.endpoint)


def review_steps(release: ReleaseRef | int) -> list[int]:
    """The rollout steps a reviewer will be asked about: none when the spec sets no
    `rollout.review_timeout`; with nothing live to roll over, the one step a first release takes on
    Kubernetes, judged like any (the local target switches a first release at once, unjudged)."""
    reg = registry()
    rel = reg.get(_release_id(release))
    loaded = release_spec(rel)
    live = reg.live(rel.name, rel.target)
    if not loaded.spec.rollout.review_timeout or (live is not None and live.id == rel.id):
        return []
    if live is None:
        return [] if rel.target == "local" else [1]
    count = len(loaded.spec.rollout.steps)
    if rel.target != "local":
        count = len(rollout_plan.for_release(loaded, rel, live).steps)
    return list(range(1, count + 1))


def pending_step(release_id: int, step: int) -> step_review.PendingStep | bool | None:
    """The step's analysis for its review task once judged, False while not yet, None when the
    rollout ended without it."""
    return step_review.pending(registry(), release_id, step)


def record_step_review(release_id: int, review: StepReview) -> None:
    step_review.record(registry(), release_id, review)


def verify(release: ReleaseRef | int, run_id: str) -> Verification:
    release_id = _release_id(release)
    result = promotion.verify(registry(), release_id)
    rebench.refresh_report(registry(), release_id)  # same page, now with the verification in its trail
    return result


def live_release_ids(name: str, only: int | None = None) -> list[int]:
    ids = [r.id for r in rebench.live_releases(registry(), name) if only is None or r.id == only]
    if not ids:
        log.info("no live release of %s%s: nothing to re-benchmark", name, f" with id {only}" if only else "")
    return ids


def rebenchmark(release_id: int, run_id: str, context: Any = None) -> Verdict:
    reg = registry()
    verdict = rebench.rebenchmark(reg, release_id, run_dir(run_id) / f"rebenchmark-{release_id}", context=context)
    return rebench.settle(reg, verdict)


def rollback(name: str, release_id: int | None, reason: str, actor: str) -> PromotionOutcome:
    reg = registry()
    candidates = reg.releases(name=name)
    if not candidates:
        raise ReleaseError(f"param name: no releases named {name!r} in the registry")
    target = reg.get(release_id).target if release_id else candidates[0].target
    rel = promotion.rollback(reg, name, target, actor, reason, to=release_id)
    return PromotionOutcome(release_id=rel.id, name=rel.name, status=rel.status, endpoint=rel.data.endpoint)


def cluster_preflight(release: ValidatedRelease) -> ClusterReady:
    """The cluster checked before any pod starts (and again before promotion): every missing
    piece is one line in the task's failure, before any GPU time is spent."""
    import os

    from pipeline.core import platform
    from pipeline.k8s import preflight

    loaded = load_spec(release.spec_path)
    in_task = bool(os.environ.get("AIRFLOW_CTX_DAG_ID"))

    def connection(conn_id: str) -> bool | None:
        # inside a task Airflow's connections are readable; from elsewhere an absent one is unknown
        return True if platform.current().connection(conn_id) is not None else (False if in_task else None)

    passed = preflight.require(preflight.preflight(loaded, connections=connection))
    log.info("preflight passed: %s", ", ".join(passed))
    return ClusterReady(passed=passed, servers_at_once=preflight.servers_at_once(loaded)[0])
