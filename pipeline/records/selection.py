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

    layout: str = Field(description="the chosen layout's name")
    rate_per_server: float | None = Field(description="max SLO req/s per server (LayoutResult.per_server)")
    per_device: float | None = Field(description="max SLO req/s per device (LayoutResult.per_device)")
    max_slo_rate: float | None = Field(description="req/s at the layout's endpoint (all its replicas)")
    bound_only: bool = Field(False, description="max_slo_rate is a lower bound (LayoutResult.bound_only)")
    unsteady: bool = Field(False, description="its runs disagreed beyond workload.max_spread (LayoutResult.unsteady)")
    client_bound: bool = Field(False, description="the load client sent late in the runs deciding it (.client_bound)")
    p90_ttft_ms: float | None = Field(description="of the probe that decided max_slo_rate, ms; None: no rate")
    p90_tpot_ms: float | None = Field(description="of the probe that decided max_slo_rate, ms; None: no rate")
    load_seconds: list[float] | None = Field(description="per replica, process start to healthy, s")
    load_split: LoadSplit | None = Field(None, description="the slowest replica's start, split by its log")
    weights_source: str | None = Field(None, description="where the measured engines read the weights from")


class LayoutSelection(BaseModel):
    """What the select task hands the SLO gate and the review end: the decision, every measured
    layout (without its probes: benchmark.json keeps them), the chosen layout's figures, the fleet."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    best: str | None = Field(description="the chosen layout; None when none met the SLO")
    passed: bool = Field(description="the SLO gate's verdict: best holds the minimum rate and its fleet fits capacity:")
    reason: str = Field(description="the verdict in words: the best layout's rate, or why the gate refuses")
    files: dict[str, str] = Field(description="kind (json, csv, plot, ...) -> where the run wrote it")
    layouts: list[LayoutResult] = Field(description="every measured layout, without its probes")
    chosen: ChosenFigures | None = Field(None, description="the best layout's figures; None: no best")
    capacity: CapacityPlan | None = Field(None, description="the fleet and its cost; None: the spec has no capacity:")
