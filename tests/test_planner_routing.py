"""The routing skew the planner's busiest-rank model takes: per-rank loads under vLLM's linear expert
placement by hand, and a measurement on the tiny model's own router."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.errors import ReleaseError
from pipeline.planner import routing

EVAL = Path(__file__).resolve().parents[1] / "configs" / "eval"


def test_rank_loads_follow_vllms_contiguous_placement():
    # ep 2: rank 0 holds experts 0-1, rank 1 experts 2-3. Layer 1: loads 6 and 2, busiest 6 over a mean of 4;
    # layer 2: 2 and 2. Summed over layers: (6 + 2) / (4 + 2) = 1.3333
    counts = [[6, 0, 1, 1], [1, 1, 1, 1]]
    assert routing.rank_imbalance(counts, 2) == pytest.approx(8 / 6)
    # ep 4: one expert per rank: busiest 6 and 1 over means 2 and 1: 7 / 3
    assert routing.rank_imbalance(counts, 4) == pytest.approx(7 / 3)
    assert routing.rank_imbalance(counts, 1) == 1.0
    with pytest.raises(ReleaseError, match="ep=3 does not divide the 4 experts"):
        routing.rank_imbalance(counts, 3)


def test_the_tiny_models_router_is_measured_over_eval_prompts(tiny_model_dir):
    prompts = routing.eval_prompts([EVAL / "tiny_add.jsonl"])[:12]
    assert prompts[0] == "72+20="
    found = routing.measure(tiny_model_dir, prompts, eps=(2, 4, 3))
    assert found.prompts == 12 and found.tokens > 12
    # every token of every layer routes to its 4 experts
    assert [sum(layer) for layer in found.counts] == [found.tokens * 4] * 4
    assert set(found.imbalance) == {2, 4}  # 3 does not divide the 16 experts: not reported
    assert 1.0 <= found.imbalance[2] <= found.imbalance[4] <= 4.0
    assert found.imbalance[2] == pytest.approx(routing.rank_imbalance(found.counts, 2), abs=1e-4)
