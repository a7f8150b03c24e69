"""The steady-state test in a probe's verdict and the confirmation at the search's answer (#61):
the statistic on probes recorded from the tiny engine, the confirmation's step-downs on stand-ins,
the floor `validate` enforces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline.core.specs import SloSpec, WorkloadSpec, load_spec
from pipeline.records.benchmark import Interference, SearchOutcome
from pipeline.records.evaluate import EvalResult
from pipeline.stages import benchmark
from pipeline.stages.benchmark import confirm, steady
from testkit.probes import fixed_probe, mm1_run
from tests.conftest import TINY_SPEC

FIXTURES = Path(__file__).parent / "fixtures" / "steady"
SLO = SloSpec(max_p90_ttft_ms=500, max_p90_tpot_ms=100, resolution=0.05)


def recorded(name: str, tmp_path: Path) -> tuple[dict, Path]:
    """A recorded probe written back as the client's result file (`parse_result` reads it as it reads
    vLLM's): per request its send time and TTFT, the p90s as vLLM computes them (numpy's percentile)."""
    import numpy as np

    fixture = json.loads((FIXTURES / name).read_text())
    sends, ttfts = zip(*fixture["requests"], strict=True)
    result = {
        "completed": len(ttfts),
        "failed": 0,
        "duration": fixture["duration_s"],
        "request_throughput": len(ttfts) / fixture["duration_s"],
        "p90_ttft_ms": float(np.percentile(ttfts, 90) * 1000),
        "p90_tpot_ms": fixture["p90_tpot_ms"],
        "start_times": list(sends),
        "ttfts": list(ttfts),
    }
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return fixture, path


def test_the_floor_is_the_time_a_queue_at_the_resolutions_overload_takes_to_cross_the_limit():
    # TTFT grows m s a second at an overload m: the p90 (near 0.9 of the run) reaches the limit after limit / (0.9 m)
    assert SLO.confirm_floor_seconds == pytest.approx(0.5 / (0.9 * 0.05))
    assert SloSpec(max_p90_ttft_ms=3000, max_p90_tpot_ms=50, resolution=0.1).confirm_floor_seconds == pytest.approx(
        3 / 0.09
    )
    workload = WorkloadSpec(input_len=1, output_len=1)
    assert steady.confirm_seconds(workload, SLO) == SLO.confirm_floor_seconds  # none set: the floor
    assert steady.confirm_seconds(workload.model_copy(update={"confirm_seconds": 40.0}), SLO) == 40.0


def test_validate_refuses_a_confirmation_below_the_floor_naming_the_field(spec_file, capsys):
    from pipeline.cli import main
    from pipeline.core.errors import SpecError

    short = spec_file(TINY_SPEC, lambda d: d["workload"].update(confirm_seconds=8))
    with pytest.raises(SpecError) as info:
        load_spec(short)
    (problem,) = info.value.problems
    assert problem.startswith(f"{short}: workload.confirm_seconds: 8 s is below the floor of 11.1 s"), problem
    assert main(["validate", str(short)]) == 1
    assert "workload.confirm_seconds" in capsys.readouterr().err
    assert load_spec(spec_file(TINY_SPEC, lambda d: d["workload"].update(confirm_seconds=12))).spec.workload
    unset = spec_file(TINY_SPEC, lambda d: d["workload"].pop("confirm_seconds"))
    assert load_spec(unset).spec.workload.confirm_seconds is None  # none: the floor


def test_the_trend_fails_an_overloaded_probe_that_its_p90_passes_and_passes_a_sustained_one(tmp_path):
    """Held-out probes recorded from the tiny engine (tests/fixtures/steady/README.md): two runs of the
    same length, one at a rate the engine sustained and one above it. The p90 passes both, as the
    verdict before #61 did; the trend carried over the confirmation fails only the overloaded one,
    and a longer run at that rate (recorded after it) broke the SLO."""
    over, over_path = recorded("overloaded.json", tmp_path)
    held, held_path = recorded("sustained.json", tmp_path)
    assert over["seconds"] == held["seconds"]  # the same length: the trend, not the length, tells them apart
    failing = benchmark.parse_result(over_path, over["rate"], len(over["requests"]), SLO)
    passing = benchmark.parse_result(held_path, held["rate"], len(held["requests"]), SLO)
    # the p90 alone passed both
    assert failing.p90_ttft_ms <= SLO.max_p90_ttft_ms and passing.p90_ttft_ms <= SLO.max_p90_ttft_ms
    assert [r.split(":")[0] for r in failing.reasons] == [f"TTFT trend +{failing.ttft_trend_ms_per_s:.1f} ms/s"]
    assert not failing.passed and failing.projected_p90_ttft_ms > SLO.max_p90_ttft_ms
    assert passing.passed and passing.projected_p90_ttft_ms <= SLO.max_p90_ttft_ms, passing.reasons
    assert failing.ttft_trend_ms_per_s > passing.ttft_trend_ms_per_s
    assert failing.backlog_end > passing.backlog_end
    assert over["longer_run"]["p90_ttft_ms"] > SLO.max_p90_ttft_ms  # what the trend foretold
    # the burst (no schedule, every request at once) is not judged on a trend
    burst = benchmark.parse_result(over_path, math.inf, len(over["requests"]), SLO)
    assert burst.ttft_trend_ms_per_s is None and burst.projected_p90_ttft_ms is None


def test_the_trend_is_the_median_slope_of_the_settled_part():
    # TTFT rising 50 ms/s after a fill; a few slow requests (the p90's tail) do not move it
    pairs = [(i / 100, 0.02 + 0.05 * i / 100 + (0.4 if i % 37 == 0 else 0.0)) for i in range(1000)]
    assert steady.trend(pairs) == pytest.approx(50.0, rel=0.02)
    flat_after_fill = [(i / 100, min(i / 100, 2.0) * 0.1) for i in range(1000)]  # fills for 2 s of 10, then flat
    assert steady.trend(flat_after_fill) == pytest.approx(0.0, abs=1e-6)
    assert steady.trend(pairs[:5]) is None
    # backlog: sent by the last send and not answered then
    assert steady.backlog_at_end([(0.0, 0.1), (1.0, 5.0), (2.0, 0.5), (3.0, 0.0001)]) == 2
    assert steady.projected(100.0, -20.0, 10.0) == 100.0 and steady.projected(100.0, 20.0, 10.0) == 300.0


def test_a_probe_failed_on_its_trend_alone_is_measured_again_twice_as_long_before_it_counts():
    """Two of three demos' edges were set by 8 s probes failed on their slope alone (p90 243 and 162 ms
    of 500): a short probe's trend is measured again, twice as long, and that run's verdict counts."""
    from pipeline.stages.benchmark.search import SloSearch

    workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=100, min_probe_seconds=1, repeats=0)

    def engine(settles: bool, p90: float = 200.0):
        seen: list[int] = []

        def run(rate: float, n: int, seed: int):
            seen.append(n)
            if len(seen) == 1:  # the short probe: a slope of 40 ms/s carried over the 11 s floor crosses 500 ms
                return fixed_probe(rate, n, p90, SLO, trend=40.0)
            return fixed_probe(rate, n, p90 if settles else 320.0, SLO, trend=0.0 if settles else 40.0)

        return run, seen

    run, seen = engine(settles=True)
    search = SloSearch(run, workload, SLO)
    counted = search.probe(50.0)
    first = search.out.probes[0]
    assert "TTFT trend +40.0 ms/s" in first.reasons[0] and first.p90_ttft_ms < SLO.max_p90_ttft_ms
    assert seen == [100, 200] and first.superseded and counted.passed and search.runs[50.0] == [counted]
    run, seen = engine(settles=False)  # the queue grows: the longer probe fails too, and counts; no third run
    search = SloSearch(run, workload, SLO)
    counted = search.probe(50.0)
    assert seen == [100, 200] and not counted.passed and search.holds(50.0) is False
    run, seen = engine(settles=True, p90=600.0)  # failed on its p90: not a slope's noise, counted at once
    search = SloSearch(run, workload, SLO)
    assert not search.probe(50.0).passed and seen == [100]


def sustains(mu: float, slo: SloSpec, seen: list[tuple[float, int]], dirty: set[int] = frozenset()):
    """A stand-in engine that serves `mu` req/s: a run shorter than the confirmation's floor passes at any
    rate up to 1.2 mu (its queue does not show in time), a longer one only at or below mu."""

    def run(rate: float, n: int, seed: int):
        seen.append((rate, n))
        long = n / rate >= slo.confirm_floor_seconds
        holds = rate <= mu or (not long and rate <= 1.2 * mu)
        probe = fixed_probe(rate, n, 200.0 if holds else 2000.0, slo, achieved=min(rate, mu))
        if len(seen) in dirty:
            probe.interference = Interference(
                wall_s=1, cores=2, busy=2, engine=1, client=0.1, owner=0, other=0.9, load_avg_1m=2
            )
        return probe

    return run


def test_a_failed_confirmation_steps_down_until_one_holds():
    workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=10, repeats=0)
    seen: list[tuple[float, int]] = []
    out = confirm.confirm(sustains(90.0, SLO, seen), SearchOutcome(probes=[], max_slo_rate=100.0), workload, SLO)
    # a resolution under the search's 100: 95 fails; down to min(95, served 90) x 0.95 = 85.5, which holds
    assert [round(r, 2) for r, _ in seen] == [95.0, 85.5]
    assert out.searched_rate == 100.0 and "failed at 95 req/s (5% under the search's 100)" in out.stop_reason
    assert all(n == math.ceil(r * SLO.confirm_floor_seconds) for r, n in seen)
    assert out.max_slo_rate == pytest.approx(85.5) and out.confirmed and out.step_downs == 1
    assert all(p.confirmation for p in out.probes) and out.deciding_p90_ttft_ms == [200.0]
    assert "stepped down 1x to 85.5" in out.stop_reason
    assert out.confirm_seconds == round(SLO.confirm_floor_seconds, 2)


def test_a_confirmation_that_never_holds_leaves_no_answer_after_the_cap():
    workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=10, repeats=0)
    seen: list[float] = []

    def never(rate: float, n: int, seed: int):  # a regression that no step-down reaches
        seen.append(rate)
        return fixed_probe(rate, n, 2000.0, SLO)

    out = confirm.confirm(never, SearchOutcome(probes=[], max_slo_rate=100.0), workload, SLO)
    assert seen == pytest.approx([100 * 0.95 ** (1 + k) for k in range(1 + confirm.MAX_STEP_DOWNS)])
    assert out.max_slo_rate is None and out.confirmed is False and out.step_downs == confirm.MAX_STEP_DOWNS
    assert "no rate is confirmed" in out.stop_reason
    nothing = confirm.confirm(never, SearchOutcome(probes=[]), workload, SLO)
    assert nothing.confirmed is None and len(seen) == 1 + confirm.MAX_STEP_DOWNS  # no answer: nothing to confirm


def test_a_disturbed_confirmation_is_run_again_not_stepped_down():
    workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=10, repeats=0)
    seen: list[tuple[float, int]] = []
    out = confirm.confirm(
        sustains(100.0, SLO, seen, dirty={1}), SearchOutcome(probes=[], max_slo_rate=100.0), workload, SLO
    )
    assert [r for r, _ in seen] == [95.0, 95.0] and out.probes[0].superseded and out.max_slo_rate == 95.0


def test_the_search_with_its_confirmation_reports_a_rate_the_engine_sustains():
    """Short probes flatter the stand-in up to 1.2x its rate, so the search alone answers above it;
    confirmed, the answer is one it sustains, within a step-down's resolution."""
    workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=10, min_probe_seconds=1, repeats=1)
    seen: list[tuple[float, int]] = []
    alone = benchmark.slo_search(sustains(60.0, SLO, []), workload, SLO, prior=50.0)
    assert alone.max_slo_rate is not None and alone.max_slo_rate > 60.0
    out = benchmark.confirmed_search(sustains(60.0, SLO, seen), workload, SLO, prior=50.0)
    assert out.confirmed and 60.0 * (1 - SLO.resolution) ** 2 <= out.max_slo_rate <= 60.0
    # a queue-free engine (the M/M/1 formula has no trend) holds a resolution under the search's edge at
    # once: that is the answer, a lower bound; the edge is kept beside it
    plain = benchmark.confirmed_search(mm1_run(60.0, SLO), workload, SLO, prior=50.0)
    edge = benchmark.slo_search(mm1_run(60.0, SLO), workload, SLO, prior=50.0).max_slo_rate
    assert plain.confirmed and plain.step_downs == 0 and plain.probes[-1].confirmation
    assert plain.searched_rate == edge and plain.max_slo_rate == pytest.approx(edge * (1 - SLO.resolution))
    assert plain.deciding_p90_ttft_ms == [round(plain.probes[-1].p90_ttft_ms, 2)]  # the confirmation's, not the edge's


