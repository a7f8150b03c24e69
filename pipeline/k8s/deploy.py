"""Roll a release out to a cluster with the official `kubernetes` client, and back when it fails.

Objects go in by server-side apply (what `kubectl apply --server-side` sends): the API server
merges our fields, records `model-release` as their manager, and an apply of the same objects
twice changes nothing. Requests are made with the client's `call_api` on the objects' REST
paths rather than through `DynamicClient`, which needs API discovery first and adds nothing
for the four kinds a release has; authentication and TLS stay the client's.

A deploy is: check the API server answers, remove this model's Deployments the new layout
does not have, apply, wait for every Deployment to roll out, send one completion through the
Service. If anything after the first change fails, the previous release's objects are
applied again the same way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from pipeline.core import platform
from pipeline.core.errors import ReleaseError

log = logging.getLogger(__name__)

FIELD_MANAGER = "model-release"
APPLY_PATCH = "application/apply-patch+yaml"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
RELEASE_ANNOTATION = "model-release/release-id"
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
}
LOG_EVERY_S = 30.0


class KubernetesError(ReleaseError):
    """The API server answered with an error status."""

    def __init__(self, message: str, status: int):
        self.status = status
        super().__init__(message)


class ClusterUnreachable(ReleaseError):
    """No answer from the API server (refused, timed out, TLS): nothing was changed."""


class RolloutFailed(ReleaseError):
    """A Deployment did not become available in time, or Kubernetes gave up on its progress."""


class SmokeFailed(ReleaseError):
    """The live Service did not answer a completion."""


class DeployOutcome(BaseModel):
    """What a deploy did, for the caller to record; events are in the order they happened."""

    status: Literal["live", "rolled_back", "failed"]
    events: list[tuple[str, dict[str, Any]]] = Field(default_factory=list)
    error: str | None = Field(None, description="why the release is not live; None when it is")


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


# ---------------------------------------------------------------- apply and wait


def apply(
    api, objs: list[dict], field_manager: str = FIELD_MANAGER, timeout_s: float = 3600.0, poll_s: float = 5.0
) -> list[dict]:
    """Server-side apply every object in order, then wait until each Deployment has rolled out.
    Returns the objects as the server holds them after the apply."""
    applied = []
    for obj in objs:
        applied.append(
            _call(
                api,
                "PATCH",
                object_path(obj),
                body=obj,
                content_type=APPLY_PATCH,
                query={"fieldManager": field_manager, "force": "true"},
            )
        )
        log.info("applied %s", _describe(obj))
    wait_rollout(api, [obj for obj in objs if obj["kind"] == "Deployment"], timeout_s, poll_s)
    return applied


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


def prune(api, keep: list[dict]) -> list[str]:
    """Delete this model's Deployments that `keep` does not have; returns their names.

    Runs before an apply, not after: on one server the replica groups of the old layout hold
    the GPUs the new layout's pods need (TP8 after 2 x TP4 cannot schedule while one TP4 runs).
    """
    deployments = [obj for obj in keep if obj["kind"] == "Deployment"]
    if not deployments:
        return []
    meta = deployments[0]["metadata"]
    selector = ",".join(f"{key}={meta['labels'][key]}" for key in (INSTANCE_LABEL, MANAGED_BY_LABEL))
    listing = _call(
        api, "GET", f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments", query={"labelSelector": selector}
    )
    wanted = {d["metadata"]["name"] for d in deployments}
    stale = sorted(
        item["metadata"]["name"] for item in listing.get("items", []) if item["metadata"]["name"] not in wanted
    )
    for name in stale:
        _call(
            api,
            "DELETE",
            f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{name}",
            query={"propagationPolicy": "Background"},
        )
        log.info("deleted Deployment %s/%s (not in the layout being applied)", meta["namespace"], name)
    return stale


# ---------------------------------------------------------------- smoke test


def smoke(
    api,
    namespace: str,
    service: str,
    port: int,
    model: str,
    timeout_s: float = 120.0,
    retries: int = 3,
    retry_delay_s: float = 2.0,
) -> str:
    """One short completion through the API server's service proxy: proves the Service reaches a
    pod that serves this model, without a route from here into the cluster network. A 503 (no
    ready endpoints yet, right after the rollout) is retried a few times; returns the text."""
    path = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy/v1/completions"
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    for attempt in range(retries + 1):
        try:
            answer = _call(api, "POST", path, body=body, timeout_s=timeout_s)
            break
        except KubernetesError as exc:
            if exc.status != 503 or attempt == retries:
                raise SmokeFailed(f"smoke test through Service {namespace}/{service}:{port}: {exc}") from None
            time.sleep(retry_delay_s)
    choices = answer.get("choices") or []
    if not choices:
        raise SmokeFailed(
            f"smoke test through Service {namespace}/{service}:{port}: expected choices in the "
            f"completion, got {json.dumps(answer)[:300]}"
        )
    return str(choices[0].get("text", ""))


def _smoke_target(manifests: list[dict]) -> tuple[str, str, int, str]:
    """(namespace, service, port, served model name) from the rendered objects."""
    service = next((obj for obj in manifests if obj["kind"] == "Service"), None)
    deployment = next((obj for obj in manifests if obj["kind"] == "Deployment"), None)
    if service is None or deployment is None:
        raise ReleaseError(
            "manifests: expected at least one Deployment and a Service (see pipeline.k8s.manifests.render)"
        )
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    model = argv[argv.index("--served-model-name") + 1]
    meta = service["metadata"]
    return meta["namespace"], meta["name"], int(service["spec"]["ports"][0]["port"]), model


def _progress_deadline(manifests: list[dict]) -> float:
    deadlines = [obj["spec"].get("progressDeadlineSeconds", 600) for obj in manifests if obj["kind"] == "Deployment"]
    return float(max(deadlines, default=600) + 60)


def _release_id(manifests: list[dict]) -> str | None:
    for obj in manifests:
        release = (obj["metadata"].get("annotations") or {}).get(RELEASE_ANNOTATION)
        if release:
            return release
    return None


# ---------------------------------------------------------------- the target


class KubernetesTarget:
    """Deploys rendered manifests; returns to the previous release's when the new one fails."""

    def __init__(
        self,
        api,
        field_manager: str = FIELD_MANAGER,
        poll_s: float = 5.0,
        smoke_timeout_s: float = 120.0,
        smoke_retry_delay_s: float = 2.0,
    ):
        self.api = api
        self.field_manager = field_manager
        self.poll_s = poll_s
        self.smoke_timeout_s = smoke_timeout_s
        self.smoke_retry_delay_s = smoke_retry_delay_s

    @classmethod
    def from_connection(cls, conn_id: str | None = None, **kwargs: Any) -> KubernetesTarget:
        return cls(api_client(conn_id), **kwargs)

    def check_reachable(self) -> str:
        """The server's version; ClusterUnreachable when it does not answer."""
        version = _call(self.api, "GET", "/version", timeout_s=15).get("gitVersion", "?")
        log.info("Kubernetes API %s answers (version %s)", self.api.configuration.host, version)
        return version

    def deploy(
        self, release_id: str, manifests: list[dict], previous: list[dict] | None = None, timeout_s: float | None = None
    ) -> DeployOutcome:
        """Make `manifests` live, or leave the previous release's objects live and say why.

        Raises ClusterUnreachable before changing anything when the API server does not answer;
        every later failure is an outcome ("rolled_back", or "failed" with no previous release).
        The rollout timeout defaults to the Deployments' own progress deadline (sized by render
        for image pull, weight fetch and model load).
        """
        timeout_s = timeout_s or _progress_deadline(manifests)
        self.check_reachable()
        namespace, service, port, model = _smoke_target(manifests)
        events: list[tuple[str, dict[str, Any]]] = [
            (
                "deploy_started",
                {
                    "release_id": release_id,
                    "namespace": namespace,
                    "server": self.api.configuration.host,
                    "objects": [f"{obj['kind']}/{obj['metadata']['name']}" for obj in manifests],
                    "previous_release": _release_id(previous or []),
                },
            )
        ]
        started = time.monotonic()
        try:
            removed = prune(self.api, manifests)
            apply(self.api, manifests, self.field_manager, timeout_s, self.poll_s)
        except Exception as exc:
            events.append(("rollout_failed", {"error": str(exc), "seconds": round(time.monotonic() - started, 1)}))
            return self._fail(exc, previous, events, timeout_s)
        events.append(
            (
                "rollout_complete",
                {
                    "deployments": [obj["metadata"]["name"] for obj in manifests if obj["kind"] == "Deployment"],
                    "removed": removed,
                    "seconds": round(time.monotonic() - started, 1),
                },
            )
        )
        try:
            text = smoke(
                self.api, namespace, service, port, model, self.smoke_timeout_s, retry_delay_s=self.smoke_retry_delay_s
            )
        except Exception as exc:
            events.append(("smoke_test", {"ok": False, "error": str(exc)}))
            return self._fail(exc, previous, events, timeout_s)
        events.append(("smoke_test", {"ok": True, "service": f"{namespace}/{service}:{port}", "text": text[:200]}))
        log.info("release %s is live in %s", release_id, namespace)
        return DeployOutcome(status="live", events=events)

    def _fail(self, exc: Exception, previous: list[dict] | None, events: list, timeout_s: float) -> DeployOutcome:
        """Apply the previous release again; with none, the failed objects stay for inspection."""
        if not isinstance(exc, ReleaseError):
            log.error("deploy failed on an unexpected error", exc_info=exc)
        error = str(exc)
        if not previous:
            log.error("deploy failed and there is no previous release to return to: %s", error)
            return DeployOutcome(status="failed", events=events, error=error)
        to_release = _release_id(previous)
        log.warning("deploy failed (%s); rolling back to release %s", error, to_release)
        events.append(("rollback_started", {"to_release": to_release, "reason": error}))
        started = time.monotonic()
        try:
            removed = prune(self.api, previous)
            apply(self.api, previous, self.field_manager, timeout_s, self.poll_s)
        except Exception as rollback_exc:
            events.append(("rollback_failed", {"to_release": to_release, "error": str(rollback_exc)}))
            return DeployOutcome(
                status="failed",
                events=events,
                error=f"{error}; rollback to release {to_release} failed: {rollback_exc}",
            )
        events.append(
            (
                "rollback_complete",
                {"to_release": to_release, "removed": removed, "seconds": round(time.monotonic() - started, 1)},
            )
        )
        return DeployOutcome(status="rolled_back", events=events, error=error)
