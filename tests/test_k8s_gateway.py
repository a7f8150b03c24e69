"""A release's checks go through the model's Gateway, as clients reach it, to that release by name:
on the fake API server, whose Gateway routes by the HTTPRoute's rules (and may lag its status)."""

from __future__ import annotations

import copy
import itertools

import pytest

from pipeline.core.errors import SmokeFailed
from pipeline.core.rollout import ServerStep
from pipeline.core.specs import load_spec
from pipeline.k8s import deploy as k8s_deploy
from pipeline.k8s import manifests
from pipeline.k8s.deploy import KubernetesTarget
from pipeline.records.rollout import StepAnalysis
from pipeline.release import controller
from tests.conftest import PROD_SPEC
from tests.k8s_fake import FakeCluster

NS = "llm-serving"
ROUTE = "qwen3-235b-a22b-fp8"
R1, R2 = "qwen3-235b-a22b-fp8-r1", "qwen3-235b-a22b-fp8-r2"
FAST = {"poll_s": 0.01, "smoke_retry_delay_s": 0.01}
LAG = 3  # requests through the Gateway that still take a route's previous rules after each change


@pytest.fixture(scope="module")
def releases():
    loaded = load_spec(PROD_SPEC)

    def render(release: str, layout: str) -> list[dict]:
        artifact = manifests.Artifact(nfs_path=f"/mnt/models/q{release}", manifest_hash=release * 64)
        return manifests.render(loaded, layout, release, artifact, manifests.RenderOptions(servers=3))

    return {"1": render("1", "tp8-ep8"), "2": render("2", "tp4-ep4-x2")}


def passes(judged: list):
    def judge(step: int, fraction: float, pods: int) -> StepAnalysis:
        judged.append((step, fraction, pods))
        return StepAnalysis(step=step, fraction=fraction, window_s=1, passed=True, queries={})

    return judge


def route_now(fake) -> tuple[dict[str, int], list[str]]:
    route = fake.get("httproutes", NS, ROUTE)
    return manifests.route_weights(route), manifests.named_releases(route)


def test_a_first_release_is_checked_through_the_gateway_by_name_though_its_data_plane_lags(releases):
    """The first release: its smoke goes to the Gateway's address (from its status) naming the
    release; the route said Accepted at once, but the data plane follows it only after LAG more
    requests, so the controller asks again until the release's own rule answers, and only then
    gives it the default rule. Its one step is judged like any (no live release to compare)."""
    judged: list = []
    with FakeCluster() as fake:
        fake.route_lag_requests = LAG
        target = KubernetesTarget(fake.client(), **FAST)
        outcome = controller.rollout(target.release("2", copy.deepcopy(releases["2"]), None, 5), None, passes(judged))
        assert outcome.status == "live", outcome.error
        assert judged == [(1, 1.0, 6)]  # 3 servers of two replica groups
        smoke = dict(outcome.events)["smoke_test"]
        assert smoke["url"] == f"http://127.0.0.1:{fake.data_plane.server_address[1]}"
        assert smoke["gateway"] == "gateway-system/inference" and smoke["release"] == R2
        # the answers before the data plane followed: no rule of the route served them (404), so
        # they proved nothing and were asked again
        assert smoke["tries"] == LAG + 1 and smoke["wrong"] == ["HTTP 404 without x-model-release"] * LAG
        # the fake's record: every check went through the Gateway naming release 2, and what passed
        # was answered by release 2's pods under its own rule, before the route gave it any share
        hits = fake.named_hits
        assert [h.named for h in hits] == [R2] * (LAG + 1)
        assert [(h.status, h.release) for h in hits] == [(404, None)] * LAG + [(200, "2")]
        assert hits[-1].answered_as == R2 and hits[-1].pod in {n for n in fake.names("pods", NS) if "-r2-" in n}
        assert [c.weights for c in fake.route_changes] == [{}, {R2: 10_000}]
        assert fake.route_changes[0].seq < hits[-1].seq < fake.route_changes[1].seq
        assert not [r for r in fake.requests if "/proxy/" in r.path]  # nothing through the service proxy
        assert route_now(fake) == ({R2: 10_000}, [R2])

        # verify, after it went live: the same path, the same proof
        verified = k8s_deploy.named_smoke(fake.client(), releases["2"], retry_delay_s=0.01)
        assert (verified.answered_by, verified.tries) == (R2, 1) and fake.named_hits[-1].release == "2"


