"""The planner's figures for a run, before any measurement: what the plan task publishes and each
layout's search starts from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["FigureFit", "LayoutPrediction", "MeasuredLayouts", "PredictionCheck", "Predictions"]


class LayoutPrediction(BaseModel):
    """The planner's figures for one layout of the run, before any measurement: the one prediction
    record (the plan task publishes it, the layout's result carries it, the registry keeps it beside
    the measurement in a `PredictionCheck`)."""

    layout: str = Field(description="the layout's name")
    predicted_max_slo_rate: float = Field(
        description="req/s at the layout's endpoint (all its replicas): the planner's rate x the calibration"
    )
    planner_rate: float = Field(description="the step-time model's own rate, before calibration")
    predicted_per_server: float = Field(description="what top_k ranks by: req/s per server, calibrated alike")
    predicted_low: float | None = Field(None, description="the interval's low end, req/s per server, calibrated alike")
    predicted_high: float | None = Field(None, description="the interval's high end, req/s per server")
    binding_slo: str = Field(description="the limit the rate stops at: p90 TTFT or p90 TPOT ('-': no rate)")
    bound: str = Field(
        description="what a replica spends its time on at that rate, or the limit it hits (e.g. HBM, batch limit)"
    )
    calibrated: bool = Field(
        description="True: scaled by what earlier releases measured here (`calibration`); False: datasheet "
        "figures x the profile's efficiency factors"
    )
    calibration_key: str = Field(description="hardware | engine image | layout shape: what a measurement transfers to")
    calibration: str | None = Field(
        None,
        description="which calibration applied (the overhead figures' or the per-shape ratio), its factor and the"
        " measurements it comes from",
    )
    figure_key: str | None = Field(
        None,
        description="hardware | engine image | engine args and env but the limits the planner models | profile: what"
        " an overhead multiplier transfers to (any shape); None: a record from before figure calibration",
    )
    calibration_kind: Literal["figures", "shape"] | None = Field(
        None,
        description="'figures': the planner ran on overheads x `multiplier`; 'shape': x the per-shape ratio; None:"
        " uncalibrated (or a record from before the kinds)",
    )
    multiplier: float | None = Field(None, description="the overhead figures' multiplier the rate ran on ('figures')")

    def error(self, measured: float) -> float:
        """measured / predicted - 1, as the table, the report and calibration's evidence show it."""
        return round(measured / self.predicted_max_slo_rate - 1, 4)


class Predictions(BaseModel):
    """What the release DAG's `plan` task publishes: every layout it will measure, predicted."""

    layouts: list[LayoutPrediction] = Field(description="one per layout of the spec; empty without performance figures")
    file: str = Field(description="where the plan task wrote them (predictions.json), a path")
    step_times: str = Field("", description="where the planner's step times came from: datasheet or profiling run")

    def of(self, layout: str) -> LayoutPrediction | None:
        found = next((p for p in self.layouts if p.layout == layout), None)
        return found if found and found.predicted_max_slo_rate > 0 else None


class MeasuredLayouts(BaseModel):
    """Which layouts the run measures: all, or `candidates.top_k` by predicted rate per server plus the
    live release's layout; the rest are named with their predictions, skipped."""

    measure: list[str] = Field(description="layouts to benchmark, by name, in the spec's order")
    skipped: dict[str, float] = Field(default_factory=dict, description="layout -> predicted req/s per server")
    reason: str = Field(description="why these: every layout, or the top_k by predicted rate (and the live one)")


class FigureFit(BaseModel):
    """The overhead multiplier that makes the planner's rate for a measured layout meet its measurement
    (planner/calibration.py, solved when the release records its measurements)."""

    figure_key: str = Field(description="the prediction's figure key: the figures the multiplier was solved on")
    multiplier: float | None = Field(
        description="x the planner's overhead figures; None: the rate is not sensitive to them (no multiplier)"
    )
    solved: float = Field(description="the bisection's answer within the reach, kept even where it gives none")
    rate: float = Field(
        description="the planner's rate at `solved`, req/s at the endpoint (the measurement, within it)"
    )
    sensitivity: float = Field(description="|d ln rate / d ln multiplier| at the answer (at most 10)")
    capped: bool = Field(False, description="the measurement lies beyond the reach: the answer is its end")


class PredictionCheck(BaseModel):
    """A benchmarked layout's prediction beside what its search measured, as a release keeps it
    (registry `predictions`): what the next plan calibrates on and the report's planner table shows."""

    model_config = ConfigDict(extra="forbid")

    layout: str = Field(description="the benchmarked layout's name")
    prediction: LayoutPrediction | None = Field(
        None, description="what the search started from; None: none was made (no performance figures)"
    )
    max_slo_rate: float | None = Field(None, description="measured, req/s at the endpoint; None: the layout failed")
    bound_only: bool = Field(False, description="the measured rate is only a lower bound (LayoutResult's)")
    extrapolated: bool = Field(False, description="a bound the passes' line puts within the resolution of the edge")
    client_bound: bool = Field(
        False, description="the load client sent late in the runs that decided the rate: it measured the client"
    )
    figure_fit: FigureFit | None = Field(
        None, description="the overhead multiplier solved from this measurement; None: not solved (a record before)"
    )

    @property
    def prediction_error(self) -> float | None:
        """measured / predicted - 1."""
        if self.prediction is None or not self.prediction.predicted_max_slo_rate or not self.max_slo_rate:
            return None
        return self.prediction.error(self.max_slo_rate)

    @model_validator(mode="before")
    @classmethod
    def flat_records_keep_their_measurement(cls, data: Any) -> Any:
        """Registries written before the one prediction record kept a flat copy of some prediction
        fields (`predicted_max_slo_rate`, `planner_rate`, `calibration_key`, ...): too few to make a
        `LayoutPrediction`, so such a check keeps its measurement and no prediction (the planner's
        calibration then skips it, as it skips a release recorded before calibration keys existed)."""
        if not isinstance(data, dict) or "prediction" in data:
            return data
        flat = ("predicted_max_slo_rate", "prediction_error", "planner_rate", "calibration_key", "calibration")
        return {k: (bool(v) if k in ("bound_only", "extrapolated", "client_bound") else v)
                for k, v in data.items() if k not in flat}  # fmt: skip
