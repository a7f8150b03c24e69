"""The layout chosen for a release: the select task's decision and the chosen layout's figures, what
the SLO gate records, the approval shows and the re-benchmarks compare against."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.records.benchmark import LayoutResult, LoadSplit
from pipeline.records.capacity import CapacityPlan

__all__ = ["ChosenFigures", "LayoutSelection"]


class ChosenFigures(BaseModel):
    """The chosen layout's figures: what the registry records at the SLO gate, the approval shows
    and the re-benchmarks compare against."""

    layout: str
    rate_per_server: float | None
    per_device: float | None
    max_slo_rate: float | None
    bound_only: bool = Field(False, description="max_slo_rate is a lower bound (LayoutResult.bound_only)")
    unsteady: bool = Field(False, description="its runs disagreed beyond workload.max_spread (LayoutResult.unsteady)")
    client_bound: bool = Field(False, description="the load client sent late in the runs deciding it (.client_bound)")
    p90_ttft_ms: float | None
    p90_tpot_ms: float | None
    load_seconds: list[float] | None
    load_split: LoadSplit | None = Field(None, description="the slowest replica's start, split by its log")
    weights_source: str | None = Field(None, description="where the measured engines read the weights from")


class LayoutSelection(BaseModel):
    """What the select task hands the SLO gate and the review end: the decision, every measured
    layout (without its probes: benchmark.json keeps them), the chosen layout's figures, the fleet."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    best: str | None = Field(description="the chosen layout; None when none met the SLO")
    passed: bool
    reason: str
    files: dict[str, str] = Field(description="kind (json, csv, plot, ...) -> where the run wrote it")
    layouts: list[LayoutResult]
    chosen: ChosenFigures | None = None
    capacity: CapacityPlan | None = None
