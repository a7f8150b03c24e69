"""What the step pods leave in storage, and how the light Airflow tasks read it back.

A pod's full result (a side's lm-eval scores, a layout's probes) is a JSON file in storage under
`<base>/<run>/`; the pod's XCom holds only its URI and hashes. The base is the spec's S3 prefix
(`s3://bucket/prefix/runs`) when it stages to S3, which the Airflow workers reach through the
spec's connection; else `<staging.nfs.path>/runs`, which the workers must then mount.

The pod side (`evaluate_side`, `benchmark_layout`) is what the CLI's `evaluate --side` and
`benchmark` sub-commands call; the Airflow side (`plan_layouts`, `benchmark_arguments`,
`accuracy_gate`, `select_layout`) wraps the same `flow` functions the local DAG uses, so both
DAGs plan and decide by the same code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from pipeline.core import artifacts, s3
from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.specs import LoadedSpec, load_spec
from pipeline.entry import flow
from pipeline.k8s import pods
from pipeline.records import edge
from pipeline.records.benchmark import LayoutResult
from pipeline.records.evaluate import EvalResult, EvaluationPair, GateDecision
from pipeline.records.plan import LayoutPrediction, Predictions
from pipeline.records.pods import Remeasured, SideResult, StoredLayout, StoredRemeasure
from pipeline.records.rebenchmark import Verdict
from pipeline.records.release import ModelRef, StagedRef, ValidatedRelease
from pipeline.records.selection import LayoutSelection
from pipeline.release import promote, rebenchmark

R = TypeVar("R", bound=BaseModel)


log = logging.getLogger(__name__)


# ---------------------------------------------------------------- where


# ---------------------------------------------------------------- read and write


def _s3(uri: str, loaded: LoadedSpec):
    if loaded.spec.staging.s3 is None:
        raise ReleaseError(f"{uri}: the spec has no staging.s3 to reach it with")
    bucket, key = s3.parse_s3_uri(uri)
    return s3.s3_client(loaded.spec.staging.s3), bucket, key


def write_bytes(uri: str, data: bytes, loaded: LoadedSpec) -> str:
    if uri.startswith("s3://"):
        client, bucket, key = _s3(uri, loaded)
        with s3.s3_errors(uri):
            client.put_object(Bucket=bucket, Key=key, Body=data)
        return uri
    atomic_write(Path(uri), data)  # a reader never sees half a result
    return uri


def write(uri: str, record: BaseModel, loaded: LoadedSpec) -> str:
    """A record's JSON (`records.edge`, as XCom carries it) at `uri`, whole or not at all."""
    return write_bytes(uri, json.dumps(edge.to_json(record), indent=2).encode(), loaded)


def read_text(uri: str, loaded: LoadedSpec) -> str:
    if uri.startswith("s3://"):
        client, bucket, key = _s3(uri, loaded)
        with s3.s3_errors(uri):
            return client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    try:
        return Path(uri).read_text()
    except FileNotFoundError:
        raise ReleaseError(f"{uri}: no such result (is the NFS share mounted on this worker?)") from None


def read(cls: type[R], uri: str, loaded: LoadedSpec) -> R:
    """The record a pod stored at `uri`; a ReleaseError naming the URI when it is missing or not one."""
    return edge.from_json(cls, read_text(uri, loaded), uri)


# ---------------------------------------------------------------- pod side


def evaluate_side(spec_path: str, side: str, results: str, run_id: str, candidate: str | None = None) -> SideResult:
    """One side of the accuracy comparison. The baseline is the spec's source (materialized, and
    cached, on the shared volume); the candidate a directory with a manifest, verified first."""
    loaded = load_spec(spec_path)
    release = flow.validate_spec(spec_path)
    if side == "baseline":
        model = ModelRef.model_validate(flow.materialize_model(release).model_dump())
    elif side == "candidate" and candidate:
        model = ModelRef(path=candidate, manifest_hash=artifacts.verify(Path(candidate)).content_hash())
    else:
        raise ReleaseError(f"evaluate: side {side!r}: expected baseline, or candidate with a candidate directory")
    result = flow.evaluate(release, model, baseline=side == "baseline")
    uri = write(f"{pods.run_uri(results, run_id)}/evaluate-{side}.json", result, loaded)
    return SideResult(side=side, result_uri=uri, model_manifest_hash=result.model_manifest_hash)


