"""Rollout, smoke test and rollback against an in-process fake of the Kubernetes API server,
through the real `kubernetes` client."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from pipeline.core.spec import load_spec
from pipeline.k8s import deploy, manifests
from pipeline.k8s.deploy import ClusterUnreachable, KubernetesTarget, RolloutFailed
from tests.conftest import PROD_SPEC
from tests.k8s_fake import FakeCluster, dead_url

NS = "llm-serving"
FAST = {"poll_s": 0.01, "smoke_retry_delay_s": 0.01}


@pytest.fixture(scope="module")
def releases():
    """r1 serves one TP8 replica; r2 moves to two TP4 replica groups."""
    loaded = load_spec(PROD_SPEC)

    def artifact(h):
        return manifests.Artifact(nfs_path=f"/mnt/models/qwen3-{h[:6]}", manifest_hash=h * 32)

    return {
        "r1": manifests.render(loaded, "tp8-ep8", "r1", artifact("a1")),
        "r2": manifests.render(loaded, "tp4-ep4-x2", "r2", artifact("b2")),
    }


@pytest.fixture
def fake():
    with FakeCluster() as cluster:
        yield cluster


def live(fake, objs, release_id):
    outcome = KubernetesTarget(fake.client(), **FAST).deploy(release_id, objs, None, timeout_s=5)
    assert outcome.status == "live", outcome.error
    fake.requests.clear()


def names(outcome):
    return [name for name, _ in outcome.events]


def test_success_goes_live_by_server_side_apply(fake, releases):
    outcome = KubernetesTarget(fake.client(), **FAST).deploy("r2", releases["r2"], None, timeout_s=5)
    assert outcome.status == "live" and outcome.error is None
    assert names(outcome) == ["deploy_started", "rollout_complete", "smoke_test"]
    smoke = dict(outcome.events)["smoke_test"]
    assert smoke["ok"] is True and smoke["text"] == " Paris."
    patches = [r for r in fake.requests if r.method == "PATCH"]
    assert len(patches) == len(releases["r2"])
    assert all(
        r.content_type == "application/apply-patch+yaml"
        and r.field_manager == "model-release"
        and r.query["force"] == "true"
        for r in patches
    )
    assert fake.names("deployments", NS) == ["qwen3-235b-a22b-fp8-0", "qwen3-235b-a22b-fp8-1"]
    assert fake.get("services", NS, "qwen3-235b-a22b-fp8")["spec"]["selector"]["model-release/release-id"] == "r2"
    assert fake.names("persistentvolumeclaims", NS) and fake.names("poddisruptionbudgets", NS)
    proxied = [r for r in fake.requests if r.method == "POST"]
    assert [r.path for r in proxied] == [
        f"/api/v1/namespaces/{NS}/services/qwen3-235b-a22b-fp8:8000/proxy/v1/completions"
    ]


def test_applying_the_same_objects_again_changes_no_generation(fake, releases):
    api = fake.client()
    deploy.apply(api, releases["r1"], timeout_s=5, poll_s=0.01)
    first = fake.get("deployments", NS, "qwen3-235b-a22b-fp8-0")["metadata"]["generation"]
    deploy.apply(api, releases["r1"], timeout_s=5, poll_s=0.01)
    assert fake.get("deployments", NS, "qwen3-235b-a22b-fp8-0")["metadata"]["generation"] == first
    deploy.apply(api, releases["r2"][:2], timeout_s=5, poll_s=0.01)  # claim and group 0 of the new layout
    assert fake.get("deployments", NS, "qwen3-235b-a22b-fp8-0")["metadata"]["generation"] == first + 1


def test_a_rollout_that_never_becomes_ready_rolls_back_to_the_previous_release(fake, releases):
    live(fake, releases["r1"], "r1")
    fake.scenarios["r2"] = "never_ready"
    outcome = KubernetesTarget(fake.client(), **FAST).deploy("r2", releases["r2"], releases["r1"], timeout_s=0.3)
    assert outcome.status == "rolled_back"
    assert names(outcome) == ["deploy_started", "rollout_failed", "rollback_started", "rollback_complete"]
    assert "qwen3-235b-a22b-fp8-0 not rolled out after 0.3 s" in outcome.error
    assert "MinimumReplicasUnavailable" in outcome.error and "available 0" in outcome.error
    assert dict(outcome.events)["rollback_complete"]["removed"] == ["qwen3-235b-a22b-fp8-1"]
    # the previous release is back, with its labels, and the new layout's extra group is gone
    assert fake.names("deployments", NS) == ["qwen3-235b-a22b-fp8-0"]
    restored = fake.get("deployments", NS, "qwen3-235b-a22b-fp8-0")
    assert restored["metadata"]["labels"]["model-release/release-id"] == "r1"
    assert restored["metadata"]["labels"]["model-release/layout"] == "tp8-ep8"
    assert restored["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"amd.com/gpu": 8}
    assert fake.get("services", NS, "qwen3-235b-a22b-fp8")["spec"]["selector"]["model-release/release-id"] == "r1"


def test_a_failure_without_a_previous_release_is_failed(fake, releases):
    fake.scenario = "never_ready"
    outcome = KubernetesTarget(fake.client(), **FAST).deploy("r2", releases["r2"], None, timeout_s=0.2)
    assert outcome.status == "failed"
    assert names(outcome) == ["deploy_started", "rollout_failed"]
    assert "not rolled out" in outcome.error


def test_a_failed_smoke_test_rolls_back(fake, releases):
    live(fake, releases["r1"], "r1")
    fake.scenarios["r2"] = "smoke_fails"
    outcome = KubernetesTarget(fake.client(), **FAST).deploy("r2", releases["r2"], releases["r1"], timeout_s=5)
    assert outcome.status == "rolled_back"
    assert names(outcome) == [
        "deploy_started",
        "rollout_complete",
        "smoke_test",
        "rollback_started",
        "rollback_complete",
    ]
    assert dict(outcome.events)["smoke_test"]["ok"] is False
    assert "HTTP 500" in outcome.error and "EngineCore died" in outcome.error
    assert (
        fake.get("deployments", NS, "qwen3-235b-a22b-fp8-0")["metadata"]["labels"]["model-release/release-id"] == "r1"
    )
    assert fake.names("deployments", NS) == ["qwen3-235b-a22b-fp8-0"]


def test_an_unreachable_api_server_raises_before_anything_changes(fake, releases):
    live(fake, releases["r1"], "r1")
    before = fake.snapshot()
    url = dead_url()
    target = KubernetesTarget(client.ApiClient(client.Configuration(host=url)), **FAST)
    with pytest.raises(ClusterUnreachable, match=f"Kubernetes API server {url} did not answer"):
        target.deploy("r2", releases["r2"], releases["r1"], timeout_s=5)
    assert fake.snapshot() == before and fake.requests == []


def test_rollout_failed_names_the_deployment_and_its_conditions(fake, releases):
    fake.scenario = "never_ready"
    with pytest.raises(RolloutFailed) as failed:
        deploy.apply(fake.client(), releases["r1"], timeout_s=0.1, poll_s=0.01)
    message = str(failed.value)
    assert message.startswith(f"Deployment {NS}/qwen3-235b-a22b-fp8-0 not rolled out")
    assert "Available=False (MinimumReplicasUnavailable" in message
    assert isinstance(failed.value, deploy.ReleaseError)


def test_smoke_returns_the_completion_and_fails_on_a_wrong_model(fake, releases):
    api = fake.client()
    deploy.apply(api, releases["r1"], timeout_s=5, poll_s=0.01)
    assert deploy.smoke(api, NS, "qwen3-235b-a22b-fp8", 8000, "qwen3-235b-a22b-fp8") == " Paris."
    with pytest.raises(deploy.SmokeFailed, match="HTTP 404.*does not exist"):
        deploy.smoke(api, NS, "qwen3-235b-a22b-fp8", 8000, "other-model", retry_delay_s=0.01)


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
    api = deploy.api_client(None)
    assert api.configuration.host == fake.url
    outcome = KubernetesTarget(api, **FAST).deploy("r1", releases["r1"], None, timeout_s=5)
    assert outcome.status == "live"
    assert {r.authorization for r in fake.requests} == {"Bearer s3cr3t-token"}
    assert "s3cr3t" not in caplog.text and fake.url in caplog.text


def test_api_client_from_an_airflow_connection(fake, tmp_path, monkeypatch):
    pytest.importorskip("airflow.providers.cncf.kubernetes")
    path = write_kubeconfig(tmp_path, fake.url)
    monkeypatch.setenv(
        "AIRFLOW_CONN_FAKE_K8S", json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(path)}})
    )
    api = deploy.api_client("fake_k8s")
    assert api.configuration.host == fake.url
    assert KubernetesTarget(api).check_reachable() == "v1.31.0-fake"
