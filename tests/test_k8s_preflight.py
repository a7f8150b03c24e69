"""Preflight against the fake API server holding the platform install the project renders plus what
the cluster itself manages: the whole passes; each case takes exactly one piece away and exactly its
check fails, with a line naming the object, what is wrong and the fix (so removing a check fails its
case). The bad-input cases are one line each, never a traceback."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from pipeline import cli
from pipeline.core.specs import load_spec
from pipeline.k8s import crds, install, preflight
from pipeline.k8s.pods import ClusterSettings
from testkit import http_stub
from tests.conftest import PROD_SPEC
from tests.k8s_fake import FakeCluster, dead_url, plural_of

GW = "gateway.networking.k8s.io/v1"
PROM = ("kube-prometheus-stack", "kube-prometheus-stack-prometheus")


def small_fleet(data):
    data["capacity"]["max_servers"] = 2  # + rollout.spare_servers 1: 3 servers at once


def node(name: str, gpus: int = 8) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"doks.digitalocean.com/gpu-model": "mi325x"}},
        "spec": {"taints": [{"key": "amd.com/gpu", "value": "true", "effect": "NoSchedule"}]},
        "status": {"allocatable": {"amd.com/gpu": str(gpus), "cpu": "126", "memory": "2Ti"}},
    }


def cluster_managed() -> list[dict]:
    """What DOKS, kube-prometheus-stack and KEDA hold, not the install: CRDs, the class, GPU nodes."""
    crd_kinds = [(GW, "Gateway"), (GW, "HTTPRoute"), ("monitoring.coreos.com/v1", "PodMonitor")]
    crd_kinds.append(("keda.sh/v1alpha1", "ScaledObject"))
    objs = [crds.definition(*kind) for kind in crd_kinds]
    objs.append(
        {
            "apiVersion": GW,
            "kind": "GatewayClass",
            "metadata": {"name": "cilium"},
            "spec": {"controllerName": "io.cilium/gateway-controller"},
            "status": {
                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}],
                "supportedFeatures": [
                    {"name": "Gateway"},
                    {"name": "HTTPRoute"},
                    {"name": "HTTPRouteRequestTimeout"},
                    {"name": "HTTPRouteResponseHeaderModification"},
                ],
            },
        }
    )
    objs += [node(f"mi325x-{i}") for i in range(3)]
    objs.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PROM[0]}})
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": PROM[1], "namespace": PROM[0]},
            "spec": {"selector": {"app": "prometheus"}, "ports": [{"port": 9090}]},
        }
    )
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "spaces-default-s3", "namespace": "model-release"},
            "data": {"AWS_ACCESS_KEY_ID": "a2V5", "AWS_SECRET_ACCESS_KEY": "c2VjcmV0"},
        }
    )
    return objs


def prometheus_answer() -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()


@pytest.fixture
def spec(spec_file):
    return spec_file(PROD_SPEC, small_fleet)


@pytest.fixture
def cluster(spec, tmp_path, monkeypatch):
    """The fake API server with the rendered install applied and a kubeconfig pointing at it."""
    options = install.PlatformOptions(nfs_server="10.110.0.10", nfs_path="/2633050/model-release")
    objs = install.render(load_spec(spec), options)
    assert install.validate(objs) == []
    stub = http_stub.serve(prometheus_answer, content_type="application/json")
    with FakeCluster() as fake:
        fake.install(objs + cluster_managed())
        fake.service_urls[PROM] = f"http://127.0.0.1:{stub.server_address[1]}"
        kubeconfig(tmp_path, fake.url, monkeypatch)
        yield fake
    stub.shutdown()


def kubeconfig(tmp_path, server: str, monkeypatch, context: str | None = "fake") -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "sre", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "sre"}}],
    }
    if context:
        config["current-context"] = context
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for name in ("MODEL_RELEASE_NAMESPACE", "MODEL_RELEASE_PVC"):
        monkeypatch.delenv(name, raising=False)


def run_cli(spec) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["preflight", str(spec), "--kubeconfig"])
    return code, out.getvalue(), err.getvalue()


def failing(err: str) -> dict[str, list[str]]:
    lines = [line for line in err.splitlines() if ": " in line and not line.startswith("error:")]
    out: dict[str, list[str]] = {}
    for line in lines:
        name = line.split(": ", 1)[0]
        if name in preflight.CHECKS or name == "api":
            out.setdefault(name, []).append(line)
    return out


def test_the_rendered_install_on_a_cluster_passes_every_check(cluster, spec):
    code, out, err = run_cli(spec)
    assert code == 0, err
    assert out.startswith(f"preflight passed ({len(preflight.CHECKS) + 1} checks): api, namespaces, access")
    assert "Traceback" not in err
    # the workers' rights were asked for the workers' account, not the caller's
    reviews = [r for r in cluster.requests if r.path.endswith("/subjectaccessreviews")]
    assert reviews and all(r.authorization == "Bearer t0ken" for r in reviews)


def _key(obj_kind: str, api_version: str, namespace: str, name: str) -> tuple:
    return (api_version, plural_of(obj_kind), namespace, name)


def no_gateway(fake):
    del fake.objects[_key("Gateway", GW, "gateway-system", "inference")]


def listener_from_same(fake):
    gateway = fake.objects[_key("Gateway", GW, "gateway-system", "inference")]
    gateway["spec"]["listeners"][0]["allowedRoutes"]["namespaces"] = {"from": "Same"}


def worker_lacks_route_patch(fake):
    role = fake.objects[
        _key("Role", "rbac.authorization.k8s.io/v1", "llm-serving", "model-release-qwen3-235b-a22b-fp8")
    ]
    rule = next(r for r in role["rules"] if r["resources"] == ["httproutes"])
    rule["verbs"].remove("patch")


def no_httproute_crd(fake):
    del fake.objects[
        _key("CustomResourceDefinition", "apiextensions.k8s.io/v1", "", "httproutes.gateway.networking.k8s.io")
    ]


def no_podmonitor_crd(fake):
    del fake.objects[
        _key("CustomResourceDefinition", "apiextensions.k8s.io/v1", "", "podmonitors.monitoring.coreos.com")
    ]


def read_write_many_only_volume(fake):
    volume = fake.objects[_key("PersistentVolume", "v1", "", "qwen3-235b-a22b-fp8-models")]
    volume["spec"]["accessModes"] = ["ReadWriteMany"]


def one_gpu_node(fake):
    for name in ("mi325x-1", "mi325x-2"):
        del fake.objects[_key("Node", "v1", "", name)]


def no_s3_secret(fake):
    del fake.objects[_key("Secret", "v1", "model-release", "spaces-default-s3")]


def prometheus_down(fake):
    fake.service_urls[PROM] = dead_url()


def no_serving_namespace(fake):
    del fake.objects[_key("Namespace", "v1", "", "llm-serving")]


def class_not_accepted(fake):
    cls = fake.objects[_key("GatewayClass", GW, "", "cilium")]
    cls["status"]["conditions"][0].update(status="False", reason="InvalidParameters", message="bad parameters")


def class_without_timeouts(fake):
    cls = fake.objects[_key("GatewayClass", GW, "", "cilium")]
    cls["status"]["supportedFeatures"] = [
        {"name": "Gateway"},
        {"name": "HTTPRoute"},
        {"name": "HTTPRouteResponseHeaderModification"},
    ]


def class_without_response_headers(fake):
    """The named-release rules' answer header is how a check knows which release answered."""
    cls = fake.objects[_key("GatewayClass", GW, "", "cilium")]
    cls["status"]["supportedFeatures"] = [
        {"name": "Gateway"},
        {"name": "HTTPRoute"},
        {"name": "HTTPRouteRequestTimeout"},
    ]


