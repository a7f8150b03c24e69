"""The cluster's API as the rollout uses it: the client, one request, object paths, listing, and
the wait for Deployments to roll out.

Requests are made with the official client's `call_api` on the objects' REST paths (see
`pipeline.k8s.deploy` for why not `DynamicClient`); authentication and TLS stay the client's.
Writes (apply, scale, delete) are in `pipeline.k8s.deploy`, beside the release that makes them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from pipeline.core import platform
from pipeline.core.errors import ClusterUnreachable, KubernetesError, ReleaseError, RolloutFailed
from pipeline.k8s import autoscaler

log = logging.getLogger(__name__)

FIELD_MANAGER = "model-release"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "HTTPRoute": "httproutes",
    "ScaledObject": "scaledobjects",
}
LOG_EVERY_S = 30.0


# ---------------------------------------------------------------- client and requests


def api_client(conn_id: str | None = None):
    """A `kubernetes.client.ApiClient`: from the Airflow connection when one is named and the
    cncf-kubernetes provider is importable, else in-cluster config, else kubeconfig."""
    from kubernetes import client, config

    if conn_id and (api := platform.current().kubernetes_api(conn_id)) is not None:
        log.info("Kubernetes API %s (connection %r)", api.configuration.host, conn_id)
        return api
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
        source = "in-cluster service account"
    except config.ConfigException:
        try:
            # KUBECONFIG read now, not when the kubernetes package was imported
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            raise ReleaseError(
                "no Kubernetes credentials: name an Airflow connection (cncf-kubernetes), "
                f"set KUBECONFIG, or run inside the cluster ({exc})"
            ) from None
        source = "kubeconfig"
    log.info("Kubernetes API %s (%s)", configuration.host, source)
    return client.ApiClient(configuration)


def _call(
    api,
    method: str,
    path: str,
    body: Any = None,
    query: dict[str, str] | None = None,
    content_type: str = "application/json",
    timeout_s: float = 30.0,
) -> dict:
    """One request through the client (its auth and TLS); JSON answer as a dict."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        response = api.call_api(
            path,
            method,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout_s,
        )
    except ApiException as exc:
        raise KubernetesError(f"{method} {path}: HTTP {exc.status}: {_api_message(exc)}", exc.status) from None
    except urllib3.exceptions.HTTPError as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ClusterUnreachable(
            f"Kubernetes API server {api.configuration.host} did not answer {method} {path}: {reason}"
        ) from None
    return json.loads(response.data) if response.data else {}


def _api_message(exc) -> str:
    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason)[:300]


def object_path(obj: dict) -> str:
    """The REST path of a namespaced object: /api/v1/... for the core group, /apis/GROUP/VERSION/... else."""
    kind, meta = obj["kind"], obj["metadata"]
    if kind not in PLURALS:
        raise ReleaseError(f"{kind}/{meta.get('name')}: cannot apply this kind (expected one of {', '.join(PLURALS)})")
    group_version = obj["apiVersion"]
    root = f"/apis/{group_version}" if "/" in group_version else f"/api/{group_version}"
    return f"{root}/namespaces/{meta['namespace']}/{PLURALS[kind]}/{meta['name']}"


def _describe(obj: dict) -> str:
    return f"{obj['kind']} {obj['metadata'].get('namespace')}/{obj['metadata']['name']}"


# ---------------------------------------------------------------- wait


def rolled_out(deployment: dict) -> bool:
    """What `kubectl rollout status` waits for: the controller saw the latest spec, and every
    replica is updated and available with no old one left."""
    want = deployment.get("spec", {}).get("replicas", 1)
    status = deployment.get("status") or {}
    return (
        status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
        and status.get("updatedReplicas", 0) == status.get("availableReplicas", 0) == want
        and status.get("replicas", 0) == want
    )


def _stalled(deployment: dict) -> bool:
    """Kubernetes itself declared no progress within the Deployment's progressDeadlineSeconds."""
    return any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in (deployment.get("status") or {}).get("conditions", [])
    )


def status_line(deployment: dict) -> str:
    status = deployment.get("status") or {}
    conditions = (
        "; ".join(
            f"{c.get('type')}={c.get('status')} ({c.get('reason')}: {c.get('message')})"
            for c in status.get("conditions", [])
        )
        or "none"
    )
    return (
        f"generation {deployment['metadata'].get('generation')} observed {status.get('observedGeneration')}, "
        f"want {deployment.get('spec', {}).get('replicas', 1)} replicas: updated {status.get('updatedReplicas', 0)}, "
        f"available {status.get('availableReplicas', 0)}, total {status.get('replicas', 0)}; conditions: {conditions}"
    )


def wait_rollout(api, deployments: list[dict], timeout_s: float, poll_s: float = 5.0) -> None:
    """Poll each Deployment until it has rolled out; RolloutFailed names the first that has not."""
    started = last_log = time.monotonic()
    pending = {object_path(d): d for d in deployments}
    current: dict[str, dict] = {}
    if pending:
        log.info("rollout: waiting up to %.0f s for %s", timeout_s, ", ".join(_describe(d) for d in deployments))
    while pending:
        for path in list(pending):
            current[path] = _call(api, "GET", path)
            if rolled_out(current[path]):
                log.info("rollout: %s available after %.0f s", _describe(pending.pop(path)), time.monotonic() - started)
            elif _stalled(current[path]):
                raise RolloutFailed(
                    f"{_describe(pending[path])}: Kubernetes reports no progress: {status_line(current[path])}"
                )
        elapsed = time.monotonic() - started
        if pending and elapsed > timeout_s:
            path = next(iter(pending))
            raise RolloutFailed(
                f"{_describe(pending[path])} not rolled out after {timeout_s:g} s: {status_line(current[path])}"
            )
        if pending and time.monotonic() - last_log >= LOG_EVERY_S:
            last_log = time.monotonic()
            log.info(
                "rollout: %d of %d Deployments available, %.0f s of %.0f s; waiting on %s",
                len(deployments) - len(pending),
                len(deployments),
                elapsed,
                timeout_s,
                ", ".join(f"{pending[p]['metadata']['name']} ({status_line(current[p])})" for p in pending),
            )
        if pending:
            time.sleep(poll_s)


# ---------------------------------------------------------------- list


LISTED = {  # plural -> (group/version, kind) of what a deploy lists
    "deployments": ("apps/v1", "Deployment"),
    "poddisruptionbudgets": ("policy/v1", "PodDisruptionBudget"),
    "services": ("v1", "Service"),
    "scaledobjects": (autoscaler.KEDA_API, "ScaledObject"),
    "pods": ("v1", "Pod"),
}


def listing(api, namespace: str, plural: str, selector: dict[str, str]) -> list[dict]:
    group_version, kind = LISTED[plural]
    root = f"/apis/{group_version}" if "/" in group_version else f"/api/{group_version}"
    query = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())}
    items = _call(api, "GET", f"{root}/namespaces/{namespace}/{plural}", query=query).get("items", [])
    for item in items:  # a List's items carry no kind / apiVersion
        item.setdefault("kind", kind)
        item.setdefault("apiVersion", group_version)
        item["metadata"].setdefault("namespace", namespace)
    return items