def benchmark_layout(
    spec_path: str, layout: str, model_dir: str, results: str, run_id: str, predictions: str | None = None
) -> StoredLayout:
    """One layout's SLO search on this (whole) node, from the planner's prediction for it (the `plan`
    task's file in storage, `predictions`); probes and engine logs stay in the run directory on the
    shared volume, the LayoutResult goes to storage. The evaluation pods' results of this run
    (stored before the gate) are what the layout's served answers are held to."""
    loaded = load_spec(spec_path)
    loaded.layout(layout)  # an unknown name fails before anything is read
    predicted = layout_prediction(predictions, layout, loaded) if predictions else None
    try:
        sides = [
            read(EvalResult, f"{pods.run_uri(results, run_id)}/evaluate-{side}.json", loaded)
            for side in ("baseline", "candidate")
        ]
    except ReleaseError as exc:  # a benchmark by hand, outside a release run
        log.warning("no evaluation results of run %s (%s): the served answers are not checked", run_id, exc)
        sides = []
    result = flow.measure_layout(
        loaded, layout, Path(model_dir), run_id, predicted, (sides[0], sides[1]) if sides else None
    )
    uri = write(f"{pods.run_uri(results, run_id)}/benchmark/{layout}.json", result, loaded)
    return StoredLayout(layout=layout, status=result.status, result_uri=uri)


def layout_prediction(uri: str, layout: str, loaded: LoadedSpec) -> LayoutPrediction | None:
    """A layout's prediction from the `plan` task's stored file; None (said in the log) when the
    planner had none for it, and the search starts without a prior."""
    predicted = read(Predictions, uri, loaded).of(layout)
    if predicted is None:
        log.warning("%s: no prediction for layout %s: its search starts without one", uri, layout)
    return predicted


def rebenchmark_uri(results: str, run_id: str, release_id: int) -> str:
    return f"{pods.run_uri(results, run_id)}/rebenchmark/release-{release_id}.json"


def evaluation_uri(results: str, run_id: str, release_id: int) -> str:
    return f"{pods.run_uri(results, run_id)}/rebenchmark/release-{release_id}-evaluation.json"


def remeasure(
    spec_path: str,
    release_id: int,
    layout: str,
    staged: StagedRef,
    promoted_rate: float,
    results: str,
    run_id: str,
    evaluation: str | None = None,
) -> StoredRemeasure:
    """A live release's re-benchmark on this node; with `evaluation` (the gate's in-process results,
    stored by `remeasure_arguments`) the fresh engine's answers are held to them, as a local
    re-benchmark's are. A measurement that cannot be made (artifact gone, engine will not start)
    is stored too, with its reason: the judge alerts with it."""
    loaded = load_spec(spec_path)
    try:
        accuracy = read(EvaluationPair, evaluation, loaded).pair() if evaluation else None
        if accuracy is None:
            log.warning("release %d: no accuracy gate results: the served answers are not checked", release_id)
        result = rebenchmark.measure(
            loaded,
            staged,
            layout,
            promoted_rate,
            flow.run_dir(run_id) / "rebenchmark" / f"release-{release_id}",
            accuracy,
        )
        body = Remeasured(status="ok", result=result, versions=rebenchmark.versions(loaded))
    except ReleaseError as exc:
        log.error("release %d: cannot re-benchmark: %s", release_id, exc)
        body = Remeasured(status="error", error=str(exc)[:1500], versions=rebenchmark.versions(loaded))
    uri = write(rebenchmark_uri(results, run_id, release_id), body, loaded)
    return StoredRemeasure(release_id=release_id, status=body.status, result_uri=uri)


# ---------------------------------------------------------------- Airflow side


