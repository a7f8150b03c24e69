"""Rollout, smoke test and rollback against an in-process fake of the Kubernetes API server,
through the real `kubernetes` client."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import ssl
import threading
import time

import certifi
import pytest
from kubernetes import client

from pipeline.core.errors import ClusterUnreachable, ReleaseError, RolloutFailed, SmokeFailed
from pipeline.core.rollout import ServerStep
from pipeline.core.specs import load_spec
from pipeline.k8s import deploy as k8s_deploy
from pipeline.k8s import manifests
from pipeline.k8s.deploy import KubernetesTarget
from pipeline.records.rollout import StepAnalysis
from pipeline.records.served_accuracy import ServedAccuracy
from pipeline.release import controller
from tests.conftest import PROD_SPEC
from tests.k8s_fake import FakeCluster, dead_url

NS = "llm-serving"
FAST = {"poll_s": 0.01, "smoke_retry_delay_s": 0.01}


@pytest.fixture(scope="module")
def releases():
    """Release 1 serves one TP8 replica per server; release 2 moves to two TP4 replica groups.
    Each renders for a 3-server fleet."""
    loaded = load_spec(PROD_SPEC)

    def artifact(h):
        return manifests.Artifact(nfs_path=f"/mnt/models/qwen3-{h[:6]}", manifest_hash=h * 32)

    options = manifests.RenderOptions(servers=3)
    return {
        "1": manifests.render(loaded, "tp8-ep8", "1", artifact("a1"), options),
        "2": manifests.render(loaded, "tp4-ep4-x2", "2", artifact("b2"), options),
    }


# a pod's engine loads for 5 minutes on the fake's clock, which runs 3,000 times faster than the wall's
LOAD_S, FAST_CLOCK = 300.0, 3000.0


@pytest.fixture
def fake(request):
    """The fake API server; parametrized "load-time", its pods turn Ready once an engine's load time
    has passed on an injectable clock (the kubelet's startup probe), not on the second read."""
    if getattr(request, "param", "second-read") == "load-time":
        cluster = FakeCluster(load_s=LOAD_S, clock=lambda: time.monotonic() * FAST_CLOCK)
    else:
        cluster = FakeCluster()
    with cluster:
        yield cluster


def assert_loaded(fake):
    """With a load time: no pod was Ready before its engine had loaded."""
    if fake.load_s is None:
        return
    assert fake.became_ready, "no pod ever became Ready"
    for pod, ready in fake.became_ready.items():
        assert ready - fake.born[pod] >= LOAD_S, pod


LOAD_TIME = pytest.mark.parametrize("fake", ["second-read", "load-time"], indirect=True)


def deploy(
    cluster: KubernetesTarget,
    release_id: str,
    objs: list[dict],
    steps: list[ServerStep] | None = None,
    judge=None,
    spare_servers: int = 1,
    timeout_s: float | None = None,
    answers=None,
    scale_down_delay_s: float = 0.0,
):
    """A rollout of `objs` by the controller, as promote runs it."""
    target = cluster.release(release_id, objs, answers, timeout_s)
    return controller.rollout(target, steps, judge, spare_servers, scale_down_delay_s)


def recover(cluster: KubernetesTarget, objs: list[dict], timeout_s: float | None = None):
    return controller.recover(cluster.release("?", objs, None, timeout_s))


STEPS = [
    ServerStep(fraction=0.1, old_servers=3, new_servers=1),
    ServerStep(fraction=0.5, old_servers=2, new_servers=2),
    ServerStep(fraction=1.0, old_servers=0, new_servers=3),
]
R1 = ["qwen3-235b-a22b-fp8-r1-0"]
R2 = ["qwen3-235b-a22b-fp8-r2-0", "qwen3-235b-a22b-fp8-r2-1"]


def live(fake, objs, release_id):
    outcome = deploy(KubernetesTarget(fake.client(), **FAST), release_id, copy.deepcopy(objs), timeout_s=5)
    assert outcome.status == "live", outcome.error
    fake.requests.clear()
    fake.history.clear()
    fake.ready_history.clear()


ROUTE = "qwen3-235b-a22b-fp8"
SERVICE = {"qwen3-235b-a22b-fp8-r1": "1", "qwen3-235b-a22b-fp8-r2": "2"}
FLEET = {"1": 3, "2": 3}
APPLY = "application/apply-patch+yaml"  # servers that hold all the traffic, per release


@contextlib.contextmanager
def clients(fake):
    """Requests to the model's address through the Gateway all through the block, as live traffic comes."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            fake.send(NS, ROUTE)
            time.sleep(0.001)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def assert_safe(fake):
    """The timeline, at every recorded change of the route or of ready pods: each backend with a
    weight has the ready servers that hold its share; every request reached a ready pod of a
    release whose checks had passed before (the old release's were in its own deploy)."""
    changes = sorted(
        [(c.seq, "route", c.weights) for c in fake.route_changes] + [(q, "ready", r) for q, r in fake.ready_changes],
        key=lambda change: change[0],
    )
    weights: dict[str, int] = {}
    ready: dict[str, int] = {}
    for seq, kind, value in changes:
        weights, ready = (value, ready) if kind == "route" else (weights, value)
        total = sum(weights.values())
        for service, weight in weights.items():
            if weight:
                release = SERVICE[service]
                need = math.ceil(weight / total * FLEET[release] - 1e-3)
                assert ready.get(release, 0) >= need, (seq, weights, ready)
    assert fake.hits and all(hit.status == 200 for hit in fake.hits), [h for h in fake.hits if h.status != 200][:3]
    first_check = {}
    for check in fake.checks:
        first_check.setdefault(check.release, check.seq)
    assert all(hit.seq > first_check[hit.release] for hit in fake.hits)


def names(outcome):
    return [name for name, _ in outcome.events]


def verdict(step: int, fraction: float, passed: bool = True) -> StepAnalysis:
    reasons = [] if passed else ["p90 TTFT 3100 ms > SLO 2000 ms"]
    return StepAnalysis(step=step, fraction=fraction, window_s=300, passed=passed, reasons=reasons, queries={})


def test_the_first_release_goes_live_whole_by_server_side_apply(fake, releases):
    outcome = deploy(KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), timeout_s=5)
    assert outcome.status == "live" and outcome.error is None
    assert names(outcome) == ["deploy_started", "smoke_test", "traffic", "rollout_step", "rollout_complete"]
    smoke = dict(outcome.events)["smoke_test"]
    assert smoke["ok"] is True and smoke["text"] == " Paris."
    assert dict(outcome.events)["rollout_step"]["new_servers"] == 3  # nothing live: no steps to take
    patches = [r for r in fake.requests if r.method == "PATCH"]
    assert len(patches) == len(releases["2"]) + 1  # every object once, the route last: twice
    assert all(
        r.content_type == "application/apply-patch+yaml"
        and r.field_manager == "model-release"
        and r.query["force"] == "true"
        for r in patches
    )
    assert fake.names("deployments", NS) == R2
    assert [fake.get("deployments", NS, n)["spec"]["replicas"] for n in R2] == [3, 3]
    assert all(p.path.endswith("/httproutes/qwen3-235b-a22b-fp8") for p in patches[-2:])
    # the model's address: the route gets the release's own rule (no default backend: clients get 503),
    # its smoke goes through the Gateway by that rule, and only then all of the default rule is its
    assert [c.weights for c in fake.route_changes] == [{}, {"qwen3-235b-a22b-fp8-r2": 10_000}]
    assert fake.route_changes[0].seq < fake.checks[0].seq < fake.route_changes[1].seq
    assert fake.route_changes[1].ready == {"2": 3}
    assert fake.names("persistentvolumeclaims", NS) and fake.names("poddisruptionbudgets", NS)
    assert [(c.release, c.via) for c in fake.checks] == [("2", "gateway")]  # no check through the service proxy
    assert not [r for r in fake.requests if "/proxy/" in r.path]


def test_applying_the_same_objects_again_changes_no_generation(fake, releases):
    api = fake.client()
    k8s_deploy.apply(api, releases["1"], timeout_s=5, poll_s=0.01)
    first = fake.get("deployments", NS, R1[0])["metadata"]["generation"]
    k8s_deploy.apply(api, releases["1"], timeout_s=5, poll_s=0.01)
    assert fake.get("deployments", NS, R1[0])["metadata"]["generation"] == first
    k8s_deploy.scale(api, copy.deepcopy(releases["1"][1]), 2)
    assert fake.get("deployments", NS, R1[0])["metadata"]["generation"] == first + 1
    assert fake.get("deployments", NS, R1[0])["spec"]["replicas"] == 2


@LOAD_TIME
def test_steps_move_servers_in_waves_and_the_old_release_keeps_servers_through_the_last_analysis(fake, releases):
    live(fake, releases["1"], "1")
    judged = []

    def judge(step, fraction, pods):
        # every step is judged while both releases' pods serve, before anything else changes
        judged.append((step, fake.servers(), fake.route_changes[-1].weights))
        return verdict(step, fraction)

    with clients(fake):
        outcome = deploy(
            KubernetesTarget(fake.client(), **FAST),
            "2",
            copy.deepcopy(releases["2"]),
            STEPS,
            judge,
            spare_servers=1,
            timeout_s=5,
        )
        time.sleep(0.05)
    assert outcome.status == "live", outcome.error
    assert [n for n in names(outcome) if n != "traffic"] == ["deploy_started"] + ["smoke_test", "rollout_step"] * 3 + [
        "rollout_complete"
    ]
    # the last step is judged with the old release still serving on what the spare budget leaves it,
    # each step at its own share of traffic
    r1, r2 = SERVICE
    assert judged == [
        (1, {"1": 3, "2": 1}, {r1: 9000, r2: 1000}),
        (2, {"1": 2, "2": 2}, {r1: 5000, r2: 5000}),
        (3, {"1": 1, "2": 3}, {r1: 0, r2: 10_000}),
    ]
    # between steps, the checked new servers took the share they hold before an old server stopped
    # (release 1's own rule and its share, when it went live, then release 2's own rule for its checks)
    assert [c.weights.get(r2, 0) for c in fake.route_changes] == [0, 0, 0, 1000, 3333, 5000, 6666, 10_000, 10_000]
    assert fake.route_changes[-1].weights == {r2: 10_000}  # the old release left the route: no controller needed
    assert_safe(fake)
    assert_loaded(fake)
    assert {h.release for h in fake.hits} == {"1", "2"}
    # never more than the live fleet + the spare server, and never fewer than the fleet serving
    assert all(sum(h.values()) <= 4 for h in fake.history), fake.history
    assert all(sum(h.values()) >= 3 for h in fake.history if h), fake.history
    assert fake.ready_history and all(sum(h.values()) >= 3 for h in fake.ready_history), fake.ready_history
    assert fake.ready_history[-1] == {"1": 0, "2": 3}
    # release 1 went to zero servers only after the last analysis passed; its objects stay (at zero)
    assert fake.history[-1] == {"1": 0, "2": 3} and fake.history[-2] == {"1": 1, "2": 3}
    assert fake.names("deployments", NS) == R1 + R2
    assert [fake.get("deployments", NS, n)["spec"]["replicas"] for n in R1] == [0]
    assert dict(outcome.events)["rollout_complete"]["kept_at_zero"] == "1"
    # what serves runs as Kubernetes runs it: each group's ReplicaSet owns three ready pods; release 1's
    # ReplicaSet is left with none
    pods = [fake.get("pods", NS, name) for name in fake.names("pods", NS)]
    owners = {
        fake.get("replicasets", NS, p["metadata"]["ownerReferences"][0]["name"])["metadata"]["ownerReferences"][0][
            "name"
        ]
        for p in pods
    }
    assert len(pods) == 6 and owners == set(R2)
    assert all(p["metadata"]["labels"]["model-release/release-id"] == "2" for p in pods)
    assert all(p["status"]["conditions"] == [{"type": "Ready", "status": "True"}] for p in pods)
    steps = [d for k, d in outcome.events if k == "rollout_step"]
    assert [(s["old_servers"], s["new_servers"], s["passed"]) for s in steps] == [
        (3, 1, True),
        (2, 2, True),
        (1, 3, True),
    ]


@pytest.mark.parametrize("failing, old_kept, first_back", [(1, 3, 0), (2, 2, 3334), (3, 1, 6667)])
@LOAD_TIME
def test_a_failed_analysis_moves_traffic_back_as_the_old_release_holds_it_then_scales_the_new_to_zero(
    fake, releases, failing, old_kept, first_back
):
    live(fake, releases["1"], "1")
    with clients(fake):
        outcome = deploy(
            KubernetesTarget(fake.client(), **FAST),
            "2",
            copy.deepcopy(releases["2"]),
            STEPS,
            lambda step, f, pods: verdict(step, f, passed=step < failing),
            timeout_s=5,
        )
        time.sleep(0.05)
    assert outcome.status == "rolled_back"
    after = names(outcome)[names(outcome).index("rollout_aborted") :]
    assert after[:2] == ["rollout_aborted", "rollback_started"] and after[-1] == "rollback_complete"
    assert f"aborted at step {failing} ({STEPS[failing - 1].new_servers} new / {old_kept} old servers)" in outcome.error
    assert [d for k, d in outcome.events if k == "rollout_step"][-1]["analysis"]["reasons"] == [
        "p90 TTFT 3100 ms > SLO 2000 ms"
    ]
    assert fake.servers() == {"1": 3, "2": 0}
    # traffic back: at once where the old release still ran all its servers; else the new one kept
    # what the old one's servers could not hold until they were back
    r1, r2 = SERVICE
    back = [d["weights"] for k, d in outcome.events[names(outcome).index("rollback_started") :] if k == "traffic"]
    assert back[0][r2] == first_back and back[-1] == {r1: 10_000, r2: 0}
    # then back by the share each returning old server holds, as they come: one wave of the spare budget each
    assert [w[r2] for w in back] == sorted({first_back, *[10_000 - 3333 * n for n in range(old_kept, 3)], 0})[::-1]
    assert_safe(fake)
    assert_loaded(fake)
    # within the budget throughout: the new release gave back servers as the old one's came back
    assert all(sum(h.values()) <= 4 for h in fake.history), fake.history
    assert all(sum(h.values()) >= 3 for h in fake.ready_history), fake.ready_history
    assert fake.ready_history[-1] == {"1": 3, "2": 0}
    moved_back = fake.route_changes[-1].seq
    assert {h.release for h in fake.hits if h.seq > moved_back} == {"1"}


def pods_of(fake, release: str) -> set[str]:
    return {
        name
        for name in fake.names("pods", NS)
        if fake.get("pods", NS, name)["metadata"]["labels"]["model-release/release-id"] == release
    }


@LOAD_TIME
def test_a_rollback_within_the_keep_window_moves_traffic_back_and_loads_nothing(fake, releases):
    """Release 2 goes live with a spare budget that keeps every old server through its last step,
    and a keep window: a rollback to release 1 within it only moves the route back; the release-2
    controller, when its window ends, sees the route changed and leaves release 1 alone."""
    live(fake, releases["1"], "1")
    r1, r2 = SERVICE
    done = {}

    def release_two():
        done["2"] = deploy(
            KubernetesTarget(fake.client(), **FAST),
            "2",
            copy.deepcopy(releases["2"]),
            STEPS,
            lambda s, f, pods: verdict(s, f),
            spare_servers=3,
            timeout_s=5,
            scale_down_delay_s=1.0,
        )

    with clients(fake):
        rollout = threading.Thread(target=release_two)
        rollout.start()
        deadline = time.monotonic() + 10
        while not (fake.route_changes and fake.route_changes[-1].weights == {r2: 10_000}):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert fake.servers() == {"1": 3, "2": 3}  # the keep window: release 1 out of the route, still running
        before = pods_of(fake, "1")
        fake.requests.clear()
        back = deploy(KubernetesTarget(fake.client(), **FAST), "1", copy.deepcopy(releases["1"]), timeout_s=5)
        rollout.join()
        time.sleep(0.05)
    assert back.status == "live", back.error
    assert dict(back.events)["deploy_started"]["kept_servers"] == 3
    assert pods_of(fake, "1") == before  # nothing loaded: the same pods took the traffic back
    applied = [r.path.rsplit("/", 1)[0].rsplit("/", 1)[-1] for r in fake.requests if r.content_type == APPLY]
    # the Deployments took the rollout's record (same pod template: same ReplicaSet), the route its weights
    assert set(applied) == {"deployments", "httproutes"}
    assert [d["weights"] for k, d in back.events if k == "traffic"] == [{r2: 0, r1: 10_000}, {r1: 10_000}]
    assert done["2"].status == "live" and "scale_down_skipped" in names(done["2"])
    assert fake.servers() == {"1": 3, "2": 0}
    assert_safe(fake)
    assert_loaded(fake)
    moved_back = fake.route_changes[-2].seq
    assert {h.release for h in fake.hits if h.seq > moved_back} == {"1"}


def test_a_live_pod_that_dies_is_replaced_and_takes_traffic_with_no_controller(fake, releases):
    live(fake, releases["1"], "1")
    deploy(
        KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), STEPS, lambda s, f, p: verdict(s, f)
    )
    before = pods_of(fake, "2")
    dead = sorted(before)[0]
    fake.client().call_api(f"/api/v1/namespaces/{NS}/pods/{dead}", "DELETE", _preload_content=False)
    for name in R2:  # the Deployment and ReplicaSet controllers and the kubelet, with no rollout running
        for _ in range(2):
            fake.read(("apps/v1", "deployments", NS, name))
    newcomer = pods_of(fake, "2") - before
    assert len(newcomer) == 1 and len(pods_of(fake, "2")) == 6 and dead not in pods_of(fake, "2")
    hits = [fake.send(NS, ROUTE) for _ in range(400)]
    assert all(h.status == 200 and h.release == "2" for h in hits)
    assert newcomer <= {h.pod for h in hits}  # the replacement answers its share


