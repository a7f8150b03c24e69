"""The serving-path accuracy check's records: one layout's served table and verdict, and the summary
the registry keeps (`pipeline/stages/served_accuracy.py` runs the check)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pipeline.records.evaluate import TaskVerdict

__all__ = [
    "ServedAccuracy",
    "ServedSummary",
    "ServedTask",
]


class ServedAccuracy(BaseModel):
    """One layout's serving-path check: the served table and its verdict."""

    passed: bool = Field(description="the GX validation of the served table passed")
    endpoint: str = Field(description="the engine URL lm-eval scored through")
    limit: int | None = Field(description="first N items of each task; None: all the gate's items")
    tasks: list[TaskVerdict] = Field(description="candidate = the served score; in_process = the candidate in-process")
    failures: list[str] = Field(default_factory=list, description="one line per failed expectation, naming the task")
    seconds: float = Field(description="what the check added to the layout's benchmark")
    validation_json: str | None = Field(None, description="GX validation result as JSON, a path")
    validation_html: str | None = Field(None, description="GX validation result rendered for reviewers, a path")

    def summary(self) -> str:
        """One line a table cell can hold: each task's served score vs in-process."""
        return ", ".join(
            f"{t.task} {t.candidate:.3f}/{t.in_process:.3f}"
            if t.in_process is not None
            else f"{t.task} {t.candidate:.3f}"
            for t in self.tasks
        )


class ServedTask(BaseModel):
    served: float = Field(description="the candidate's score at the layout's endpoint")
    in_process: float | None = Field(description="the candidate in-process on the same items")


class ServedSummary(BaseModel):
    """One layout's serving-path check as the registry keeps it (the release's `served_accuracy`)."""

    layout: str = Field(description="the layout's name")
    passed: bool = Field(description="the check passed (ServedAccuracy.passed)")
    seconds: float = Field(description="what the check added to the layout's benchmark, s")
    tasks: dict[str, ServedTask] = Field(description="task -> served and in-process scores")

    @classmethod
    def of(cls, layout: str, served: ServedAccuracy) -> ServedSummary:
        tasks = {t.task: ServedTask(served=t.candidate, in_process=t.in_process) for t in served.tasks}
        return cls(layout=layout, passed=served.passed, seconds=served.seconds, tasks=tasks)