def test_fidelity_reports_an_answer_too_high_as_loudly_as_one_too_low():
    """benchmarks/fidelity.py's target (#61): under the independent client the answer holds and 1.1x fails;
    either way it misses is 'NOT met' (the script's exit is non-zero on anything but 'met')."""
    import importlib.util

    script = Path(__file__).parents[1] / "benchmarks" / "fidelity.py"
    spec = importlib.util.spec_from_file_location("fidelity_script", script)
    assert spec and spec.loader
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)

    def pairs(at_ms: float, above_ms: float):
        return [
            ("independent", fixed_probe(80.0, 2400, at_ms, SLO)),
            ("vllm", fixed_probe(80.0, 2400, 100.0, SLO)),
            ("independent", fixed_probe(80.0 * fidelity.ABOVE, 2640, above_ms, SLO)),
        ]

    assert fidelity.lower_bound_verdict(80.0, pairs(200, 2000)).startswith("lower-bound target met")
    high = fidelity.lower_bound_verdict(80.0, pairs(900, 3000))
    low = fidelity.lower_bound_verdict(80.0, pairs(200, 300))
    assert high.startswith("lower-bound target NOT met: the answer is TOO HIGH") and "p90 TTFT 900.0 ms > 500" in high
    assert low.startswith("lower-bound target NOT met: the answer is TOO LOW, 1.1x it holds")
    assert "NOT met" in fidelity.lower_bound_verdict(None, [])


