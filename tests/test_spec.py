"""Release spec loading and every validation rule, good and bad inputs, through the CLI too."""

from __future__ import annotations

import pytest

from pipeline.cli import main
from pipeline.core.errors import SpecError
from pipeline.core.specs import kv_reserve_gb, load_spec, weights_per_device_gb
from tests.conftest import PROD_SPEC, TINY_SPEC


def problems(path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value.problems


def test_shipped_specs_are_valid():
    prod = load_spec(PROD_SPEC)
    assert prod.hardware.devices == 8 and prod.hardware.device_resource == "amd.com/gpu"
    assert [(lay.tp, lay.ep, lay.replicas) for lay in prod.spec.layouts] == [(8, 8, 1), (4, 4, 2)]
    assert prod.spec.model.architecture.num_experts == 128
    tiny = load_spec(TINY_SPEC)
    assert tiny.hardware.kind == "cpu" and tiny.spec.model.source == "builtin://tiny-qwen3-moe"


def test_weights_per_gpu_match_reference_deployment():
    # ~29 GB per GPU at TP8 and ~58 GB at TP4 for the 235B FP8 checkpoint
    spec = load_spec(PROD_SPEC).spec
    tp8, tp4 = spec.layouts
    assert weights_per_device_gb(spec, tp8) == pytest.approx(29.4, abs=0.1)
    assert weights_per_device_gb(spec, tp4) == pytest.approx(58.75, abs=0.1)
    # fp8 KV: 2 x 94 layers x 1 kv head x 128 x 1 byte x 32768 tokens at TP4
    assert kv_reserve_gb(spec, tp4) == pytest.approx(2 * 94 * 1 * 128 * 32768 / 1e9)


def test_tp16_on_8_gpu_node_names_the_field(spec_file, capsys):
    path = spec_file(PROD_SPEC, lambda d: d["layouts"][0].update(tp=16, ep=16))
    found = problems(path)
    assert any(f"{path}: layouts[0].tp: " in p and "has 8" in p for p in found), found
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: layouts[0].tp:" in err


def test_cli_validate_good_spec_exits_zero(capsys):
    assert main(["validate", str(PROD_SPEC)]) == 0
    assert "ok" in capsys.readouterr().out


def test_yaml_syntax_error_names_the_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel:\n  name: a\n   source: y\n")
    assert problems(path) == [f"{path}: line 4, column 10: YAML syntax error: mapping values are not allowed here"]
    assert main(["validate", str(path)]) == 1
    assert f"{path}: line 4, column 10:" in capsys.readouterr().err


def test_missing_file(tmp_path):
    assert problems(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: file not found"]


def test_unknown_field_is_a_typo(spec_file):
    path = spec_file(PROD_SPEC, lambda d: d["slo"].update(p90_ttft=1))
    assert any("slo.p90_ttft: unknown field" in p for p in problems(path))


def test_wrong_type_names_the_field(spec_file):
    path = spec_file(PROD_SPEC, lambda d: d["layouts"][1].update(tp="four"))
    assert any("layouts[1].tp:" in p for p in problems(path))


@pytest.mark.parametrize("field", ["max_p90_ttft_ms", "max_p90_tpot_ms"])
def test_slo_must_be_positive(spec_file, field):
    path = spec_file(PROD_SPEC, lambda d: d["slo"].update({field: 0}))
    assert any(f"slo.{field}:" in p for p in problems(path))


def test_a_limit_by_its_old_name_is_read_as_the_limit_and_both_names_are_refused(spec_file):
    """A release's stored spec from before the limits were named `max_` still loads (a rollback reads
    it again); a spec naming one limit twice is refused, naming both keys."""
    old = spec_file(PROD_SPEC, lambda d: d.update(slo={"p90_ttft_ms": 700, "p90_tpot_ms": 40}), "old.yaml")
    slo = load_spec(old).spec.slo
    assert (slo.max_p90_ttft_ms, slo.max_p90_tpot_ms) == (700, 40)
    both = spec_file(PROD_SPEC, lambda d: d["slo"].update(p90_ttft_ms=700), "both.yaml")
    assert any("p90_ttft_ms and max_p90_ttft_ms both given" in p for p in problems(both))
    # a trigger's conf alike (the DAG hands the old param names on; unset ones are None)
    from pipeline.records.release import Overrides

    conf = Overrides.model_validate({"p90_ttft_ms": 2000, "p90_tpot_ms": None, "max_p90_tpot_ms": 80})
    assert (conf.max_p90_ttft_ms, conf.max_p90_tpot_ms) == (2000, 80)
    with pytest.raises(ValueError, match="extra"):
        Overrides.model_validate({"max_p90_ttft": 2000})  # a misspelt limit is refused, never ignored


@pytest.mark.parametrize("field", ["input_len", "output_len", "num_prompts"])
def test_workload_must_be_positive(spec_file, field):
    path = spec_file(PROD_SPEC, lambda d: d["workload"].update({field: -1}))
    assert any(f"workload.{field}:" in p for p in problems(path))


def test_ep_must_divide_experts(spec_file):
    def edit(d):
        d["model"]["architecture"]["num_experts"] = 100

    found = problems(spec_file(PROD_SPEC, edit))
    assert any("layouts[0].ep: ep=8 does not divide the 100 experts" in p for p in found), found


def test_ep_needs_moe(spec_file):
    def edit(d):
        d["model"]["architecture"].update(num_experts=0, num_experts_per_tok=0)

    found = problems(spec_file(PROD_SPEC, edit))
    assert any("layouts[0].ep: expert parallelism needs a MoE model" in p for p in found), found


def test_ep_must_match_tp_times_dp(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["layouts"][1].update(ep=2)))
    assert any("layouts[1].ep:" in p and "must be 4 or 1" in p for p in found), found


def test_replicas_must_fit_the_node(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["layouts"][1].update(replicas=3)))
    assert any("layouts[1].replicas:" in p and "12 devices" in p for p in found), found


