"""In-process evaluation of the tiny model: lm-eval's task index built per task (as before) vs
once per process and not at all for shipped tasks (now), in one run.

    .venv/bin/python benchmarks/evaluate.py [--rounds 2]

Prints seconds per evaluation (the spec's three tasks, all items) for each way, alternating, and
the ratio of the medians. Ratios within one run hold on a noisy machine; absolute times do not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.specs import load_spec
from pipeline.stages import evaluate, tiny_model


def per_task_index(shipped: bool):
    """What `run_task` did before: a full TaskManager for every task."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    spec = load_spec(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml").spec
    model = tiny_model.reference()
    cached = evaluate.task_manager
    ways = {"index per task (before)": per_task_index, "index once, none for shipped (now)": cached}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, manager in ways.items():
            evaluate.task_manager = manager
            started = time.monotonic()
            result = evaluate.evaluate(model, "benchmark", spec.evaluation)
            times[name].append(time.monotonic() - started)
            print(f"{name:40} {times[name][-1]:6.1f} s  {[round(s.score, 3) for s in result.scores]}", flush=True)
    before, now = (statistics.median(v) for v in times.values())
    print(f"median: before {before:.1f} s, now {now:.1f} s; now / before = {now / before:.2f}")
    path = measurements.record(
        "evaluate",
        {"seconds": times, "median_before_s": before, "median_now_s": now, "ratio_now_before": now / before},
        summary=f"an in-process evaluation of the tiny model's tasks: {now:.1f} s now vs {before:.1f} s before "
        f"(ratio {now / before:.2f}, medians of {args.rounds})",
    )
    print(f"record: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
