"""Fleet size and token cost: the arithmetic against literal numbers, and where decisions are made."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.core.errors import GateFailed, SpecError
from pipeline.core.paths import PROJECT_ROOT
from pipeline.core.specs import CapacitySpec, WorkloadSpec, load_spec
from pipeline.entry import flow
from pipeline.records import edge
from pipeline.records.benchmark import LayoutResult
from pipeline.records.events import detail_of
from pipeline.release.registry import Registry, ReleaseData
from pipeline.stages import capacity
from tests.conftest import PROD_SPEC, TINY_SPEC
from tests.test_registry import chosen

WORK = WorkloadSpec(input_len=5600, output_len=140)


def test_fleet_arithmetic_against_literal_numbers():
    # 120 req/s peak + 20% = 144 req/s; at 12.5 req/s per server that is 11.52 -> 12 servers at $16 each
    cap = CapacitySpec(peak_rps=120, mean_rps=70, headroom=0.2, min_servers=2, max_servers=16)
    f = capacity.fleet("tp8", 12.5, cap, WORK, 16.0)
    assert (f.servers_exact, f.servers, f.fleet_rps, f.within_max) == (11.52, 12, 150.0, True)
    assert f.usd_per_hour == 192.0
    # one server at its SLO rate: 12.5 x 5600 = 70,000 input tokens/s = 252 M/hour for $16
    assert f.usd_per_m_input_at_slo == pytest.approx(16 / 252)  # $0.0635
    assert f.usd_per_m_output_at_slo == pytest.approx(16 / 6.3)  # 12.5 x 140 x 3600 = 6.3 M/hour: $2.54
    # the 12-server fleet ($192/h) over the mean: 70 x 5600 x 3600 = 1411.2 M input tokens/hour
    assert f.usd_per_m_input_at_mean == pytest.approx(192 / 1411.2)  # $0.136
    assert f.usd_per_m_output_at_mean == pytest.approx(192 / 35.28)  # $5.44


def test_an_exact_fit_does_not_round_up_and_min_servers_holds():
    cap = CapacitySpec(peak_rps=100, mean_rps=50, headroom=0.2)
    assert capacity.fleet("x", 12.0, cap, WORK, 1.0).servers == 10  # 100 x 1.2 / 12 is 10, not 10.000000000000002
    small = CapacitySpec(peak_rps=1, mean_rps=1, headroom=0, min_servers=3)
    assert capacity.fleet("x", 50.0, small, WORK, None).servers == 3
    assert capacity.fleet("x", 50.0, small, WORK, None).usd_per_hour is None  # no price: servers only
    assert not capacity.fleet("x", 1.0, CapacitySpec(peak_rps=9, mean_rps=1, max_servers=8), WORK, 1.0).within_max


def test_candidate_vs_live_change_and_the_approval_phrase(spec_file):
    path = spec_file(TINY_SPEC, lambda d: d["capacity"].update(peak_rps=20, mean_rps=10, headroom=0.25))
    loaded = load_spec(path)
    plan = capacity.plan(loaded, {"single": 15.0, "two-replicas": 9.0}, "single", ("live release 7", "old", 10.0, None))
    assert plan is not None and plan.candidate and plan.live and plan.change
    # 25 req/s with headroom: live 2.5 -> 3 servers, candidate 1.67 -> 2; $/M output scales with 1/rate
    assert (plan.live.servers, plan.candidate.servers) == (3, 2)
    assert plan.change.usd_per_hour_pct == pytest.approx(-33.33)
    assert plan.change.usd_per_m_output_pct == pytest.approx(-33.33)
    assert plan.change.summary() == "3 -> 2 servers, -33% $/M output tokens"
    assert [r.label for r in capacity.rows(plan)] == ["live release 7", "candidate", "two-replicas"]
    text = capacity.table(plan)
    assert "vs live: 3 -> 2 servers" in text and "$0.05/server-hour" in text


def test_a_cost_without_a_price_names_the_hardware_field(tmp_path):
    (tmp_path / "configs" / "releases").mkdir(parents=True)
    (tmp_path / "configs" / "hardware").mkdir()
    hw = (PROJECT_ROOT / "configs" / "hardware" / "cpu-local.yaml").read_text()
    priceless = "\n".join(line for line in hw.splitlines() if not line.startswith("price"))
    (tmp_path / "configs" / "hardware" / "cpu-local.yaml").write_text(priceless)
    spec = tmp_path / "configs" / "releases" / "tiny.yaml"
    spec.write_text(TINY_SPEC.read_text())
    with pytest.raises(SpecError) as exc:
        load_spec(spec)
    assert f"{tmp_path / 'configs' / 'hardware' / 'cpu-local.yaml'}: price_per_server_hour: missing" in str(exc.value)
    no_capacity = (
        TINY_SPEC.read_text().split("capacity:")[0]
        + "hardware: cpu-local\n"
        + "".join(TINY_SPEC.read_text().split("hardware: cpu-local\n")[1:])
    )
    spec.write_text(no_capacity)
    assert load_spec(spec).spec.capacity is None  # no cost asked for: no price needed


def test_capacity_fields_are_checked(spec_file):
    with pytest.raises(SpecError, match=r"capacity: .*mean_rps 500 is above peak_rps 400"):
        load_spec(spec_file(TINY_SPEC, lambda d: d["capacity"].update(mean_rps=500)))
    with pytest.raises(SpecError, match=r"capacity: .*max_servers 1 is below min_servers 2"):
        load_spec(spec_file(TINY_SPEC, lambda d: d["capacity"].update(min_servers=2, max_servers=1)))


def _result(name: str, per_server: float) -> dict:
    r = LayoutResult(layout=name, tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="ok", max_slo_rate=per_server)
    r.per_server, r.per_device, r.capacity_rps = per_server, per_server / 2, per_server * 1.1
    return r.model_dump(mode="json")


def _measured_against_live(path, live_rate: float):
    """A live release at `live_rate` req/s per server, and a run that measured single 150, two-replicas 90."""
    loaded = load_spec(path)
    reg = Registry()
    live = reg.open_release("run-0", loaded.spec.name, str(path), path.read_text(), "local")
    reg.record(
        live.id,
        detail_of("deploy_finished", None),
        "pipeline",
        status="live",
        data=ReleaseData(chosen=chosen("single", rate_per_server=live_rate)),
    )
    rel = reg.open_release("run-1", loaded.spec.name, str(path), path.read_text(), "local")
    selection = edge.call(
        flow.select_layout, _release(path, rel.id), [_result("single", 150.0), _result("two-replicas", 90.0)], "run-1"
    )
    return reg, rel, selection


def _release(path, release_id: int | None) -> dict:
    """The validate task's record for a release the test opened, as XCom carries it."""
    return flow.validate_spec(str(path)).model_copy(update={"release_id": release_id}).model_dump()


