"""The scheduled re-measurement of a live release (`rebenchmark:`) and where its verdict goes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.specs.base import Strict


class NotifySpec(Strict):
    """Where a re-benchmark verdict goes: the registry always; also e-mail or Slack via an Airflow connection."""

    kind: Literal["log", "smtp", "slack"] = "log"
    connection_id: str | None = Field(None, description="Airflow connection (smtp or slack webhook)")
    to: list[str] = Field(default_factory=list, description="e-mail recipients (smtp)")
    from_email: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> NotifySpec:
        if self.kind != "log" and not self.connection_id:
            raise ValueError(f"kind {self.kind!r} needs connection_id")
        if self.kind == "smtp" and not self.to:
            raise ValueError("kind 'smtp' needs at least one address in to")
        return self


# Airflow's cron presets (a CronTriggerTimetable takes these or a cron expression)
SCHEDULE_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")


class RebenchmarkSpec(Strict):
    schedule: str = Field("@daily", description="a cron expression or an Airflow preset (@daily, ...)")
    tolerance: Annotated[float, Field(gt=0, lt=1, description="allowed drop of the max SLO rate")] = 0.10
    auto_rollback: bool = False
    max_probes: Annotated[
        int, Field(ge=3, description="runs of the short search, which starts at the promoted rate and steps by 1.25x")
    ] = 8
    notify: NotifySpec = Field(default_factory=NotifySpec)

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        from croniter import croniter

        if value in SCHEDULE_PRESETS or (not value.startswith("@") and croniter.is_valid(value)):
            return value
        raise ValueError(
            f"{value!r} is neither a cron expression (e.g. '0 3 * * 2') nor an Airflow preset "
            f"({', '.join(SCHEDULE_PRESETS)})"
        )
