"""The model source's record: the materialized directory and its manifest hash, which content-addresses
everything derived from it (`pipeline/stages/sources.py` materializes it)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = [
    "ModelSource",
]


class ModelSource(BaseModel):
    uri: str = Field(description="the spec's model.source: builtin://, hf:// or a local path")
    path: str = Field(description="the materialized local directory")
    manifest_hash: str = Field(description="its manifest's content hash: what everything derived from it keys on")
    total_bytes: int = Field(description="all its files, bytes")
    files: int = Field(description="files in its manifest")