def test_weights_must_fit_device_memory(spec_file):
    # 235 GB of FP8 weights on one 256 GB GPU at 0.90 utilization does not fit with the KV reserve
    found = problems(spec_file(PROD_SPEC, lambda d: d["layouts"][0].update(tp=1, ep=1)))
    assert any("layouts[0].tp: weights 235.0 GB" in p for p in found), found


def test_heads_must_split_over_tp(spec_file):
    found = problems(spec_file(TINY_SPEC, lambda d: d["layouts"][0].update(tp=3)))
    assert any("layouts[0].tp: 4 attention heads do not split over tp=3" in p for p in found), found


def test_reviewers_required_with_approval(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["promotion"].update(reviewers=[])))
    assert any("promotion.reviewers:" in p for p in found), found


def test_layout_flags_not_allowed_in_engine_args(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["serving"]["engine_args"].update({"tensor-parallel-size": 2})))
    assert any("serving.engine_args:" in p and "set by the layout" in p for p in found), found


def test_max_model_len_must_hold_the_workload(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["serving"]["engine_args"].update({"max-model-len": 4096})))
    assert any("serving.engine_args.max-model-len: 4096 is shorter" in p for p in found), found


def test_unknown_hardware_profile(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d.update(hardware="h100-8")))
    assert found and "hardware: unknown profile 'h100-8'" in found[0] and "mi325x-8" in found[0]


def test_unknown_scheme(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["quantization"].update(scheme="INT3")))
    assert any("quantization.scheme:" in p for p in found), found


def test_bad_source(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["model"].update(source="ftp://x/y")))
    assert any("model.source:" in p for p in found), found


def test_duplicate_layout_names(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d["layouts"][1].update(name="tp8-ep8")))
    assert any("layouts[1].name: duplicate" in p for p in found), found


def test_staging_needs_a_target(spec_file):
    found = problems(spec_file(PROD_SPEC, lambda d: d.update(staging={})))
    assert any(p.endswith("staging: set at least one of s3 or nfs") for p in found), found


def test_every_problem_is_reported_at_once(spec_file):
    def edit(d):
        d["layouts"][0].update(tp=16, ep=16)
        d["promotion"]["reviewers"] = []

    found = problems(spec_file(PROD_SPEC, edit))
    assert len(found) >= 2


def test_a_local_source_that_does_not_exist_is_a_spec_error(spec_file, tmp_path):
    found = problems(spec_file(PROD_SPEC, lambda d: d["model"].update(source=str(tmp_path / "nowhere"))))
    spec = tmp_path / "releases" / "variant.yaml"
    assert found == [f"{spec}: model.source: {tmp_path / 'nowhere'}: no such directory"]
    empty = tmp_path / "releases" / "empty"  # a relative source is relative to the spec's directory
    empty.mkdir()
    found = problems(spec_file(PROD_SPEC, lambda d: d["model"].update(source="empty")))
    assert found == [f"{spec}: model.source: {empty}: not a model directory (no config.json)"]
    (empty / "config.json").write_text("{}")
    assert load_spec(spec_file(PROD_SPEC, lambda d: d["model"].update(source="empty"))).spec.model.source == "empty"


@pytest.mark.parametrize("schedule", ["every tuesday-ish", "@sometimes", "61 * * * *"])
def test_a_schedule_that_is_neither_cron_nor_preset_is_a_spec_error(spec_file, schedule):
    found = problems(spec_file(PROD_SPEC, lambda d: d["rebenchmark"].update(schedule=schedule)))
    assert len(found) == 1 and found[0].endswith(
        f"rebenchmark.schedule: {schedule!r} is neither a cron expression (e.g. '0 3 * * 2') nor an Airflow preset "
        "(@hourly, @daily, @weekly, @monthly, @quarterly, @yearly)"
    ), found


@pytest.mark.parametrize("schedule", ["0 3 * * 2", "@quarterly", "*/30 * * * *"])
def test_cron_expressions_and_presets_are_accepted(spec_file, schedule):
    assert load_spec(spec_file(PROD_SPEC, lambda d: d["rebenchmark"].update(schedule=schedule))).spec.rebenchmark


def test_the_run_copy_of_a_spec_keeps_its_relative_local_source(spec_file, tmp_path):
    from pipeline.entry import flow
    from pipeline.records.release import Overrides

    path = spec_file(PROD_SPEC, lambda d: d["model"].update(source="model"))
    (path.parent / "model").mkdir()
    (path.parent / "model" / "config.json").write_text("{}")
    copy = flow.apply_overrides(path, Overrides(max_p90_ttft_ms=2000), tmp_path / "run")
    assert copy.parent != path.parent
    assert load_spec(copy).spec.model.source == str((path.parent / "model").resolve())
