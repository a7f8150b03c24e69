"""The live + spare budget on a cluster where pods scaled away keep their GPUs while they drain:
on the fake API server (tests/k8s_fake.py), whose pods stay Terminating, holding their devices,
for a while on its clock after their ReplicaSet scaled them away (their preStop's drain).

The budget is asserted at every change of the pods: the devices every pod requests (Pending,
Running or Terminating) never exceed (live + spare) servers' worth."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest

from pipeline.core.specs import load_spec
from pipeline.k8s import manifests
from pipeline.k8s.deploy import KubernetesTarget
from pipeline.release import controller, rollout_plan
from pipeline.release.rollout_plan import StepPlan
from tests.conftest import PROD_SPEC
from tests.k8s_fake import FakeCluster, FakePrometheus
from tests.test_k8s_deploy import FAST, STEPS, Killed, deploy, live, recover, releases, verdict  # noqa: F401

NS = "llm-serving"
SERVER_GPUS = 8  # one tp8-ep8 pod or two tp4-ep4 pods: a server's devices, either release
BUDGET = (3 + 1) * SERVER_GPUS  # a 3-server live fleet and one spare server
DRAIN_TICKS = 40.0  # how long a pod scaled away drains, on the fake's clock (one tick per look at it)


@pytest.fixture
def fake():
    """A fake whose clock moves one tick each time the cluster looks at it (a pod created, a list of
    pods, a request through the Gateway): a pod's drain ends after that many looks, whenever they
    come, so no assertion depends on how fast this machine runs."""
    ticks = itertools.count()
    with FakeCluster(clock=lambda: float(next(ticks))) as cluster:
        yield cluster


def test_new_servers_start_only_once_those_scaled_away_have_given_back_their_gpus(fake, releases, caplog):  # noqa: F811
    """Release 2 replaces release 1 in three steps; each wave past the first needs the room an old
    server scaled away leaves, which it holds until its drain ends. The controller counts the
    terminating pods (KubernetesRelease.terminating: their GPU limits, in servers) and starts the
    wave only once they fit: never more than live + spare servers' GPUs are asked for. The waves
    that waited are the ones `rollout-plan` states for these steps (its `waits` column)."""
    caplog.set_level(logging.INFO, logger="pipeline.release.controller")
    live(fake, releases["1"], "1")
    fake.terminating_s = DRAIN_TICKS
    fake.devices.clear()
    judge = lambda step, fraction, pods: verdict(step, fraction)  # noqa: E731
    outcome = deploy(KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), STEPS, judge, 1, 5)
    assert outcome.status == "live", outcome.error
    assert all(held <= BUDGET for held, _ in fake.devices), fake.devices
    # not vacuous: servers did drain while the budget was full, and the budget was used
    assert any(held == BUDGET and going for held, going in fake.devices), fake.devices
    assert fake.servers() == {"1": 0, "2": 3}
    waited = [r.getMessage() for r in caplog.records if "still drain; waiting" in r.getMessage()]
    assert waited == [
        "step 2: 1 servers scaled away still drain; waiting for room for 0",
        "step 3: 1 servers scaled away still drain; waiting for room for 0",
    ]
    on_paper = [
        StepPlan(
            step=n,
            fraction=s.fraction,
            old_servers=s.old_servers,
            new_servers=s.new_servers,
            at_once=0,
            waves=0,
            old_holds_rps=None,
            new_holds_rps=None,
            old_share_rps=None,
            new_share_rps=None,
            starts_servers=0,
            seconds=None,
            ok=True,
        )
        for n, s in enumerate(STEPS, 1)
    ]
    assert [waits for _, waits in rollout_plan._terminating(on_paper, 3, 1)] == [0, 1, 1]


def test_an_undo_reloads_old_servers_only_into_gpus_the_new_release_has_given_back(fake, releases):  # noqa: F811
    """The last step's analysis fails: release 1 comes back in the widest waves the budget leaves,
    and the new release's pods it scaled away still drain; the old release's reloads wait for them
    (controller._undo counts them through the same `terminating`), within the budget throughout."""
    live(fake, releases["1"], "1")
    fake.terminating_s = DRAIN_TICKS
    fake.devices.clear()
    judge = lambda step, fraction, pods: verdict(step, fraction, passed=step < 3)  # noqa: E731
    outcome = deploy(KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), STEPS, judge, 1, 5)
    assert outcome.status == "rolled_back", outcome.error
    assert all(held <= BUDGET for held, _ in fake.devices), fake.devices
    assert any(held == BUDGET and going for held, going in fake.devices), fake.devices
    assert fake.servers() == {"1": 3, "2": 0}


def test_servers_that_never_finish_draining_fail_the_step_clearly(fake, releases, monkeypatch):  # noqa: F811
    """A drain that outlasts its bound (a preStop stuck past the grace period's SIGKILL, here for
    good): the wave that needs its room fails the step, naming what still holds the GPUs, rather
    than asking the cluster for more than the budget; the undo cannot reload into that room either,
    and says so; the budget holds throughout."""
    live(fake, releases["1"], "1")
    fake.terminating_s = float("inf")
    fake.devices.clear()
    monkeypatch.setattr(controller, "TERMINATING_WAIT_S", 0.2)
    judge = lambda step, fraction, pods: verdict(step, fraction)  # noqa: E731
    outcome = deploy(KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), STEPS, judge, 1, 5)
    assert outcome.status == "failed"
    assert outcome.error.startswith(
        "step 2: 1 servers scaled away still hold their devices after 0.2 s; live + spare leaves room for 0 "
        "beside those running; back to release 1 failed: "
    ), outcome.error
    assert all(held <= BUDGET for held, _ in fake.devices), fake.devices


def with_scalers(release: str, layout: str, prometheus: str) -> list[dict]:
    """A release's objects with KEDA scalers (18 req/s per server at 60%: 10.8 req/s each), their
    trigger asking `prometheus`, and a minimum of one server (the spec's mean rate asks for 7)."""
    artifact = manifests.Artifact(nfs_path=f"/mnt/models/r{release}", manifest_hash=release * 64)
    options = manifests.RenderOptions(servers=3, autoscale_rate=18.0)
    objs = manifests.render(load_spec(PROD_SPEC), layout, release, artifact, options)
    for scaler in (o for o in objs if o["kind"] == "ScaledObject"):
        scaler["spec"]["minReplicaCount"] = 1
        scaler["spec"]["triggers"][0]["metadata"]["serverAddress"] = prometheus
    return objs


def test_a_spike_during_a_rollout_is_met_by_the_controller_and_after_it_by_the_scalers(fake):
    """While a rollout holds both releases' scalers paused, the controller answers for them: before
    each wave it asks their own query (the model's demand, in servers at their target) and, where
    it needs more than the fleet the rollout was sized for, grows the fleet to it (the budget is
    that + spare, as KEDA would have grown the live fleet): the old side at once to its share,
    the steps not yet taken to theirs. Here the demand rises from 3 to 5 servers' worth while step
    1 is judged: step 2 holds half of 5 on each side, the last step 5 new servers, and KEDA, paused,
    scaled nothing. Once the new release is live its scalers are back and act on their own: a
    further rise to 7 servers' worth is theirs to meet."""
    seen: list[tuple[int, dict[str, int]]] = []
    with FakePrometheus(fake, ttft_s={}) as prometheus:
        target = KubernetesTarget(fake.client(), **FAST)
        first = deploy(target, "1", with_scalers("1", "tp8-ep8", prometheus.url), timeout_s=5)
        assert first.status == "live", first.error
        fake.demand_rps = 30.0  # 3 servers' worth at 10.8 req/s each: what release 1 runs
        assert fake.read(("apps/v1", "deployments", NS, "qwen3-235b-a22b-fp8-r1-0")) and fake.keda_scaled == []

        def judge(step: int, fraction: float, pods: int):
            seen.append((step, fake.ready_servers()))
            if step == 1:
                fake.demand_rps = 50.0  # 5 servers' worth
            return verdict(step, fraction)

        fake.history.clear()
        outcome = deploy(target, "2", with_scalers("2", "tp4-ep4-x2", prometheus.url), STEPS, judge, 1, 5)
        assert outcome.status == "live", outcome.error
        assert [d for kind, d in outcome.events if kind == "fleet_resized"] == [
            {"step": 2, "servers": 5, "sized_for": 3}
        ]
        # the last step keeps the one old server the 5 + 1 budget leaves beside 5 new, as any last step does
        assert seen == [(1, {"1": 3, "2": 1}), (2, {"1": 3, "2": 3}), (3, {"1": 1, "2": 5})]
        assert fake.keda_scaled == [] and fake.scaled_unpaused == []  # the counts were the controller's
        assert all(sum(h.values()) <= 5 + 1 for h in fake.history), fake.history
        assert fake.servers() == {"1": 0, "2": 5}

        fake.demand_rps = 70.0  # 7 servers' worth: release 2's scalers, resumed, act on their own
        fake.read(("apps/v1", "deployments", NS, "qwen3-235b-a22b-fp8-r2-0"))
        assert [(name, n) for _, name, n in fake.keda_scaled] == [
            ("qwen3-235b-a22b-fp8-r2-0", 7),
            ("qwen3-235b-a22b-fp8-r2-1", 7),
        ]
        assert fake.servers() == {"1": 0, "2": 7}


def test_an_undo_after_a_spike_gives_the_old_release_the_grown_fleet(fake):
    """The demand rises to 5 servers' worth during step 1; the last step's analysis fails: the old
    release comes back to the 5 servers the demand needs (not the 3 it ran before), within the
    grown budget, and its scalers are back."""
    with FakePrometheus(fake, ttft_s={}) as prometheus:
        target = KubernetesTarget(fake.client(), **FAST)
        assert deploy(target, "1", with_scalers("1", "tp8-ep8", prometheus.url), timeout_s=5).status == "live"
        fake.demand_rps = 30.0

        def judge(step: int, fraction: float, pods: int):
            if step == 1:
                fake.demand_rps = 50.0
            return verdict(step, fraction, passed=step < 3)

        fake.history.clear()
        outcome = deploy(target, "2", with_scalers("2", "tp4-ep4-x2", prometheus.url), STEPS, judge, 1, 5)
        assert outcome.status == "rolled_back", outcome.error
        assert dict(outcome.events)["rollback_complete"]["servers"] == 5
        assert all(sum(h.values()) <= 5 + 1 for h in fake.history), fake.history
        assert fake.servers() == {"1": 5, "2": 0} and fake.keda_scaled == []
        scaler = fake.get("scaledobjects", NS, "qwen3-235b-a22b-fp8-r1-0")
        assert "autoscaling.keda.sh/paused-replicas" not in scaler["metadata"].get("annotations", {})


def test_a_recover_after_a_spike_gives_the_old_release_the_grown_fleet(fake):
    """As above, but the controller dies while the last step is judged: the grown count is in the
    rollout's record (written before the fleet grew), so `recover` brings the old release back to
    the 5 servers the demand needed, not the 3 the rollout started from."""
    with FakePrometheus(fake, ttft_s={}) as prometheus:
        target = KubernetesTarget(fake.client(), **FAST)
        assert deploy(target, "1", with_scalers("1", "tp8-ep8", prometheus.url), timeout_s=5).status == "live"
        fake.demand_rps = 30.0

        def judge(step: int, fraction: float, pods: int):
            if step == 1:
                fake.demand_rps = 50.0
            if step == 3:
                raise Killed("the controller's task, during the last step's analysis")
            return verdict(step, fraction)

        with pytest.raises(Killed):
            deploy(target, "2", with_scalers("2", "tp4-ep4-x2", prometheus.url), STEPS, judge, 1, 5)
        assert fake.servers() == {"1": 1, "2": 5}
        fake.demand_rps = 30.0  # the spike is over by now: the record, not the demand, says what to give back
        outcome = recover(KubernetesTarget(fake.client(), **FAST), with_scalers("2", "tp4-ep4-x2", prometheus.url))
        assert outcome.status == "rolled_back", outcome.error
        assert fake.servers() == {"1": 5, "2": 0}
        assert dict(outcome.events)["rollback_complete"]["servers"] == 5