def test_a_candidate_needing_more_than_max_servers_is_refused_at_the_slo_gate(
    spec_file, release_env, monkeypatch, tmp_path
):
    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "home"))
    path = spec_file(TINY_SPEC, lambda d: d["capacity"].update(max_servers=3))
    reg, rel, selection = _measured_against_live(path, live_rate=200.0)
    # 400 req/s + 25% = 500 req/s: 500 / 150 = 3.33 -> 4 servers > 3
    assert not selection["passed"]
    assert selection["reason"] == (
        "layout single needs 4 servers for the peak (400 req/s + 25% headroom at 150 req/s per server); "
        "capacity.max_servers is 3"
    )
    with pytest.raises(GateFailed, match="capacity.max_servers is 3") as exc:
        edge.call(flow.slo_gate, _release(path, rel.id), selection)
    assert "> max servers" in str(exc.value)  # the fleet table comes with the refusal
    after = reg.get(rel.id)
    assert after.status == "gate_failed"
    plan = after.data.capacity
    assert plan.live and plan.live.servers == 3 and plan.candidate and plan.candidate.servers == 4
    gate = [e for e in reg.events(rel.id) if e.kind == "slo_gate"][-1]
    assert (
        gate.detail.stored()["servers"] == 4
        and gate.detail.stored()["vs_live"] == "3 -> 4 servers, +33% $/M output tokens"
    )


def test_the_fleet_reaches_the_report_the_approval_and_releases_show(spec_file, release_env, monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "home"))
    from pipeline.airflow import approval
    from pipeline.release import registry, report

    path = spec_file(TINY_SPEC)
    loaded = load_spec(path)
    reg, rel, selection = _measured_against_live(path, live_rate=100.0)
    assert selection["passed"]
    edge.call(flow.slo_gate, _release(path, rel.id), selection)
    data = reg.get(rel.id).data
    # 500 req/s with headroom: live 5 servers at 100, candidate 3.33 -> 4 at 150; $/M output -33%
    assert approval.fleet_phrase(data) == "; 5 -> 4 servers, -33% $/M output tokens"
    assert "| candidate (single) | 150 | 4 | $0.200 | $0.00145 | $0.00579 |" in approval.fleet_lines(data)
    page = report.render(reg, reg.get(rel.id), loaded, None, None)
    assert "<h2>Fleet and cost</h2>" in page and "5 -&gt; 4 servers, -33% $/M output tokens" in page
    assert "alt='servers, $/hour and $/M output tokens: live vs candidate'" in page
    shown = registry.audit_trail(reg, rel.id)
    assert "fleet and cost:" in shown and "candidate (single)" in shown and "live release 1 (single)" in shown


