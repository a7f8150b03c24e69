"""The fleet's KEDA autoscaler (pipeline/k8s/autoscaler.py): rendered for the production spec,
validated against KEDA's own CRD schema, its replica groups in lockstep, its trigger's PromQL run by
Prometheus' own `promtool test rules`, and the pause / resume the rollout controller sends."""

from __future__ import annotations

import copy
import math
import subprocess

import pytest
import yaml

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import load_spec
from pipeline.k8s import autoscaler, manifests
from pipeline.stages import capacity
from tests.conftest import PROD_SPEC

RATE = 18.1  # req/s per server of tp4-ep4-x2 (the capacity tests' given rate)
ARTIFACT = manifests.Artifact(nfs_path="/mnt/models/q", manifest_hash="c" * 64)


@pytest.fixture(scope="module")
def loaded():
    return load_spec(PROD_SPEC)


@pytest.fixture(scope="module")
def rendered(loaded):
    """The release's objects as a rollout applies them: 3 servers per group, scalers born paused at 3."""
    options = manifests.RenderOptions(servers=3, autoscale_rate=RATE)
    return manifests.render(loaded, "tp4-ep4-x2", "manual__2026-12-05T11:00:00+00:00", ARTIFACT, options)


def _kinds(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_the_production_autoscaler_is_one_valid_scaled_object_per_replica_group(loaded, rendered):
    deployments, scalers = _kinds(rendered, "Deployment"), _kinds(rendered, "ScaledObject")
    assert manifests.validate(rendered) == [] and autoscaler.validate(scalers) == []
    # each group's Deployment is the target of exactly one scaler, named after it (and its HPA too)
    assert [s["spec"]["scaleTargetRef"]["name"] for s in scalers] == [d["metadata"]["name"] for d in deployments]
    assert len(scalers) == 2  # tp4-ep4-x2: two replica groups
    auto = loaded.spec.capacity.autoscale
    target = RATE * auto.utilisation
    for scaler in scalers:
        spec = scaler["spec"]
        # min: the mean at the target; max: capacity.max_servers; fallback: the peak at the target
        assert spec["minReplicaCount"] == math.ceil(loaded.spec.capacity.mean_rps / target)
        assert spec["maxReplicaCount"] == loaded.spec.capacity.max_servers
        assert spec["fallback"]["replicas"] == math.ceil(loaded.spec.capacity.peak_rps / target)
        trigger = spec["triggers"][0]
        assert trigger["metadata"]["query"].endswith(f"/ {target:.6g})") and trigger["metadata"]["threshold"] == "1"
        assert trigger["metadata"]["serverAddress"] == loaded.spec.rollout.prometheus_url
        # born paused at the count the controller gave the Deployment
        assert scaler["metadata"]["annotations"] == {autoscaler.PAUSED_REPLICAS: "3"}
    assert all(d["spec"]["replicas"] == 3 for d in deployments)


def test_kedas_schema_is_really_applied(rendered):
    scaler = copy.deepcopy(_kinds(rendered, "ScaledObject")[0])
    scaler["spec"]["fallback"]["behavior"] = "sometimes"
    scaler["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # an unquoted YAML number: KEDA takes strings
    scaler["spec"]["pollingInterval"] = 0
    del scaler["spec"]["scaleTargetRef"]["name"]
    problems = autoscaler.validate([scaler])
    for where in ("fallback.behavior", "triggers.0.metadata.threshold", "pollingInterval", "scaleTargetRef: 'name'"):
        assert any(where in p for p in problems), (where, problems)
    scaler = copy.deepcopy(_kinds(rendered, "ScaledObject")[0])
    scaler["spec"]["minReplicaCount"] = 17  # the CRD's CEL rule, checked by hand
    assert any("minReplicaCount 17 is above maxReplicaCount 16" in p for p in autoscaler.validate([scaler]))


def hpa_proposal(current: int, value: float, threshold: float, low: int, high: int, tolerance: float = 0.1) -> int:
    """Kubernetes' replica count for an AverageValue external metric (replica_calculator.go,
    GetExternalPerPodMetricReplicas: keep the count inside the tolerance, else ceil(value /
    threshold)), within the HPA's bounds: what each group's `keda-hpa-*` does with KEDA's value."""
    ratio = value / (threshold * current)
    proposal = current if abs(1.0 - ratio) <= tolerance else math.ceil(value / threshold)
    return min(high, max(low, proposal))


def test_the_replica_groups_scale_in_lockstep(loaded, rendered):
    """Every group's scaler is the same but for its target, and the value each HPA gets is the
    number of servers wanted. Through a spike from the mean to 1.5 x the peak and back, with the
    rendered zero tolerance both groups' HPAs propose exactly that count at every evaluation, even
    from counts that differ (one group's HPA evaluated before a change, the other after). Where the
    cluster keeps the default 10%, groups that start equal still never part, and differing ones
    meet below 10 servers; the raw rate with the per-server target as threshold (the obvious
    trigger) leaves them apart inside the tolerance."""
    scalers = _kinds(rendered, "ScaledObject")

    def without_target(s: dict) -> dict:
        s = copy.deepcopy(s)
        del s["spec"]["scaleTargetRef"]["name"], s["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["name"]
        del s["metadata"]["name"], s["metadata"]["labels"][f"{manifests.FIELD_PREFIX}/replica-group"]
        return s

    assert without_target(scalers[0]) == without_target(scalers[1])
    spec = scalers[0]["spec"]
    low, high = spec["minReplicaCount"], spec["maxReplicaCount"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    tolerance = float(behavior["scaleUp"]["tolerance"])
    assert tolerance == float(behavior["scaleDown"]["tolerance"]) == 0
    target = RATE * loaded.spec.capacity.autoscale.utilisation
    cap = loaded.spec.capacity
    demand = [cap.mean_rps + (cap.peak_rps * 1.5 - cap.mean_rps) * min(t, 40) / 40 for t in range(60)]
    demand += demand[::-1]  # up over 10 minutes of 15 s evaluations, held, and down again

    def replay(start: tuple[int, int], tolerance: float) -> list[tuple[int, int, int]]:
        a, b, out = *start, []
        for rps in demand:
            wanted = min(high, max(low, math.ceil(rps / target)))  # the trigger's value (PromQL: promtool below)
            a = hpa_proposal(a, wanted, 1, low, high, tolerance)
            b = hpa_proposal(b, wanted, 1, low, high, tolerance)
            out.append((wanted, a, b))
        return out

    for start in [(low, low), (low, low + 1), (8, 12), (12, 8), (high, low)]:
        assert all(a == b == wanted for wanted, a, b in replay(start, tolerance)), start
    default = replay((low, low), 0.1)
    assert all(a == b and a * 1.1 >= wanted for wanted, a, b in default)
    assert any(a < wanted for wanted, a, _ in default)  # the lag capacity counts against the spare
    assert all(a == b for wanted, a, b in replay((8, 9), 0.1)[1:] if wanted < 10)
    # the obvious trigger: 8.5 servers' worth of traffic holds groups at 8 and 9 where they are
    raw = 8.5 * target
    assert (hpa_proposal(8, raw, target, low, high), hpa_proposal(9, raw, target, low, high)) == (8, 9)


def _series(labels: dict[str, str], per_second: float) -> dict:
    """A counter scraped every 15 s growing at `per_second`, as promtool's series notation."""
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{autoscaler.DEMAND}{{{text}}}", "values": f"0+{per_second * 15:g}x60"}


def _promtool(tmp_path, query: str, expected: list[dict]) -> subprocess.CompletedProcess:
    """`promtool test rules` on synthetic series: two groups' pods of the new release, a pod of the
    old one still serving, aborted requests, and the same counter of another model in the namespace
    and of this model in another namespace; the query evaluated at 10 minutes."""
    model, ns = "qwen3-235b-a22b-fp8", "llm-serving"
    own = {"namespace": ns, "model_name": model, "finished_reason": "stop"}
    series = [
        _series({**own, "pod": f"{model}-r2-0-7d9f8-0", "release": "2", "engine": "0"}, 14.0),
        _series({**own, "pod": f"{model}-r2-1-5c4b2-0", "release": "2", "engine": "0"}, 13.5),
        _series({**own, "pod": f"{model}-r1-0-1a2b3-0", "release": "1", "engine": "0"}, 10.0),
        _series({**own, "finished_reason": "abort", "pod": f"{model}-r2-0-7d9f8-0", "release": "2"}, 0.5),
        _series({**own, "model_name": "another-model", "pod": "another-model-r4-0-x", "release": "4"}, 50.0),
        _series({**own, "namespace": "llm-staging", "pod": f"{model}-r9-0-y", "release": "9"}, 50.0),
    ]
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [{"expr": query, "eval_time": "10m", "exp_samples": expected}],
            }
        ],
    }
    path = tmp_path / "scaler_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_the_trigger_query_with_promtool(loaded, rendered, tmp_path):
    """The rendered query counts every finished request of the model in its namespace, whichever
    release and group served it (38 req/s: 3.5 servers at 10.86 -> 4), nothing of another model or
    namespace; with either matcher removed Prometheus answers otherwise and promtool fails."""
    query = _kinds(rendered, "ScaledObject")[0]["spec"]["triggers"][0]["metadata"]["query"]
    target = RATE * loaded.spec.capacity.autoscale.utilisation
    wanted = math.ceil((14.0 + 13.5 + 10.0 + 0.5) / target)
    assert wanted == 4
    done = _promtool(tmp_path, query, [{"labels": "{}", "value": wanted}])
    assert done.returncode == 0, done.stdout + done.stderr
    for matcher in ('namespace="llm-serving",', ',model_name="qwen3-235b-a22b-fp8"'):
        assert matcher in query
        broken = _promtool(tmp_path, query.replace(matcher, ""), [{"labels": "{}", "value": wanted}])
        assert broken.returncode == 1 and "FAILED" in broken.stdout + broken.stderr, matcher
    # no engine scraped: an empty answer (not 0), which ignoreNullValues: false makes an error -> fallback
    nothing = query.replace('namespace="llm-serving"', 'namespace="nowhere"')
    done = _promtool(tmp_path, nothing, [])
    assert done.returncode == 0, done.stdout + done.stderr


def _merge(obj: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch, as the API server applies application/merge-patch+json."""
    out = copy.deepcopy(obj)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif isinstance(value, dict):
            out[key] = _merge({}, value)
        else:
            out[key] = value
    return out


def _keda_pauses(obj: dict) -> bool:
    """KEDA's NeedToBePausedByAnnotation (apis/keda/v1alpha1/scaledobject_types.go, v2.20.2)."""
    annotations = obj["metadata"].get("annotations") or {}
    return autoscaler.PAUSED_REPLICAS in annotations or annotations.get(autoscaler.PAUSED, "false") == "true"


def test_pause_and_resume_are_the_patches_keda_acts_on(rendered):
    scalers = _kinds(rendered, "ScaledObject")
    live = [_merge(s, {"metadata": {"annotations": None}}) for s in scalers]  # resumed after an earlier rollout
    assert not any(_keda_pauses(s) for s in live)
    patches = autoscaler.pause(live, 5, "7")
    assert [p.path for p in patches] == [
        f"/apis/keda.sh/v1alpha1/namespaces/llm-serving/scaledobjects/{s['metadata']['name']}" for s in scalers
    ]
    assert {p.content_type for p in patches} == {"application/merge-patch+json"}
    paused = [_merge(s, p.body) for s, p in zip(live, patches, strict=True)]
    ours = {autoscaler.PAUSED_REPLICAS: "5", autoscaler.OWNER: "7"}  # marked as release 7's rollout's pause
    assert all(_keda_pauses(s) and s["metadata"]["annotations"] == ours for s in paused)
    # a scaler an operator paused (`paused: "true"`, or a count of theirs) is left alone, and never resumed
    for theirs in ({autoscaler.PAUSED: "true"}, {autoscaler.PAUSED_REPLICAS: "2"}):
        by_hand = _merge(live[0], {"metadata": {"annotations": theirs}})
        assert autoscaler.operator_paused(by_hand)
        assert autoscaler.pause([by_hand], 5, "7") == [] and autoscaler.resume([by_hand]) == []
    resumed = [_merge(s, p.body) for s, p in zip(paused, autoscaler.resume(paused), strict=True)]
    assert not any(_keda_pauses(s) for s in resumed) and all(s["metadata"]["annotations"] == {} for s in resumed)
    assert resumed[0]["spec"] == scalers[0]["spec"]  # the scaler itself untouched
    # KEDA's status tells the controller when the count is its own
    status = {"conditions": [{"type": "Paused", "status": "True"}], "pausedReplicaCount": 5}
    assert autoscaler.is_paused({**paused[0], "status": status}, 5)
    assert not autoscaler.is_paused({**paused[0], "status": status}, 4)
    assert not autoscaler.is_paused(paused[0])  # KEDA has not acted yet
    with pytest.raises(ReleaseError, match="replicas must be 0 or more"):
        autoscaler.pause(live, -1)


def test_a_spec_without_autoscale_or_prometheus_is_named(loaded, spec_file):
    deployments = [o for o in manifests.render(loaded, "tp8-ep8", "3", ARTIFACT) if o["kind"] == "Deployment"]
    assert not _kinds(manifests.render(loaded, "tp8-ep8", "3", ARTIFACT), "ScaledObject")  # none unless asked
    plain = load_spec(spec_file(PROD_SPEC, lambda d: d["capacity"].pop("autoscale")))
    with pytest.raises(ReleaseError, match=r"capacity.autoscale: missing"):
        autoscaler.scaled_objects(plain, deployments, RATE)
    # a Kubernetes spec must name it (validate refuses one without); a preview of a local spec need not
    rollout = loaded.spec.rollout.model_copy(update={"prometheus_url": None})
    blind = loaded.model_copy(update={"spec": loaded.spec.model_copy(update={"rollout": rollout})})
    with pytest.raises(ReleaseError, match=r"rollout.prometheus_url: missing"):
        autoscaler.scaled_objects(blind, deployments, RATE)
    small = load_spec(spec_file(PROD_SPEC, lambda d: d["capacity"].update(max_servers=4), name="small.yaml"))
    with pytest.raises(ReleaseError, match=r"capacity.max_servers 4: the mean rate needs 7 servers"):
        autoscaler.scaled_objects(small, deployments, RATE)
    assert capacity.scaling(small, RATE, None, "-").problems()[0].startswith("the mean rate needs 7 servers")
