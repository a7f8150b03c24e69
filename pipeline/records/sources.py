"""The model source's record: the materialized directory and its manifest hash, which content-addresses
everything derived from it (`pipeline/stages/sources.py` materializes it)."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = [
    "ModelSource",
]


class ModelSource(BaseModel):
    uri: str
    path: str
    manifest_hash: str
    total_bytes: int
    files: int
