"""How long the planner takes to plan a spec, against its per-step records, in one run.

    .venv/bin/python benchmarks/plan_speed.py [--spec configs/releases/qwen3-235b-a22b-fp8-mi325x.yaml]
        [--rounds 2]

`plan` (every feasible layout, with intervals) simulates ~10^4 engine steps per rate it tries; at
each prediction's answer it also adds every step's time by bound. The reference adds it from
StepModel.cost(), a record per part per step (what the planner did until 2026-12-05); the current
path from StepModel.bounds(), the same numbers without the records. Alternating rounds, each timed in
CPU seconds of this process (the machine is shared: CPU time moves less than wall time), the
median per path, the ratio, and whether both plans are the same.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core.specs import load_spec
from pipeline.planner import plan as planner
from pipeline.planner.step_time import StepModel

PROD_SPEC = Path(__file__).resolve().parents[1] / "configs" / "releases" / "qwen3-235b-a22b-fp8-mi325x.yaml"


def by_records(self: StepModel, batch) -> list[tuple[str, float]]:
    """The reference: a record per part, as cost() builds them for the plan's explanation."""
    return [(part.bound, part.seconds) for part in self.cost(batch).parts]


def timed(loaded, reference: bool) -> tuple[float, str]:
    current = StepModel.bounds
    if reference:
        StepModel.bounds = by_records  # type: ignore[method-assign]
    try:
        started = time.process_time()
        result = planner.plan(loaded)
        return time.process_time() - started, result.model_dump_json()
    finally:
        StepModel.bounds = current  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=PROD_SPEC)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    loaded = load_spec(args.spec)
    times: dict[bool, list[float]] = {True: [], False: []}
    plans: dict[bool, set[str]] = {True: set(), False: set()}
    for i in range(args.rounds):
        for reference in (True, False) if i % 2 == 0 else (False, True):
            seconds, plan = timed(loaded, reference)
            times[reference].append(seconds)
            plans[reference].add(plan)
            print(f"round {i + 1}: {'reference' if reference else 'current'} {seconds:.1f} s CPU", flush=True)
    before, after = statistics.median(times[True]), statistics.median(times[False])
    same = plans[True] == plans[False] and len(plans[True]) == 1
    print(f"plan of {args.spec.name}: reference {before:.1f} s, current {after:.1f} s CPU (median of {args.rounds})")
    print(f"ratio reference/current: {before / after:.2f}x; plans identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
