"""Expert placement, collectives and intervals of the planner against numbers worked out by hand.

One layer of Qwen3-235B-A22B (hidden 4096, 128 experts of 3 x 4096 x 1536 = 18,874,368 fp8
weights, 8 per token) on the mi325x-8 profile's figures: link 64 GB/s x 0.75 = 48 GB/s usable,
an all-reduce's fixed cost 14 us at 4 ranks and 22 us at 8 (the dp collectives' too), HBM 6000 GB/s
x 0.75 = 4.5e12 B/s; the production spec's expert_imbalance 1.25. The expected values are literals
from the formulas in the comments.
"""

from __future__ import annotations

import pytest

from pipeline.core.errors import SpecError
from pipeline.core.specs import Layout, load_spec
from pipeline.planner import host, step_time, uncertainty
from pipeline.planner import plan as planner
from pipeline.planner import simulate as sim
from pipeline.planner.step_time import Batch, StepModel
from tests.conftest import PROD_SPEC

LOADED = load_spec(PROD_SPEC)
ARCH = LOADED.spec.model.architecture.model_copy(update={"num_layers": 1})
PERF = LOADED.hardware.performance
assert PERF is not None


def layer(layout: Layout, tokens: int) -> tuple[StepModel, dict[str, tuple[float, float, float, str]]]:
    model = StepModel(ARCH, layout, PERF, weight_bytes=1, kv_bytes=1)
    batch = Batch(tokens=tokens, pairs=tokens * 1000, context=tokens * 1000, sampled=tokens)
    return model, {p.name: (p.flops, p.bytes, p.seconds, p.bound) for p in model.cost(batch).parts}


def test_one_qwen3_layer_at_tp8_ep8_and_tp4_ep4_by_hand():
    # 256 decode tokens: 2048 routed (token, expert) pairs; 128 x (1 - (120/128)^256) = 127.99999 experts touched
    # rows per expert GEMM: 2048 / 127.99999 = 16.0 tokens per *active* expert
    ep8, parts8 = layer(Layout(name="tp8-ep8", tp=8, ep=8), 256)
    load8 = ep8.expert_load(256)
    assert load8.rows == pytest.approx(16.0, rel=1e-6)
    # busiest of 8 ranks: 1.25 x (1 + sqrt(2 ln 8 x 7 / 2048)) = 1.25 x 1.119226 = 1.399033 x the mean 256 pairs
    assert load8.imbalance == pytest.approx(1.399033, rel=1e-6)
    assert load8.routed == pytest.approx(358.1524, rel=1e-6)
    # it holds 16 whole experts and its 358 pairs touch all 16: 16 x 18,874,368 = 301,989,888 B per layer
    assert parts8["experts"][1] == pytest.approx(301_989_888)
    # 2 x 358.1524 x 18,874,368 FLOPs = 13,519,802,104 (16 rows: 16/80 of 1307.45 TFLOP/s: 51.7 us) vs
    # 301,989,888 B / 4.5e12 B/s = 67.11 us: memory bound
    assert parts8["experts"][0] == pytest.approx(13_519_802_104, rel=1e-6)
    assert parts8["experts"][2:] == (pytest.approx(6.7108864e-05), "memory")
    # two all-reduces of 256 x 4096 x 2 B = 2,097,152 B over 8: each 22 us + 2 x 2,097,152 / (8 x 48e9) s
    assert parts8["all-reduce"][2] == pytest.approx(2 * (22e-6 + 2 * 2_097_152 / (8 * 48e9)))
    assert parts8["all-reduce"][2] == pytest.approx(6.5845333e-05)

    ep4, parts4 = layer(Layout(name="tp4-ep4", tp=4, ep=4), 256)
    load4 = ep4.expert_load(256)
    # busiest of 4: 1.25 x (1 + sqrt(2 ln 4 x 3 / 2048)) = 1.25 x 1.0637292 = 1.3296615; 2048 x that / 4 = 680.7867
    assert load4.imbalance == pytest.approx(1.3296615, rel=1e-6)
    assert load4.routed == pytest.approx(680.7867, rel=1e-6)
    # 32 whole experts, all touched: 32 x 18,874,368 = 603,979,776 B (twice TP8's), 134.2 us of reads
    assert parts4["experts"][1:] == (pytest.approx(603_979_776), pytest.approx(1.34217728e-04), "memory")
    # each all-reduce: 14 us + 2 x 2,097,152 / (4 x 48e9) = 35.845 us: less latency, more bytes per link
    assert parts4["all-reduce"][2] == pytest.approx(2 * 3.5845333e-05)

    # tp8 without EP slices every expert: every rank does 1/8 of all 2048 pairs, no rank is busier
    tp8, parts = layer(Layout(name="tp8", tp=8), 256)
    assert tp8.expert_load(256).imbalance == 1.0
    assert parts["experts"][0] == pytest.approx(2 * 2048 * 18_874_368 / 8)
    # so EP changes the prediction: tp8 and tp8-ep8 are not the same layout any more
    assert parts["experts"][0] != parts8["experts"][0]