CASES = {
    "no Gateway": (no_gateway, "gateway", "Gateway gateway-system/inference (promotion.gateway): not found"),
    "a listener with from: Same": (
        listener_from_same,
        "listener",
        "no listener admits HTTPRoutes from namespace llm-serving (http (from: Same))",
    ),
    "a verb the workers' account lacks": (
        worker_lacks_route_patch,
        "access",
        "ServiceAccount model-release/airflow-worker: may not patch httproutes.gateway.networking.k8s.io "
        "in llm-serving",
    ),
    "no HTTPRoute CRD": (
        no_httproute_crd,
        "crds",
        "CustomResourceDefinition httproutes.gateway.networking.k8s.io: not found",
    ),
    "no PodMonitor CRD with monitoring on": (
        no_podmonitor_crd,
        "crds",
        "CustomResourceDefinition podmonitors.monitoring.coreos.com: not found",
    ),
    "a ReadWriteMany-only volume": (
        read_write_many_only_volume,
        "weights",
        "access modes ['ReadWriteMany'] lack ReadOnlyMany",
    ),
    "one GPU node for a rollout of 3": (
        one_gpu_node,
        "gpus",
        "up to 3 servers at once (capacity.max_servers 2 + rollout.spare_servers 1) of 8 amd.com/gpu each (24); "
        "nodes with doks.digitalocean.com/gpu-model=mi325x hold 1 (8 allocatable amd.com/gpu on 1 schedulable",
    ),
    "a missing Secret": (no_s3_secret, "secrets", "Secret model-release/spaces-default-s3"),
    "Prometheus down": (prometheus_down, "prometheus", "does not answer through the API server's service proxy"),
    "no serving namespace": (
        no_serving_namespace,
        "namespaces",
        "Namespace llm-serving (promotion.namespace): not found",
    ),
    "a GatewayClass not Accepted": (class_not_accepted, "gateway-class", "GatewayClass cilium: not Accepted"),
    "a class without request timeouts": (
        class_without_timeouts,
        "route-features",
        "does not support HTTPRouteRequestTimeout",
    ),
    "a class that cannot set the answer's header": (
        class_without_response_headers,
        "route-features",
        "does not support HTTPRouteResponseHeaderModification",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_missing_piece_fails_its_own_check_in_one_line(cluster, spec, case):
    take_away, check, says = CASES[case]
    take_away(cluster)
    code, out, err = run_cli(spec)
    assert code == 1 and out == ""
    found = failing(err)
    assert set(found) == {check}, err  # that check, and only it
    assert any(says in line for line in found[check]), found[check]
    assert "Traceback" not in err


def test_a_live_release_prometheus_does_not_scrape_is_named(cluster, spec):
    cluster.objects[("apps/v1", "deployments", "llm-serving", "qwen3-235b-a22b-fp8-r7-0")] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "qwen3-235b-a22b-fp8-r7-0",
            "namespace": "llm-serving",
            "labels": {"app.kubernetes.io/instance": "qwen3-235b-a22b-fp8", "model-release/release-id": "7"},
            "uid": "u",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": {"replicas": 2, "selector": {"matchLabels": {}}, "template": {"metadata": {}, "spec": {}}},
        "status": {},
    }
    code, _, err = run_cli(spec)
    assert code == 1
    assert set(failing(err)) == {"prometheus"}
    assert "scrapes no engine of live release 7" in err


def test_a_missing_airflow_connection_is_named_where_connections_are_readable(spec):
    loaded = load_spec(spec)
    cluster = preflight.Cluster(connections={"kubernetes_default": True, "spaces_default": False})
    ctx = preflight.Context(loaded, ClusterSettings(), "airflow-worker")
    assert preflight.check_connections(ctx, cluster) == [
        "Airflow connection 'spaces_default': not defined: add it (Admin > Connections, or "
        "AIRFLOW_CONN_SPACES_DEFAULT in the Helm values' env)"
    ]
    assert preflight.check_connections(ctx, preflight.Cluster(connections={"spaces_default": None})) == []


# ---------------------------------------------------------------- bad input: one line each


def test_an_unreachable_api_server_is_one_line(spec, tmp_path, monkeypatch):
    kubeconfig(tmp_path, dead_url(), monkeypatch)
    code, out, err = run_cli(spec)
    assert code == 1 and out == ""
    assert "api: Kubernetes API server" in err and "did not answer GET /version" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2  # "error: preflight failed:" + the line


def test_a_kubeconfig_without_a_context_is_one_line(spec, tmp_path, monkeypatch):
    kubeconfig(tmp_path, "http://127.0.0.1:1", monkeypatch, context=None)
    code, out, err = run_cli(spec)
    assert code == 1 and out == ""
    assert err.startswith("error: no Kubernetes credentials") and "current-context" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_forbidden_list_is_one_line(cluster, spec):
    cluster.forbidden.add("/api/v1/nodes")
    code, _, err = run_cli(spec)
    assert code == 1
    assert failing(err) == {"gpus": [line for line in err.splitlines() if line.startswith("gpus: ")]}
    assert "gpus: cannot read /api/v1/nodes: forbidden for this caller" in err
    assert "Traceback" not in err


def test_a_spec_that_promotes_to_no_cluster_is_refused_in_one_line():
    """The embedded default's spec promotes locally: neither an install nor a preflight means anything for it."""
    from tests.conftest import TINY_SPEC

    for argv in (["preflight", str(TINY_SPEC)], ["platform", str(TINY_SPEC), "--nfs-server", "h", "--nfs-path", "/p"]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        assert code == 1 and out.getvalue() == "", argv
        assert err.getvalue().strip() == (
            f"error: {TINY_SPEC}: promotion.target is 'local': the cluster's install and preflight are for a spec "
            "that promotes to Kubernetes"
        )
