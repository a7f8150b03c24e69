"""The cluster's Prometheus wiring (pipeline/k8s/monitoring.py), checked with Prometheus' own tools.

No cluster here: the pods' service-discovery labels are what Prometheus' Kubernetes discovery
would give the pods the rendered Deployments make (each pod label as `__meta_kubernetes_pod_label_`
+ its sanitised name, the namespace, pod name, container port name and phase), handed to the real
`prometheus` binary through file discovery, with the rendered scrape config's relabeling rules.
The rollout analysis' own PromQL then runs against that server.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import time

import pytest
import requests
import yaml

from pipeline.core.errors import PrometheusError
from pipeline.core.specs import load_spec
from pipeline.k8s import manifests, monitoring
from pipeline.release import analysis, local_prometheus
from pipeline.stages import serving
from tests.conftest import PROD_SPEC
from tests.test_rollout import FakeEngine


@pytest.fixture(scope="module")
def loaded():
    return load_spec(PROD_SPEC)


def test_the_pod_monitor_is_valid_against_the_operators_crd_schema(loaded):
    monitor = monitoring.pod_monitor(loaded)
    assert monitoring.validate_pod_monitor(monitor) == []
    # kube-prometheus-stack's default podMonitorSelector: its Helm release's name as `release`
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["namespace"] == loaded.spec.promotion.namespace
    # the schema is really applied: a wrong type and an unknown action are named
    broken = copy.deepcopy(monitor)
    endpoint = broken["spec"]["podMetricsEndpoints"][0]
    endpoint["relabelings"][0]["action"] = "copy"
    endpoint["interval"] = 30
    problems = monitoring.validate_pod_monitor(broken)
    assert any("relabelings.0.action: 'copy' is not one of" in p for p in problems), problems
    assert any("podMetricsEndpoints.0.interval" in p for p in problems), problems


def test_the_pod_monitor_and_the_scrape_config_map_labels_by_the_same_rules(loaded):
    camel = monitoring.pod_monitor(loaded)["spec"]["podMetricsEndpoints"][0]["relabelings"]
    snake = monitoring.scrape_config(loaded)["relabel_configs"]
    as_snake = [{re.sub(r"([A-Z])", r"_\1", k).lower(): v for k, v in rule.items()} for rule in camel]
    assert as_snake == snake[-len(as_snake) :]  # the plain config: the operator's selection first, then these
    assert {"target_label": "release", "action": "replace"}.items() <= as_snake[0].items()
    assert as_snake[0]["source_labels"] == ["__meta_kubernetes_pod_label_model_release_release_id"]


def test_promtool_accepts_the_rendered_scrape_config(loaded, tmp_path):
    """promtool checks every rule (its regexes compiled by Prometheus itself). Debian's build has no
    Kubernetes discovery ("field kubernetes_sd_configs not found"), so the check sees the rendered
    job with its discovery put in file form; the discovery block itself is two fixed keys."""
    job = monitoring.scrape_config(loaded)
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"names": ["llm-serving"]}}]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "*.json")]}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    job["relabel_configs"][0]["regex"] = "llm-(serving"  # and it does check them
    config.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    assert subprocess.run(["promtool", "check", "config", str(config)], capture_output=True).returncode == 1


def _discovered(pod: dict, port: int, phase: str = "Running") -> dict:
    """A file-discovery target group with the labels Prometheus' Kubernetes discovery gives `pod`."""
    labels = {monitoring.meta_label(k): v for k, v in pod["metadata"]["labels"].items()}
    labels |= {
        f"__meta_kubernetes_pod_labelpresent_{k.removeprefix('__meta_kubernetes_pod_label_')}": "true" for k in labels
    }
    container = pod["spec"]["containers"][0]
    return {
        "targets": [f"127.0.0.1:{port}"],
        "labels": {
            **labels,
            "__meta_kubernetes_namespace": pod["metadata"]["namespace"],
            "__meta_kubernetes_pod_name": pod["metadata"]["name"],
            "__meta_kubernetes_pod_container_name": container["name"],
            "__meta_kubernetes_pod_container_port_name": container["ports"][0]["name"],
            "__meta_kubernetes_pod_phase": phase,
        },
    }


