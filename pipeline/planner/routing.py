"""Expert load per expert-parallel rank from a model's real router outputs.

The planner's busiest-rank model (step_time.rank_imbalance) multiplies the spread of few draws by
the routing's own skew, `model.architecture.expert_imbalance`. For a model we hold, that skew is
measured here: run prompts through the model, record each layer's top-k expert choices, place the
experts on ep ranks as vLLM does by default (rank r holds experts r E/ep .. (r+1) E/ep - 1, the
linear map of `determine_expert_map`), and take the busiest rank's routed pairs over the mean,
summed over layers (a step pays every layer's busiest rank).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError


class RoutingProfile(BaseModel):
    """Routed (token, expert) pairs per expert and layer over a set of prompts, and what they make per rank."""

    model_dir: str
    prompts: int
    tokens: int
    counts: list[list[int]] = Field(description="per layer, routed pairs per expert")
    imbalance: dict[int, float] = Field(description="ep -> busiest rank's pairs / the mean, summed over layers")


def rank_imbalance(counts: list[list[int]], ep: int) -> float:
    """Sum over layers of the busiest rank's routed pairs over the sum of the mean rank's, under vLLM's
    linear placement (contiguous blocks of E/ep experts per rank)."""
    busiest = mean = 0.0
    for layer in counts:
        experts = len(layer)
        if experts % ep:
            raise ReleaseError(f"ep={ep} does not divide the {experts} experts")
        size = experts // ep
        loads = [sum(layer[r * size : (r + 1) * size]) for r in range(ep)]
        busiest += max(loads)
        mean += sum(loads) / ep
    return busiest / mean if mean else 1.0


def eval_prompts(paths: Iterable[Path]) -> list[str]:
    """The `question` of every line of the evaluation tasks' JSONL files."""
    prompts = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                prompts.append(str(json.loads(line)["question"]))
    return prompts


def measure(model_dir: Path, prompts: list[str], eps: Iterable[int] = (2, 4, 8)) -> RoutingProfile:
    """Run each prompt through the model (transformers, CPU) and count its router's top-k choices."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    if not (model_dir / "tokenizer.json").exists():
        raise ReleaseError(f"{model_dir}: no tokenizer.json to encode the prompts with")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    config = model.config
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
    if not experts:
        raise ReleaseError(f"{model_dir}: not a mixture-of-experts model (no num_experts in config.json)")
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    counts = [[0] * experts for _ in gates]

    def hook(index: int) -> Callable[[Any, Any, Any], None]:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            chosen = output[-1] if isinstance(output, tuple) else output.topk(config.num_experts_per_tok).indices
            for expert in chosen.reshape(-1).tolist():
                counts[index][expert] += 1

        return record

    handles = [gate.register_forward_hook(hook(i)) for i, gate in enumerate(gates)]
    tokens, threads = 0, torch.get_num_threads()
    torch.set_num_threads(1)  # one short prompt at a time: more threads only contend for the cores
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = tokenizer.encode(prompt).ids
                tokens += len(ids)
                model(torch.tensor([ids]))
    finally:
        torch.set_num_threads(threads)
        for handle in handles:
            handle.remove()
    return RoutingProfile(
        model_dir=str(model_dir),
        prompts=len(prompts),
        tokens=tokens,
        counts=counts,
        imbalance={ep: round(rank_imbalance(counts, ep), 4) for ep in eps if experts % ep == 0},
    )
