"""The registry's events, one record per kind: what each event's evidence (its `detail`) holds.

`EventDetail` is their union, discriminated by `kind`: `Registry.record` takes one of them (the
kind is the record's own, so no caller writes a kind with another's shape, and a misspelt or
mistyped field is refused naming the kind and the field), and `Event.detail` reads back as one.
The stored detail keeps its JSON shape (the kind lives in the row's own column, not in the JSON;
a field is stored only where its writer set it), so the audit trail shows an event as written and
rows of older releases read as they were. A stored kind no record knows (one an older release
wrote, or a row that no longer fits its record) reads as `UnreadEvent`: the JSON kept whole, typed
as JSON, with why it did not read.

Some kinds have two writers that know different things (the rollout controller and promotion
both write `deploy_started`, `rollback_started`, `rollback_failed`, `rollout_complete`): their
record is one, each writer's fields optional where the other has none.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError, model_validator

from pipeline.core.rollout import Deployment, ServerStep
from pipeline.records.evaluate import TaskVerdict
from pipeline.records.plan import LayoutPrediction, MeasuredLayouts
from pipeline.records.rebenchmark import Remeasure, Verdict
from pipeline.records.rollout import GatewaySmoke, StepAnalysis, StepReview
from pipeline.records.selection import ChosenFigures

__all__ = [
    "AccuracyGate",
    "Alert",
    "AlertFailed",
    "ApprovalRequested",
    "Approved",
    "AutoscalerLeftPaused",
    "AutoscalerMissing",
    "AutoscalerResumed",
    "ControllerInterrupted",
    "Created",
    "DeployFailure",
    "DeployFinished",
    "DeployStarted",
    "ErrorEvent",
    "EventRecord",
    "FleetResized",
    "GateVerdict",
    "JudgedStep",
    "KeepWindow",
    "LayoutsChosen",
    "LeaseLoss",
    "ManifestsRendered",
    "Overload",
    "Predicted",
    "PromotionRefusal",
    "Pruned",
    "RebenchmarkCancelled",
    "RebenchmarkFailed",
    "Recovered",
    "RecoveryStarted",
    "Rejected",
    "ReportWritten",
    "ReviewDecision",
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
    "ServingStopped",
    "SloGate",
    "SmokeTest",
    "Staged",
    "StepReviewed",
    "Stopped",
    "Superseded",
    "Traffic",
    "TrendPoint",
    "UnreadEvent",
    "Verified",
    "VerifyFailed",
]


class EventRecord(BaseModel):
    """One kind's evidence. Every record names its `kind` (a Literal, defaulted: a writer never
    spells it); a field it does not declare is refused, naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: str = Field(description="the event's kind: the registry row's `kind` column, not stored in its JSON")

    def stored(self) -> dict[str, JsonValue]:
        """The JSON the registry keeps for it: the fields its writer set, under their stored names."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"kind"})

    def pair(self) -> tuple[str, dict[str, JsonValue]]:
        """(kind, stored JSON): an event as the rollout controller and the targets keep it until
        promotion records it (core.rollout.Event; core imports no records)."""
        return self.kind, self.stored()


class Created(EventRecord):
    """A release opened for a run (`Registry.open_release`)."""

    kind: Literal["created"] = Field("created", description="the event's kind")
    run_key: str = Field(description="the Airflow run id that opened it")
    spec_path: str = Field(description="the spec it was opened from")


class Staged(EventRecord):
    """The FP8 artifact staged, by manifest hash."""

    kind: Literal["staged"] = Field("staged", description="the event's kind")
    manifest_hash: str | None = Field(None, description="the staged artifact's manifest hash")
    s3_uri: str | None = Field(None, description="the staged artifact on S3 / Spaces")
    nfs_path: str | None = Field(None, description="the staged artifact on the NFS share")
    bytes_sent: int | None = Field(None, description="bytes uploaded (0: already there)")


class GateVerdict(EventRecord):
    """What every gate's event says first: its verdict (what promotion checks)."""

    passed: bool = Field(False, description="the gate passed (an event without a verdict: it did not)")


class AccuracyGate(GateVerdict):
    """The accuracy gate's verdict and its failed expectations."""

    kind: Literal["accuracy_gate"] = Field("accuracy_gate", description="the event's kind")
    failures: list[str] = Field(default_factory=list, description="one line per failed expectation")


def _nest_flat_figures(data: Any) -> Any:
    """An SLO gate recorded before the figures were nested (up to 1b3a689) keeps them flat beside the
    verdict: read into `chosen` (the same reading as ReleaseData's)."""
    if not isinstance(data, dict) or "layout" not in data:
        return data
    flat = {k: data[k] for k in ChosenFigures.model_fields if k in data}
    rest = {k: v for k, v in data.items() if k not in flat}
    if rest.get("chosen") is None:
        rest["chosen"] = {k: None for k, f in ChosenFigures.model_fields.items() if f.is_required()} | flat
    return rest