def test_capacity_command_from_a_given_and_a_recorded_rate(spec_file, release_env, tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "capacity", *args], capture_output=True, text=True, timeout=120
        )

    given = cli(
        str(PROD_SPEC),
        "--rate-per-server",
        "tp8-ep8=12.5",
        "--rate-per-server",
        "tp4-ep4-x2=18.1",
        "--load-seconds",
        "900",
    )
    assert given.returncode == 0, given.stderr
    assert "candidate: tp4-ep4-x2" in given.stdout
    # the autoscaler's figures and lead times, each with its source (the arithmetic: test_scaling_*)
    assert "autoscale: target 10.9 req/s per server (60% of 18.1); servers 7-16" in given.stdout
    assert (
        "load 900 s (given); node provisioning 600-1800 s (assumed: mi328x-8 node_provisioning)".replace(
            "mi328x", "mi325x"
        )
        in given.stdout
    )
    assert "server on a standing node: 1005 s, covered; node to add: 2805 s, covered" in given.stdout
    rows = {line.split()[0]: line.split()[-7:] for line in given.stdout.splitlines()[3:5]}
    # rate, servers, $/hour, $/M in and out at the SLO rate, at the mean rate (literal: see the arithmetic test)
    assert rows["candidate"] == ["18.1", "8", "$128.00", "$0.0438", "$1.75", "$0.0907", "$3.63"]
    assert rows["tp8-ep8"] == ["12.5", "12", "$192.00", "$0.0635", "$2.54", "$0.136", "$5.44"]

    path = spec_file(TINY_SPEC, lambda d: d["capacity"].update(autoscale={"utilisation": 0.5}))
    none = cli(str(path))
    assert none.returncode != 0 and "give --rate-per-server R" in none.stderr
    loaded = load_spec(path)
    reg = Registry()
    rel = reg.open_release("run-9", loaded.spec.name, str(path), path.read_text(), "local")
    data = {"layout": "two-replicas", "rate_per_server": 120.0, "load_seconds": [38.5, 42.0]}
    reg.record(rel.id, detail_of("slo_gate", None), "gate", data=ReleaseData.model_validate(data))
    recorded = cli(str(path))
    assert recorded.returncode == 0, recorded.stderr
    assert f"measured by release {rel.id}" in recorded.stdout and "candidate (two-replicas)" in recorded.stdout
    # the lead time from the release's own slowest replica; cpu-local has no node provisioning time
    assert f"load 42 s (measured by release {rel.id}); node provisioning unknown" in recorded.stdout
    assert "server on a standing node: 147 s, covered; node to add: unknown" in recorded.stdout
    bad = cli(str(path), "--rate-per-server", "fast")
    assert bad.returncode != 0 and "--rate-per-server fast: expected R or LAYOUT=R" in bad.stderr


def _autoscaled(utilisation: float = 0.7, max_servers: int = 16, provisioning: bool = True):
    """The production spec with its autoscale: section at `utilisation`, a spike of 1.5 x in 10 minutes."""
    loaded = load_spec(PROD_SPEC)
    cap = loaded.spec.capacity
    assert cap is not None and cap.autoscale is not None
    auto = cap.autoscale.model_copy(update={"utilisation": utilisation, "spike_factor": 1.5, "spike_within": "10m"})
    spec = loaded.spec.model_copy(
        update={"capacity": cap.model_copy(update={"autoscale": auto, "max_servers": max_servers})}
    )
    hw = loaded.hardware if provisioning else loaded.hardware.model_copy(update={"node_provisioning": None})
    return loaded.model_copy(update={"spec": spec, "hardware": hw})


def test_scaling_arithmetic_against_literal_numbers():
    # 12.5 req/s per server at 70%: target 8.75; the mean (70) needs 8 servers, the peak (120) 14
    s = capacity.scaling(_autoscaled(), 12.5, 200.0, "given")
    assert s is not None
    assert (s.target_rps, s.min_servers, s.max_servers, s.peak_servers) == (8.75, 8, 16, 14)
    assert s.fallback_servers == 14  # more than the peak-sized fleet's 12 (144 / 12.5)
    assert s.spike_top_servers == 15  # 180 req/s at the SLO rate: 14.4 -> 15, within 16
    # spare at the busiest: 1 / (0.7 x 1.1 HPA tolerance) - 1 = 29.9%; growth 50% in 600 s -> covers 358.4 s
    assert s.spare == pytest.approx(1 / 0.77 - 1, abs=1e-6) and s.covered_s == 358.4
    # detection: half the 120 s rate window + a 30 s scrape + a 15 s HPA sync
    assert (s.lead.detect_s, s.lead.node_up_s, s.lead.node_to_add_s) == (105, 305, 2105)
    assert s.covers(s.lead.node_up_s) and not s.covers(s.lead.node_to_add_s)
    assert s.problems() == [
        "scale-up lead time for a node to add is 2105 s; the spare 30% covers 358 s of a spike to 1.5 x within "
        "600 s (capacity.autoscale.utilisation 0.7)"
    ]
    # the production spec's own 60%: 51.5% spare carries the whole 50% spike, whatever the lead time
    loaded = load_spec(PROD_SPEC)
    prod = capacity.scaling(loaded, 12.5, None, "-")
    assert prod is not None and prod.covered_s is None and prod.problems() == []