def test_the_report_shows_the_confirmation_beside_the_searchs_probes():
    from pipeline.records.benchmark import BenchmarkFile, LayoutResult
    from pipeline.release import report

    workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=10, min_probe_seconds=1, repeats=0)
    out = benchmark.confirmed_search(sustains(60.0, SLO, []), workload, SLO, prior=50.0)
    result = LayoutResult(
        layout="single", tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="ok", probes=out.probes,
        max_slo_rate=out.max_slo_rate, confirm_seconds=out.confirm_seconds, confirmed=out.confirmed,
        step_downs=out.step_downs, searched_rate=out.searched_rate,
    )  # fmt: skip
    html = report._section_measurement(BenchmarkFile(layouts=[result]))
    failed, held = [p for p in out.probes if p.confirmation]
    assert failed.rate == pytest.approx(out.searched_rate * (1 - SLO.resolution))
    assert (
        f"11 s runs from under the search&#39;s {out.searched_rate:.3g} req/s, held, 1 step-down: "
        f"{failed.rate:.3g} req/s x {failed.num_prompts}: p90 TTFT 2000 ms"
    ) in html
    assert f"{held.rate:.3g} req/s x {held.num_prompts}: p90 TTFT 200 ms, trend -, pass</td>" in html
    assert html.count("<td>confirmation: fail</td>") == 1 and html.count("<td>confirmation: pass</td>") == 1
    assert result.deciding_probe() is held  # the performance row's p90s are the confirmation's


