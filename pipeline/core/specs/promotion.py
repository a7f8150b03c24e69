"""How a release reaches traffic: the gates and approval (`promotion:`) and the stepped rollout
(`rollout:`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from pipeline.core.specs.base import DURATION_PATTERN, Strict


class GatewayRef(Strict):
    """The Gateway (Gateway API) that carries the model's traffic on Kubernetes: the rollout moves
    traffic between releases by the weights of the model's HTTPRoute attached to it."""

    name: str = Field(description="the Gateway's name (its listener must allow routes from promotion.namespace)")
    namespace: str | None = Field(None, description="the Gateway's namespace; unset: promotion.namespace")
    section_name: str | None = Field(None, description="one listener of the Gateway; unset: every listener")


class PromotionSpec(Strict):
    target: Literal["local", "kubernetes"] = "local"
    namespace: str = "model-release"
    gateway: GatewayRef | None = Field(
        None, description="kubernetes target: the Gateway the model's HTTPRoute attaches to (required there)"
    )
    requires_approval: bool = True
    reviewers: list[str] = Field(default_factory=list)
    approval_timeout: Annotated[str, Field(pattern=DURATION_PATTERN.pattern)] = "24h"
    kubernetes_conn_id: str | None = Field(
        "kubernetes_default", description="Airflow connection of the cluster; None: kubeconfig or in-cluster config"
    )
    rollout_timeout: Annotated[str, Field(pattern=DURATION_PATTERN.pattern)] = "45m"


class RolloutSpec(Strict):
    """How a new release takes traffic from the live one: in steps, each held for an analysis window
    in which the new release's live p90s (from Prometheus) must meet the SLO, or traffic goes back."""

    steps: Annotated[
        list[Annotated[float, Field(gt=0, le=1)]],
        Field(min_length=1, description="fractions of traffic on the new release, increasing, ending at 1.0"),
    ] = Field(default_factory=lambda: [0.1, 0.5, 1.0])
    analysis_window: Annotated[
        str, Field(pattern=DURATION_PATTERN.pattern, description="how long each step is held and analysed")
    ] = "5m"
    min_requests: Annotated[
        int, Field(ge=1, description="requests the new release must finish in a window for a verdict")
    ] = 20
    max_error_fraction: Annotated[float, Field(ge=0, lt=1, description="aborted or failed / finished requests")] = 0.01
    max_vs_live: Annotated[
        float | None,
        Field(gt=1, description="new p90s may be at most this multiple of the old release's in the same window"),
    ] = None
    prometheus_url: str | None = Field(
        None, description="the cluster's Prometheus (kubernetes target); the local target starts its own"
    )
    scrape_interval: Annotated[
        str,
        Field(
            pattern=DURATION_PATTERN.pattern,
            description="the cluster Prometheus' scrape interval: a step waits two after its window",
        ),
    ] = "30s"
    spare_servers: Annotated[
        int, Field(ge=0, description="servers a step may run beyond the live fleet (old ones go as new are ready)")
    ] = 1
    instant_abort: bool = Field(
        False,
        description="keep every old server through every step, so an abort anywhere only moves traffic back "
        "(no reloads); refused at plan time when spare_servers cannot hold the old fleet beside each step's new one",
    )
    scale_down_delay: Annotated[
        str,
        Field(
            pattern=DURATION_PATTERN.pattern,
            description="after the last step's analysis passed, the old release keeps the servers it had while "
            "that step was judged for this long (a rollback then only moves traffic back); then it goes to zero "
            "servers, its objects kept until the next release replaces them",
        ),
    ] = "0s"
    review_timeout: Annotated[
        str | None,
        Field(
            pattern=DURATION_PATTERN.pattern,
            description="in the release DAG, each step's analysis goes to the promotion's reviewers (Continue / "
            "Abort, Airflow's Required actions) for this long, then the verdict stands; unset: no step reviews",
        ),
    ] = None

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[float]) -> list[float]:
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"{steps}: fractions must increase")
        if steps[-1] != 1.0:
            raise ValueError(f"{steps}: the last step must be 1.0 (all traffic on the new release)")
        return steps