def test_a_one_token_moe_step_is_memory_bound():
    # one token: 8 experts touched, 1 row each. TP8 reads a 1/8 slice of each: 18,874,368 B, 4.19 us
    _, tp8 = layer(Layout(name="tp8", tp=8), 1)
    assert tp8["experts"][1:] == (pytest.approx(18_874_368), pytest.approx(4.194304e-06), "memory")
    # EP8: the busiest rank holds 1.25 x (1 + sqrt(2 ln 8 x 7 / 8)) = 3.6345 of the 8 chosen experts, whole
    ep8, parts = layer(Layout(name="tp8-ep8", tp=8, ep=8), 1)
    assert ep8.expert_load(1).rows == 1.0
    assert parts["experts"][1] == pytest.approx(3.6345278 * 18_874_368, rel=1e-6)
    assert parts["experts"][3] == "memory" and parts["attention projections + router"][3] == "memory"
    # the whole 94-layer one-token step is under a millisecond of expert reads on TP8, not milliseconds of compute
    full = StepModel(LOADED.spec.model.architecture, Layout(name="tp8", tp=8), PERF, 1, 1)
    experts = next(p for p in full.cost(Batch(tokens=1, pairs=1, context=0, sampled=1)).parts if p.name == "experts")
    assert experts.bound == "memory" and experts.seconds == pytest.approx(94 * 4.194304e-06)


def test_data_parallel_dispatch_and_combine_volume_by_hand():
    # tp1 x dp8, ep8: each rank carries 64 tokens; the all-gather brings the other 7 ranks' 64 x 4096 x 2 B
    # = 3,670,016 B in, the reduce-scatter sends as much back: 7,340,032 B per layer
    dp8, parts = layer(Layout(name="tp1-dp8-ep8", tp=1, dp=8, ep=8), 64)
    assert parts["dispatch + combine"][1] == 7_340_032
    # each phase: a collective over 8 ranks, 22 us + one rank's 524,288 B over one 48 GB/s link (all 7 at once)
    assert parts["dispatch + combine"][2] == pytest.approx(2 * (22e-6 + 524_288 / 48e9))
    assert parts["all-reduce"][2] == 0  # tp 1: nothing to all-reduce
    # the experts see all 8 ranks' 512 tokens: 4096 pairs, 32 rows per active expert
    assert dp8.expert_load(64).rows == pytest.approx(32.0)


def test_dp_layouts_are_candidates_and_their_weights_split_experts_over_ep():
    from pipeline.core.specs import weights_per_device_gb

    names = [lay.name for lay in planner.data_parallel_shapes(LOADED.spec, LOADED.hardware)]
    assert "tp1-dp8-ep8" in names and "tp4-dp2-ep8" in names
    # 94 x 128 x 18,874,368 = 227.1 GB of experts over 8 ranks + the other 7.9 GB on each rank
    experts = 94 * 128 * 18_874_368 / 1e9
    got = weights_per_device_gb(LOADED.spec, Layout(name="d", tp=1, dp=8, ep=8))
    assert got == pytest.approx(experts / 8 + (235 - experts))


def test_ranges_name_known_figures_and_a_bad_one_is_a_spec_error(spec_file):
    def bad(data):
        data["model"]["architecture"]["expert_imbalance"] = 0.5

    with pytest.raises(SpecError, match="expert_imbalance"):
        load_spec(spec_file(PROD_SPEC, bad))
    with pytest.raises(ValueError, match="not a ranged figure"):
        PERF.model_validate({**PERF.model_dump(), "ranges": {"link_speed": [1, 2]}})
    with pytest.raises(ValueError, match="low <= high"):
        PERF.model_validate({**PERF.model_dump(), "ranges": {"link_latency_us": [9, 2]}})


