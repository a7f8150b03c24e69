"""The events of a release's run up to its promotion: opened, staged, planned, the gates' verdicts,
the report, the reviewers' approval or the promotion's refusal (`release/registry.py`,
`entry/flow.py`, `airflow/approval.py`, `release/promote.py` write them). One record per kind;
`events.py` reads them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.records.events_base import EventRecord
from pipeline.records.plan import LayoutPrediction, MeasuredLayouts
from pipeline.records.selection import ChosenFigures

__all__ = [
    "AccuracyGate",
    "ApprovalRequested",
    "Approved",
    "Created",
    "GateVerdict",
    "LayoutsChosen",
    "Predicted",
    "PromotionRefusal",
    "Rejected",
    "ReportWritten",
    "ReviewDecision",
    "SloGate",
    "Staged",
]


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
