"""The whole release spec, one section per module of this package, and the spec as loaded: with
its file and its hardware profile."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError
from pipeline.core.specs.base import Strict
from pipeline.core.specs.capacity import CapacitySpec
from pipeline.core.specs.evaluation import EvaluationSpec
from pipeline.core.specs.hardware import HardwareProfile
from pipeline.core.specs.model import ModelSpec, QuantizationSpec
from pipeline.core.specs.promotion import PromotionSpec, RolloutSpec
from pipeline.core.specs.rebenchmark import RebenchmarkSpec
from pipeline.core.specs.serving import CandidatesSpec, Layout, ServingSpec
from pipeline.core.specs.staging import StagingSpec
from pipeline.core.specs.workload import SloSpec, WorkloadSpec


class ReleaseSpec(Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    description: str = ""
    model: ModelSpec
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    evaluation: EvaluationSpec
    staging: StagingSpec
    serving: ServingSpec
    layouts: Annotated[list[Layout], Field(min_length=1)]
    workload: WorkloadSpec
    slo: SloSpec
    hardware: str = Field(description="profile name in configs/hardware/")
    promotion: PromotionSpec = Field(default_factory=PromotionSpec)
    rebenchmark: RebenchmarkSpec = Field(default_factory=RebenchmarkSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    capacity: CapacitySpec | None = Field(None, description="the fleet to size and price; needs the hardware's price")
    candidates: CandidatesSpec | None = Field(
        None, description="generated layouts and how many of all layouts to measure (planner ranks them)"
    )
    execution: Literal["local", "kubernetes"] = "local"


class LoadedSpec(BaseModel):
    """A validated spec together with where it came from and its resolved hardware profile."""

    path: Path
    spec: ReleaseSpec
    hardware: HardwareProfile

    def layout(self, name: str) -> Layout:
        """The spec's layout of that name; a ReleaseError naming the file and the known names if none."""
        for layout in self.spec.layouts:
            if layout.name == name:
                return layout
        known = ", ".join(layout.name for layout in self.spec.layouts)
        raise ReleaseError(f"{self.path}: layouts: no layout named {name!r} (known: {known})")
