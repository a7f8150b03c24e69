"""The events of a rollout and its undo: what the controller, the two targets and promotion's
deploy and rollback record, step by step (the start, the checks, the route, the steps, aborts,
rollbacks, recovery, the keep window, the autoscalers, a step's review). One record per kind;
`events.py` reads them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.rollout import Deployment, ServerStep
from pipeline.records.evaluate import TaskVerdict
from pipeline.records.events_base import ErrorEvent, EventRecord
from pipeline.records.rollout import GatewaySmoke, StepAnalysis, StepReview

__all__ = [
    "AutoscalerLeftPaused",
    "AutoscalerMissing",
    "AutoscalerResumed",
    "ControllerInterrupted",
    "DeployFailure",
    "DeployFinished",
    "DeployStarted",
    "FleetResized",
    "JudgedStep",
    "KeepWindow",
    "LeaseLoss",
    "ManifestsRendered",
    "Overload",
    "Pruned",
    "Recovered",
    "RecoveryStarted",
    "RollbackComplete",
    "RollbackFailed",
    "RollbackFinished",
    "RollbackStarted",
    "RolledBack",
    "RolloutAbort",
    "RolloutAccuracy",
    "RolloutComplete",
    "RolloutFailure",
    "RolloutStep",
    "RolloutStopped",
    "ScaleDownSkipped",
    "ScaledToZero",
    "SmokeTest",
    "StepReviewed",
    "Stopped",
    "Superseded",
    "Traffic",
]


class DeployStarted(EventRecord):
    """A rollout begun: promotion's record (target, layout, what it replaces), then the controller's
    (the fleet it found, its steps, and the target's own `about`: the local front or the cluster)."""

    kind: Literal["deploy_started"] = Field("deploy_started", description="the event's kind")
    target: str | None = Field(None, description="promotion: the release's target")
    layout: str | None = Field(None, description="promotion: the chosen layout")
    replacing: int | None = Field(None, description="promotion: the live release it replaces")
    release_id: str | None = Field(None, description="controller: the release rolled out")
    live_release: str | None = Field(None, description="controller: the release serving beside it")
    live_servers: int | None = Field(None, description="controller: that release's servers")
    kept_servers: int | None = Field(None, description="controller: the release's own servers already running")
    steps: list[ServerStep] | None = Field(None, description="controller: the rollout's steps")
    front: str | None = Field(None, description="local target: the front's address")
    namespace: str | None = Field(None, description="kubernetes target: the namespace")
    server: str | None = Field(None, description="kubernetes target: the API server")
    objects: list[str] | None = Field(None, description="kubernetes target: the release's objects, Kind/name")


class SmokeTest(EventRecord):
    """A smoke completion at the new release's servers before they take traffic (on Kubernetes
    through the Gateway: the GatewaySmoke's fields)."""

    kind: Literal["smoke_test"] = Field("smoke_test", description="the event's kind")
    ok: bool = Field(description="it answered")
    error: str | None = Field(None, description="why not")
    ports: list[int] | None = Field(None, description="local target: the engines asked")
    prompt: str | None = Field(None, description="local target: the prompt")
    step: int | None = Field(None, description="kubernetes target: the step it checked")
    gateway: str | None = Field(None, description=GatewaySmoke.model_fields["gateway"].description)
    url: str | None = Field(None, description=GatewaySmoke.model_fields["url"].description)
    release: str | None = Field(None, description=GatewaySmoke.model_fields["release"].description)
    answered_by: str | None = Field(None, description=GatewaySmoke.model_fields["answered_by"].description)
    tries: int | None = Field(None, description=GatewaySmoke.model_fields["tries"].description)
    wrong: list[str] | None = Field(None, description=GatewaySmoke.model_fields["wrong"].description)
    text: str | None = Field(None, description="the completion")


class RolloutAccuracy(EventRecord):
    """A step's served-answers check (a ServedAccuracy's fields), or why it was skipped."""

    kind: Literal["rollout_accuracy"] = Field("rollout_accuracy", description="the event's kind")
    step: int = Field(description="the rollout step, from 1")
    new_servers: int | None = Field(None, description="kubernetes target: the new release's servers")
    skipped: str | None = Field(None, description="why it was not checked")
    summary: str | None = Field(None, description="each task's served score vs in-process, one line")
    passed: bool | None = Field(None, description="the served table's validation passed")
    endpoint: str | None = Field(None, description="the engine URL scored through")
    limit: int | None = Field(None, description="first N items of each task; None: all the gate's items")
    tasks: list[TaskVerdict] | None = Field(None, description="per task: served vs in-process")
    failures: list[str] | None = Field(None, description="one line per failed expectation")
    seconds: float | None = Field(None, description="what the check took, s")
    validation_json: str | None = Field(None, description="GX validation result as JSON, a path")
    validation_html: str | None = Field(None, description="GX validation result for reviewers, a path")


class Traffic(EventRecord):
    """The route's weights set."""

    kind: Literal["traffic"] = Field("traffic", description="the event's kind")
    weights: dict[str, int] = Field(description="backend -> weight")
    at_s: float = Field(description="seconds since the rollout began")
    step: int | None = Field(None, description="the step that moved it")
    seconds: float | None = Field(None, description="an abort's: seconds since it began")


class RolloutStep(EventRecord):
    """A rollout step done: its servers and, where judged, its analysis."""

    kind: Literal["rollout_step"] = Field("rollout_step", description="the event's kind")
    step: int = Field(description="the rollout step, from 1")
    fraction: float = Field(description="the new release's share of the traffic")
    old_servers: int = Field(description="the old release's servers while judged")
    new_servers: int = Field(description="the new release's servers")
    seconds: float = Field(description="how long the step took, s")
    analysis: StepAnalysis | None = Field(None, description="its analysis, where judged")
    passed: bool | None = Field(None, description="the analysis passed, where judged")


class RolloutComplete(EventRecord):
    """The rollout done (the controller's figures), or a keep window finished by `recover` (promotion's)."""

    kind: Literal["rollout_complete"] = Field("rollout_complete", description="the event's kind")
    kept_at_zero: str | None = Field(None, description="controller: the old release, kept at zero servers")
    seconds: float | None = Field(None, description="controller: the rollout's length, s")
    all_traffic_after_s: float | None = Field(None, description="controller: when the new release took it all, s")
    servers: int | None = Field(None, description="controller: the new release's servers")
    keep_window: str | None = Field(None, description="recover: how the keep window ended")
    scaled_to_zero: str | None = Field(None, description="recover: the old release it scaled to zero")


class RolloutStopped(EventRecord):
    """A rollout stopped before it was done (aborted or failed)."""

    error: str = Field(description="what went wrong")
    seconds: float | None = Field(None, description="how long it ran before, s")


class RolloutAbort(RolloutStopped):
    """A step's analysis or served answers failed: the rollout stopped."""

    kind: Literal["rollout_aborted"] = Field("rollout_aborted", description="the event's kind")


class RolloutFailure(RolloutStopped):
    """The rollout failed on an error."""

    kind: Literal["rollout_failed"] = Field("rollout_failed", description="the event's kind")


class ScaledToZero(EventRecord):
    """A release's servers scaled to zero (its objects kept)."""

    kind: Literal["scaled_to_zero"] = Field("scaled_to_zero", description="the event's kind")
    release: str = Field(description="the release")


class Overload(BaseModel):
    """Wrong answers left the new release at once: how far over the old servers still running run."""

    model_config = ConfigDict(extra="forbid")

    servers: int = Field(description="the old servers running")
    load_of_servers: int = Field(description="the servers whose load they take")
    factor: float = Field(description="load_of_servers / servers")


class RollbackStarted(EventRecord):
    """A rollback's start: promotion's (a person's or the re-benchmark's, with the status its release
    had before: a dead rollback's release goes back to it), or the controller's undo of a rollout."""

    kind: Literal["rollback_started"] = Field("rollback_started", description="the event's kind")
    to_release: str | None = Field(None, description="controller: the release the undo goes back to")
    reason: str | None = Field(None, description="why")
    from_release: int | None = Field(None, alias="from", description="promotion: the live release rolled back from")
    was: str | None = Field(None, description="promotion: the release's status before; None: an undo's start")
    overload: Overload | None = Field(None, description="controller: the old servers' overload meanwhile")


class RollbackFailed(EventRecord):
    """A rollback (promotion's) or an undo (the controller's) that failed."""

    kind: Literal["rollback_failed"] = Field("rollback_failed", description="the event's kind")
    to_release: str | None = Field(None, description="controller: the release it went back to")
    reason: str | None = Field(None, description="promotion: why it was rolled back")
    error: str = Field(description="what went wrong")


class RollbackComplete(EventRecord):
    """The controller's undo done: the old release serves all the traffic again."""

    kind: Literal["rollback_complete"] = Field("rollback_complete", description="the event's kind")
    to_release: str = Field(description="the release serving again")
    servers: int = Field(description="its servers")
    seconds: float = Field(description="how long the undo took, s")


class Recovered(EventRecord):
    """A dead controller's rollout brought to an end by `recover()`: what it found."""

    kind: Literal["recovered"] = Field("recovered", description="the event's kind")
    state: str = Field(
        "nothing applied",
        description="complete, undone, or nothing of the release was applied; 'nothing applied' before recover() said",
    )
    release_id: str | None = Field(None, description="the release recovered")
    replacing: str | None = Field(None, description="the release it was replacing")
    weights: dict[str, int] | None = Field(None, description="the route's weights found")
    old_servers: int | None = Field(None, description="the old release's servers found")
    new_servers: int | None = Field(None, description="the new release's servers found")


class KeepWindow(EventRecord):
    """The keep window after a release carries all traffic: the old servers stay until `until`."""

    kind: Literal["scale_down_delay"] = Field("scale_down_delay", description="the event's kind")
    seconds: float | None = Field(None, description="the window's length, s (rollout.scale_down_delay)")
    old_servers: int | None = Field(None, description="the old release's servers kept meanwhile")
    until: float = Field(0.0, description="when the old servers may go, Unix time (recover finishes it after)")


class ScaleDownSkipped(EventRecord):
    """The old release kept its servers after the keep window."""

    kind: Literal["scale_down_skipped"] = Field("scale_down_skipped", description="the event's kind")
    reason: str = Field(description="why")


class Pruned(EventRecord):
    """What of other releases the rollout removed before it began."""

    kind: Literal["pruned"] = Field("pruned", description="the event's kind")
    engines: list[str] | None = Field(None, description="local target: the engines stopped, by pid file")
    objects: list[str] | None = Field(None, description="kubernetes target: the objects deleted, Kind/name")


class Stopped(EventRecord):
    """A local release's engines stopped after their drain."""

    kind: Literal["stopped"] = Field("stopped", description="the event's kind")
    release: int = Field(description="the release stopped")
    drain: dict[str, int | float | None] | None = Field(
        description="what the drain saw (local_target.drain); None: nothing"
    )
    front_failed: int = Field(description="requests the front failed meanwhile")


class AutoscalerResumed(EventRecord):
    """KEDA's scalers of the release resumed."""

    kind: Literal["autoscaler_resumed"] = Field("autoscaler_resumed", description="the event's kind")
    scaled_objects: list[str] = Field(description="the ScaledObjects")


class AutoscalerLeftPaused(EventRecord):
    """KEDA's scalers left paused (someone else paused them)."""

    kind: Literal["autoscaler_left_paused"] = Field("autoscaler_left_paused", description="the event's kind")
    scaled_objects: list[str] = Field(description="the ScaledObjects")
    by: str = Field(description="who paused them")


class AutoscalerMissing(EventRecord):
    """A KEDA scaler of the release was gone."""

    kind: Literal["autoscaler_missing"] = Field("autoscaler_missing", description="the event's kind")
    scaled_object: str = Field(description="the ScaledObject")


class DeployFinished(EventRecord):
    """The release carries all the traffic: live, with where it serves."""

    kind: Literal["deploy_finished"] = Field("deploy_finished", description="the event's kind")
    recovered: bool | None = Field(None, description="a recovery finished it")
    target: str | None = Field(None, description="the release's target")
    endpoint: str | None = Field(None, description="where it serves")
    deployment: Deployment | None = Field(None, description="local target: the running instance")


class Superseded(EventRecord):
    """A newer release took over."""

    kind: Literal["superseded"] = Field("superseded", description="the event's kind")
    by: int = Field(description="the release that took over")


class RecoveryStarted(EventRecord):
    """`recover()` began on a release a dead controller left deploying."""

    kind: Literal["recovery_started"] = Field("recovery_started", description="the event's kind")
    target: str = Field(description="the release's target")


class DeployFailure(EventRecord):
    """The rollout failed: undone, or nothing serves."""

    kind: Literal["deploy_failed"] = Field("deploy_failed", description="the event's kind")
    error: str = Field(description="what went wrong")
    previous_serving: int | None = Field(None, description="the earlier release serving again, if any")
    problems: list[str] | None = Field(None, description="the rendered manifests' schema problems")


class ManifestsRendered(EventRecord):
    """The release's Kubernetes objects rendered, validated and kept."""

    kind: Literal["manifests_rendered"] = Field("manifests_rendered", description="the event's kind")
    objects: list[str] = Field(description="Kind/name of each")
    file: str = Field(description="where they were written, as YAML")
    servers: int = Field(description="the servers they were rendered for")


class ControllerInterrupted(ErrorEvent):
    """The controller's task was terminated mid-rollout (left deploying, for recovery)."""

    kind: Literal["controller_interrupted"] = Field("controller_interrupted", description="the event's kind")


class LeaseLoss(ErrorEvent):
    """Another controller took the model's lock meanwhile."""

    kind: Literal["lease_lost"] = Field("lease_lost", description="the event's kind")


class RollbackFinished(EventRecord):
    """A rollback done: the earlier release serves again, and how."""

    kind: Literal["rollback_finished"] = Field("rollback_finished", description="the event's kind")
    reason: str = Field(description="why it was rolled back")
    path: str = Field(description="kept objects, re-rollout, or resumed (a dead rollback recovered)")
    all_traffic_after_s: float | None = Field(None, description="when it took all the traffic back, s")
    seconds: float | None = Field(None, description="how long it took, s")
    events: list[str] | None = Field(None, description="the controller's events, by kind")
    endpoint: str | None = Field(None, description="where it serves")
    deployment: Deployment | None = Field(None, description="local target: the running instance")


class RolledBack(EventRecord):
    """This release gave the traffic back to an earlier one."""

    kind: Literal["rolled_back"] = Field("rolled_back", description="the event's kind")
    reason: str | None = Field(None, description="why")
    restored: int = Field(description="the release serving again")


class JudgedStep(StepAnalysis, EventRecord):
    """A rollout step's analysis put to its reviewers, with how long the review waits."""

    kind: Literal["rollout_step_judged"] = Field("rollout_step_judged", description="the event's kind")
    review_timeout_s: float = Field(description="how long the review waits for an answer, s")


class StepReviewed(StepReview, EventRecord):
    """A reviewer's Continue / Abort on a rollout step (or the verdict by default)."""

    kind: Literal["step_review"] = Field("step_review", description="the event's kind")


class FleetResized(EventRecord):
    """A spike met during a rollout: the paused scalers' demand needed more servers than the rollout
    was sized for, and the controller grew the fleet to it (controller.rollout)."""

    kind: Literal["fleet_resized"] = Field("fleet_resized", description="the event's kind")
    step: int = Field(description="the step before whose wave the demand was read, from 1")
    servers: int = Field(description="servers the demand needs: the fleet now")
    sized_for: int = Field(description="servers the rollout was sized for until then")