@pytest.mark.parametrize("fresh", [True, False])
def test_the_answer_is_confirmed_on_a_fresh_engine_started_after_the_searchs_stopped(fresh, tmp_path, monkeypatch):
    """Two instances of one layout: the search's sustains 100 req/s, the next one 88 (#61 measured two
    instances of one engine 4-10% apart on this host). The fresh instance's confirmation fails the
    search's answer and steps it down to a rate it holds; its served answers are checked there. Off
    (`confirm_on_fresh_engine: false`), the search's own engine confirms what it found."""
    import contextlib

    from pipeline.records.served_accuracy import ServedAccuracy
    from pipeline.stages import served_accuracy
    from pipeline.stages.benchmark import orchestration

    loaded = load_spec(TINY_SPEC)
    spec = loaded.spec.model_copy(deep=True)
    spec.workload = WorkloadSpec(
        input_len=1, output_len=1, num_prompts=10, min_probe_seconds=1, repeats=0, confirm_on_fresh_engine=fresh
    )
    spec.slo = SLO
    events: list[str] = []
    seen: list[tuple[int, float]] = []  # (instance, rate) of every probe

    @contextlib.contextmanager
    def running(spec, hw, layout, model_dir, out_dir, base_port=None):
        instance = 1 + sum(e.startswith("start") for e in events)
        mu = {1: 100.0, 2: 88.0}[instance]
        engine = type(
            "Engine",
            (),
            {"url": f"http://instance-{instance}", "load_seconds": [1.0], "load_splits": lambda self: []},
        )()
        sustained = sustains(mu, SLO, [])

        def probe(rate: float, n: int, seed: int):
            assert events[-1] == f"start {instance}", "a probe of an engine that is not running"
            seen.append((instance, rate))
            return sustained(rate, n, seed)

        events.append(f"start {instance}")
        try:
            yield engine, probe
        finally:
            events.append(f"stop {instance}")

    checked: list[str] = []

    def check(url, *args, **kwargs):
        checked.append(url)
        return ServedAccuracy(passed=True, endpoint=url, limit=20, tasks=[], seconds=1.0)

    monkeypatch.setattr(orchestration, "running_layout", running)
    monkeypatch.setattr(served_accuracy, "check", check)
    gate = EvalResult.model_construct()
    result = benchmark.benchmark_layout(
        spec, loaded.hardware, loaded.layout("single"), tmp_path, tmp_path, prior=90.0, accuracy=(gate, gate)
    )
    confirmations = [p for p in result.probes if p.confirmation]
    searched = [rate for instance, rate in seen if instance == 1]
    assert result.status == "ok" and confirmations and result.confirmed
    assert max(p.rate for p in result.probes if not p.confirmation and p.passed) > 100.0  # short probes flatter
    if fresh:
        assert events == ["start 1", "stop 1", "start 2", "stop 2"]  # the fresh one starts once the search's stopped
        # the fresh engine is warmed first at the first confirmation's rate; that run is kept, not counted
        warm = [p for p in result.probes if p.warmup]
        assert len(warm) == 1 and warm[0].superseded and not warm[0].confirmation
        assert warm[0].num_prompts == math.ceil(warm[0].rate * confirm.WARMUP_SECONDS)
        assert [rate for instance, rate in seen if instance == 2] == [warm[0].rate] + [p.rate for p in confirmations]
        assert warm[0].rate == confirmations[0].rate
        assert result.step_downs >= 1 and result.max_slo_rate <= 88.0  # it holds what the second instance sustains
        assert checked == ["http://instance-2"] and result.confirm_engine == "fresh"
        assert "on a fresh engine" in result.stop_reason
    else:
        assert events == ["start 1", "stop 1"] and checked == ["http://instance-1"]
        assert len(searched) == len(result.probes) and result.confirm_engine == "searched"
        assert not any(p.warmup for p in result.probes)  # the search's engine is warm already
        assert 100.0 * (1 - SLO.resolution) ** 2 <= result.max_slo_rate <= 100.0
    assert result.confirm_wall_s is not None and result.confirm_wall_s >= 0


