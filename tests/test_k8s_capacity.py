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

from pipeline.k8s.deploy import KubernetesTarget
from pipeline.release import controller, rollout_plan
from pipeline.release.rollout_plan import StepPlan
from tests.k8s_fake import FakeCluster
from tests.test_k8s_deploy import FAST, STEPS, deploy, live, releases, verdict  # noqa: F401

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
