"""The traffic the fleet must carry (`capacity:`) and how it scales with it (`capacity.autoscale:`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.core.specs.base import DURATION_PATTERN, Strict


class AutoscaleSpec(Strict):
    """Scale-out of the serving fleet on Kubernetes (KEDA, pipeline/k8s/autoscaler.py): between the
    servers the mean rate needs and capacity.max_servers, each server loaded to `utilisation` of its
    measured max SLO rate; the spare (1/utilisation - 1) is what carries a spike while new servers start."""

    utilisation: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="target load per server as a fraction of its measured max SLO rate (the scaler's target)",
        ),
    ] = 0.7
    spike_factor: Annotated[
        float,
        Field(
            gt=1,
            description="traffic may grow to this multiple of its level within spike_within (e.g. 1.5: 'peak x 1.5 "
            "within 10 minutes'); capacity checks the fleet's spare covers it for the scale-up lead time",
        ),
    ] = 1.5
    spike_within: Annotated[
        str, Field(pattern=DURATION_PATTERN.pattern, description="the time the spike takes to reach spike_factor")
    ] = "10m"


class CapacitySpec(Strict):
    """The traffic the fleet must carry: sizes the fleet from the measured max SLO rate per server."""

    peak_rps: Annotated[float, Field(gt=0, description="requests/s the fleet must serve at its busiest")]
    mean_rps: Annotated[float, Field(gt=0, description="expected average requests/s (what a day costs)")]
    headroom: Annotated[float, Field(ge=0, le=4, description="spare capacity above the peak, as a fraction of it")] = (
        0.2
    )
    min_servers: Annotated[int, Field(ge=1)] = 1
    max_servers: Annotated[int | None, Field(ge=1, description="a candidate needing more fails the SLO gate")] = None
    autoscale: AutoscaleSpec | None = Field(
        None, description="scale the fleet with traffic (KEDA on Kubernetes) between the mean's servers and max_servers"
    )

    @model_validator(mode="after")
    def _consistent(self) -> CapacitySpec:
        if self.mean_rps > self.peak_rps:
            raise ValueError(f"mean_rps {self.mean_rps:g} is above peak_rps {self.peak_rps:g}")
        if self.max_servers is not None and self.max_servers < self.min_servers:
            raise ValueError(f"max_servers {self.max_servers} is below min_servers {self.min_servers}")
        if self.autoscale is not None and self.max_servers is None:
            raise ValueError("autoscale needs max_servers: the most servers the scaler may run")
        return self
