"""The events of a live release: its endpoint verified, its re-benchmarks and their alerts, the
demo's stop (`release/promote.py`, `release/rebenchmark.py`, `release/alerts.py`,
`embedded/demo.py`). One record per kind; `events.py` reads them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.records.events_base import ErrorEvent, EventRecord
from pipeline.records.rebenchmark import Remeasure, Verdict

__all__ = [
    "Alert",
    "AlertFailed",
    "RebenchmarkCancelled",
    "RebenchmarkFailed",
    "ServingStopped",
    "TrendPoint",
    "Verified",
    "VerifyFailed",
]


class Verified(EventRecord):
    """The live endpoint answered a completion."""

    kind: Literal["verified"] = Field("verified", description="the event's kind")
    url: str = Field(description="the address asked")
    text: str = Field(description="the completion")


class VerifyFailed(ErrorEvent):
    """The live endpoint did not answer a completion."""

    kind: Literal["verify_failed"] = Field("verify_failed", description="the event's kind")


class AlertFailed(ErrorEvent):
    """A re-benchmark's alert could not be sent."""

    kind: Literal["alert_failed"] = Field("alert_failed", description="the event's kind")


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


class ServingStopped(EventRecord):
    """The embedded demo stopped the release it served."""

    kind: Literal["serving_stopped"] = Field("serving_stopped", description="the event's kind")
    why: str = Field(description="why")
