"""What each DAG task calls: spec path in, small JSON out (XCom carries only this).

Kept free of Airflow imports so the same calls run from the CLI, a pod or a test.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline import sources
from pipeline.paths import PROJECT_ROOT
from pipeline.spec import load_spec

log = logging.getLogger(__name__)

# Stages of the release flow that have no task yet; the demo names them so nobody mistakes
# a skeleton run for a release.
NOT_BUILT = ["evaluate", "accuracy_gate", "benchmark", "slo_gate", "report", "approve", "promote"]


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
