"""How the engine runs (`serving:`), the layouts it is measured in (`layouts:`) and the layouts
generated beside them (`candidates:`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from pipeline.core.specs.base import Strict

Scalar = str | int | float | bool | None
EngineArgs = dict[str, Scalar | dict[str, Any] | list[Any]]
FLAG_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

# Flags the layout owns: they come from tp/dp/ep/pp, never from free-form engine args.
LAYOUT_FLAGS = {
    "tensor-parallel-size",
    "data-parallel-size",
    "pipeline-parallel-size",
    "enable-expert-parallel",
    "port",
    "host",
    "model",
}


def _check_flags(args: EngineArgs) -> EngineArgs:
    for flag in args:
        if not FLAG_PATTERN.match(flag):
            raise ValueError(
                f"engine arg {flag!r}: expected a vllm flag name without dashes in front, e.g. max-model-len"
            )
        if flag in LAYOUT_FLAGS:
            raise ValueError(f"engine arg {flag!r} is set by the layout (tp/dp/ep/pp) or the launcher, not here")
    return args


class ServingSpec(Strict):
    engine: Literal["vllm"] = "vllm"
    engine_image: str = Field(description="container image of the engine (production)")
    engine_args: EngineArgs = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    port: Annotated[int, Field(gt=0, lt=65536)] = 8000
    kv_cache_reserve_gb: Annotated[float, Field(ge=0)] = 0.0

    @field_validator("engine_args")
    @classmethod
    def _flags(cls, value: EngineArgs) -> EngineArgs:
        return _check_flags(value)


class Layout(Strict):
    """One way to serve the model on one node: replica groups of tp x dp x pp devices each."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    tp: Annotated[int, Field(ge=1)] = 1
    dp: Annotated[int, Field(ge=1)] = 1
    ep: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1
    replicas: Annotated[int, Field(ge=1, description="replica groups per node, behind one endpoint")] = 1
    engine_args: EngineArgs = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("engine_args")
    @classmethod
    def _flags(cls, value: EngineArgs) -> EngineArgs:
        return _check_flags(value)

    @property
    def devices_per_replica(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def devices(self) -> int:
        return self.devices_per_replica * self.replicas


class CandidatesSpec(Strict):
    """Layouts generated beside the spec's own, for the planner to rank before anything is measured:
    every feasible tp x ep x replicas shape of the node (up to `max_tp`), with every combination of
    the knob grid; each is a named layout (`tp1-x2-seqs16`), so run params and overrides name it."""

    max_tp: Annotated[int | None, Field(ge=1, description="largest tensor-parallel size to generate")] = None
    engine_args: dict[str, Annotated[list[Scalar], Field(min_length=1)]] = Field(
        default_factory=dict, description="knob grid: engine arg -> values, e.g. max-num-seqs: [16, 64]"
    )
    top_k: Annotated[
        int | None,
        Field(
            ge=1,
            description="measure only the k layouts with the best predicted rate per server (the live "
            "release's layout is always measured); null: every layout",
        ),
    ] = None

    @field_validator("engine_args")
    @classmethod
    def _flags(cls, value: dict[str, list[Scalar]]) -> dict[str, list[Scalar]]:
        _check_flags(dict.fromkeys(value, ""))
        return value