class Killed(BaseException):
    """The controller's task killed (SIGKILL, a worker restart): no except clause of the controller runs."""


def killing_after(monkeypatch, changes: int):
    """The controller dies right after its `changes`-th change to the cluster (an apply, scale or delete)."""
    real = k8s_deploy._call
    made = []

    def call(api, method, path, *args, **kwargs):
        answer = real(api, method, path, *args, **kwargs)
        if method in ("PATCH", "DELETE"):
            made.append(path)
            if len(made) == changes:
                raise Killed(path)
        return answer

    monkeypatch.setattr(k8s_deploy, "_call", call)
    return made


def test_a_controller_killed_at_any_change_leaves_a_safe_state_that_recovery_resumes_or_undoes(
    fake, releases, monkeypatch
):
    """Killed after each of the changes a good 3-step rollout makes, in turn: the state it leaves
    holds the traffic (requests keep flowing and succeeding), and `recover` (the promote task's
    retry) finishes a rollout that had moved everything, else undoes it; never a second copy."""
    r1, r2 = SERVICE
    with FakeCluster() as counting:  # how many changes a good rollout makes
        live(counting, releases["1"], "1")
        made = killing_after(monkeypatch, -1)
        deploy(
            KubernetesTarget(counting.client(), **FAST),
            "2",
            copy.deepcopy(releases["2"]),
            STEPS,
            lambda s, f, p: verdict(s, f),
            timeout_s=5,
        )
        total = len(made)
    monkeypatch.undo()
    outcomes = []
    for changes in range(1, total + 1):
        with FakeCluster() as cluster:
            live(cluster, releases["1"], "1")
            with clients(cluster):
                killing_after(monkeypatch, changes)
                with pytest.raises(Killed):
                    deploy(
                        KubernetesTarget(cluster.client(), **FAST),
                        "2",
                        copy.deepcopy(releases["2"]),
                        STEPS,
                        lambda s, f, p: verdict(s, f),
                        timeout_s=5,
                    )
                monkeypatch.undo()
                time.sleep(0.02)  # the dead controller's state serves for a while
                target = KubernetesTarget(cluster.client(), **FAST)
                outcome = recover(target, copy.deepcopy(releases["2"]), timeout_s=5)
                again = recover(target, copy.deepcopy(releases["2"]), timeout_s=5)
                time.sleep(0.02)
            assert_safe(cluster)
            assert all(sum(h.values()) <= 4 for h in cluster.history), (changes, cluster.history)
            assert len([n for n in cluster.names("deployments", NS) if "-r2-" in n]) <= 2  # no second copy
            route = cluster.get("httproutes", NS, ROUTE)["spec"]["rules"][0]["backendRefs"]
            weights = {b["name"]: b["weight"] for b in route if b["weight"]}
            running = {release: n for release, n in cluster.servers().items() if n}
            if outcome.status == "live":
                assert running == {"2": 3} and weights == {r2: 10_000}, changes
            else:
                assert outcome.status == "rolled_back", (changes, outcome.error)
                assert running == {"1": 3} and weights == {r1: 10_000}, changes
            # a second recovery finds nothing to change
            assert again.status == outcome.status and not [k for k, _ in again.events if k == "traffic"]
            outcomes.append(outcome.status)
    # killed before its last change the rollout is undone; after the route and servers had all moved, finished
    assert outcomes[0] == "rolled_back" and outcomes[-1] == "live" and total >= 15, (total, outcomes)