def remeasure_arguments(release_ids: list[int], run_id: str) -> list[list[str]]:
    """The re-benchmark pods' container arguments, one per live release, from its registry row; the
    gate's in-process results it was released on go to storage first, for the pod to hold the fresh
    engine's answers to (a release recorded before the registry kept them has none)."""
    reg = flow.registry()
    out = []
    for release_id in release_ids:
        rel = reg.get(release_id)
        loaded = promote.release_spec(rel)
        facts = rel.data
        uri = evaluation_uri(pods.base_uri(loaded), run_id, release_id)
        # the pair promote.gate_results reads, as stored: the pod reads it alike
        evaluation = write(uri, facts.evaluation, loaded) if facts.evaluation else None
        out.append(
            pods.shell(
                pods.cli_args(
                    loaded,
                    "rebenchmark",
                    release=rel.id,
                    layout=facts.layout,
                    s3_uri=facts.s3_uri,
                    nfs_path=facts.nfs_path,
                    manifest_hash=facts.manifest_hash,
                    promoted_rate=rel.chosen().max_slo_rate,
                    run_id=run_id,
                    evaluation=evaluation,
                )
            )
        )
    return out


def plan_layouts(release: ValidatedRelease, run_id: str) -> Predictions:
    """The planner's predictions, as the local DAG's `plan` task makes them, published to storage
    before any benchmark pod starts; `file` is their URI there, which each pod reads its prior from."""
    loaded = load_spec(release.spec_path)
    predictions = flow.plan_layouts(release, run_id)
    published = _publish_run_dir(loaded, run_id)
    return predictions.model_copy(update={"file": published[predictions.file]})


def benchmark_arguments(
    spec_path: str, layouts: list[str], fetched: ModelRef, predictions: Predictions, run_id: str
) -> list[list[str]]:
    """The benchmark pods' container arguments, one per layout the plan chose to measure, each on
    the fetched serving copy (the fetch pod's FetchResult, read as the ModelRef it is) and starting
    from its prediction."""
    loaded = load_spec(spec_path)
    return [
        pods.shell(
            pods.cli_args(
                loaded, "benchmark", layout=name, model=fetched.path, predictions=predictions.file, run_id=run_id
            )
        )
        for name in layouts
    ]


def judge_remeasured(release_id: int, run_id: str, context: Any = None) -> Verdict:
    """Conclude a pod's re-benchmark like a local one (trend point, verdict, alert, auto rollback);
    a pod that left no result is a failed measurement, never evidence of degradation."""
    reg = flow.registry()
    rel = reg.get(release_id)
    loaded = promote.release_spec(rel)
    uri = rebenchmark_uri(pods.base_uri(loaded), run_id, release_id)
    try:
        body = read(Remeasured, uri, loaded)
    except ReleaseError as exc:
        body = Remeasured(
            status="error", error=f"the re-benchmark pod left no result: {exc} (see the measure task's log)"
        )
    result = body.result if body.status == "ok" else None
    verdict = rebenchmark.conclude(
        reg, rel, loaded, result, body.error, body.versions or rebenchmark.versions(loaded), uri, context
    )
    return rebenchmark.settle(reg, verdict)


def _publish_run_dir(loaded: LoadedSpec, run_id: str) -> dict[str, str]:
    """Copy what a light task wrote into its (ephemeral) local run directory to storage: local path -> URI."""
    local = flow.run_dir(run_id)
    base = pods.run_uri(pods.base_uri(loaded), run_id)
    return {
        str(path): write_bytes(f"{base}/{path.relative_to(local).as_posix()}", path.read_bytes(), loaded)
        for path in sorted(local.rglob("*"))
        if path.is_file()
    }


def accuracy_gate(release: ValidatedRelease, baseline: SideResult, candidate: SideResult, run_id: str) -> GateDecision:
    """The local DAG's gate on the pods' stored results; the GX report is published either way."""
    loaded = load_spec(release.spec_path)
    try:
        decision = flow.accuracy_gate(
            release,
            read(EvalResult, baseline.result_uri, loaded),
            read(EvalResult, candidate.result_uri, loaded),
            run_id,
        )
    finally:
        published = _publish_run_dir(loaded, run_id)
    html = decision.validation_html
    return decision.model_copy(update={"validation_html": published.get(str(html), html)}) if html else decision


def select_layout(release: ValidatedRelease, refs: list[StoredLayout], run_id: str) -> LayoutSelection:
    """The best layout from the benchmark pods' stored results; the JSON, CSV and plot go to storage."""
    loaded = load_spec(release.spec_path)
    results = [read(LayoutResult, ref.result_uri, loaded) for ref in refs]
    selection = flow.select_layout(release, results, run_id)
    published = _publish_run_dir(loaded, run_id)
    return selection.model_copy(
        update={"files": {kind: published.get(path, path) for kind, path in selection.files.items()}}
    )
