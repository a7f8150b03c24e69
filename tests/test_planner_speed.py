"""The simulation's fast path (decode-only stretches run by the step model in one call, a step's fixed
parts cached by its token and sampled counts) gives the step loop's answers: float for float against
the same simulation with fast=False, and within 1e-9 against a step time summed part by part."""

from __future__ import annotations

import random

import pytest

from pipeline.core.specs import Layout, load_spec
from pipeline.planner import simulate as sim
from pipeline.planner import step_time
from pipeline.planner.step_time import Batch, StepModel
from tests.conftest import PROD_SPEC

LOADED = load_spec(PROD_SPEC)
LAYOUTS = [
    Layout(name="tp8-ep8", tp=8, ep=8),
    Layout(name="tp4-ep4-x2", tp=4, ep=4, replicas=2),
    Layout(name="tp1-dp8-ep8", tp=1, dp=8, ep=8),
]


class Counted:
    """A step model that counts the steps its decode_run / lockstep_decode_run ran (the fast path taken)."""

    def __init__(self, model: StepModel):
        self.model, self.fast_steps = model, 0
        self.request_overhead_s, self.admission_s = model.request_overhead_s, model.admission_s

    def seconds(self, batch: Batch) -> float:
        return self.model.seconds(batch)

    def lockstep_seconds(self, batches: list[Batch]) -> float:
        return self.model.lockstep_seconds(batches)

    def decode_run(self, *args, **kwargs):
        ran, now, busy = self.model.decode_run(*args, **kwargs)
        self.fast_steps += ran
        return ran, now, busy

    def lockstep_decode_run(self, *args, **kwargs):
        ran, now, busy = self.model.lockstep_decode_run(*args, **kwargs)
        self.fast_steps += ran
        return ran, now, busy


class PartByPart:
    """The reference step time: every part of StepModel.bounds() summed, the dp ranks' lockstep step from
    each rank's own parts, the experts on all ranks' tokens and the links, without any cache."""

    def __init__(self, model: StepModel):
        self.model = model
        self.request_overhead_s, self.admission_s = model.request_overhead_s, model.admission_s

    def seconds(self, batch: Batch) -> float:
        return sum(seconds for _, seconds in self.model.bounds(batch))

    def lockstep_seconds(self, batches: list[Batch]) -> float:
        m = self.model

        def own(b: Batch) -> float:
            if not b.tokens:
                return m.step_overhead_s
            terms = [m._token_terms(b.tokens)[0], *m._batch_terms(b)]
            return m.overhead_seconds(b) + sum(max(f / fps, n / bps) for _, f, n, fps, bps in terms)

        total, busiest = sum(b.tokens for b in batches), max(b.tokens for b in batches)
        _, f, n, fps, bps = m._token_terms(max(1, busiest), max(1, total))[1]
        return max(own(b) for b in batches) + max(f / fps, n / bps) + m.link_seconds(busiest)


def mixed_requests(rate: float, n: int, seed: int) -> list[sim.Request]:
    """Poisson arrivals of prompts and outputs of varied lengths (some one-token outputs)."""
    rng = random.Random(seed)
    arrivals = sim.poisson_arrivals(rate, n, seed)
    return [
        sim.Request(arrival=a, input_len=rng.randint(1, 6000), output_len=rng.choice([1, 2, 40, 140, 300]))
        for a in arrivals
    ]


def cases():
    spec, hw = LOADED.spec, LOADED.hardware
    slo = sim.Slo(p90_ttft_s=spec.slo.max_p90_ttft_ms / 1e3, p90_tpot_s=spec.slo.max_p90_tpot_ms / 1e3)
    for layout in LAYOUTS:
        model = step_time.step_model(spec, layout, hw)
        limits = step_time.engine_limits(spec, layout, hw, model)
        tight = sim.Limits(max_num_seqs=6, max_num_batched_tokens=4096, kv_capacity_tokens=20_000)
        for rate in (0.3, 3.0, 9.0):
            steady, warmup = sim.steady_requests(rate, 5600, 140, slo.lifetime(140), spec.workload.seed, n=120)
            yield layout, model, limits, steady, warmup
            yield layout, model, tight, mixed_requests(rate, 80, 7), 0.0