def test_a_route_its_gateway_refuses_fails_the_step_and_the_route_is_set_back(fake, releases):
    """The controller counts a route change only once the Gateway reports it accepted (the route's
    status, at its generation): a refused one fails the rollout, and the undo sets the route again
    (the refused weights may be what it holds) before the new release leaves."""
    live(fake, releases["1"], "1")
    fake.refuse_routes = 1
    with clients(fake):
        outcome = deploy(KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), STEPS, timeout_s=5)
    assert outcome.status == "rolled_back"
    assert "refused by its Gateway: Accepted NotAllowedByListeners: no listener allows this route" in outcome.error
    r1, r2 = SERVICE
    # the refused route (release 2's own rule, for its first check) set again, without release 2
    assert fake.route_changes[-1].weights == {r1: 10_000}
    assert manifests.named_releases(fake.get("httproutes", NS, ROUTE)) == [r1]
    assert fake.servers() == {"1": 3, "2": 0}
    assert_safe(fake)


def test_the_controller_owns_the_counts_while_the_scalers_are_paused(fake):
    """With KEDA scalers (capacity.autoscale): every count the controller sets, on either release,
    is one its scalers are paused at first (KEDA would otherwise put its own back); the serving
    release's scalers are paused before the rollout changes anything; the release that serves at
    the end, after a good rollout or an abort, has its scalers back."""
    loaded = load_spec(PROD_SPEC)
    options = manifests.RenderOptions(servers=3, autoscale_rate=18.0)

    def render(release: str, layout: str) -> list[dict]:
        artifact = manifests.Artifact(nfs_path=f"/mnt/models/r{release}", manifest_hash=release * 64)
        return manifests.render(loaded, layout, release, artifact, options)

    cluster = KubernetesTarget(fake.client(), **FAST)
    scalers = {
        r: [o["metadata"]["name"] for o in render(r, layout) if o["kind"] == "ScaledObject"]
        for r, layout in (("1", "tp8-ep8"), ("2", "tp4-ep4-x2"), ("3", "tp4-ep4-x2"))
    }
    assert len(scalers["2"]) == 2  # one per replica group

    def paused(release: str) -> set:
        return {
            (fake.get("scaledobjects", NS, n) or {})
            .get("metadata", {})
            .get("annotations", {})
            .get("autoscaling.keda.sh/paused-replicas")
            for n in scalers[release]
        }

    assert deploy(cluster, "1", render("1", "tp8-ep8"), timeout_s=5).status == "live"
    assert paused("1") == {None}  # live, whole: its scaler drives it
    fake.scaler_changes.clear()
    with clients(fake):
        good = deploy(cluster, "2", render("2", "tp4-ep4-x2"), STEPS, lambda s, f, p: verdict(s, f), timeout_s=5)
    assert good.status == "live", good.error
    assert fake.scaled_unpaused == []
    first = next(change for change in fake.scaler_changes if change[1] in scalers["1"])
    assert first[2] == 3  # the live release held at its 3 servers before any count of it changed
    # and only after the rollout's record was on the cluster (the new Deployments carry it)
    record_at = next(i for i, r in enumerate(fake.requests) if r.method == "PATCH" and "/deployments/" in r.path)
    pause_at = next(
        i
        for i, r in enumerate(fake.requests)
        if r.method == "PATCH" and r.path.endswith(f"/scaledobjects/{scalers['1'][0]}")
    )
    assert record_at < pause_at
    assert paused("2") == {None} and paused("1") == {"0"}  # the new one scales itself; the old one held at 0
    assert fake.servers() == {"1": 0, "2": 3}

    with clients(fake):
        bad = deploy(cluster, "3", render("3", "tp4-ep4-x2"), STEPS, lambda s, f, p: verdict(s, f, s < 2), timeout_s=5)
    assert bad.status == "rolled_back"
    assert fake.scaled_unpaused == []
    assert paused("2") == {None} and paused("3") == {"0"}  # the release serving again has its scalers back
    assert fake.servers() == {"2": 3, "3": 0}


