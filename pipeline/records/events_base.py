"""What every event record is: the base each kind's record derives from, and the shape of an event
that says only what went wrong. Below the kinds' modules (`events_run`, `events_rollout`,
`events_live`) and the union that reads them back (`events.py`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, JsonValue

__all__ = ["ErrorEvent", "EventRecord"]


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


class ErrorEvent(EventRecord):
    """An event that says only what went wrong."""

    error: str = Field(description="what went wrong")
