"""The model to release (`model:`) and how it is quantized (`quantization:`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.specs.base import Strict

SOURCE_PATTERN = re.compile(r"^(hf://[\w.-]+/[\w.-]+(@[\w./-]+)?|s3://[\w.-]+/.+|builtin://[\w.-]+|[^:]+)$")
DEFAULT_IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
BYTES_PER_PARAM = {"FP8_DYNAMIC": 1.0, "FP8_BLOCK": 1.0}


class Architecture(Strict):
    """Facts about the model, used for feasibility checks before anything is loaded."""

    model_type: str = Field("qwen3_moe", description="transformers model_type")
    num_layers: Annotated[int, Field(gt=0)]
    hidden_size: Annotated[int, Field(gt=0)]
    num_attention_heads: Annotated[int, Field(gt=0)]
    num_kv_heads: Annotated[int, Field(gt=0)]
    head_dim: Annotated[int, Field(gt=0)]
    num_experts: Annotated[int, Field(ge=0, description="0 for a dense model")] = 0
    num_experts_per_tok: Annotated[int, Field(ge=0)] = 0
    moe_intermediate_size: Annotated[int, Field(ge=0)] = 0
    intermediate_size: Annotated[int, Field(ge=0, description="dense MLP width (dense models; the planner)")] = 0
    vocab_size: Annotated[int, Field(gt=0)]
    params_b: Annotated[float, Field(gt=0, description="total parameters, billions")]
    active_params_b: Annotated[float | None, Field(gt=0)] = None
    expert_imbalance: Annotated[
        float,
        Field(
            ge=1,
            description="routed tokens of the busiest expert-parallel rank / the mean, at large batches (the"
            " planner; small batches add their own statistical spread)",
        ),
    ] = 1.0
    expert_imbalance_range: tuple[float, float] | None = Field(
        None, description="(low, high) plausible values of expert_imbalance where it is not measured"
    )
    expert_imbalance_source: str = Field("", description="where expert_imbalance comes from, or 'assumed'")

    @model_validator(mode="after")
    def _moe_consistent(self) -> Architecture:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class ModelSpec(Strict):
    name: str
    source: str = Field(description="local dir, hf://org/name[@rev], s3://bucket/key or builtin://NAME")
    architecture: Architecture

    @field_validator("source")
    @classmethod
    def _source_form(cls, value: str) -> str:
        if not SOURCE_PATTERN.match(value):
            raise ValueError("expected a local path, hf://org/name[@revision], s3://bucket/prefix or builtin://NAME")
        return value


class QuantizationSpec(Strict):
    scheme: Literal["FP8_DYNAMIC", "FP8_BLOCK"] = "FP8_DYNAMIC"
    method: Literal["oneshot", "model_free", "streaming", "auto"] = Field(
        "auto", description="auto: oneshot when the model fits in the worker's memory, else streaming"
    )
    ignore: list[str] = Field(default_factory=lambda: list(DEFAULT_IGNORE))
