"""A re-benchmark's records: the figures a release was promoted with, what a fresh instance
measured against them, and the verdict that the trend, the alert and the report read."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["Promoted", "Remeasure", "Verdict"]


class Promoted(BaseModel):
    """The figures a release was promoted with (its registry facts): what a re-benchmark is held to."""

    layout: str | None = Field(None, description="the layout it was promoted with")
    max_slo_rate: float | None = Field(None, description="req/s at the endpoint, as promoted")
    bound_only: bool | None = Field(None, description="that rate was a lower bound")
    rate_per_server: float | None = Field(None, description="req/s per server, as promoted")
    p90_ttft_ms: float | None = Field(None, description="measured at the promoted rate, at promotion")
    p90_tpot_ms: float | None = Field(None, description="measured at the promoted rate, at promotion")


class Remeasure(BaseModel):
    """What the fresh instance measured: its own max SLO rate, and the latencies at the promoted rate."""

    max_slo_rate: float | None = Field(None, description="req/s; None: the SLO held at no rate")
    bound_only: bool = Field(False, description="a lower bound (LayoutResult.bound_only)")
    unsteady: bool = Field(False, description="its runs disagreed beyond workload.max_spread (LayoutResult's)")
    client_bound: bool = Field(False, description="the load client's lag decided it (LayoutResult's)")
    capacity_rps: float | None = Field(None, description="highest throughput any counted probe achieved, req/s")
    p90_ttft_ms_at_promoted_rate: float | None = Field(
        None, description="last counted probe at the promoted rate, ms; None: none ran"
    )
    p90_tpot_ms_at_promoted_rate: float | None = Field(
        None, description="last counted probe at the promoted rate, ms; None: none ran"
    )
    slo_holds_at_promoted_rate: bool | None = Field(None, description="None: no probe ran at the promoted rate")
    served_accuracy: dict[str, float] | None = Field(None, description="task -> served score; None: not checked")
    served_accuracy_passed: bool | None = Field(None, description="the serving-path check passed; None: not checked")


class Verdict(BaseModel):
    """A re-benchmark's conclusion: recorded as the trend point (or the failure), alerted, reported."""

    release_id: int = Field(description="the registry's release re-benchmarked")
    status: Literal["ok", "degraded", "error", "cancelled"] = Field(
        description="degraded: the SLO fails at the promoted rate, the rate dropped or the answers got worse; "
        "error: it could not measure; cancelled: stopped from outside"
    )
    reasons: list[str] = Field(description="why degraded, or the error or cancellation; empty when ok")
    expected: Promoted | None = Field(None, description="None: cancelled before anything was compared")
    measured: Remeasure | None = Field(None, description="None: no measurement (an error, a cancellation)")
    versions: dict[str, str] = Field(default_factory=dict, description="engine image and package versions")
