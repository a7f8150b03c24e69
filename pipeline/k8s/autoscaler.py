"""Scale-out of a release's serving fleet with KEDA: one ScaledObject per replica group, in lockstep.

Why KEDA and not an HPA on external metrics: an HPA reads external metrics only through an adapter
(prometheus-adapter) whose rules are cluster-wide configuration kube-prometheus-stack does not ship;
KEDA's Prometheus trigger carries its query in the object itself, next to the release it scales,
and KEDA has what a rollout needs: pause at a given replica count (`paused-replicas`) and resume,
and a fallback count when Prometheus does not answer. Under it KEDA still drives a plain HPA
(`keda-hpa-*`, named here), so scaling follows Kubernetes' own replica formula and behaviour.

Why one ScaledObject per replica group: each group is its own Deployment (manifests.py) and a
ScaledObject scales exactly one `scaleTargetRef`; KEDA has nothing that fans one count out to
several Deployments. So every group gets the same trigger, target, bounds and behaviour, and the
query answers a whole number: the servers the model's traffic needs at the target,
`ceil(demand / target)` with threshold 1. For an AverageValue metric the HPA proposes
ceil(value / threshold) whenever value / (threshold x current) is off 1 by more than its
tolerance, which the behaviour sets to 0 (Kubernetes' HPAConfigurableTolerance, beta in 1.34): so
every group's HPA proposes that same number whatever its current count. On a cluster without the
gate the field is dropped and the default 10% applies: groups that start equal still move together,
a count may lag one server behind above 10 servers (capacity counts that 10% against the spare),
and groups that differ converge below 10 servers.

Demand is the model's finished requests per second (vLLM's `request_success_total` of every
pod serving the model in the namespace, whichever release): a fleet past its capacity finishes at
its capacity, which is still above the target (utilisation < 1), so it keeps scaling out. An empty
answer (no engine scraped) is an error, not zero: after three failures KEDA sets the fallback
count (the peak's servers), never fewer than are running.

During a rollout the controller owns replica counts: a release's ScaledObjects are applied born
paused (`paused-replicas`) and every count the controller sets goes through `pause` first; `resume`
hands the count back to the scaler once the release carries the traffic (docs/production.md).
Meanwhile a spike is the controller's to meet: it asks the paused scalers' own query
(`KubernetesRelease.demand`) and grows the fleet to what it needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import LoadedSpec, duration_seconds
from pipeline.k8s import crds
from pipeline.stages import capacity

__all__ = [
    "KEDA_API",
    "OWNER",
    "PAUSED",
    "PAUSED_REPLICAS",
    "Patch",
    "demand_query",
    "is_paused",
    "operator_paused",
    "pause",
    "resume",
    "scaled_objects",
    "servers_query",
    "validate",
]

KEDA_API = "keda.sh/v1alpha1"  # the vendored CRD: KEDA v2.20.2
PAUSED_REPLICAS = "autoscaling.keda.sh/paused-replicas"
PAUSED = "autoscaling.keda.sh/paused"
OWNER = "model-release/paused-for"  # the release whose rollout paused a scaler: only those are resumed
DEMAND = "vllm:request_success_total"  # every finished request, whatever its finished_reason
POLLING_S = 30  # KEDA's default; with min >= 1 it only paces the fallback's failure count
FALLBACK_FAILURES = 3
MERGE_PATCH = "application/merge-patch+json"


class Patch(NamedTuple):
    """One request the controller sends through its Kubernetes client (kubeapi's `_call`)."""

    path: str
    body: dict[str, Any]
    content_type: str = MERGE_PATCH


def demand_query(loaded: LoadedSpec) -> str:
    """The model's finished requests per second, every serving pod of every release in the namespace
    (the PodMonitor adds `namespace`; vLLM labels `model_name` with the served name, the spec's)."""
    spec = loaded.spec
    window = capacity.rate_window_s(duration_seconds(spec.rollout.scrape_interval))
    selector = f'namespace="{spec.promotion.namespace}",model_name="{spec.name}"'
    return f"sum(rate({DEMAND}{{{selector}}}[{window}s]))"


def servers_query(loaded: LoadedSpec, target_rps: float) -> str:
    """Servers the demand needs at `target_rps` each: the trigger's value, a whole number."""
    return f"ceil({demand_query(loaded)} / {target_rps:.6g})"


def scaled_objects(
    loaded: LoadedSpec,
    deployments: list[dict[str, Any]],
    rate_per_server: float,
    *,
    paused_replicas: int | None = None,
) -> list[dict[str, Any]]:
    """One ScaledObject per replica group's Deployment (`manifests.render`'s), all alike but their
    target; `paused_replicas` applies them paused at that count (a rollout's new release)."""
    spec = loaded.spec
    scaling = capacity.scaling(loaded, rate_per_server, None, "not needed to render")
    if scaling is None:
        raise ReleaseError(f"{loaded.path}: capacity.autoscale: missing; the spec asks for no autoscaler")
    if scaling.min_servers > scaling.max_servers:
        raise ReleaseError(
            f"{loaded.path}: capacity.max_servers {scaling.max_servers}: the mean rate needs {scaling.min_servers} "
            f"servers at the autoscale target ({scaling.target_rps:.3g} req/s each)"
        )
    prometheus = spec.rollout.prometheus_url
    if not prometheus:
        raise ReleaseError(f"{loaded.path}: rollout.prometheus_url: missing; the scaler's trigger queries it")
    targets = [d for d in deployments if d.get("kind") == "Deployment"]
    if not targets:
        raise ReleaseError("no Deployment to scale: pass manifests.render's objects")
    trigger = {
        "type": "prometheus",
        "name": "servers-wanted",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": prometheus,
            "query": servers_query(loaded, scaling.target_rps),
            "threshold": "1",
            "ignoreNullValues": "false",
        },
    }
    behavior = {
        # no limit on the way up: a spike's lead time is already longer than one would wish
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "tolerance": "0",
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": scaling.max_servers, "periodSeconds": 15}],
        },
        # a server given back takes a whole lead time to return: keep the highest count of a spike's span
        "scaleDown": {
            "stabilizationWindowSeconds": max(300, scaling.spike_within_s),
            "tolerance": "0",
            "selectPolicy": "Min",
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        },
    }
    out = []
    for deployment in targets:
        meta = deployment["metadata"]
        annotations = {PAUSED_REPLICAS: str(paused_replicas)} if paused_replicas is not None else {}
        out.append(
            {
                "apiVersion": KEDA_API,
                "kind": "ScaledObject",
                "metadata": {
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "labels": dict(meta.get("labels") or {}),
                    **({"annotations": annotations} if annotations else {}),
                },
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"]},
                    "pollingInterval": POLLING_S,
                    "minReplicaCount": scaling.min_servers,
                    "maxReplicaCount": scaling.max_servers,
                    "fallback": {
                        "failureThreshold": FALLBACK_FAILURES,
                        "replicas": scaling.fallback_servers,
                        "behavior": "currentReplicasIfHigher",
                    },
                    "advanced": {
                        "restoreToOriginalReplicaCount": False,
                        # KEDA's default `keda-hpa-<name>` would pass 63 characters for long release ids
                        "horizontalPodAutoscalerConfig": {"name": meta["name"], "behavior": behavior},
                    },
                    "triggers": [trigger],
                },
            }
        )
    return out