@pytest.mark.parametrize("slowdown", [1.0, 1.37])
def test_the_fast_simulation_gives_the_step_loops_answers_float_for_float(slowdown):
    taken = 0
    for layout, model, limits, requests, warmup in cases():
        counted = Counted(model)
        timer = counted if slowdown == 1.0 else sim.Slowed(counted, slowdown)  # type: ignore[arg-type]
        fast = sim.simulate(timer, limits, requests, measure_from=warmup, ranks=layout.dp)  # type: ignore[arg-type]
        loop = sim.simulate(timer, limits, requests, measure_from=warmup, ranks=layout.dp, fast=False)  # type: ignore[arg-type]
        assert fast == loop, (layout.name, limits, len(requests))
        taken += counted.fast_steps
    assert taken > 0.5 * 10**5  # the fast path ran most decode steps: the comparison is not one path twice


def test_the_fast_simulation_matches_a_step_time_summed_part_by_part():
    for layout, model, limits, requests, warmup in cases():
        fast = sim.simulate(model, limits, requests, measure_from=warmup, ranks=layout.dp)
        ref = sim.simulate(PartByPart(model), limits, requests, measure_from=warmup, ranks=layout.dp)  # type: ignore[arg-type]
        assert (fast.steps, fast.tokens, fast.blocked_by_seqs, fast.blocked_by_kv) == (
            ref.steps,
            ref.tokens,
            ref.blocked_by_seqs,
            ref.blocked_by_kv,
        ), layout.name
        for name in ("ttft_s", "tpot_s", "latency_s"):
            assert getattr(fast, name) == pytest.approx(getattr(ref, name), rel=1e-9), (layout.name, name)
        assert fast.busy_s == pytest.approx(ref.busy_s, rel=1e-9)


def test_a_decode_stretch_stops_before_the_next_arrival_and_before_a_finishing_step():
    """Two requests: the second arrives mid-decode of the first. The fast run takes the stretch up to the
    arrival, lets the step loop admit, and the answers stay the step loop's."""
    model = step_time.step_model(LOADED.spec, LAYOUTS[0], LOADED.hardware)
    limits = sim.Limits(max_num_seqs=8, max_num_batched_tokens=8192, kv_capacity_tokens=10**6)
    requests = [
        sim.Request(arrival=0.0, input_len=100, output_len=400),
        sim.Request(arrival=1.0, input_len=100, output_len=50),
    ]
    counted = Counted(model)
    fast = sim.simulate(counted, limits, requests)  # type: ignore[arg-type]
    loop = sim.simulate(model, limits, requests, fast=False)
    assert fast == loop and counted.fast_steps > 300
    assert fast.ttft_s[1] - 1.0 < 0.2  # the second request's prefill ran right after its arrival


def test_bounds_cached_by_shape_are_the_part_by_part_sums_float_for_float():
    """bounds() keeps all but attention per (tokens, sampled): each batch's list is what the terms give."""
    for layout in LAYOUTS:
        model = step_time.step_model(LOADED.spec, layout, LOADED.hardware)
        for batch in [
            Batch(tokens=64, pairs=64 * 5700, context=64 * 5700, sampled=64),
            Batch(tokens=64, pairs=64 * 300, context=64 * 299, sampled=64),  # same shape, other contexts
            Batch(tokens=4096 + 32, pairs=4096 * 2048 + 32 * 5700, context=32 * 5700, sampled=33),
            Batch(tokens=1, pairs=1, context=0, sampled=1),
        ]:
            expected = []
            for _, flops, nbytes, fps, bps in model._terms(batch):
                compute, memory = flops / fps, nbytes / bps
                expected.append(("compute" if compute >= memory else "memory", max(compute, memory)))
            expected.append(("link", model.all_reduce_seconds(batch.tokens)))
            if layout.dp > 1:
                expected.append(("link", model.dispatch_seconds(batch.tokens)))
            expected.append(("overhead", model.overhead_seconds(batch)))
            assert model.bounds(batch) == expected, (layout.name, batch)
