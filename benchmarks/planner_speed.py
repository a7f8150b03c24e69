"""How much faster the planner's simulation runs than the step loop it replaced, on the same answers.

    .venv/bin/python benchmarks/planner_speed.py [--spec configs/releases/qwen3-235b-a22b-fp8-mi325x.yaml]
        [--rounds 3]

The reference is the simulation as it was until 2026-12-07: every step scheduled and timed one by one
(`simulate(fast=False)`), a step's time with its parts cached by token count only, the dp ranks' lockstep
step and a prediction's time by bound computed part by part each step (the old methods, copied below).
The current path runs decode-only stretches in one call of the step model and caches every part but
attention by the step's shape. The work: each of the spec's layouts and one data-parallel layout
predicted (its rate search and its time by bound at the answer), then simulated at 1/4 and 1/2 of its
answer (an interval's pessimistic end runs there: few sequences, long decode stretches). Alternating
rounds, CPU seconds of this process (the machine is shared), the median per path, the ratio, and
whether every answer is the same, float for float. Writes a record under benchmarks/results/planner_speed/.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import measurements  # noqa: E402
from pipeline.core.specs import Layout, load_spec  # noqa: E402
from pipeline.planner import host, step_time  # noqa: E402
from pipeline.planner import plan as planner  # noqa: E402
from pipeline.planner import simulate as sim  # noqa: E402
from pipeline.planner.step_time import Batch, StepModel  # noqa: E402

PROD_SPEC = Path(__file__).resolve().parents[1] / "configs" / "releases" / "qwen3-235b-a22b-fp8-mi325x.yaml"


def old_seconds(self: StepModel, batch: Batch) -> float:
    by_tokens = self.__dict__.setdefault("_old_by_tokens", {}).get(batch.tokens)
    if by_tokens is None:
        by_tokens = self.__dict__["_old_by_tokens"][batch.tokens] = (
            self.link_seconds(batch.tokens),
            [max(f / fps, b / bps) for _, f, b, fps, bps in self._token_terms(batch.tokens)],
        )
    link, token_parts = by_tokens
    total = self.overhead_seconds(batch) + link
    for part in token_parts:
        total += part
    for _, flops, nbytes, flops_per_s, bytes_per_s in self._batch_terms(batch):
        total += max(flops / flops_per_s, nbytes / bytes_per_s)
    return total


def old_own_seconds(self: StepModel, batch: Batch) -> float:
    total = self.overhead_seconds(batch) if batch.tokens else self.step_overhead_s
    if not batch.tokens:
        return total
    _, f, b, fps, bps = self._token_terms(batch.tokens, batch.tokens)[0]
    total += max(f / fps, b / bps)
    for _, flops, nbytes, flops_per_s, bytes_per_s in self._batch_terms(batch):
        total += max(flops / flops_per_s, nbytes / bytes_per_s)
    return total


def old_lockstep_seconds(self: StepModel, batches: list[Batch]) -> float:
    total = sum(b.tokens for b in batches)
    busiest = max(b.tokens for b in batches)
    own = max(old_own_seconds(self, b) for b in batches)
    experts = 0.0
    if self.arch.is_moe:
        _, f, b, fps, bps = self._token_terms(max(1, busiest), max(1, total))[1]
        experts = max(f / fps, b / bps)
    return own + experts + self.link_seconds(busiest)


def old_bounds(self: StepModel, batch: Batch, expert_tokens: int | None = None) -> list[tuple[str, float]]:
    out = []
    for _, flops, nbytes, flops_per_s, bytes_per_s in self._terms(batch, expert_tokens):
        compute, memory = flops / flops_per_s, nbytes / bytes_per_s
        out.append(("compute" if compute >= memory else "memory", max(compute, memory)))
    out.append(("link", self.all_reduce_seconds(batch.tokens)))
    if self.layout.dp > 1:
        out.append(("link", self.dispatch_seconds(batch.tokens)))
    out.append(("overhead", self.overhead_seconds(batch)))
    return out


def work(loaded, layouts: list[Layout]) -> list[str]:
    """Every answer of the work as JSON: the predictions, then the runs at 1/4 and 1/2 of each answer."""
    spec, hw = loaded.spec, loaded.hardware
    wl = spec.workload
    slo = sim.Slo(p90_ttft_s=spec.slo.max_p90_ttft_ms / 1e3, p90_tpot_s=spec.slo.max_p90_tpot_ms / 1e3)
    out = []
    for layout in layouts:
        estimate = planner.predict(spec, hw, layout, wl.input_len, wl.output_len, True)
        out.append(estimate.model_dump_json())
        model = step_time.step_model(spec, layout, hw)
        limits = step_time.engine_limits(spec, layout, hw, model)
        run = sim.workload(
            model, limits, slo, wl.input_len, wl.output_len, wl.seed, host.share(hw, layout).slowdown, ranks=layout.dp
        )
        for share in (0.25, 0.5):
            out.append(run(estimate.rate_per_replica * share).model_dump_json())
    return out


def timed(loaded, layouts: list[Layout], reference: bool) -> tuple[float, list[str]]:
    saved = StepModel.seconds, StepModel.lockstep_seconds, StepModel.bounds, sim.simulate.__defaults__
    if reference:
        StepModel.seconds, StepModel.lockstep_seconds, StepModel.bounds = (  # type: ignore[method-assign]
            old_seconds,
            old_lockstep_seconds,
            old_bounds,
        )
        defaults = list(sim.simulate.__defaults__ or ())
        defaults[-1] = False  # fast=False: the step loop
        sim.simulate.__defaults__ = tuple(defaults)
    try:
        started = time.process_time()
        answers = work(loaded, layouts)
        return time.process_time() - started, answers
    finally:
        StepModel.seconds, StepModel.lockstep_seconds, StepModel.bounds = saved[:3]  # type: ignore[method-assign]
        sim.simulate.__defaults__ = saved[3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=PROD_SPEC)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    loaded = load_spec(args.spec)
    layouts = [*loaded.spec.layouts]
    if loaded.spec.model.architecture.is_moe and loaded.hardware.devices >= 8:
        layouts.append(Layout(name="tp1-dp8-ep8", tp=1, dp=8, ep=8))
    times: dict[bool, list[float]] = {True: [], False: []}
    answers: dict[bool, set[str]] = {True: set(), False: set()}
    for i in range(args.rounds):
        for reference in (True, False) if i % 2 == 0 else (False, True):
            seconds, got = timed(loaded, layouts, reference)
            times[reference].append(seconds)
            answers[reference].add("\n".join(got))
            print(f"round {i + 1}: {'reference' if reference else 'current'} {seconds:.2f} s CPU", flush=True)
    before, after = statistics.median(times[True]), statistics.median(times[False])
    same = answers[True] == answers[False] and len(answers[True]) == 1
    ratio = before / after
    names = ", ".join(layout.name for layout in layouts)
    print(f"{args.spec.name} ({names}): reference {before:.2f} s, current {after:.2f} s CPU (median of {args.rounds})")
    print(f"ratio reference/current: {ratio:.2f}x; answers identical: {same}")
    summary = (
        f"simulation {ratio:.1f}x less CPU than the step loop ({before:.1f} vs {after:.1f} s, median of"
        f" {args.rounds}) on {names}; answers identical: {same}"
    )
    figures = {
        "spec": args.spec.name,
        "layouts": [layout.name for layout in layouts],
        "reference_cpu_s": [round(t, 3) for t in times[True]],
        "current_cpu_s": [round(t, 3) for t in times[False]],
        "ratio": round(ratio, 2),
        "identical": same,
    }
    path = measurements.record("planner_speed", figures, summary=summary)
    print(f"record: {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
