"""The evidence of the registry's events that later steps read back: each read as its record
(`Event.detail_as`), never by string key. The stored detail keeps its shape (the audit trail and
older releases show it as written)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pipeline.records.rebenchmark import Remeasure
from pipeline.records.rollout import StepAnalysis
from pipeline.records.selection import ChosenFigures

__all__ = ["GateVerdict", "JudgedStep", "KeepWindow", "Recovered", "RollbackStarted", "SloGate", "TrendPoint"]


class GateVerdict(BaseModel):
    """An accuracy or SLO gate's event: its verdict (what promotion checks)."""

    passed: bool = Field(False, description="the gate passed (an event without a verdict: it did not)")


class SloGate(GateVerdict):
    """The SLO gate's event: the verdict, the chosen layout's figures nested whole, the fleet's size.
    (Until the registry was typed, the figures were spread flat beside the verdict.)"""

    reason: str = Field(description="the verdict in words (LayoutSelection.reason)")
    chosen: ChosenFigures | None = Field(None, description="the chosen layout's figures; None: none chosen")
    servers: int | None = Field(None, description="the chosen layout's fleet at the spec's peak; None: no capacity:")
    usd_per_hour: float | None = Field(None, description="that fleet's cost, USD per hour; None: no price")
    vs_live: str | None = Field(None, description="the change from the live release's fleet, in words")


class TrendPoint(Remeasure):
    """A re-benchmark's point on the release's trend: the fresh measurement, its verdict, where it ran."""

    engine_image: str | None = Field(None, description="the engine image that ran it (rebenchmark.versions)")
    engine: str | None = Field(None, description="the engine package and version that ran it")
    verdict: Literal["ok", "degraded"] = Field(description="the re-benchmark's verdict on this point")
    out_dir: str = Field(description="where the measurement wrote its files")


class JudgedStep(StepAnalysis):
    """A rollout step's analysis put to its reviewers, with how long the review waits."""

    review_timeout_s: float = Field(description="how long the review waits for an answer, s")


class Recovered(BaseModel):
    """A dead controller's rollout brought to an end by `recover()`: what it found."""

    state: str = Field(
        "nothing applied",
        description="complete, undone, or nothing of the release was applied; 'nothing applied' before recover() said",
    )


class RollbackStarted(BaseModel):
    """A rollback's start, as promote records it: the status its release had before (a dead
    rollback's release goes back to it). The controller's undo writes the same kind without it."""

    was: str | None = Field(None, description="the release's status before the rollback; None: an undo's start")


class KeepWindow(BaseModel):
    """The keep window after a release carries all traffic: the old servers stay until `until`."""

    until: float = Field(0.0, description="when the old servers may go, Unix time (recover finishes it after)")
    seconds: float | None = Field(None, description="the window's length, s (rollout.scale_down_delay)")
    old_servers: int | None = Field(None, description="the old release's servers kept meanwhile")