def test_leftovers_of_an_aborted_release_are_removed_by_the_next(fake, releases):
    live(fake, releases["1"], "1")
    deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        STEPS,
        lambda s, f, pods: verdict(s, f, passed=False),
        timeout_s=5,
    )
    assert set(fake.names("deployments", NS)) == set(R1 + R2)
    loaded = load_spec(PROD_SPEC)
    third = manifests.render(
        loaded,
        "tp8-ep8",
        "3",
        manifests.Artifact(nfs_path="/mnt/models/q3", manifest_hash="c" * 64),
        manifests.RenderOptions(servers=3),
    )
    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST), "3", third, STEPS, lambda s, f, pods: verdict(s, f), timeout_s=5
    )
    assert outcome.status == "live", outcome.error
    assert dict(outcome.events)["pruned"]["objects"][:2] == [f"Deployment/{n}" for n in R2]
    # release 1, which served until release 3 passed its last analysis, stays at zero beside it
    assert fake.names("deployments", NS) == [*R1, "qwen3-235b-a22b-fp8-r3-0"]
    assert fake.get("deployments", NS, R1[0])["spec"]["replicas"] == 0


def test_a_rollout_that_never_becomes_ready_leaves_the_old_release_serving(fake, releases):
    live(fake, releases["1"], "1")
    fake.scenarios["2"] = "never_ready"
    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        STEPS,
        lambda s, f, pods: verdict(s, f),
        timeout_s=0.3,
    )
    assert outcome.status == "rolled_back"
    assert names(outcome) == ["deploy_started", "rollout_failed", "rollback_started", "rollback_complete"]
    assert "qwen3-235b-a22b-fp8-r2-0 not rolled out after 0.3 s" in outcome.error
    assert "MinimumReplicasUnavailable" in outcome.error and "available 0" in outcome.error
    assert fake.servers() == {"1": 3, "2": 0}
    assert all(h["1"] == 3 for h in fake.history)  # the old release never lost a server
    restored = fake.get("deployments", NS, R1[0])
    assert restored["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"amd.com/gpu": 8}


def test_a_failure_without_a_live_release_is_failed(fake, releases):
    fake.scenario = "never_ready"
    outcome = deploy(KubernetesTarget(fake.client(), **FAST), "2", copy.deepcopy(releases["2"]), timeout_s=0.2)
    assert outcome.status == "failed"
    assert names(outcome) == ["deploy_started", "rollout_failed", "scaled_to_zero"]
    assert "not rolled out" in outcome.error
    # its pods, Pending here, give back what they hold; its objects stay for the post-mortem
    assert fake.servers() == {"2": 0} and fake.names("deployments", NS) == R2 and not pods_of(fake, "2")


def test_a_failed_smoke_test_never_takes_a_server_from_the_old_release(fake, releases):
    live(fake, releases["1"], "1")
    fake.scenarios["2"] = "smoke_fails"
    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        STEPS,
        lambda s, f, pods: verdict(s, f),
        timeout_s=5,
    )
    assert outcome.status == "rolled_back"
    assert names(outcome) == ["deploy_started", "smoke_test", "rollout_failed", "rollback_started", "rollback_complete"]
    assert dict(outcome.events)["smoke_test"]["ok"] is False
    assert "HTTP 500" in outcome.error and "EngineCore died" in outcome.error
    assert all(h["1"] == 3 for h in fake.history)
    assert fake.servers() == {"1": 3, "2": 0}


