"""One controller per model: the Lease on the fake API server (compare-and-swap only), its fence,
two controllers in separate processes, and query errors that are not failures."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.core.errors import LeaseHeld, LeaseLost, PrometheusError
from pipeline.core.specs import load_spec
from pipeline.k8s.deploy import KubernetesTarget
from pipeline.k8s.lease import Fenced, Lease
from pipeline.records.rollout import StepReview
from pipeline.release import analysis, controller
from tests.conftest import PROD_SPEC
from tests.k8s_fake import FakeCluster, FakePrometheus
from tests.test_k8s_deploy import FAST, NS, STEPS, live, verdict

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen3-235b-a22b-fp8"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_lease_is_taken_and_renewed_by_compare_and_swap_and_expires_on_the_observers_clock():
    with FakeCluster() as fake:
        clock = Clock()
        first = Lease(fake.client(), NS, MODEL, "first", duration_s=10, clock=clock)
        second = Lease(fake.client(), NS, MODEL, "second", duration_s=10, clock=clock)
        assert first.try_acquire()
        assert not second.try_acquire()  # its create answered 409: the Lease exists
        clock.now = 9
        assert not second.try_acquire()  # silent for 9 s of the second's clock: not yet
        first.ensure()  # a renewal: the record changed, the second's count starts again
        clock.now = 18
        assert not second.try_acquire()
        with pytest.raises(LeaseHeld, match="another controller holds Lease llm-serving/model-release-qwen3.*: first"):
            second.acquire(wait_s=0, poll_s=0)
        clock.now = 30  # 12 s of silence since the second saw the renewal: taken over by an update
        assert second.try_acquire()
        with pytest.raises(LeaseLost):
            first.ensure()  # its update carried a stale resourceVersion: 409, and it knows it lost
        stale = [w for w in fake.writes if w[3] == "first"]
        assert [w[1] for w in stale] == ["POST", "PUT"]  # created, renewed once; never written after
        second.release()
        assert first.try_acquire()  # given back: no wait


def test_a_stale_update_is_refused_by_the_fake_as_the_api_server_refuses_it():
    from kubernetes.client import CoordinationV1Api
    from kubernetes.client.exceptions import ApiException

    with FakeCluster() as fake:
        lease = Lease(fake.client(), NS, MODEL, "a")
        assert lease.try_acquire()
        api = CoordinationV1Api(fake.client())
        body = lease._body("0")  # a resourceVersion nobody holds any more
        with pytest.raises(ApiException) as refused:
            api.replace_namespaced_lease(lease.name, NS, body)
        assert refused.value.status == 409
        with pytest.raises(ApiException) as exists:
            api.create_namespaced_lease(NS, lease._body(None))
        assert exists.value.status == 409


CONTENDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kubernetes import client
    from pipeline.core.errors import LeaseHeld
    from pipeline.k8s.lease import Lease

    url, holder, wait_s, hold_until = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    lease = Lease(client.ApiClient(client.Configuration(host=url)), "llm-serving", "qwen3-235b-a22b-fp8", holder)
    try:
        lease.acquire(wait_s, poll_s=0.05)
    except LeaseHeld as exc:
        print("REFUSED", exc, flush=True)
        sys.exit(3)
    print("HOLDS", holder, flush=True)
    while not hold_until.exists():
        lease.ensure()  # a write of ours, fenced
        time.sleep(0.05)
    lease.release()
    print("RELEASED", holder, flush=True)
    """
)