def test_an_answer_from_another_release_fails_the_check_and_the_new_release_is_taken_down(releases):
    """Release 1 serves; the Gateway never applies release 2's rule within the deadline (a data plane
    that does not follow its route): a request naming release 2 falls to the default rule and release
    1's pods answer it. That is no proof of release 2, so the check fails, release 2 never gets a share,
    leaves the route and goes to zero, its objects kept; release 1 keeps serving throughout."""
    with FakeCluster() as fake:
        target = KubernetesTarget(fake.client(), **FAST, route_timeout_s=0.3)
        first = controller.rollout(target.release("1", copy.deepcopy(releases["1"]), None, 5), None, passes([]))
        assert first.status == "live", first.error
        fake.route_lag_requests = 10**9  # from here on the data plane keeps the rules it has
        steps = [
            ServerStep(fraction=0.5, old_servers=2, new_servers=2),
            ServerStep(fraction=1.0, old_servers=0, new_servers=3),
        ]
        second = controller.rollout(target.release("2", copy.deepcopy(releases["2"]), None, 5), steps, passes([]))
        assert second.status == "rolled_back"
        assert f"no answer from release {R2}" in second.error and "HTTP 200 without x-model-release" in second.error
        named = [h for h in fake.named_hits if h.named == R2]
        assert len(named) >= 2 and all((h.status, h.release, h.answered_as) == (200, "1", None) for h in named)
        assert [k for k, _ in second.events if k in ("traffic", "smoke_test")] == ["smoke_test"]  # failed, no share
        assert dict(second.events)["smoke_test"]["ok"] is False
        assert route_now(fake) == ({R1: 10_000}, [R1])  # release 2 out of the route, rule and all
        assert (
            fake.servers() == {"1": 3, "2": 0} and len([n for n in fake.names("deployments", NS) if "-r2-" in n]) == 2
        )
        assert all(h["1"] == 3 for h in fake.history)


STEPS = [
    ServerStep(fraction=0.5, old_servers=2, new_servers=2),
    ServerStep(fraction=1.0, old_servers=0, new_servers=3),
]


@pytest.mark.parametrize("lag", ["requests", "seconds"])
def test_a_step_is_judged_only_once_the_gateways_data_plane_serves_its_weights(releases, lag):
    """The Gateway accepts each route change at once (its status), but its data plane keeps routing
    by the previous weights for LAG requests, or for a while on its clock. The controller asks the
    Gateway's address (GET /v1/models; the default rule's answers carry its weights) until it
    serves the step's weights, so each step's analysis judges traffic the new release does get.
    Without that check the first step would be judged while every request still went to release 1."""
    seen: list[tuple[int, dict[str, int], dict[str, int]]] = []

    def judge(step: int, fraction: float, pods: int) -> StepAnalysis:
        seen.append((step, fake.served_weights(NS, ROUTE), route_now(fake)[0]))
        return StepAnalysis(step=step, fraction=fraction, window_s=1, passed=True, queries={})

    with FakeCluster() as fake:
        target = KubernetesTarget(fake.client(), **FAST, route_timeout_s=30)
        assert controller.rollout(target.release("1", copy.deepcopy(releases["1"]), None, 5)).status == "live"
        if lag == "requests":
            fake.route_lag_requests = LAG
        else:
            fake.route_lag_s = 0.2
        fake.probes.clear()
        outcome = controller.rollout(target.release("2", copy.deepcopy(releases["2"]), None, 5), STEPS, judge)
        assert outcome.status == "live", outcome.error
        half = {R1: 5000, R2: 5000}
        last = {R1: 0, R2: 10_000}
        assert seen == [(1, half, half), (2, last, last)]
        # after each change the checks saw the previous weights first, then the new ones (three
        # answers in a row before the next change): runs of one tag, in the order the route took them
        tags = [p.headers[manifests.WEIGHTS_HEADER] for p in fake.probes]
        runs = [(tag, len(list(group))) for tag, group in itertools.groupby(tags)]
        moved = [manifests.weights_tag(d["weights"]) for kind, d in outcome.events if kind == "traffic"]
        assert [tag for tag, _ in runs] == [
            manifests.weights_tag({R1: 10_000}),
            *[t for t, _ in itertools.groupby(moved)],
        ]
        assert all(n > 3 for _, n in runs[1:-1])
        # the last two changes send traffic alike (release 1 at 0, then out of the default rule): the
        # answers of either rule prove the second, three of each
        assert moved[-2:] == [f"{R2}=10000"] * 2 and runs[-1] == (f"{R2}=10000", 6)
        assert not fake.hits  # the checks are no client requests (no request metric counts them)


def test_a_data_plane_that_never_serves_the_steps_weights_fails_the_step_clearly(releases, monkeypatch):
    """After release 2's smoke passed, the Gateway's data plane stops following the route (its status
    still says Accepted): the first share never reaches release 2, so the step fails within the
    route timeout, naming the Gateway and what it served, before any analysis; the undo's weights
    (everything on release 1) are what the data plane still serves, so release 1 serves on."""
    real = k8s_deploy.named_smoke
    judged: list = []

    def then_stuck(*args, **kwargs):
        smoked = real(*args, **kwargs)
        fake.route_lag_requests = 10**9
        return smoked

    with FakeCluster() as fake:
        target = KubernetesTarget(fake.client(), **FAST, route_timeout_s=0.3)
        assert controller.rollout(target.release("1", copy.deepcopy(releases["1"]), None, 5)).status == "live"
        monkeypatch.setattr(k8s_deploy, "named_smoke", then_stuck)
        outcome = controller.rollout(target.release("2", copy.deepcopy(releases["2"]), None, 5), STEPS, passes(judged))
        assert outcome.status == "rolled_back" and judged == []
        assert outcome.error.startswith(
            f"HTTPRoute {NS}/{ROUTE}: accepted, but Gateway gateway-system/inference "
            f"(http://127.0.0.1:{fake.data_plane.server_address[1]}) did not serve its weights "
            f"{R1}=6667,{R2}=3333 within 0.3 s"
        ), outcome.error
        assert outcome.error.endswith(
            f"the last answered {R1}=10000): its data plane has not taken the change, so no traffic moved"
        )
        assert fake.served_weights(NS, ROUTE) == {R1: 10_000} and fake.servers() == {"1": 3, "2": 0}