def test_an_unreachable_api_server_raises_before_anything_changes(fake, releases):
    live(fake, releases["1"], "1")
    before = fake.snapshot()
    url = dead_url()
    target = KubernetesTarget(client.ApiClient(client.Configuration(host=url)), **FAST)
    with pytest.raises(ClusterUnreachable, match=f"Kubernetes API server {url} did not answer"):
        deploy(target, "2", copy.deepcopy(releases["2"]), STEPS, timeout_s=5)
    assert fake.snapshot() == before and fake.requests == []


def test_rollout_failed_names_the_deployment_and_its_conditions(fake, releases):
    fake.scenario = "never_ready"
    with pytest.raises(RolloutFailed) as failed:
        k8s_deploy.apply(fake.client(), releases["1"], timeout_s=0.1, poll_s=0.01)
    message = str(failed.value)
    assert message.startswith(f"Deployment {NS}/{R1[0]} not rolled out")
    assert "Available=False (MinimumReplicasUnavailable" in message
    assert isinstance(failed.value, ReleaseError)


def test_smoke_through_the_gateway_returns_the_completion_and_fails_on_a_wrong_model(fake, releases):
    api = fake.client()
    objs = copy.deepcopy(releases["1"])
    k8s_deploy.apply(api, objs, timeout_s=5, poll_s=0.01)  # the route names release 1 (its own rule too)
    checked = k8s_deploy.named_smoke(api, objs, retry_delay_s=0.01)
    own = "qwen3-235b-a22b-fp8-r1"
    assert (checked.text, checked.release, checked.answered_by, checked.tries) == (" Paris.", own, own, 1)
    assert checked.url == f"http://127.0.0.1:{fake.data_plane.server_address[1]}"
    for obj in objs:  # the engine asked for a model it does not serve: the release answered, wrongly
        if obj["kind"] == "Deployment":
            command = obj["spec"]["template"]["spec"]["containers"][0]["command"]
            command[command.index("--served-model-name") + 1] = "other-model"
    with pytest.raises(SmokeFailed, match=f"release {own} answered HTTP 404.*does not exist"):
        k8s_deploy.named_smoke(api, objs, retry_delay_s=0.01)


