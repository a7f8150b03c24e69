"""The planner's figures for a run, before any measurement: what the plan task publishes and each
layout's search starts from."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["LayoutPrediction", "MeasuredLayouts", "Predictions"]


class LayoutPrediction(BaseModel):
    """The planner's figures for one layout of the run, before any measurement."""

    layout: str
    predicted_max_slo_rate: float = Field(
        description="req/s at the layout's endpoint (all its replicas): the planner's rate x the calibration"
    )
    planner_rate: float = Field(description="the step-time model's own rate, before calibration")
    predicted_per_server: float = Field(description="what top_k ranks by: req/s per server, calibrated alike")
    predicted_low: float | None = Field(None, description="the interval's low end, req/s per server, calibrated alike")
    predicted_high: float | None = Field(None, description="the interval's high end, req/s per server")
    binding_slo: str
    bound: str
    calibrated: bool = Field(
        description="True: scaled by what earlier releases measured here (`calibration`); False: datasheet "
        "figures x the profile's efficiency factors"
    )
    calibration_key: str = Field(description="hardware | engine image | layout shape: what a measurement transfers to")
    calibration: str | None = Field(None, description="the factor and the measurements it comes from")


class Predictions(BaseModel):
    """What the release DAG's `plan` task publishes: every layout it will measure, predicted."""

    layouts: list[LayoutPrediction]
    file: str
    step_times: str = Field("", description="where the planner's step times came from: datasheet or profiling run")

    def of(self, layout: str) -> LayoutPrediction | None:
        found = next((p for p in self.layouts if p.layout == layout), None)
        return found if found and found.predicted_max_slo_rate > 0 else None


class MeasuredLayouts(BaseModel):
    """Which layouts the run measures: all, or `candidates.top_k` by predicted rate per server plus the
    live release's layout; the rest are named with their predictions, skipped."""

    measure: list[str]
    skipped: dict[str, float] = Field(default_factory=dict, description="layout -> predicted req/s per server")
    reason: str
