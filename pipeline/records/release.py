"""A release run's own records: what `validate` opens, what the review end writes and promotes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.core.specs import limits_by_their_name

__all__ = [
    "ModelRef",
    "Overrides",
    "PromotionOutcome",
    "ReleaseInputs",
    "ReleaseRef",
    "ReportPage",
    "StagedRef",
    "ValidatedRelease",
    "Verification",
]


class Overrides(BaseModel):
    """A trigger's changes to the spec for one run (the DAG's params); empty: the spec as written.
    An unknown name is refused (a misspelt limit must not run the spec's unchanged)."""

    model_config = ConfigDict(extra="forbid")

    layouts: list[str] = Field(default_factory=list, description="layouts to measure, by name; empty: the spec's")
    max_p90_ttft_ms: float | None = Field(None, gt=0, description="the run's p90 TTFT limit, ms; None: the spec's")
    max_p90_tpot_ms: float | None = Field(None, gt=0, description="the run's p90 TPOT limit, ms; None: the spec's")

    @model_validator(mode="before")
    @classmethod
    def limits_by_their_name(cls, data: Any) -> Any:
        return limits_by_their_name(data)  # a trigger's conf from before the limits were named max_

    def any(self) -> bool:
        return bool(self.layouts) or self.max_p90_ttft_ms is not None or self.max_p90_tpot_ms is not None


class ValidatedRelease(BaseModel):
    """What the validate task hands on (XCom): the spec every later task loads, and the release."""

    spec_path: str = Field(description="the spec as this run uses it (a copy with the trigger's overrides)")
    name: str = Field(description="the spec's release name")
    layouts: list[str] = Field(description="every layout of the spec, generated ones included")
    release_id: int | None = Field(None, description="the registry's release, when a run opened one")


class ReleaseInputs(BaseModel):
    """What a release was built from besides its spec text, kept with it in the registry: a rollback
    or re-benchmark months later reads these, not whatever profile or directory is on disk then."""

    model_config = ConfigDict(extra="forbid")

    hardware_path: str = Field(description="where the hardware profile was read from (for messages)")
    hardware_yaml: str = Field(description="the hardware profile's text, as the release was measured on it")
    model_source: str = Field(description="the model source, resolved: a local directory absolute, a URI as written")


class ReleaseRef(BaseModel):
    """A release by its registry id: what the review end needs of a run's validated record, or of a
    promotion's outcome (either record's JSON reads as one)."""

    release_id: int = Field(description="the registry's release (a run that opened none has nothing to review)")


class ModelRef(BaseModel):
    """A model directory by content: a materialized source or a published FP8 artifact, as the
    evaluate step reads either (both records carry these two fields)."""

    path: str = Field(description="the local directory")
    manifest_hash: str = Field(description="sha256 of its manifest: what caches and the registry key on")


class StagedRef(BaseModel):
    """An artifact where it is staged, by manifest hash: what an engine's serving copy is fetched from."""

    manifest_hash: str = Field(description="the artifact's manifest hash: what a fetched copy is verified against")
    s3_uri: str | None = Field(None, description="on S3 / Spaces")
    nfs_path: str | None = Field(None, description="on the NFS share")


class PromotionOutcome(BaseModel):
    """Where a promotion or rollback left a release (also the live-release Asset event's extra)."""

    release_id: int = Field(description="the registry's release")
    name: str = Field("", description="the release's name (the spec's)")
    status: str = Field(description="the registry status after it: live, failed, rolled_back, ...")
    endpoint: str | None = Field(None, description="the URL the release serves at, when it serves")


class ReportPage(BaseModel):
    """The reviewer report of a release: one HTML page, re-rendered in place by later steps."""

    release_id: int = Field(description="the registry's release")
    path: str = Field(description="the HTML page, a path (later steps re-render it there)")


class Verification(BaseModel):
    """The live endpoint's answer after the switch (the verify task)."""

    release_id: int = Field(description="the registry's release")
    endpoint: str = Field(description="the URL that answered the smoke completion")
    text: str = Field(description="the completion it returned")