def write_kubeconfig(tmp_path, server):
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "ci", "user": {"token": "s3cr3t-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "ci"}}],
            }
        )
    )
    return path


def test_api_client_from_kubeconfig_sends_the_token_and_never_logs_it(fake, releases, tmp_path, monkeypatch, caplog):
    path = write_kubeconfig(tmp_path, fake.url)
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    caplog.set_level("DEBUG")
    api = k8s_deploy.api_client(None)
    assert api.configuration.host == fake.url
    outcome = deploy(KubernetesTarget(api, **FAST), "1", copy.deepcopy(releases["1"]), timeout_s=5)
    assert outcome.status == "live"
    assert {r.authorization for r in fake.requests} == {"Bearer s3cr3t-token"}
    assert "s3cr3t" not in caplog.text and fake.url in caplog.text


def test_api_client_from_an_airflow_connection(fake, tmp_path, monkeypatch):
    pytest.importorskip("airflow.providers.cncf.kubernetes")
    path = write_kubeconfig(tmp_path, fake.url)
    monkeypatch.setenv(
        "AIRFLOW_CONN_FAKE_K8S", json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(path)}})
    )
    api = k8s_deploy.api_client("fake_k8s")
    assert api.configuration.host == fake.url
    assert KubernetesTarget(api).check_reachable() == "v1.31.0-fake"


# ---------------------------------------------------------------- served answers at each step


