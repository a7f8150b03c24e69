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

The records live by phase: `events_run` (the run up to promotion), `events_rollout` (a rollout
and its undo), `events_live` (a live release), over `events_base`; this module is their union
and its reading, and hands every record on.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import BaseModel, Field, JsonValue, TypeAdapter, ValidationError

from pipeline.records.events_base import ErrorEvent, EventRecord
from pipeline.records.events_live import (
    Alert,
    AlertFailed,
    RebenchmarkCancelled,
    RebenchmarkFailed,
    ServingStopped,
    TrendPoint,
    Verified,
    VerifyFailed,
)
from pipeline.records.events_rollout import (
    AutoscalerLeftPaused,
    AutoscalerMissing,
    AutoscalerResumed,
    ControllerInterrupted,
    DeployFailure,
    DeployFinished,
    DeployStarted,
    FleetResized,
    JudgedStep,
    KeepWindow,
    LeaseLoss,
    ManifestsRendered,
    Overload,
    Pruned,
    Recovered,
    RecoveryStarted,
    RollbackComplete,
    RollbackFailed,
    RollbackFinished,
    RollbackStarted,
    RolledBack,
    RolloutAbort,
    RolloutAccuracy,
    RolloutComplete,
    RolloutFailure,
    RolloutStep,
    RolloutStopped,
    ScaleDownSkipped,
    ScaledToZero,
    SmokeTest,
    StepReviewed,
    Stopped,
    Superseded,
    Traffic,
)
from pipeline.records.events_run import (
    AccuracyGate,
    ApprovalRequested,
    Approved,
    Created,
    GateVerdict,
    LayoutsChosen,
    Predicted,
    PromotionRefusal,
    Rejected,
    ReportWritten,
    ReviewDecision,
    SloGate,
    Staged,
)

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