def test_take_down_keeps_a_release_the_route_sends_traffic_to_and_zeroes_one_it_does_not(releases):
    """What promote does after an error the controller's undo never saw: a release with a share of
    the route keeps serving (zeroing it would drop its users' requests); one without goes out of the
    route and to zero, its objects kept."""
    with FakeCluster() as fake:
        target = KubernetesTarget(fake.client(), **FAST)
        assert controller.rollout(target.release("1", copy.deepcopy(releases["1"]), None, 5)).status == "live"
        serving = target.release("1", copy.deepcopy(releases["1"]), None, 5)
        serving.state()
        assert serving.take_down() is False and fake.servers() == {"1": 3}
        second = target.release("2", copy.deepcopy(releases["2"]), None, 5)
        second.state()
        second.start(1)  # applied, unexposed
        second._name_own()  # its own rule in the route, no share
        assert route_now(fake) == ({R1: 10_000}, [R1, R2])
        assert second.take_down() is True
        assert fake.servers() == {"1": 3, "2": 0} and route_now(fake) == ({R1: 10_000}, [R1])
        assert len([n for n in fake.names("deployments", NS) if "-r2-" in n]) == 2


def test_a_gateway_that_is_missing_or_has_no_address_is_named_in_one_line(releases):
    objs = copy.deepcopy(releases["1"])
    with FakeCluster(gateways=()) as fake:
        with pytest.raises(SmokeFailed) as missing:
            k8s_deploy.named_smoke(fake.client(), objs)
    assert str(missing.value) == (
        "Gateway gateway-system/inference: not found (promotion.gateway names it); create it first"
    )
    with FakeCluster() as fake:
        gateway = fake.get("gateways", "gateway-system", "inference")
        gateway["status"] = {"conditions": [{"type": "Programmed", "status": "False"}]}
        with pytest.raises(SmokeFailed) as unprogrammed:
            k8s_deploy.named_smoke(fake.client(), objs)
        assert str(unprogrammed.value) == (
            "Gateway gateway-system/inference: no address in its status (not programmed yet? "
            "conditions: Programmed=False)"
        )
        gateway["status"] = {"addresses": [{"type": "IPAddress", "value": "127.0.0.1"}]}
        gateway["spec"]["listeners"][0]["protocol"] = "TCP"
        with pytest.raises(SmokeFailed, match="^Gateway gateway-system/inference: no HTTP or HTTPS listener$"):
            k8s_deploy.named_smoke(fake.client(), objs)


def test_a_release_whose_undo_fails_before_it_took_traffic_still_gives_back_its_servers(releases, monkeypatch):
    """Release 2 fails its smoke; the undo's first route change (release 2 out of the route) fails
    once: the undo is a `rollback_failed`, but release 2 never had a share, so it goes to zero all
    the same (its objects kept) and release 1 serves on."""
    failed: list[dict] = []
    real = k8s_deploy.KubernetesRelease.route

    def fails_once(self, weights):
        if self.own not in weights and not failed:
            failed.append(weights)
            raise k8s_deploy.KubernetesError("PATCH httproutes: HTTP 500: etcdserver: request timed out", 500)
        return real(self, weights)

    with FakeCluster() as fake:
        target = KubernetesTarget(fake.client(), **FAST)
        assert controller.rollout(target.release("1", copy.deepcopy(releases["1"]), None, 5)).status == "live"
        fake.scenarios["2"] = "smoke_fails"
        monkeypatch.setattr(k8s_deploy.KubernetesRelease, "route", fails_once)
        steps = [ServerStep(fraction=1.0, old_servers=0, new_servers=3)]
        outcome = controller.rollout(target.release("2", copy.deepcopy(releases["2"]), None, 5), steps, passes([]))
    assert failed == [{R1: 10_000}]
    assert outcome.status == "failed" and "etcdserver" in outcome.error
    kinds = [k for k, _ in outcome.events]
    assert kinds[-2:] == ["rollback_failed", "scaled_to_zero"]
    assert fake.servers() == {"1": 3, "2": 0} and route_now(fake) == ({R1: 10_000}, [R1])
    assert len([n for n in fake.names("deployments", NS) if "-r2-" in n]) == 2
