"""What a step pod prints (its XCom) about the result it stored: where, and the little a light task
needs before reading it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pipeline.records.benchmark import LayoutResult

__all__ = ["Remeasured", "SideResult", "StoredLayout", "StoredRemeasure"]


class SideResult(BaseModel):
    """An evaluation pod's side of the accuracy comparison, stored as an EvalResult at `result_uri`."""

    side: str = Field(description="baseline or candidate")
    result_uri: str = Field(description="where its EvalResult is stored: s3:// URI or a path on the shared volume")
    model_manifest_hash: str = Field(description="what it evaluated, by content")


class StoredLayout(BaseModel):
    """A benchmark pod's layout, its LayoutResult stored at `result_uri`."""

    layout: str = Field(description="the layout's name")
    status: str = Field(description="the search's status: ok, or why the layout failed")
    result_uri: str = Field(description="where its LayoutResult is stored: s3:// URI or a path on the shared volume")


class StoredRemeasure(BaseModel):
    """A re-benchmark pod's measurement of a live release, stored at `result_uri` for the judge task."""

    release_id: int = Field(description="the registry's release that was re-benchmarked")
    status: str = Field(description="ok, or error: it could not measure (the stored result says why)")
    result_uri: str = Field(description="where its Remeasured is stored: s3:// URI or a path on the shared volume")


class Remeasured(BaseModel):
    """What a re-benchmark pod stores for the judge task: the measurement, or why there is none."""

    status: Literal["ok", "error"] = Field(description="ok: measured (result); error: it could not (error)")
    result: LayoutResult | None = Field(None, description="the fresh instance's measurement; None on error")
    error: str | None = Field(None, description="why it could not measure (artifact gone, engine would not start)")
    versions: dict[str, str] = Field(default_factory=dict, description="engine image and package versions")
