"""The quantize stage's records: the numeric check, the stage's result and the artifact the quantize
task hands on (`pipeline/stages/quantize.py` builds and verifies the FP8 checkpoint)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = [
    "NumericCheck",
    "QuantizeResult",
    "QuantizedArtifact",
]


class NumericCheck(BaseModel):
    """FP8 vs source logits on a few prompts (transformers, CPU)."""

    prompts: int = 0
    max_rel_error: float | None = Field(None, description="max over prompts of ||fp8 - src|| / ||src|| of the logits")
    mean_rel_error: float | None = None
    top1_agreement: float | None = Field(None, description="share of positions where both pick the same next token")
    skipped: str | None = None


class QuantizeResult(BaseModel):
    path: str
    manifest_hash: str
    method: str
    scheme: str
    source_manifest_hash: str
    reused: bool = Field(description="an identical finished output existed; nothing was recomputed")
    seconds: float
    source_bytes: int
    output_bytes: int
    mb_per_s: float = Field(description="MB of source weights read per second")
    tensors_quantized: int
    tensors_kept: int
    numeric_check: NumericCheck

    def artifact(self) -> QuantizedArtifact:
        return QuantizedArtifact(
            path=self.path,
            manifest_hash=self.manifest_hash,
            method=self.method,
            reused=self.reused,
            mb_per_s=self.mb_per_s,
            max_rel_error=self.numeric_check.max_rel_error,
        )


class QuantizedArtifact(BaseModel):
    """What the quantize task hands on (XCom): the published FP8 artifact and how it was made."""

    path: str
    manifest_hash: str
    method: str
    reused: bool
    mb_per_s: float
    max_rel_error: float