def _contender(fake: FakeCluster, holder: str, wait_s: float, done: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", CONTENDER, fake.url, holder, str(wait_s), str(done)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )


def test_two_controllers_in_separate_processes_contend_only_through_the_lease(tmp_path):
    """Two processes, sharing nothing but the fake API server: the first holds the Lease; the
    second is refused with the holder named (no traceback); once the first gives it back a third
    that waits gets it."""
    with FakeCluster() as fake:
        first = _contender(fake, "release-dag-try-1", 0, tmp_path / "first-done")
        assert first.stdout is not None and first.stdout.readline().startswith("HOLDS release-dag-try-1")
        second = _contender(fake, "rollback-dag", 0.5, tmp_path / "second-done")
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 3, out
        assert out.startswith("REFUSED") and "release-dag-try-1" in out and "Traceback" not in out
        third = _contender(fake, "recover-door", 60, tmp_path / "third-done")
        (tmp_path / "first-done").touch()
        assert first.wait(timeout=60) == 0
        assert third.stdout is not None and third.stdout.readline().startswith("HOLDS recover-door")
        (tmp_path / "third-done").touch()
        assert third.wait(timeout=60) == 0
        holders = [w[3] for w in fake.writes]
        # every write of the first came before the third's first; the second wrote nothing
        assert "rollback-dag" not in holders
        last_first = max(i for i, h in enumerate(holders) if h == "release-dag-try-1")
        assert all(h != "recover-door" for h in holders[: last_first + 1])


@pytest.fixture(scope="module")
def releases():
    from pipeline.k8s import manifests

    loaded = load_spec(PROD_SPEC)
    options = manifests.RenderOptions(servers=3)

    def artifact(h):
        return manifests.Artifact(nfs_path=f"/mnt/models/qwen3-{h[:6]}", manifest_hash=h * 32)

    return {
        "1": manifests.render(loaded, "tp8-ep8", "1", artifact("a1"), options),
        "2": manifests.render(loaded, "tp4-ep4-x2", "2", artifact("b2"), options),
    }


@pytest.mark.parametrize("during", ["pod readiness", "analysis window", "review", "keep window"])
def test_a_controller_whose_lease_was_taken_during_a_wait_writes_nothing_after(during, releases, monkeypatch):
    """The Lease taken over while the controller waits (new pods turning Ready; a step's analysis
    window; a reviewer's answer, which the judge waits for too; the keep window):
    its next write is refused by the fence before it is sent, so the cluster sees no write of it
    after the takeover, and it undoes nothing (the new holder owns the model)."""
    with FakeCluster() as fake:
        live(fake, releases["1"], "1")
        clock = Clock()
        mine = Lease(fake.client(), NS, MODEL, "controller-1", duration_s=10, clock=clock)
        assert mine.try_acquire()
        thief = Lease(fake.client(), NS, MODEL, "controller-2", duration_s=10, clock=clock)
        taken: list[int] = []

        def take_over() -> None:
            assert not thief.try_acquire()  # first sight of the holder's record
            clock.now += 11  # it stays silent (stuck) for longer than the duration on the thief's clock
            assert thief.try_acquire()
            taken.append(len(fake.requests))

        def judge(step, fraction, pods):
            if during == "analysis window" and step == 2:
                take_over()
            result = verdict(step, fraction)
            if during == "review" and step == 1:  # the analysis passed; the reviewer takes their time
                take_over()
                result = result.decided(StepReview(step=step, decision="continue", actor="ml-lead", comment="ok"))
            return result

        from pipeline.k8s import deploy as k8s_deploy

        real_wait = k8s_deploy.wait_rollout
        waits: list[int] = []

        def wait_rollout(*args, **kwargs):
            waits.append(1)
            if during == "pod readiness" and len(waits) == 2:  # the second wave's pods loading
                take_over()
            return real_wait(*args, **kwargs)

        monkeypatch.setattr(k8s_deploy, "wait_rollout", wait_rollout)

        def wait(seconds):
            take_over()

        target = KubernetesTarget(Fenced(fake.client(), mine), **FAST).release(
            "2", copy.deepcopy(releases["2"]), None, 5
        )
        with pytest.raises(LeaseLost):
            controller.rollout(target, STEPS, judge, 1, 30.0 if during == "keep window" else 0.0, None, wait)
        assert taken, "the Lease was never taken over"
        sent = [r for r in fake.requests[taken[0] :] if r.method in ("PATCH", "DELETE", "POST", "PUT")]
        # what it sent after: only its renewal, which the API server refused (409), nothing else
        assert all(r.path.endswith(f"/leases/{mine.name}") and r.method == "PUT" for r in sent), sent
        assert [w[3] for w in fake.writes][-1] == "controller-2"


def test_one_query_error_is_asked_again_for_the_same_window_and_more_than_the_limit_abort():
    with FakeCluster() as fake, FakePrometheus(fake, ttft_s={"2": 0.4}) as prometheus:
        loaded = load_spec(PROD_SPEC)
        spec = loaded.spec
        rollout = spec.rollout.model_copy(update={"min_requests": 0})
        limit = analysis.CONSECUTIVE_ERROR_LIMIT
        assert limit == 4  # Argo Rollouts' consecutiveErrorLimit default
        prometheus.failing = limit  # four errors in a row on the first query: asked again each time
        verdict_ = analysis.analyze(
            prometheus.url, 'release="2"', None, 1, 0.1, 60, spec.slo, rollout, at=1234.5, retry_s=0
        )
        assert verdict_.queries["new_p90_ttft"].value == 0.4 and prometheus.errors == limit
        assert set(prometheus.at) == {"1234.500"}  # every try, and every query, pinned at the window's end
        prometheus.failing = limit + 1
        with pytest.raises(PrometheusError, match="5 errors in a row, more than the consecutive error limit 4"):
            analysis.analyze(prometheus.url, 'release="2"', None, 1, 0.1, 60, spec.slo, rollout, at=1.0, retry_s=0)


def test_a_metric_that_answers_and_fails_aborts_at_once_without_a_retry():
    with FakeCluster() as fake, FakePrometheus(fake, ttft_s={}) as prometheus:
        spec = load_spec(PROD_SPEC).spec
        rollout = spec.rollout.model_copy(update={"min_requests": 0})
        result = analysis.analyze(prometheus.url, 'release="2"', None, 1, 0.1, 60, spec.slo, rollout, retry_s=0)
        # answered: no engine of the release is up, which fails the step as it stands
        assert not result.passed and any(r.startswith("no engine of the new release") for r in result.reasons)
        assert len(prometheus.asked) == len(analysis.queries('release="2"', None, 60))  # each asked once


@functools.cache
def _prod():
    """The production spec, read once: the kill-at-every-change test renders releases ~150 times, and
    each read of the spec and its hardware profile (YAML, validation) was 0.1 s of it."""
    return load_spec(PROD_SPEC)


def _scaled(release: str, layout: str) -> list[dict]:
    from pipeline.k8s import manifests

    loaded = _prod()
    artifact = manifests.Artifact(nfs_path=f"/mnt/models/r{release}", manifest_hash=release * 64)
    return manifests.render(loaded, layout, release, artifact, manifests.RenderOptions(servers=3, autoscale_rate=18.0))


def test_an_operators_pause_is_kept_and_a_missing_scaler_is_no_failed_rollback():
    """A scaler an operator paused stays paused through a rollout and its undo (never resumed by
    us); a scaler that is gone is skipped and said, and the undo still brings the old release back."""
    from pipeline.k8s import autoscaler

    with FakeCluster() as fake:
        cluster = KubernetesTarget(fake.client(), **FAST)
        one = _scaled("1", "tp8-ep8")
        assert controller.rollout(cluster.release("1", copy.deepcopy(one), None, 5)).status == "live"
        name = next(o["metadata"]["name"] for o in one if o["kind"] == "ScaledObject")
        key = ("keda.sh/v1alpha1", "scaledobjects", NS, name)
        fake.merge_scaler(key, {"metadata": {"annotations": {autoscaler.PAUSED: "true"}}})  # an operator's
        bad = controller.rollout(
            cluster.release("2", _scaled("2", "tp4-ep4-x2"), None, 5), STEPS, lambda s, f, p: verdict(s, f, s < 2), 1
        )
        assert bad.status == "rolled_back", bad.error
        annotations = fake.get("scaledobjects", NS, name)["metadata"]["annotations"]
        assert annotations == {autoscaler.PAUSED: "true"}  # as the operator left it
        assert ("autoscaler_left_paused", {"scaled_objects": [name], "by": "an operator"}) in bad.events

        three = _scaled("3", "tp4-ep4-x2")
        gone = next(o["metadata"]["name"] for o in three if o["kind"] == "ScaledObject")

        def judge(step, fraction, pods):  # one of the new release's scalers deleted by hand meanwhile
            fake.objects.pop(("keda.sh/v1alpha1", "scaledobjects", NS, gone), None)
            return verdict(step, fraction, step < 2)

        again = controller.rollout(cluster.release("3", three, None, 5), STEPS, judge, 1)
        assert again.status == "rolled_back", again.error  # not rollback_failed
        assert ("autoscaler_missing", {"scaled_object": gone}) in again.events
        assert {r: n for r, n in fake.servers().items() if n} == {"1": 3}


@pytest.mark.usefixtures("release_env")
def test_the_recover_door_says_when_there_is_nothing_and_names_the_holder_of_the_lock(capsys):
    """`model-release recover NAME`: nothing to recover -> says so, exit 0; the model's lock held
    by another controller -> one line naming it, exit 1, no traceback."""
    from pipeline import cli
    from pipeline.release import lock
    from pipeline.release.registry import Registry, inputs_of
    from tests.conftest import TINY_SPEC

    loaded = load_spec(TINY_SPEC)
    name = loaded.spec.name
    reg = Registry()
    reg.open_release("run-1", name, str(loaded.path), loaded.path.read_text(), "local", inputs_of(loaded))
    assert cli.main(["recover", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nothing to recover: no release of {name} on local is deploying"), out
    with lock.controlling(name, "local", loaded, "release-dag", wait_s=0):
        assert cli.main(["recover", name, "--wait", "0.2"]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another controller holds its switch lock: release-dag@" in errors[0], captured.err
    assert "Traceback" not in captured.err


def test_a_route_status_written_for_the_previous_generation_is_not_taken_for_the_change(releases):
    """The Gateway's controller reports on a change some reads later; until then the route's status
    is the previous generation's (Accepted). The controller waits for the status of its own
    generation, which refuses it: the step fails (a controller that read any Accepted as its own
    would go on with weights the Gateway does not serve)."""
    with FakeCluster() as fake:
        live(fake, releases["1"], "1")
        fake.route_status_lag_reads, fake.refuse_routes = 3, 1
        outcome = controller.rollout(
            KubernetesTarget(fake.client(), **FAST).release("2", copy.deepcopy(releases["2"]), None, 5),
            STEPS,
            lambda s, f, p: verdict(s, f),
            1,
        )
        assert outcome.status == "rolled_back"
        assert "refused by its Gateway" in (outcome.error or "")
        assert fake.servers() == {"1": 3, "2": 0}


def test_a_route_another_writer_changed_since_it_was_read_is_not_overwritten(releases):
    """The route's writes are conditional on the resourceVersion read just before: a second writer
    in between makes the API server refuse ours (409), the step fails, the undo (reading again)
    puts the old release back."""
    with FakeCluster() as fake:
        live(fake, releases["1"], "1")
        fake.second_writer = 1
        outcome = controller.rollout(
            KubernetesTarget(fake.client(), **FAST).release("2", copy.deepcopy(releases["2"]), None, 5),
            STEPS,
            lambda s, f, p: verdict(s, f),
            1,
        )
        assert outcome.status == "rolled_back"
        assert "HTTP 409" in (outcome.error or "") and "has been modified" in (outcome.error or "")
        assert ("PATCH", "second writer") in {(w[1], w[3]) for w in fake.writes}
        assert fake.servers() == {"1": 3, "2": 0}
        assert fake.route_changes[-1].weights == {"qwen3-235b-a22b-fp8-r1": 10_000}


def _serving_scalers_resumed(fake: FakeCluster) -> None:
    """The release the route sends traffic to has its scalers back (none paused by a rollout)."""
    from pipeline.k8s import autoscaler

    route = fake.get("httproutes", NS, MODEL)["spec"]["rules"][0]["backendRefs"]
    serving = {b["name"].rsplit("-r", 1)[-1] for b in route if b["weight"]}
    for obj in fake._objects("scaledobjects"):
        release = obj["metadata"]["labels"]["model-release/release-id"]
        if release in serving:
            assert autoscaler.PAUSED_REPLICAS not in (obj["metadata"].get("annotations") or {}), obj["metadata"]


@pytest.mark.parametrize("path", ["rollout with scalers and a keep window", "rollback to kept objects"])
def test_a_controller_killed_at_any_change_with_scalers_keep_window_and_rollback_is_recovered(path, monkeypatch):
    """Killed after each change in turn (the pauses and resumes included): a good 3-step rollout of
    release 2 over 1 with KEDA scalers and a keep window, or the rollback to release 1's kept
    objects after it; `recover` leaves one release serving all the traffic with its scalers
    resumed, and a second recovery changes nothing."""
    from tests.test_k8s_deploy import Killed, assert_safe, clients, killing_after

    def setup(cluster: FakeCluster) -> None:
        target = KubernetesTarget(cluster.client(), **FAST)
        assert controller.rollout(target.release("1", _scaled("1", "tp8-ep8"), None, 5)).status == "live"
        if path == "rollback to kept objects":
            good = controller.rollout(
                target.release("2", _scaled("2", "tp4-ep4-x2"), None, 5), STEPS, lambda s, f, p: verdict(s, f), 1, 0.01
            )
            assert good.status == "live", good.error
        cluster.requests.clear()
        cluster.history.clear()

    def run(cluster: FakeCluster):
        target = KubernetesTarget(cluster.client(), **FAST)
        if path == "rollback to kept objects":
            return controller.rollout(target.release("1", _scaled("1", "tp8-ep8"), None, 5))
        release = target.release("2", _scaled("2", "tp4-ep4-x2"), None, 5)
        return controller.rollout(release, STEPS, lambda s, f, p: verdict(s, f), 1, 0.01)

    moved, objs = ("1", _scaled("1", "tp8-ep8")) if path == "rollback to kept objects" else ("2", None)
    objs = objs or _scaled("2", "tp4-ep4-x2")
    with FakeCluster() as counting:
        setup(counting)
        state = counting.state()  # set up once: each kill below starts from a copy of it
        made = killing_after(monkeypatch, -1)
        assert run(counting).status == "live"
        total = len(made)
    monkeypatch.undo()
    assert any("/scaledobjects/" in p for p in made)  # the pauses and resumes are among the changes
    outcomes = []
    for changes in range(1, total + 1):
        with FakeCluster() as cluster:
            cluster.restore(state)
            with clients(cluster):
                made_now = killing_after(monkeypatch, changes)
                with pytest.raises(Killed):
                    run(cluster)
                monkeypatch.undo()
                target = KubernetesTarget(cluster.client(), **FAST)
                outcome = controller.recover(target.release("?", copy.deepcopy(objs), None, 5))
                again = controller.recover(target.release("?", copy.deepcopy(objs), None, 5))
            try:
                assert_safe(cluster)  # every change held its traffic, every request reached a checked pod
            except AssertionError as exc:
                raise AssertionError(f"killed after change {changes} ({made_now[-1]}): {exc}") from None
            running = {release: n for release, n in cluster.servers().items() if n}
            assert len(running) == 1 and sum(running.values()) == 3, (changes, running)
            _serving_scalers_resumed(cluster)
            assert again.status == outcome.status and not [k for k, _ in again.events if k == "traffic"]
            outcomes.append(outcome.status)
    assert outcomes[-1] == "live" and (moved == "1" or outcomes[0] == "rolled_back"), outcomes


def test_the_platform_role_allows_every_request_the_lease_makes():
    """The install's Role in the model's namespace carries what taking, renewing, taking over and
    giving back the Lease sends (coordination.k8s.io leases get / create / update)."""
    from pipeline.k8s import install

    objects = install.render(load_spec(PROD_SPEC), install.PlatformOptions(nfs_server="h", nfs_path="/p"))
    role = next(o for o in objects if o.get("kind") == "Role" and o["metadata"]["namespace"] == NS)
    allowed = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    with FakeCluster() as fake:
        clock = Clock()
        first = Lease(fake.client(), NS, MODEL, "a", duration_s=10, clock=clock)
        second = Lease(fake.client(), NS, MODEL, "b", duration_s=10, clock=clock)
        assert first.try_acquire() and not second.try_acquire()
        first.ensure()
        first.release()
        assert second.try_acquire()
        verbs = {"GET": "get", "POST": "create", "PUT": "update"}
        needed = {("coordination.k8s.io", "leases", verbs[r.method]) for r in fake.requests if "/leases" in r.path}
    assert needed == {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    assert needed <= allowed


def test_the_lease_is_renewed_in_the_background_and_again_after_the_keep_window_gave_it_back():
    import time

    with FakeCluster() as fake:
        lease = Lease(fake.client(), NS, MODEL, "a", duration_s=10)
        assert lease.try_acquire()

        def renewals() -> int:
            return len([w for w in fake.writes if w[1] == "PUT" and w[3] == "a"])

        def renewed_after(count: int) -> bool:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if renewals() > count:
                    return True
                time.sleep(0.01)
            return False

        lease.start_renewing(every_s=0.02)
        assert renewed_after(renewals())
        lease.release()  # the keep window: given back, holder cleared
        assert fake.get("leases", NS, lease.name)["spec"]["holderIdentity"] is None
        lease.acquire(0, 0)
        lease.start_renewing(every_s=0.02)
        assert renewed_after(renewals())
        lease.release()