class SloGate(GateVerdict):
    """The SLO gate's event: the verdict, the chosen layout's figures nested whole, the fleet's size.
    (Until the registry was typed, the figures were spread flat beside the verdict: read nested.)"""

    kind: Literal["slo_gate"] = Field("slo_gate", description="the event's kind")
    reason: str | None = Field(None, description="the verdict in words (LayoutSelection.reason)")
    chosen: ChosenFigures | None = Field(None, description="the chosen layout's figures; None: none chosen")
    servers: int | None = Field(None, description="the chosen layout's fleet at the spec's peak; None: no capacity:")
    usd_per_hour: float | None = Field(None, description="that fleet's cost, USD per hour; None: no price")
    vs_live: str | None = Field(None, description="the change from the live release's fleet, in words")

    _flat = model_validator(mode="before")(_nest_flat_figures)


class Predicted(EventRecord):
    """The planner's predictions for every layout, before any measurement."""

    kind: Literal["predicted"] = Field("predicted", description="the event's kind")
    layouts: list[LayoutPrediction] = Field(description="one per layout of the spec")
    step_times: str = Field("", description="where the planner's step times came from")


class LayoutsChosen(MeasuredLayouts, EventRecord):
    """Which layouts the run measures, where the planner skipped some."""

    kind: Literal["layouts_chosen"] = Field("layouts_chosen", description="the event's kind")


class ReportWritten(EventRecord):
    """The reviewer report written (or moved)."""

    kind: Literal["report"] = Field("report", description="the event's kind")
    path: str = Field(description="the report's path")


class ApprovalRequested(EventRecord):
    """The release put to its reviewers (Airflow's HITL)."""

    kind: Literal["approval_requested"] = Field("approval_requested", description="the event's kind")
    reviewers: list[str] = Field(description="who may approve (spec promotion.reviewers)")
    timeout: str = Field(description="how long the request waits (spec promotion.approval_timeout)")
    subject: str = Field(description="what the reviewers were asked")


class ReviewDecision(EventRecord):
    """A reviewer's decision on a release (Approved or Rejected)."""

    comment: str | None = Field(None, description="the reviewer's comment, or the policy that decided")
    responded_at: str | None = Field(None, description="when the reviewer answered (Airflow's time)")
    user_name: str | None = Field(None, description="the reviewer's name (the actor is their id)")


class Approved(ReviewDecision):
    """A reviewer (or the spec's policy) approved the release."""

    kind: Literal["approved"] = Field("approved", description="the event's kind")


class Rejected(ReviewDecision):
    """A reviewer rejected the release, or nobody answered in time."""

    kind: Literal["rejected"] = Field("rejected", description="the event's kind")
    error: str | None = Field(None, description="the HITL's error type, where nobody answered")


class PromotionRefusal(EventRecord):
    """Promotion refused: the gates, approval or artifact said no."""

    kind: Literal["promotion_refused"] = Field("promotion_refused", description="the event's kind")
    reasons: list[str] = Field(description="every reason, one line each")


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


class Verified(EventRecord):
    """The live endpoint answered a completion."""

    kind: Literal["verified"] = Field("verified", description="the event's kind")
    url: str = Field(description="the address asked")
    text: str = Field(description="the completion")


class ErrorEvent(EventRecord):
    """An event that says only what went wrong."""

    error: str = Field(description="what went wrong")


class VerifyFailed(ErrorEvent):
    """The live endpoint did not answer a completion."""

    kind: Literal["verify_failed"] = Field("verify_failed", description="the event's kind")


class ControllerInterrupted(ErrorEvent):
    """The controller's task was terminated mid-rollout (left deploying, for recovery)."""

    kind: Literal["controller_interrupted"] = Field("controller_interrupted", description="the event's kind")


class LeaseLoss(ErrorEvent):
    """Another controller took the model's lock meanwhile."""

    kind: Literal["lease_lost"] = Field("lease_lost", description="the event's kind")


class AlertFailed(ErrorEvent):
    """A re-benchmark's alert could not be sent."""

    kind: Literal["alert_failed"] = Field("alert_failed", description="the event's kind")


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


class RebenchmarkCancelled(Verdict, EventRecord):
    """A re-benchmark stopped from outside: its verdict."""

    kind: Literal["rebenchmark_cancelled"] = Field("rebenchmark_cancelled", description="the event's kind")


class RebenchmarkFailed(Verdict, EventRecord):
    """A re-benchmark that could not measure: its verdict."""

    kind: Literal["rebenchmark_failed"] = Field("rebenchmark_failed", description="the event's kind")


class TrendPoint(Remeasure, EventRecord):
    """A re-benchmark's point on the release's trend: the fresh measurement, its verdict, where it ran."""

    kind: Literal["trend_point"] = Field("trend_point", description="the event's kind")
    engine_image: str | None = Field(None, description="the engine image that ran it (rebenchmark.versions)")
    engine: str | None = Field(None, description="the engine package and version that ran it")
    verdict: Literal["ok", "degraded"] = Field(description="the re-benchmark's verdict on this point")
    out_dir: str = Field(description="where the measurement wrote its files")