def served(step: int, passed: bool) -> ServedAccuracy:
    failures = [] if passed else ["tiny_add: recovery vs min_recovery (recovery=0.100 < 0.95)"]
    return ServedAccuracy(passed=passed, endpoint="e", limit=10, tasks=[], failures=failures, seconds=1.0)


def test_answers_that_got_worse_abort_the_step_before_the_old_release_gives_a_server(fake, releases):
    live(fake, releases["1"], "1")
    asked = []

    def answers(step, endpoint, model):
        asked.append((step, endpoint.url, model, dict(fake.servers())))
        return served(step, passed=step < 2)

    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        STEPS,
        lambda s, f, pods: verdict(s, f),
        timeout_s=5,
        answers=answers,
    )
    assert outcome.status == "rolled_back"
    own = f"{fake.url}/api/v1/namespaces/{NS}/services/qwen3-235b-a22b-fp8-r2:8000/proxy"
    # each check goes to the release's own Service: step 1's once its first servers run, before the
    # route gives it any traffic; step 2's before its share rises and before any old server stops
    assert asked == [
        (1, own, "qwen3-235b-a22b-fp8", {"1": 3, "2": 1}),
        (2, own, "qwen3-235b-a22b-fp8", {"1": 3, "2": 1}),
    ]
    r1, r2 = SERVICE
    # release 2's own rule, its share, the share back, then release 2 out of the route
    assert [c.weights for c in fake.route_changes[2:]] == [
        {r1: 10_000},
        {r1: 9000, r2: 1000},
        {r1: 10_000, r2: 0},
        {r1: 10_000},
    ]
    checks = [d for k, d in outcome.events if k == "rollout_accuracy"]
    assert [(c["step"], c["passed"]) for c in checks] == [(1, True), (2, False)]
    assert [n for n in names(outcome) if n != "traffic"][-3:] == [
        "rollout_aborted",
        "rollback_started",
        "rollback_complete",
    ]
    assert "step 2: serving-path accuracy through Service llm-serving/qwen3-235b-a22b-fp8-r2" in outcome.error
    assert "tiny_add: recovery" in outcome.error
    assert fake.servers() == {"1": 3, "2": 0}
    assert all(sum(h.values()) >= 3 for h in fake.ready_history), fake.ready_history


def test_a_first_release_whose_answers_got_worse_is_scaled_to_zero(fake, releases):
    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        timeout_s=5,
        answers=lambda step, endpoint, model: served(step, False),
    )
    assert outcome.status == "failed"
    assert names(outcome) == ["deploy_started", "smoke_test", "rollout_accuracy", "rollout_aborted", "scaled_to_zero"]
    assert fake.servers() == {"2": 0}


def test_pods_rendered_before_the_tokenizer_endpoint_are_not_checked_and_say_so(fake, releases):
    # a rollback to a release whose stored manifests predate the flag: no check is possible, none blocks
    old_objs = copy.deepcopy(releases["2"])
    for obj in old_objs:
        if obj["kind"] == "Deployment":
            obj["spec"]["template"]["spec"]["containers"][0]["command"].remove(manifests.TOKENIZER_INFO_FLAG)
    live(fake, releases["1"], "1")
    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        old_objs,
        STEPS,
        lambda s, f, pods: verdict(s, f),
        timeout_s=5,
        answers=lambda *a: served(1, False),
    )
    assert outcome.status == "live", outcome.error
    checks = [d for k, d in outcome.events if k == "rollout_accuracy"]
    assert [c["step"] for c in checks] == [1, 2, 3] and all("not checked" in c["skipped"] for c in checks)


def test_the_endpoint_carries_the_clients_credentials_and_ca(tmp_path):
    configuration = client.Configuration(host="https://k8s.example:6443/")
    configuration.api_key = {"BearerToken": "Bearer s3cret"}  # as the kubeconfig loader sets it
    ca = certifi.where()  # a real PEM bundle stands for the cluster's CA
    configuration.ssl_ca_cert = ca
    endpoint = k8s_deploy.service_endpoint(client.ApiClient(configuration), NS, "svc-r2", 8000)
    assert endpoint.url == f"https://k8s.example:6443/api/v1/namespaces/{NS}/services/svc-r2:8000/proxy"
    assert endpoint.headers == {"Authorization": "Bearer s3cret"} and endpoint.ca_cert == ca
    # what lm-eval gets: the token for the remote tokenizer, and the CA in the form each HTTP stack takes
    concurrent, serial = endpoint.lm_args(4), endpoint.lm_args(1)
    assert concurrent["auth_token"] == "s3cret" and concurrent["ca_cert_path"] == ca
    assert concurrent["header"] == {"Authorization": "Bearer s3cret"}
    assert isinstance(concurrent["verify_certificate"], ssl.SSLContext)  # aiohttp, requests in flight at once
    assert serial["verify_certificate"] == ca  # requests, one at a time
    configuration.verify_ssl = False  # the kubeconfig's insecure-skip-tls-verify: the user's choice, kept
    insecure = k8s_deploy.service_endpoint(client.ApiClient(configuration), NS, "svc-r2", 8000)
    assert insecure.lm_args(4)["verify_certificate"] is False
    # the token stays out of what is printed, recorded or logged
    assert "s3cret" not in repr(endpoint) + str(endpoint) + endpoint.model_dump_json()


