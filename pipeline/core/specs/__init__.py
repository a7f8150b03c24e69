"""The release spec: one YAML file describes a whole release, and every stage reads it.

Loading checks types (pydantic) and then feasibility (does the layout fit the node, do the
weights fit the device memory), so that a bad spec fails in seconds, before GPU time is
spent. Every problem is reported as one line, `file: dotted.field: what is wrong`.

One module per section of the spec (as vLLM's `vllm/config/` keeps one per area), then the
whole and the ways to read it:

- base         Strict (unknown keys are errors), durations
- model        `model:` (its architecture) and `quantization:`
- evaluation   `evaluation:` (the accuracy gate's tasks, the served-answers check)
- staging      `staging:` (S3, NFS)
- serving      `serving:`, `layouts:` and `candidates:`
- workload     `workload:` and `slo:`
- promotion    `promotion:` and `rollout:`
- rebenchmark  `rebenchmark:`
- capacity     `capacity:` (and its autoscale)
- hardware     a hardware profile (`configs/hardware/`)
- release      ReleaseSpec (every section) and LoadedSpec (with its file and hardware)
- feasibility  the checks that span fields and hardware; the generated layouts
- loading      load_spec and load_recorded: YAML, types, then feasibility

Callers import from the package (`from pipeline.core.specs import load_spec`); the names below are
the modules' public ones.
"""

from __future__ import annotations

from pipeline.core.specs.base import DURATION_PATTERN, Strict, duration_seconds
from pipeline.core.specs.capacity import AutoscaleSpec, CapacitySpec
from pipeline.core.specs.evaluation import EvalTask, EvaluationSpec, ServedAccuracySpec
from pipeline.core.specs.feasibility import (
    KNOB_NAMES,
    arg_number,
    feasibility_problems,
    feasible_shapes,
    generated_layouts,
    kv_reserve_gb,
    weights_per_device_gb,
)
from pipeline.core.specs.hardware import (
    PER_WORLD_SIZE,
    RANGED_FIGURES,
    DevicePerformance,
    Efficiency,
    HardwareProfile,
    NodeProvisioning,
    ranged_figure,
)
from pipeline.core.specs.loading import (
    hardware_path,
    load_hardware,
    load_recorded,
    load_spec,
    local_source,
    resolved_source,
)
from pipeline.core.specs.model import (
    BYTES_PER_PARAM,
    DEFAULT_IGNORE,
    SOURCE_PATTERN,
    Architecture,
    ModelSpec,
    QuantizationSpec,
)
from pipeline.core.specs.promotion import GatewayRef, PromotionSpec, RolloutSpec
from pipeline.core.specs.rebenchmark import SCHEDULE_PRESETS, NotifySpec, RebenchmarkSpec
from pipeline.core.specs.release import LoadedSpec, ReleaseSpec
from pipeline.core.specs.serving import (
    FLAG_PATTERN,
    LAYOUT_FLAGS,
    CandidatesSpec,
    EngineArgs,
    Layout,
    Scalar,
    ServingSpec,
)
from pipeline.core.specs.staging import NfsTarget, S3Target, StagingSpec
from pipeline.core.specs.workload import SloSpec, WorkloadSpec, limits_by_their_name

__all__ = [
    "BYTES_PER_PARAM",
    "DEFAULT_IGNORE",
    "DURATION_PATTERN",
    "FLAG_PATTERN",
    "KNOB_NAMES",
    "LAYOUT_FLAGS",
    "PER_WORLD_SIZE",
    "RANGED_FIGURES",
    "SCHEDULE_PRESETS",
    "SOURCE_PATTERN",
    "Architecture",
    "AutoscaleSpec",
    "CandidatesSpec",
    "CapacitySpec",
    "DevicePerformance",
    "Efficiency",
    "EngineArgs",
    "EvalTask",
    "EvaluationSpec",
    "GatewayRef",
    "HardwareProfile",
    "Layout",
    "LoadedSpec",
    "ModelSpec",
    "NfsTarget",
    "NodeProvisioning",
    "NotifySpec",
    "PromotionSpec",
    "QuantizationSpec",
    "RebenchmarkSpec",
    "ReleaseSpec",
    "RolloutSpec",
    "S3Target",
    "Scalar",
    "ServedAccuracySpec",
    "ServingSpec",
    "SloSpec",
    "StagingSpec",
    "Strict",
    "WorkloadSpec",
    "arg_number",
    "duration_seconds",
    "feasibility_problems",
    "feasible_shapes",
    "generated_layouts",
    "hardware_path",
    "kv_reserve_gb",
    "limits_by_their_name",
    "load_hardware",
    "load_recorded",
    "load_spec",
    "local_source",
    "ranged_figure",
    "resolved_source",
    "weights_per_device_gb",
]