class Alert(EventRecord):
    """A degraded or failed re-benchmark's alert, as sent."""

    kind: Literal["alert"] = Field("alert", description="the event's kind")
    channel: str = Field(description="how it was sent (spec rebenchmark.notify.kind)")
    subject: str = Field(description="its subject")
    to: list[str] | None = Field(None, description="to whom, for mail")
    body: str = Field(description="its text")


class JudgedStep(StepAnalysis, EventRecord):
    """A rollout step's analysis put to its reviewers, with how long the review waits."""

    kind: Literal["rollout_step_judged"] = Field("rollout_step_judged", description="the event's kind")
    review_timeout_s: float = Field(description="how long the review waits for an answer, s")


class StepReviewed(StepReview, EventRecord):
    """A reviewer's Continue / Abort on a rollout step (or the verdict by default)."""

    kind: Literal["step_review"] = Field("step_review", description="the event's kind")


class ServingStopped(EventRecord):
    """The embedded demo stopped the release it served."""

    kind: Literal["serving_stopped"] = Field("serving_stopped", description="the event's kind")
    why: str = Field(description="why")


class FleetResized(EventRecord):
    """A spike met during a rollout: the paused scalers' demand needed more servers than the rollout
    was sized for, and the controller grew the fleet to it (controller.rollout)."""

    kind: Literal["fleet_resized"] = Field("fleet_resized", description="the event's kind")
    step: int = Field(description="the step before whose wave the demand was read, from 1")
    servers: int = Field(description="servers the demand needs: the fleet now")
    sized_for: int = Field(description="servers the rollout was sized for until then")


EventDetail = Annotated[
    Created
    | Staged
    | AccuracyGate
    | SloGate
    | Predicted
    | LayoutsChosen
    | ReportWritten
    | ApprovalRequested
    | Approved
    | Rejected
    | PromotionRefusal
    | DeployStarted
    | SmokeTest
    | RolloutAccuracy
    | Traffic
    | RolloutStep
    | FleetResized
    | RolloutComplete
    | RolloutAbort
    | RolloutFailure
    | ScaledToZero
    | RollbackStarted
    | RollbackFailed
    | RollbackComplete
    | Recovered
    | KeepWindow
    | ScaleDownSkipped
    | Pruned
    | Stopped
    | AutoscalerResumed
    | AutoscalerLeftPaused
    | AutoscalerMissing
    | DeployFinished
    | Superseded
    | RecoveryStarted
    | DeployFailure
    | ManifestsRendered
    | Verified
    | VerifyFailed
    | ControllerInterrupted
    | LeaseLoss
    | AlertFailed
    | RollbackFinished
    | RolledBack
    | RebenchmarkCancelled
    | RebenchmarkFailed
    | TrendPoint
    | Alert
    | JudgedStep
    | StepReviewed
    | ServingStopped,
    Field(discriminator="kind"),
]
DETAIL: TypeAdapter[EventDetail] = TypeAdapter(EventDetail)


def kinds() -> dict[str, type[EventRecord]]:
    """Every kind a record is written for -> its record (the union's members)."""
    members: tuple[type[EventRecord], ...] = get_args(get_args(EventDetail)[0])
    return {record.model_fields["kind"].default: record for record in members}


KINDS = kinds()


class UnreadEvent(BaseModel):
    """A stored event no record reads: a kind this code no longer writes, or a row that no longer
    fits its kind's record. Kept whole as JSON (the audit trail shows it as written); never written."""

    kind: str = Field(description="the stored kind")
    raw: dict[str, JsonValue] = Field(description="the stored detail, as written")
    problem: str = Field(
        description="why it did not read as a record: the kind unknown, or each field that did not fit"
    )

    def stored(self) -> dict[str, JsonValue]:
        """The JSON the registry keeps for it, as written."""
        return self.raw


def detail_of(kind: str, stored: dict[str, Any] | None) -> EventDetail:
    """A `(kind, JSON)` pair, the rollout controller's event as it makes it, read as its kind's
    record: an unknown kind or a field that does not fit is a ValueError naming the kind and field."""
    if kind not in KINDS:
        raise ValueError(f"event {kind!r}: no record for this kind (pipeline/records/events.py)")
    try:
        return DETAIL.validate_python({**(stored or {}), "kind": kind})
    except ValidationError as exc:
        raise ValueError(f"event {kind!r}: {_problem(exc)}") from None


def read(kind: str, stored: dict[str, JsonValue]) -> EventDetail | UnreadEvent:
    """A stored row's detail read as its kind's record, or kept as an `UnreadEvent` saying why not."""
    if kind not in KINDS:
        return UnreadEvent(
            kind=kind, raw=stored, problem=f"no record reads kind {kind!r} (one this code does not write)"
        )
    try:
        return DETAIL.validate_python({**stored, "kind": kind})
    except ValidationError as exc:
        return UnreadEvent(kind=kind, raw=stored, problem=_problem(exc))


def _problem(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'][1:]) or 'kind'}: {err['msg']}" for err in exc.errors(include_url=False)
    )