@pytest.mark.slow
def test_each_step_checks_the_served_answers_through_the_releases_own_service(
    fake, releases, tiny_model_dir, tiny_engine, spec_file, release_env, caplog
):
    """The check the promotion runs (promote.step_answers): lm-eval through the API server's
    service proxy, with the client's token, to a real engine behind release 2's pods, scored with
    the engine's own tokenizer and held to the in-process scores of the same model."""
    import logging
    from datetime import UTC, datetime

    from pipeline.release import promote
    from pipeline.release.registry import Release
    from pipeline.stages import evaluate
    from tests.conftest import TINY_SPEC

    caplog.set_level(logging.INFO)
    path = spec_file(TINY_SPEC, lambda d: d["evaluation"].update(limit=10, served={"limit": 10, "rollout_limit": 10}))
    loaded = load_spec(path)
    in_process = evaluate.evaluate(tiny_model_dir, "tiny", loaded.spec.evaluation).model_dump(mode="json")
    now = datetime.now(UTC)
    rel = Release(
        id=2,
        run_key="k8s-answers",
        name=loaded.spec.name,
        spec_path=str(path),
        spec_yaml="",
        target="kubernetes",
        status="approved",
        data={"evaluation": {"baseline": in_process, "candidate": in_process}},
        created_at=now,
        updated_at=now,
    )
    answers = promote.step_answers(rel, loaded)
    assert answers is not None
    live(fake, releases["1"], "1")
    api = fake.client()
    api.configuration.api_key = {"BearerToken": "Bearer s3cret"}  # as the kubeconfig loader sets it
    steps = [
        ServerStep(fraction=0.5, old_servers=2, new_servers=2),
        ServerStep(fraction=1.0, old_servers=0, new_servers=3),
    ]
    fake.backends["2"] = tiny_engine  # the shared engine answers as the production spec's model too
    outcome = deploy(
        KubernetesTarget(api, **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        steps,
        lambda s, f, pods: verdict(s, f),
        timeout_s=5,
        answers=answers,
    )
    assert outcome.status == "live", outcome.error
    checks = [d for k, d in outcome.events if k == "rollout_accuracy"]
    assert [(c["step"], c["passed"], c["limit"]) for c in checks] == [(1, True, 10), (2, True, 10)]
    assert {t["task"] for t in checks[0]["tasks"]} == {t.name for t in loaded.spec.evaluation.tasks}
    assert all(t["samples_candidate"] == 10 for c in checks for t in c["tasks"])
    proxied = [r for r in fake.requests if "/proxy/" in r.path]
    own = f"/api/v1/namespaces/{NS}/services/qwen3-235b-a22b-fp8-r2:8000/proxy/"
    assert proxied and all(r.path.startswith(own) for r in proxied)
    # completions and the engine's own tokenizer, all with the client's token
    assert {"v1/completions", "tokenizer_info", "tokenize"} <= {r.path[len(own) :] for r in proxied}
    assert {r.authorization for r in proxied} == {"Bearer s3cret"}
    assert "s3cret" not in json.dumps(outcome.events) + caplog.text


def test_the_documented_role_allows_every_request_of_a_rollout_an_abort_and_a_rollback(fake, releases):
    """The platform install's Roles for the controller (docs/production.md step 4), checked against
    what it sends: every request of a first deploy, a 3-step rollout, an aborted one and a rollback
    to kept objects, mapped to the (API group, resource, verb) RBAC checks (an apply may create)."""
    from pipeline.k8s import install

    objects = install.render(load_spec(PROD_SPEC), install.PlatformOptions(nfs_server="h", nfs_path="/p"))
    roles = {o["metadata"]["namespace"]: o for o in objects if o.get("kind") == "Role"}
    allowed = {
        (group, resource, verb)
        for role in roles.values()
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if resource != "gateways" or role["metadata"]["namespace"] == "gateway-system"  # where the Gateway is
    }
    assert NS in roles
    target = KubernetesTarget(fake.client(), **FAST)
    deploy(target, "1", copy.deepcopy(releases["1"]), timeout_s=5)
    deploy(target, "2", copy.deepcopy(releases["2"]), STEPS, lambda s, f, p: verdict(s, f), timeout_s=5)
    deploy(target, "3", _third(), STEPS, lambda s, f, p: verdict(s, f, passed=s < 2), timeout_s=5)
    deploy(target, "1", copy.deepcopy(releases["1"]), timeout_s=5)  # a rollback: release 1's objects were kept
    needed = set()
    for request in fake.requests:
        match = deploy_path.match(request.path)
        if request.path == "/version":
            continue  # discovery: every authenticated user may read it
        assert match, request.path
        group = match["group"] or ""
        resource = match["plural"] + (f"/{match['sub']}" if match["sub"] else "")
        verb = {"GET": "get" if match["name"] else "list", "PATCH": "patch", "DELETE": "delete", "POST": "create"}[
            request.method
        ]
        needed.add((group, resource, verb))
        if request.content_type == APPLY:
            needed.add((group, resource, "create"))  # server-side apply of an object not there yet
    assert needed - allowed == set()
    assert {
        ("gateway.networking.k8s.io", "httproutes", "patch"),
        ("gateway.networking.k8s.io", "gateways", "get"),  # its address, for the checks through it
        ("", "pods", "list"),  # those still terminating hold GPUs: counted against the budget
    } <= needed


deploy_path = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/[^/]+/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+)(?:/.*)?)?)?$"
)


def _third() -> list[dict]:
    loaded = load_spec(PROD_SPEC)
    artifact = manifests.Artifact(nfs_path="/mnt/models/q3", manifest_hash="c" * 64)
    return manifests.render(loaded, "tp8-ep8", "3", artifact, manifests.RenderOptions(servers=3))