def test_what_the_scaling_check_refuses_on():
    # no node provisioning time known: the server on a standing node decides (305 s < 358 s)
    assert capacity.scaling(_autoscaled(provisioning=False), 12.5, 200.0, "given").problems() == []
    # the load time unknown: a node to add takes at least 105 + 1800 s, enough to refuse on
    unknown = capacity.scaling(_autoscaled(), 12.5, None, "none recorded")
    assert unknown.lead.node_to_add_s is None and "is at least 1905 s" in unknown.problems()[0]
    # a spike's top past max_servers; a peak that pins the fleet at max leaves less spare
    pinned = capacity.scaling(_autoscaled(0.6, max_servers=12), 12.5, 200.0, "given")
    assert pinned.peak_servers == 16 and pinned.spare == pytest.approx(12 * 12.5 / 120 - 1)
    assert "a spike to 1.5 x the peak needs 15 servers at their max SLO rate; capacity.max_servers is 12" in (
        pinned.problems()
    )
    assert capacity.scaling(load_spec(TINY_SPEC), 12.5, 1.0, "-") is None  # no autoscale: section


def test_the_slo_gate_refuses_a_fleet_that_cannot_scale_out_in_time(spec_file, release_env, monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "home"))
    auto = {"utilisation": 0.8, "spike_factor": 2.0, "spike_within": "5m"}
    path = spec_file(TINY_SPEC, lambda d: d["capacity"].update(autoscale=auto, max_servers=10))
    loaded = load_spec(path)
    reg = Registry()
    rel = reg.open_release("run-1", loaded.spec.name, str(path), path.read_text(), "local")
    measured = [{**_result("single", 150.0), "load_seconds": [25.0, 30.0]}, _result("two-replicas", 90.0)]
    selection = edge.call(flow.select_layout, _release(path, rel.id), measured, "run-1")
    # 150 req/s at 80%: 4 servers at the 400 req/s peak, 600 req/s; spare 1/0.88 - 1 = 13.6% covers
    # 40.9 s of a doubling in 300 s; a server takes 105 s to notice + 30 s (its slowest replica) to load
    assert not selection["passed"]
    assert selection["reason"] == (
        "layout single cannot scale out in time: scale-up lead time for a server on a standing node is 135 s; "
        "the spare 14% covers 41 s of a spike to 2 x within 300 s (capacity.autoscale.utilisation 0.8)"
    )
    with pytest.raises(GateFailed) as exc:
        edge.call(flow.slo_gate, _release(path, rel.id), selection)
    assert "load 30 s (measured by this run)" in str(exc.value)  # the lead time's sources come with it


def test_an_unsteady_client_bound_answer_is_marked_in_the_registry_and_the_approval(
    spec_file, release_env, monkeypatch, tmp_path
):
    """The chosen layout's marks go from its result through the SLO gate to the registry, and the
    reviewer's request says what the rate must be read with; an unmarked answer says nothing."""
    from pipeline.airflow import approval

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "home"))
    path = spec_file(TINY_SPEC)
    loaded = load_spec(path)
    reg = Registry()
    for marks, run in (({"unsteady": True, "client_bound": True}, "marked"), ({}, "plain")):
        rel = reg.open_release(run, loaded.spec.name, str(path), path.read_text(), "local")
        single = {**_result("single", 150.0), **marks}
        release = _release(path, rel.id)
        edge.call(flow.slo_gate, release, edge.call(flow.select_layout, release, [single], run))
        chosen = reg.get(rel.id).chosen()
        assert (chosen.unsteady, chosen.client_bound) == ((True, True) if marks else (False, False))
        text = approval.body(reg.get(rel.id), None, loaded, "http://airflow")
        if marks:
            assert "Read this rate with care: **unsteady**" in text and "**client-bound**" in text
        else:
            assert "Read this rate with care" not in text and "150 req/s per server" in text