def _pod(deployment: dict, index: int) -> dict:
    """A pod as the Deployment's ReplicaSet makes it: the template's labels and containers."""
    template = deployment["spec"]["template"]
    return {
        "metadata": {
            "name": f"{deployment['metadata']['name']}-7d9f8-{index}",
            "namespace": deployment["metadata"]["namespace"],
            "labels": template["metadata"]["labels"],
        },
        "spec": template["spec"],
    }


def _start_prometheus(root, relabel_configs) -> tuple[subprocess.Popen, str]:
    (root / "targets").mkdir(parents=True)
    config = root / "prometheus.yml"
    job = {
        "job_name": "pods",
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "file_sd_configs": [{"files": [str(root / "targets" / "*.json")], "refresh_interval": "1s"}],
        "relabel_configs": relabel_configs,
    }
    config.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    port = serving.free_port()
    proc = subprocess.Popen(
        [
            local_prometheus.binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "prometheus.log", "wb"),  # noqa: SIM115 - the server's for its life
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError((root / "prometheus.log").read_text()[-2000:])


@pytest.mark.parametrize("mapped", [True, False], ids=["rendered", "without-the-release-mapping"])
def test_the_analysis_finds_each_release_through_the_rendered_relabeling(loaded, tmp_path, mapped):
    """Two releases' pods and a pod of another app, discovered as the cluster would; the analysis'
    PromQL sees release 2's two engines up with their requests, and nothing of the other app. With
    the `release` mapping removed, the same analysis finds no engine of the release: the rule is
    what a rollout on the cluster stands on."""
    artifact = manifests.Artifact(nfs_path="/mnt/models/q", manifest_hash="b" * 64)
    options = manifests.RenderOptions(servers=1)
    relabel = monitoring.scrape_config(loaded)["relabel_configs"]
    if not mapped:
        relabel = [r for r in relabel if r.get("target_label") != "release"]
    engines = [FakeEngine(ttft=0.3, tpot=0.02, rate=20) for _ in range(4)]
    proc, url = _start_prometheus(tmp_path, relabel)
    try:
        new = [o for o in manifests.render(loaded, "tp4-ep4-x2", "2", artifact, options) if o["kind"] == "Deployment"]
        old = [o for o in manifests.render(loaded, "tp8-ep8", "1", artifact, options) if o["kind"] == "Deployment"]
        other = _pod(old[0], 9)
        other["metadata"]["labels"] = {**other["metadata"]["labels"], "app.kubernetes.io/instance": "another-model"}
        groups = [
            _discovered(_pod(new[0], 0), engines[0].port),
            _discovered(_pod(new[1], 0), engines[1].port),
            _discovered(_pod(old[0], 0), engines[2].port),
            _discovered(other, engines[3].port),
        ]
        (tmp_path / "targets" / "pods.json").write_text(json.dumps(groups))
        if mapped:
            analysis.wait_up(url, 'release="2"', 2, timeout=30)
            analysis.wait_up(url, 'release="1"', 1, timeout=30)
            time.sleep(4)  # a few scrapes of the fed histograms
        else:
            with pytest.raises(PrometheusError, match=r'0 of 2 engines \(release="2"\)'):
                analysis.wait_up(url, 'release="2"', 2, timeout=8)
        rollout = loaded.spec.rollout.model_copy(update={"min_requests": 5})
        verdict = analysis.analyze(url, 'release="2"', 'release="1"', 1, 0.5, 3, loaded.spec.slo, rollout)
        values = {k: q.value for k, q in verdict.queries.items()}
        up = requests.get(f"{url}/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
        assert len(up) == 3  # the other app's pod is not scraped
        if mapped:
            assert values["new_targets"] == 2 and values["new_requests"] > 5, values
            assert values["old_requests"] > 5 and 0.2 < values["new_p90_ttft"] <= 0.5, values
            assert verdict.passed, verdict.reasons
            assert {r["metric"]["layout"] for r in up} == {"tp4-ep4-x2", "tp8-ep8"}
            assert {r["metric"]["pod"] for r in up} >= {"qwen3-235b-a22b-fp8-r2-0-7d9f8-0"}
        else:
            assert values["new_targets"] is None and not verdict.passed
            assert "no engine of the new release is scraped" in " ".join(verdict.reasons)
    finally:
        proc.kill()  # its data is the test's alone; a loaded machine's shutdown can take 10 s
        proc.wait()
        for engine in engines:
            engine.stop()
