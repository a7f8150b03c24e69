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

    prompts: int = Field(0, description="prompts compared; 0 when skipped")
    max_rel_error: float | None = Field(None, description="max over prompts of ||fp8 - src|| / ||src|| of the logits")
    mean_rel_error: float | None = Field(None, description="mean over prompts of the same relative logits error")
    top1_agreement: float | None = Field(None, description="share of positions where both pick the same next token")
    skipped: str | None = Field(
        None, description="why it did not run (checkpoint too large to load here); None: it ran"
    )


class QuantizeResult(BaseModel):
    path: str = Field(description="the published FP8 checkpoint's directory")
    manifest_hash: str = Field(description="its manifest's content hash: what staging, caches and the registry key on")
    method: str = Field(description="how it was built: oneshot, model_free or streaming")
    scheme: str = Field(description="the FP8 scheme (quantization.scheme): FP8_DYNAMIC or FP8_BLOCK")
    source_manifest_hash: str = Field(description="the source model's manifest hash: what it was made from")
    reused: bool = Field(description="an identical finished output existed; nothing was recomputed")
    seconds: float = Field(
        description="conversion wall time, before verification, s (a reused result keeps its build's)"
    )
    source_bytes: int = Field(description="the source's weight shards, bytes")
    output_bytes: int = Field(description="the FP8 checkpoint's weight shards, bytes")
    mb_per_s: float = Field(description="MB of source weights read per second")
    tensors_quantized: int = Field(description="Linear weights verified as FP8 with their scale")
    tensors_kept: int = Field(description="tensors kept unquantized, verified identical to the source")
    numeric_check: NumericCheck = Field(description="FP8 vs source logits on a few prompts")

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

    path: str = Field(description="the published FP8 checkpoint's directory")
    manifest_hash: str = Field(description="its manifest's content hash: what staging and the registry key on")
    method: str = Field(description="how it was built: oneshot, model_free or streaming")
    reused: bool = Field(description="an identical finished output existed; nothing was recomputed")
    mb_per_s: float = Field(description="MB of source weights read per second")
    max_rel_error: float | None = Field(
        description="the numeric check's max relative logits error; None: the check was skipped (a checkpoint too "
        "large to load on the worker, the production case)"
    )
