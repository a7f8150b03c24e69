"""The accuracy gate (`evaluation:`): lm-eval tasks, in-process and at each layout's endpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.core.specs.base import Strict


class EvalTask(Strict):
    name: str
    num_fewshot: Annotated[int, Field(ge=0)] = 0
    metric: str | None = Field(None, description="lm-eval metric to gate on; default: the task's first")
    min_recovery: Annotated[float, Field(gt=0, le=2)] = 0.99
    floor: Annotated[float, Field(ge=0, le=1, description="absolute minimum score")] = 0.0
    served_min_recovery: Annotated[
        float | None,
        Field(
            gt=0,
            le=2,
            description="the minimum recovery on the serving-path check's first N items, where a few items "
            "moving is noise rather than a worse model (its other rule, served within two combined stderr of "
            "in-process, judges the rest); default: min_recovery",
        ),
    ] = None


class ServedAccuracySpec(Strict):
    """lm-eval against each layout's own endpoint after its SLO search: the served model (engine,
    layout, tokenizer path, engine version) must answer as the checkpoint did on the same items."""

    enabled: bool = True
    limit: Annotated[
        int | None,
        Field(gt=0, description="the first N items of each task (of the gate's items); null: all the gate's"),
    ] = 50
    num_concurrent: Annotated[int, Field(gt=0, description="requests lm-eval keeps in flight")] = 4
    rollout_limit: Annotated[
        int | None,
        Field(
            gt=0,
            description="a local rollout's smoke test: the first N items at the new release's own engine before "
            "each step takes traffic (before the switch, with no live release); a failure aborts; null: no check",
        ),
    ] = 20


class EvaluationSpec(Strict):
    backend: Literal["hf", "vllm", "local-completions"] = "hf"
    tasks: Annotated[list[EvalTask], Field(min_length=1)]
    limit: Annotated[int | None, Field(gt=0)] = None
    seed: int = 1234
    batch_size: Annotated[int, Field(gt=0)] = 8
    tensor_parallel_size: Annotated[
        int | None,
        Field(
            ge=1, description="vllm backend: devices the evaluation engine shards over; default: the widest layout's tp"
        ),
    ] = None
    num_concurrent: Annotated[
        int, Field(gt=0, description="local-completions backend: requests lm-eval keeps in flight at the endpoint")
    ] = 4
    served: ServedAccuracySpec = Field(default_factory=ServedAccuracySpec)