def test_top_k_also_measures_overlapping_layouts_up_to_the_bound():
    class P:
        def __init__(self, name: str, rate: float, low: float, high: float) -> None:
            self.name, self.rate_per_server, self.rate_low, self.rate_high = name, rate, low, high

    ranked = [P("a", 10, 8, 12), P("b", 9, 7, 11), P("c", 7.5, 6, 8), P("d", 5, 4, 7.9), P("e", 4, 3, 8.5)]
    chosen = uncertainty.choose(ranked, 1, lambda p: p.name)
    # b, c and e reach a's low end (8); d tops out at 7.9 below it
    assert chosen.measure == ["a", "b", "c", "e"] and chosen.left_out == []
    bounded = uncertainty.choose(ranked, 1, lambda p: p.name, bound=2)
    assert bounded.measure == ["a", "b", "c"] and bounded.left_out == ["e"]
    assert "at most" in bounded.reason(1, 5) and "past that bound: e" in bounded.reason(1, 5)
    points = [P("a", 10, 10, 10), P("b", 9, 9, 9)]
    assert uncertainty.choose(points, 1, lambda p: p.name).measure == ["a"]


def estimate(name: str, rate: float) -> planner.Estimate:
    return planner.Estimate(
        layout=Layout(name=name), in_spec=True, devices=1, rate_per_replica=rate, rate_per_server=rate,
        rate_per_device=rate, p90_ttft_ms=None, p90_tpot_ms=None, binding_slo="-", bound="-", time_shares={},
        mean_step_ms=None, tokens_per_step=None, fixed_step_ms=0.0, engine_notes=[], simulations=1,
    )  # fmt: skip


def test_a_margin_over_rates_known_in_closed_form_has_its_sign_swings_and_interval_exactly():
    """Layout a pays the 8-rank all-reduce latency x: 10 / (1 + x / 10) req/s; b pays the step overhead o:
    8 x 6 / o. Central x 10, o 6: a 5, b 8, so b over a is +60%. x at 0 / 30: a 10 / 2.5, margin -20% /
    +220%; o at 3 / 10: b 16 / 4.8, margin +220% / -4% (each flips it). In quadrature: 0.6 - sqrt(0.8^2 + 0.64^2) =
    -0.42450, 0.6 + sqrt(1.6^2 + 1.6^2) = 2.86274; linear: -84% to +380%."""

    def predict(spec, hw, layout, input_len, output_len, **_):
        perf = hw.performance
        x, o = perf.all_reduce_latency_us[8], perf.step_overhead_ms
        return estimate(layout.name, 10 / (1 + x / 10) if layout.name == "a" else 8 * 6 / o)

    hw = LOADED.hardware.model_copy(
        update={"performance": PERF.model_copy(update={"all_reduce_latency_us": {8: 10.0}, "step_overhead_ms": 6.0})}
    )
    found = [
        uncertainty.Figure(name="all_reduce_latency_us.8", central=10, low=0, high=30),
        uncertainty.Figure(name="step_overhead_ms", central=6, low=3, high=10),
        uncertainty.Figure(name="efficiency.memory", central=0.75, low=0.6, high=0.85),  # moves neither
    ]
    m = uncertainty.margin(estimate("b", 8), estimate("a", 5), LOADED.spec, hw, 1000, 50, found, predict)
    assert m.central == pytest.approx(0.6)
    swings = {s.figure: s for s in m.swings}
    assert (swings["all_reduce_latency_us.8"].at_low, swings["all_reduce_latency_us.8"].at_high) == pytest.approx(
        (-0.2, 2.2)
    )
    assert (swings["step_overhead_ms"].at_low, swings["step_overhead_ms"].at_high) == pytest.approx((2.2, -0.04))
    assert swings["all_reduce_latency_us.8"].flips and swings["step_overhead_ms"].flips  # -20%, -4%
    assert not swings["efficiency.memory"].flips
    assert swings["efficiency.memory"].at_low == swings["efficiency.memory"].at_high == pytest.approx(0.6)
    assert [s.figure for s in m.swings][:2] == ["all_reduce_latency_us.8", "step_overhead_ms"]  # largest first
    assert (m.low, m.high) == pytest.approx((-0.424500, 2.862742), abs=1e-5)
    assert (m.bound_low, m.bound_high) == pytest.approx((-0.84, 3.8))
    assert not m.determined and m.too_wide and "undetermined" in m.describe() and "too wide" in m.describe()