def test_no_fresh_engine_starts_for_a_search_without_an_answer(tmp_path, monkeypatch):
    import contextlib

    from pipeline.stages.benchmark import orchestration

    loaded = load_spec(TINY_SPEC)
    starts: list[int] = []

    @contextlib.contextmanager
    def running(*args, **kwargs):
        starts.append(1)
        engine = type("Engine", (), {"url": "http://x", "load_seconds": [1.0], "load_splits": lambda self: []})()
        yield engine, lambda rate, n, seed: fixed_probe(rate, n, 5000.0, SLO, achieved=min(rate, 50.0))

    monkeypatch.setattr(orchestration, "running_layout", running)
    result = benchmark.benchmark_layout(loaded.spec, loaded.hardware, loaded.layout("single"), tmp_path, tmp_path)
    assert starts == [1] and result.max_slo_rate is None and result.confirm_engine is None


def test_a_fresh_engine_that_fails_to_start_fails_the_layout_keeping_the_searchs_figures(tmp_path, monkeypatch):
    """The search answered on its engine; the fresh one's start fails: the layout fails (nothing
    confirmed the answer), and its record keeps what the search found, its answer as the search's."""
    import contextlib

    from pipeline.core.errors import ReleaseError
    from pipeline.stages.benchmark import orchestration

    loaded = load_spec(TINY_SPEC)
    spec = loaded.spec.model_copy(deep=True)
    spec.workload = WorkloadSpec(input_len=1, output_len=1, num_prompts=10, min_probe_seconds=1, repeats=0)
    spec.slo = SLO
    starts: list[int] = []

    @contextlib.contextmanager
    def running(*args, **kwargs):
        starts.append(1)
        if len(starts) == 2:
            raise ReleaseError("engine exited with code 1 before it was ready")
        engine = type("Engine", (), {"url": "http://x", "load_seconds": [1.0], "load_splits": lambda self: []})()
        yield engine, sustains(100.0, SLO, [])

    monkeypatch.setattr(orchestration, "running_layout", running)
    result = benchmark.benchmark_layout(spec, loaded.hardware, loaded.layout("single"), tmp_path, tmp_path, prior=90.0)
    assert starts == [1, 1] and result.status == "failed" and "before it was ready" in (result.error or "")
    assert result.max_slo_rate is None and result.searched_rate is not None and result.searched_rate > 90.0
    assert result.capacity_rps and result.stop_reason and result.probes
    assert not any(p.confirmation for p in result.probes)