def validate(objs: list[dict[str, Any]]) -> list[str]:
    """Problems against KEDA's CRD schema and the name rules its admission webhook adds."""
    problems = []
    for obj in objs:
        problems += crds.problems(obj)
        name = obj["metadata"]["name"]
        low, high = obj["spec"].get("minReplicaCount", 0), obj["spec"].get("maxReplicaCount", 100)
        if low > high:  # the CRD's CEL rule, which a JSON-schema validator does not run
            problems.append(f"ScaledObject/{name}: minReplicaCount {low} is above maxReplicaCount {high}")
        hpa = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("name") or f"keda-hpa-{name}"
        for what, value in (("name", name), ("HPA name", hpa)):
            if len(value) > 63:
                problems.append(f"ScaledObject/{name}: {what} {value!r} is longer than 63 (KEDA's webhook refuses it)")
    return problems


def _path(scaler: dict[str, Any]) -> str:
    meta = scaler["metadata"]
    return f"/apis/{KEDA_API}/namespaces/{meta['namespace']}/scaledobjects/{meta['name']}"


def operator_paused(scaler: dict[str, Any]) -> bool:
    """Paused by someone else (an operator's `paused` or `paused-replicas`, with no rollout's
    OWNER annotation): a rollout leaves it paused and never resumes it."""
    annotations = scaler["metadata"].get("annotations") or {}
    return OWNER not in annotations and (PAUSED_REPLICAS in annotations or PAUSED in annotations)


def pause(scalers: list[dict[str, Any]], replicas: int, owner: str = "") -> list[Patch]:
    """The patches that stop a release's scalers and hold every group at `replicas` (KEDA deletes
    the HPAs and scales each target to it); send them before any scale the controller makes.
    Each carries OWNER (`owner`: the release rolled out) so only what a rollout paused is resumed;
    a scaler an operator paused is left as it is (no patch)."""
    if replicas < 0:
        raise ReleaseError(f"pause: replicas must be 0 or more, got {replicas}")
    body = {"metadata": {"annotations": {PAUSED_REPLICAS: str(replicas), OWNER: owner or "rollout"}}}
    return [Patch(_path(s), body) for s in scalers if not operator_paused(s)]


def resume(scalers: list[dict[str, Any]]) -> list[Patch]:
    """The patches that hand a release's counts back to its scalers: only those a rollout paused
    (OWNER), their count and OWNER removed; an operator's own `paused` is never touched."""
    body = {"metadata": {"annotations": {PAUSED_REPLICAS: None, OWNER: None}}}
    return [Patch(_path(s), body) for s in scalers if OWNER in (s["metadata"].get("annotations") or {})]


def is_paused(scaler: dict[str, Any], replicas: int | None = None) -> bool:
    """KEDA has acted on a pause, as the ScaledObject's status says (Paused condition True and, with
    `replicas`, the paused count recorded): only then is the count the controller's."""
    status = scaler.get("status") or {}
    paused = any(c.get("type") == "Paused" and c.get("status") == "True" for c in status.get("conditions") or [])
    return paused and (replicas is None or status.get("pausedReplicaCount") == replicas)