def test_the_production_margin_moves_with_each_figure_the_way_its_physics_says():
    """tp8-ep8 alone pays the 8-rank all-reduce latency and 7 workers' broadcast, tp4-ep4-x2 3: each figure's
    high end favours the two replicas. The API server's time does not bind at these rates, and the same
    arrivals serve every rate: exactly 0."""
    ranges = {"all_reduce_latency_us.8": (8.0, 400.0), "step_overhead_per_rank_ms": (0.0, 0.5),
              "host_ms_per_request": (1.0, 2.0)}  # fmt: skip
    perf = PERF.model_copy(update={"ranges": ranges})
    arch = LOADED.spec.model.architecture.model_copy(update={"expert_imbalance_range": None})
    spec = LOADED.spec.model_copy(update={"model": LOADED.spec.model.model_copy(update={"architecture": arch})})
    loaded = LOADED.model_copy(
        update={"spec": spec, "hardware": LOADED.hardware.model_copy(update={"performance": perf})}
    )
    result = planner.plan(loaded, 1000, 50, every_layout=False)
    [m] = result.margins
    swings = {s.figure: s for s in m.swings}
    assert set(swings) == {*ranges, "simulation noise (other seeds)"}
    favour = 1 if m.better == "tp4-ep4-x2" else -1  # the margin is the better one's over the other
    for name in ("all_reduce_latency_us.8", "step_overhead_per_rank_ms"):
        s = swings[name]
        assert favour * (s.at_high - s.at_low) > 0, name
    host = swings["host_ms_per_request"]
    assert host.at_low == host.at_high == m.central
    for p in result.predictions:
        assert p.rate_low is not None and p.rate_high is not None and p.rate_low <= p.rate_per_server <= p.rate_high


def test_every_ranged_figure_moves_a_step_the_way_the_interval_assumes():
    """Each of mi325x-8's ranged figures at its pessimistic end (uncertainty.corner) makes some step of some
    layout slower and none faster: a figure the model ignores, or a cost taken for a gain, is caught."""
    spec, hw = LOADED.spec, LOADED.hardware
    layouts = [*spec.layouts, Layout(name="tp8", tp=8), Layout(name="tp2-x4", tp=2, replicas=4)]
    batches = [
        Batch(tokens=64, pairs=64 * 5700, context=64 * 5700, sampled=64),  # decode only
        Batch(tokens=4096 + 32, pairs=4096 * 2048 + 32 * 5700, context=32 * 5700, sampled=33),  # with a prefill
    ]
    for figure in uncertainty.figures(spec, hw):
        ends = {}
        for pessimistic in (True, False):
            value = figure.high if uncertainty.is_cost(figure.name) == pessimistic else figure.low
            s, h = uncertainty.at(spec, h0 := hw, {figure.name: value})
            assert h0.performance is not None
            steps = [step_time.step_model(s, lay, h).seconds(b) for lay in layouts for b in batches]
            hosts = [host.share(h, lay).load(1.0) for lay in layouts]
            ends[pessimistic] = steps + hosts
        worse, better = ends[True], ends[False]
        assert all(w >= b for w, b in zip(worse, better, strict=True)), figure.name
        assert any(w > b for w, b in zip(worse, better, strict=True)), f"{figure.name} moves nothing"


def test_a_dp_replicas_ranks_step_together_so_one_ranks_prefill_holds_the_others_token():
    """Two dp ranks, one short request each at t=0 (the second to the idle rank): alone a 1-token prompt's
    first token takes 1 ms; beside a 1000-token prompt on the other rank it takes the whole 1 s step."""

    class PerToken:
        request_overhead_s = admission_s = 0.0

        def seconds(self, batch: Batch) -> float:
            return 0.001 * batch.tokens

        def lockstep_seconds(self, batches: list[Batch]) -> float:
            return max(self.seconds(b) for b in batches)

    limits = sim.Limits(max_num_seqs=4, max_num_batched_tokens=2048, kv_capacity_tokens=10**6)
    short = sim.Request(arrival=1e-6, input_len=1, output_len=3)
    long = sim.Request(arrival=1e-6, input_len=1000, output_len=3)
    alone = sim.simulate(PerToken(), limits, [short], ranks=2)
    assert alone.ttft_s == [pytest.approx(0.001)]
    together = sim.simulate(PerToken(), limits, [short, long], ranks=2)
    assert together.ttft_s == [pytest.approx(1.0), pytest.approx(1.0)]
    assert sorted(together.tpot_s) == [pytest.approx(0.001), pytest.approx(0.001)]


def test_a_replica_whose_kv_cache_cannot_hold_one_max_length_sequence_is_infeasible():
    args = {**LOADED.spec.serving.engine_args, "max-model-len": 50_000_000}
    spec = LOADED.spec.model_copy(update={"serving": LOADED.spec.serving.model_copy(update={"engine_args": args})})
    got = planner.predict(spec, LOADED.hardware, Layout(name="tp8-ep8", tp=8, ep=8), 5600, 140)
    assert got.rate_per_server == 0 and got.bound.startswith("infeasible: KV cache") and "50000000" in got.bound
    fits = planner.predict(LOADED.spec, LOADED.hardware, Layout(name="tp8-ep8", tp=8, ep=8), 1000, 50)
    assert fits.rate_per_server > 0


def test_a_profile_without_a_layouts_all_reduce_latency_is_refused_naming_the_field():
    from pipeline.core.specs import feasibility_problems

    perf = PERF.model_copy(update={"all_reduce_latency_us": {4: 14.0}})
    hw = LOADED.hardware.model_copy(update={"performance": perf})
    problems = feasibility_problems(LOADED.spec, hw)
    assert [f for f, _ in problems if "all_reduce_latency_us" in f] == [
        "hardware mi325x-8: performance.all_reduce_latency_us.8"
    ]
    assert not [f for f, _ in feasibility_problems(LOADED.spec, LOADED.hardware) if "all_reduce" in f]


def test_the_rate_search_over_the_same_arrivals_is_monotone():
    """Every rate runs the same sample path, its time scaled: past the first rate that misses the SLO no
    higher one meets it (a ~200-request draw per rate let a tighter limit find a higher rate)."""
    spec, hw = LOADED.spec, LOADED.hardware
    layout = Layout(name="tp4-ep4", tp=4, ep=4)
    model = step_time.step_model(spec, layout, hw)
    limits = step_time.engine_limits(spec, layout, hw, model)
    slo = sim.Slo(p90_ttft_s=spec.slo.max_p90_ttft_ms / 1e3, p90_tpot_s=spec.slo.max_p90_tpot_ms / 1e3)
    run = sim.workload(model, limits, slo, 1000, 50, spec.workload.seed)
    found = sim.max_slo_rate(run, slo).rate
    verdicts = [sim.within(run(found * (0.8 + 0.02 * i)), slo) for i in range(21)]
    assert verdicts[0] and not verdicts[-1]
    first_miss = verdicts.index(False)
    assert not any(verdicts[first_miss:]), verdicts


def test_a_profiled_plans_margin_comes_from_the_two_intervals():
    def predicted(name: str, rate: float, low: float, high: float) -> planner.Estimate:
        return estimate(name, rate).model_copy(update={"rate_low": low, "rate_high": high})

    m = uncertainty.margin_of_intervals(predicted("a", 120, 100, 150), predicted("b", 100, 80, 125))
    # 120/100 - 1 = +20%; worst 100/125 - 1 = -20%, best 150/80 - 1 = +87.5%: undetermined
    assert (m.central, m.low, m.high) == pytest.approx((0.2, -0.2, 0.875))
    assert not m.determined and "fit's error" in m.describe() and "undetermined" in m.describe()


@pytest.mark.parametrize("layout", [Layout(name="tp8-ep8", tp=8, ep=8), Layout(name="tp1-dp8-ep8", tp=1, dp=8, ep=8)])
def test_the_simulations_time_by_bound_is_the_explanations_parts_exactly(layout):
    """bounds() (summed over every simulated step) gives cost()'s parts' bounds and seconds, in order,
    bit for bit: a plan's shares by bound do not depend on which one sums them."""
    model = StepModel(ARCH, layout, PERF, weight_bytes=1, kv_bytes=1)
    for tokens, pairs, sampled in [(1, 1, 1), (256, 256_000, 256), (8192, 4_000_000, 3), (3, 10, 0)]:
        batch = Batch(tokens=tokens, pairs=pairs, context=pairs, sampled=sampled)
        assert model.bounds(batch) == [(p.bound, p.seconds) for p in model.cost(batch).parts]
