"""Roll a release out to a cluster with the official `kubernetes` client, in steps, beside the live one.

Objects go in by server-side apply (what `kubectl apply --server-side` sends): the API server
merges our fields, records `model-release` as their manager, and an apply of the same objects
twice changes nothing; replicas change through the scale subresource (what `kubectl scale`
sends). Requests are made with the client's `call_api` on the objects' REST paths rather than
through `DynamicClient`, which needs API discovery first and adds nothing for the kinds a
release has; authentication and TLS stay the client's.

A deploy (KubernetesTarget.deploy) is: check the API server answers, delete what earlier
releases left scaled to zero, start the new release's first servers beside the live release,
smoke-test them through the release's own Service, then move step by step (new servers up in
waves, old ones down as the new are ready, as many kept as the spare budget allows), judging each
step on live metrics; the old release scales to zero only after the last step's analysis passed,
and its objects stay until the next release prunes them. Any failure gives the old release its
servers back before the new one scales to zero.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

from pydantic import BaseModel, Field

from pipeline.core import platform
from pipeline.core.errors import ReleaseError, RolloutAborted
from pipeline.k8s.manifests import RELEASE_LABEL, TOKENIZER_INFO_FLAG, WEIGHT_TOTAL
from pipeline.stages.evaluate import Endpoint
from pipeline.stages.served_accuracy import Answers

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


ROLLOUT_ANNOTATION = "model-release/rollout"


class RolloutRecord(BaseModel):
    """What a rollout's undo needs and the cluster alone does not say, kept as an annotation on the
    new release's Deployments before anything else changes: a controller that dies (its task
    killed) leaves it for `KubernetesTarget.recover`."""

    replacing: str | None = Field(description="the release that served when the rollout started")
    live_servers: int = Field(description="its servers then: what an undo gives it back")
    full: int = Field(description="the new release's servers for all the traffic")
    spare: int = Field(description="rollout.spare_servers")


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


# ---------------------------------------------------------------- smoke test


def service_endpoint(api, namespace: str, service: str, port: int) -> Endpoint:
    """A Service's engine as lm-eval reaches it: through the API server's service proxy, with the
    client's own credentials (its bearer token, refreshed as the client refreshes it) and CA, so
    the check needs no route into the cluster network, like the smoke test."""
    configuration = api.configuration
    headers = {
        auth["key"].title() if auth["key"].lower() == "authorization" else auth["key"]: auth["value"]
        for auth in configuration.auth_settings().values()
        if auth.get("in") == "header" and auth.get("value")
    }
    return Endpoint(
        url=f"{configuration.host.rstrip('/')}/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy",
        headers=headers,
        ca_cert=configuration.ssl_ca_cert,
        verify=bool(configuration.verify_ssl),
    )


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


def _engine_argv(deployment: dict) -> list[str]:
    """The engine command a rendered Deployment's pods run."""
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def _smoke_target(manifests: list[dict]) -> tuple[str, str, int, str]:
    """(namespace, service, port, served model name) from the rendered objects."""
    service = next((obj for obj in manifests if obj["kind"] == "Service"), None)
    deployment = next((obj for obj in manifests if obj["kind"] == "Deployment"), None)
    if service is None or deployment is None:
        raise ReleaseError(
            "manifests: expected at least one Deployment and a Service (see pipeline.k8s.manifests.render)"
        )
    argv = _engine_argv(deployment)
    model = argv[argv.index("--served-model-name") + 1]
    meta = service["metadata"]
    return meta["namespace"], meta["name"], int(service["spec"]["ports"][0]["port"]), model


def _progress_deadline(manifests: list[dict]) -> float:
    deadlines = [obj["spec"].get("progressDeadlineSeconds", 600) for obj in manifests if obj["kind"] == "Deployment"]
    return float(max(deadlines, default=600) + 60)


# ---------------------------------------------------------------- scale, list, delete


def scale(api, deployment: dict, replicas: int) -> None:
    """What `kubectl scale` sends: a merge patch of the Deployment's scale subresource."""
    _call(
        api,
        "PATCH",
        object_path(deployment) + "/scale",
        body={"spec": {"replicas": replicas}},
        content_type=MERGE_PATCH,
    )
    deployment.setdefault("spec", {})["replicas"] = replicas


def listing(api, namespace: str, plural: str, selector: dict[str, str]) -> list[dict]:
    group = (
        "/apis/apps/v1"
        if plural == "deployments"
        else "/apis/policy/v1"
        if plural == "poddisruptionbudgets"
        else "/api/v1"
    )
    query = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())}
    items = _call(api, "GET", f"{group}/namespaces/{namespace}/{plural}", query=query).get("items", [])
    for item in items:  # a List's items carry no kind / apiVersion
        item.setdefault("kind", {"deployments": "Deployment", "services": "Service"}.get(plural, "PodDisruptionBudget"))
        item.setdefault("apiVersion", group.removeprefix("/apis/").removeprefix("/api/"))
        item["metadata"].setdefault("namespace", namespace)
    return items


def delete(api, obj: dict) -> None:
    _call(api, "DELETE", object_path(obj), query={"propagationPolicy": "Background"})
    log.info("deleted %s", _describe(obj))


# ---------------------------------------------------------------- the progressive rollout


class ServerStep(BaseModel):
    """One step of a rollout in servers (pods per replica group): what runs once it is reached."""

    fraction: float = Field(gt=0, le=1, description="the spec's share of traffic for this step")
    old_servers: int = Field(ge=0)
    new_servers: int = Field(ge=1)


class Verdict(Protocol):
    """A step's analysis (pipeline.release.analysis.StepAnalysis): passed or not, and why."""

    passed: bool
    reasons: list[str]

    def summary(self) -> str: ...

    def model_dump(self) -> dict[str, Any]: ...


# (step number, its traffic fraction, the new release's pods now): the step's verdict
Judge = Callable[[int, float, int], Verdict]


class AnswersWorse(ReleaseError):
    """The new release's served answers failed the step's accuracy check."""


def _own_service(manifests: list[dict]) -> str:
    """The release's own Service (it selects the release's pods only), as opposed to the stable one."""
    return next(
        o["metadata"]["name"]
        for o in manifests
        if o["kind"] == "Service" and RELEASE_LABEL in o["spec"].get("selector", {})
    )


def _release_of(obj: dict) -> str:
    return (obj["metadata"].get("labels") or {}).get(RELEASE_LABEL, "")


class KubernetesTarget:
    """Rolls a release out beside the live one in steps of servers, judged on live metrics.

    Traffic reaches a release only through the model's HTTPRoute, whose backends are the releases'
    own Services with weights this controller sets: the new release's pods start unexposed (Ready
    in their own Service, in no route), its smoke test and served answers go through that Service,
    and only then does the route give it a share. New servers start in waves of at most
    `spare_servers`; after each wave the route moves onto the checked new servers the share they
    hold (never past the step's fraction) and the old release gives back only the servers its
    remaining share no longer needs, so what takes traffic never holds less than the live fleet
    did and no more than the live fleet plus the spare budget run at once. After each step the
    judge (the PromQL analysis of the window) decides, while the old release keeps as many servers
    as the budget leaves it; a failed step moves traffic back (at once where the old release still
    holds it, else as its servers return), then scales the new one to zero. Only after the last
    step's analysis, and `scale_down_delay_s` more, does the old release go to zero servers; its
    objects stay until the next release prunes them, so a rollback within that time only scales
    them up again (`deploy` of that release, which finds its objects).
    """

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
        self,
        release_id: str,
        manifests: list[dict],
        steps: list[ServerStep] | None = None,
        judge: Judge | None = None,
        spare_servers: int = 1,
        timeout_s: float | None = None,
        answers: Answers | None = None,
        scale_down_delay_s: float = 0.0,
    ) -> DeployOutcome:
        """Make `manifests` live without taking the model offline, or leave the old release serving.

        `steps` default to one step with every server the manifests render; with no release of
        this model serving in the cluster, the new one starts whole (no steps, nothing to judge).
        Where the release's objects are still in the cluster (kept at zero by a later release, or
        still serving beside it: a rollback), they are scaled up, not created again.
        Raises ClusterUnreachable before changing anything when the API server does not answer;
        every later failure is an outcome ("rolled_back" while the old release serves, "failed"
        with none). The rollout timeout per wave defaults to the Deployments' progress deadline.
        `answers` checks the new release's served answers through its own Service at each step,
        before the route gives it that step's share: answers that got worse abort the rollout like
        a failed analysis (with nothing live before, the new release goes to zero).
        """
        timeout_s = timeout_s or _progress_deadline(manifests)
        self.check_reachable()
        namespace, own, port, model = _smoke_target(manifests)
        route, new_deps, label, instance = _release_objects(manifests)
        found = listing(self.api, namespace, "deployments", instance)
        others = [d for d in found if _release_of(d) != label]
        old = [d for d in others if d["spec"].get("replicas", 0) > 0]
        old_servers = live_servers = max((d["spec"]["replicas"] for d in old), default=0)
        old_release = _release_of(old[0]) if old else None
        old_service = self._service_of(namespace, instance, old_release) if old_release else None
        # a rollback to kept objects: what of them runs already counts
        kept = [d for d in found if _release_of(d) == label]
        new_servers = min((d["spec"].get("replicas", 0) for d in kept), default=0) if kept else 0
        full = max(d["spec"].get("replicas", 1) for d in new_deps)
        if not old or not steps:
            steps = [ServerStep(fraction=1.0, old_servers=0, new_servers=full)]
        full = max(full, steps[-1].new_servers)
        events: list[tuple[str, dict[str, Any]]] = [
            (
                "deploy_started",
                {
                    "release_id": release_id,
                    "namespace": namespace,
                    "server": self.api.configuration.host,
                    "objects": [f"{obj['kind']}/{obj['metadata']['name']}" for obj in manifests],
                    "live_release": old_release,
                    "live_servers": old_servers,
                    "kept_servers": new_servers if kept else None,
                    "steps": [s.model_dump() for s in steps],
                },
            )
        ]
        started = time.monotonic()
        record = RolloutRecord(replacing=old_release, live_servers=live_servers, full=full, spare=spare_servers)
        for dep in new_deps:  # applied with the first wave, or now onto kept objects, before any other change
            dep["metadata"].setdefault("annotations", {})[ROLLOUT_ANNOTATION] = record.model_dump_json()
        # the new Deployments once they exist (an undo scales them to zero)
        applied: list[dict] = list(new_deps) if kept else []
        traffic = _Traffic(self, route, old_service, own, events)
        try:
            if kept:
                for dep in new_deps:
                    dep["spec"]["replicas"] = new_servers
                apply(self.api, new_deps, self.field_manager, timeout_s, self.poll_s)
            if old and old_service is None:
                raise RolloutFailed(f"release {old_release} serves but its own Service is gone: nothing to weigh it by")
            removed = self._remove_releases({_release_of(d) for d in others if d not in old}, namespace, instance)
            if removed:
                events.append(("pruned", {"objects": removed}))
            for number, step in enumerate(steps, 1):
                step_started = time.monotonic()
                budget = live_servers + spare_servers  # servers that may run at once
                checked = False
                while new_servers < step.new_servers or not checked:
                    if new_servers and not checked:  # the step's checks, before its share rises
                        self._check(events, answers, number, namespace, manifests, port, model, new_servers)
                        checked = True
                    if new_servers >= step.new_servers:
                        break
                    if checked and old:  # the checked new servers take the share they hold
                        traffic.move(min(step.fraction, new_servers / full), number)
                    if old:
                        # old servers stop only where the old share, at the route's weights, no longer
                        # needs them, and to leave the wave room within live + spare
                        wave, room = next_wave(
                            number, step, new_servers, old_servers, traffic.new_share, live_servers, spare_servers
                        )
                        old_servers = self._scale_to(old, room, old_servers, timeout_s)
                    else:
                        wave = step.new_servers - new_servers
                    new_servers += wave
                    self._start(manifests, new_deps, new_servers, applied, timeout_s)
                traffic.move(step.fraction, number)
                # the old release keeps every server the budget leaves it while the step is judged
                # (never fewer than its share needs): at the last step it still serves beside the
                # new one, and an abort there has that much less to reload
                keep = kept_while_judged(step, live_servers, budget)
                old_servers = self._scale_to(old, min(keep, old_servers), old_servers, timeout_s)
                detail: dict[str, Any] = {
                    "step": number,
                    "fraction": step.fraction,
                    "old_servers": old_servers,
                    "new_servers": new_servers,
                    "seconds": round(time.monotonic() - step_started, 1),
                }
                if old and judge is not None:
                    verdict = judge(number, step.fraction, new_servers * len(new_deps))
                    detail |= {"analysis": verdict.model_dump(), "passed": verdict.passed}
                    events.append(("rollout_step", detail))
                    if not verdict.passed:
                        raise RolloutAborted(
                            f"rollout of release {release_id} aborted at step {number} "
                            f"({new_servers} new / {old_servers} old servers): " + "; ".join(verdict.reasons),
                            [verdict],
                        )
                else:
                    events.append(("rollout_step", detail))
                log.info(
                    "release %s, step %d/%d done: %d new and %d old servers",
                    release_id,
                    number,
                    len(steps),
                    new_servers,
                    old_servers,
                )
            traffic.only_new()  # the old release leaves the route: what serves now needs no controller
        except Exception as exc:
            servers = _Servers(live_servers, old_servers, new_servers, full, spare_servers)
            return self._undo(exc, events, applied, old, old_release, servers, started, timeout_s, traffic)
        # every analysis passed: only now, and after the keep window, does the old release give back
        # its last servers; its objects stay, at zero, until the next release's deploy prunes them
        if old and old_servers and self._keep(scale_down_delay_s, old_servers, traffic, events):
            old_servers = self._scale_to(old, 0, old_servers, timeout_s)
        kept_at_zero = [f"Deployment/{d['metadata']['name']}" for d in old] if not old_servers else []
        events.append(
            (
                "rollout_complete",
                {
                    "kept_at_zero": kept_at_zero,
                    "seconds": round(time.monotonic() - started, 1),
                    "all_traffic_after_s": traffic.all_new_after_s,
                    "servers": new_servers,
                },
            )
        )
        log.info("release %s is live in %s on %d servers", release_id, namespace, new_servers)
        return DeployOutcome(status="live", events=events)

    def recover(self, manifests: list[dict], timeout_s: float | None = None) -> DeployOutcome:
        """Pick up a rollout whose controller died (its task killed between two actions): from what
        the cluster holds (the route's weights, each release's servers) and the rollout's record on
        the new release's Deployments. A rollout that had moved all traffic and servers is finished
        ("live"); any other is undone as an abort would ("rolled_back": the old release gets its
        servers and traffic back within the spare budget, the new one goes to zero). Idempotent:
        it starts nothing of the new release, and a second call finds nothing left to do."""
        timeout_s = timeout_s or _progress_deadline(manifests)
        self.check_reachable()
        namespace, own, _port, _model = _smoke_target(manifests)
        route, _new_deps, label, instance = _release_objects(manifests)
        current = listing(self.api, namespace, "deployments", {**instance, RELEASE_LABEL: label})
        events: list[tuple[str, dict[str, Any]]] = []
        started = time.monotonic()
        annotated = [d for d in current if ROLLOUT_ANNOTATION in (d["metadata"].get("annotations") or {})]
        if not annotated:
            events.append(("recovered", {"state": "nothing of the release was applied", "release_id": label}))
            return DeployOutcome(status="rolled_back", events=events, error="the rollout had changed nothing")
        record = RolloutRecord.model_validate_json(annotated[0]["metadata"]["annotations"][ROLLOUT_ANNOTATION])
        # servers taken: a group the controller had scaled before it died counts (not the fewest)
        new_servers = max(d["spec"].get("replicas", 0) for d in current)
        old = (
            listing(self.api, namespace, "deployments", {**instance, RELEASE_LABEL: record.replacing})
            if record.replacing
            else []
        )
        old_servers = max((d["spec"].get("replicas", 0) for d in old), default=0)
        old_service = self._service_of(namespace, instance, record.replacing) if record.replacing else None
        traffic = _Traffic(self, route, old_service, own, events)
        traffic.load()
        state = {
            "release_id": label,
            "replacing": record.replacing,
            "weights": traffic.weights,
            "old_servers": old_servers,
            "new_servers": new_servers,
        }
        log.warning("recovering the rollout of release %s from %s", label, state)
        complete = min(d["spec"].get("replicas", 0) for d in current) >= record.full
        if traffic.weights == {own: WEIGHT_TOTAL} and complete:
            events.append(("recovered", {"state": "complete", **state}))
            if old_servers:
                self._scale_to(old, 0, old_servers, timeout_s)
            return DeployOutcome(status="live", events=events)
        events.append(("recovered", {"state": "undone", **state}))
        died = RolloutFailed(f"the controller of release {label}'s rollout died mid-rollout; undone from {state}")
        servers = _Servers(record.live_servers, old_servers, new_servers, record.full, record.spare)
        return self._undo(died, events, current, old, record.replacing, servers, started, timeout_s, traffic)

    def _keep(self, delay_s: float, old_servers: int, traffic: _Traffic, events: list) -> bool:
        """The keep window after the last step: the old release holds its servers, out of the route,
        so a rollback meanwhile only moves traffic back. True when it may go to zero now (the route
        still sends everything to the new release: nobody rolled back meanwhile)."""
        if delay_s > 0:
            events.append(("scale_down_delay", {"seconds": delay_s, "old_servers": old_servers}))
            log.info("keeping %d old servers for %.0f s (rollout.scale_down_delay)", old_servers, delay_s)
            time.sleep(delay_s)
        if traffic.current() != {traffic.own: WEIGHT_TOTAL}:
            events.append(("scale_down_skipped", {"reason": "the route changed during the keep window"}))
            log.warning("the route changed during the keep window; the old release keeps its servers")
            return False
        return True

    def _service_of(self, namespace: str, instance: dict[str, str], release: str) -> str | None:
        """A release's own Service (the one selecting its pods), if it still exists."""
        services = listing(self.api, namespace, "services", {**instance, RELEASE_LABEL: release})
        return next((s["metadata"]["name"] for s in services if RELEASE_LABEL in s["spec"].get("selector", {})), None)

    # -------------------------------------------------------- steps

    def _start(
        self, manifests: list[dict], new_deps: list[dict], servers: int, applied: list, timeout_s: float
    ) -> None:
        """Apply the release's objects with `servers` pods per group (first wave), or scale them."""
        if not applied:
            for dep in new_deps:
                dep["spec"]["replicas"] = servers
            applied.extend(new_deps)  # from the first PATCH on, there may be something to undo
            # everything but the route: the release starts unexposed, in its own Service only
            unexposed = [obj for obj in manifests if obj["kind"] != "HTTPRoute"]
            apply(self.api, unexposed, self.field_manager, timeout_s, self.poll_s)
        else:
            for dep in new_deps:
                scale(self.api, dep, servers)
            wait_rollout(self.api, new_deps, timeout_s, self.poll_s)

    def _scale_to(self, deps: list[dict], servers: int, now: int, timeout_s: float) -> int:
        if deps and servers != now:
            for dep in deps:
                scale(self.api, dep, servers)
            wait_rollout(self.api, deps, timeout_s, self.poll_s)
            log.info("release %s: %d -> %d servers", _release_of(deps[0]), now, servers)
        return servers

    def _check(
        self,
        events: list[tuple[str, dict[str, Any]]],
        answers: Answers | None,
        step: int,
        namespace: str,
        manifests: list[dict],
        port: int,
        model: str,
        new_servers: int,
    ) -> None:
        """A step's checks through the release's own Service: the smoke completion (once), then the
        serving-path accuracy check, one `rollout_accuracy` event with its table; raises SmokeFailed
        or AnswersWorse when they fail. Pods rendered before they served /tokenizer_info (a rollback
        to such a release) cannot have their answers checked this way: the event says so and the
        rollout goes on, judged by its analysis."""
        if not any(kind == "smoke_test" for kind, _ in events):
            events.append(self._smoke(namespace, manifests, port, model))
        if answers is None:
            return
        own = _own_service(manifests)
        if TOKENIZER_INFO_FLAG not in _engine_argv(next(o for o in manifests if o["kind"] == "Deployment")):
            reason = f"the release's pods run without {TOKENIZER_INFO_FLAG} (rendered before it): not checked"
            events.append(("rollout_accuracy", {"step": step, "new_servers": new_servers, "skipped": reason}))
            log.warning("step %d: served answers %s", step, reason)
            return
        checked = answers(step, service_endpoint(self.api, namespace, own, port), model)
        events.append(
            (
                "rollout_accuracy",
                {
                    "step": step,
                    "new_servers": new_servers,
                    "summary": checked.summary(),
                    **checked.model_dump(mode="json"),
                },
            )
        )
        log.info("step %d: served answers %s: %s", step, "pass" if checked.passed else "FAIL", checked.summary())
        if not checked.passed:
            raise AnswersWorse(
                f"step {step}: serving-path accuracy through Service {namespace}/{own}: " + "; ".join(checked.failures)
            )

    def _smoke(self, namespace: str, manifests: list[dict], port: int, model: str) -> tuple[str, dict[str, Any]]:
        """A completion through the release's own Service: it reaches only the new pods."""
        own = _own_service(manifests)
        text = smoke(
            self.api, namespace, own, port, model, self.smoke_timeout_s, retry_delay_s=self.smoke_retry_delay_s
        )
        return ("smoke_test", {"ok": True, "service": f"{namespace}/{own}:{port}", "text": text[:200]})

    def _remove_releases(self, releases: set[str], namespace: str, instance: dict[str, str]) -> list[str]:
        """Delete every object of these releases (Deployments, their Services and budgets)."""
        removed = []
        for release in sorted(r for r in releases if r):
            for plural in ("deployments", "services", "poddisruptionbudgets"):
                for obj in listing(self.api, namespace, plural, {**instance, RELEASE_LABEL: release}):
                    delete(self.api, obj)
                    removed.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return removed

    def _undo(
        self,
        exc: Exception,
        events: list,
        applied: list[dict],
        old: list[dict],
        old_release: str | None,
        servers: _Servers,
        started: float,
        timeout_s: float,
        traffic: _Traffic,
    ) -> DeployOutcome:
        """Traffic and servers back to the old release, within the spare budget, then the new one to zero.

        The route moves back at once where the old release still runs all its servers, or where
        the new one answers wrong; otherwise the old release's servers come back in waves of the
        spare budget, each taking back the share it holds while the new release gives back the
        servers its remaining share no longer needs."""
        if not isinstance(exc, ReleaseError):
            log.error("rollout failed on an unexpected error", exc_info=exc)
        error = str(exc)
        seconds = round(time.monotonic() - started, 1)
        if isinstance(exc, SmokeFailed):
            events.append(("smoke_test", {"ok": False, "error": error}))
        kind = "rollout_aborted" if isinstance(exc, RolloutAborted | AnswersWorse) else "rollout_failed"
        events.append((kind, {"error": error, "seconds": seconds}))
        if not old:
            log.error("rollout failed and no earlier release serves: %s", error)
            if isinstance(exc, AnswersWorse):  # no answers rather than worse ones
                for dep in applied:
                    scale(self.api, dep, 0)
                events.append(("scaled_to_zero", {"objects": [f"Deployment/{d['metadata']['name']}" for d in applied]}))
            return DeployOutcome(status="failed", events=events, error=error)
        live, have, new, full, spare = servers
        log.warning("rollout failed (%s); release %s back to %d servers", error, old_release, live)
        events.append(("rollback_started", {"to_release": old_release, "reason": error}))
        aborted = time.monotonic()
        try:
            if traffic.exposed:
                traffic.back(0.0 if isinstance(exc, AnswersWorse) else 1 - have / live, aborted)
            while True:
                # the new release keeps only what its share needs, then old servers come back in its room
                keep_new = _servers_for(traffic.new_share, full) if traffic.exposed else 0
                if keep_new < new:
                    new = self._scale_new(applied, keep_new)
                if have >= live:
                    break
                wave = min(max(1, spare), live - have, live + spare - have - new)
                if wave < 1:
                    raise RolloutFailed(f"{have} old and {new} new servers leave no room in the spare budget")
                have = self._scale_to(old, have + wave, have, timeout_s)
                if traffic.exposed:
                    traffic.back(max(0.0, 1 - have / live), aborted)
            if traffic.exposed:
                traffic.back(0.0, aborted)
            self._scale_new(applied, 0)
        except Exception as undo_exc:
            events.append(("rollback_failed", {"to_release": old_release, "error": str(undo_exc)}))
            return DeployOutcome(
                status="failed", events=events, error=f"{error}; back to release {old_release} failed: {undo_exc}"
            )
        events.append(
            (
                "rollback_complete",
                {"to_release": old_release, "servers": live, "seconds": round(time.monotonic() - aborted, 1)},
            )
        )
        return DeployOutcome(status="rolled_back", events=events, error=error)

    def _scale_new(self, applied: list[dict], servers: int) -> int:
        """The new release down to `servers` (its Deployments that exist: a failed first apply may
        have created only some)."""
        for dep in applied:
            try:
                scale(self.api, dep, servers)
            except KubernetesError as missing:
                if missing.status != 404:  # never created: nothing to scale
                    raise
        return servers


class _Servers(NamedTuple):
    """Where a rollout stood when it failed: what its undo starts from."""

    live: int  # the old release's servers when the rollout started: what it gets back
    old: int  # the old release's servers now
    new: int  # the new release's servers now
    full: int  # the new release's servers for all the traffic
    spare: int  # rollout.spare_servers


def kept_servers(api, manifests: list[dict]) -> int | None:
    """Servers a release's Deployments run now, where they all still exist in the cluster (kept at
    zero, or still serving); None where any is gone (pruned by a later release)."""
    counts = []
    for dep in (obj for obj in manifests if obj["kind"] == "Deployment"):
        try:
            counts.append(_call(api, "GET", object_path(dep))["spec"].get("replicas", 0))
        except KubernetesError as exc:
            if exc.status == 404:
                return None
            raise
    return min(counts) if counts else None


class _Traffic:
    """The model's HTTPRoute as one rollout sets it: the old release's Service and the new one's,
    weighted in parts of WEIGHT_TOTAL. Until `move` gives the new release a share it is in no route (exposed
    False); every change is a `traffic` event."""

    def __init__(self, target: KubernetesTarget, route: dict, old: str | None, own: str, events: list):
        self.target, self.route, self.old, self.own, self.events = target, route, old, own, events
        self.started = time.monotonic()
        self.all_new_after_s: float | None = None  # when the new release first took all the traffic
        self.new_share = 0.0
        self.exposed = False
        self.weights: dict[str, int] = {}  # as this rollout last set them

    def move(self, share: float, step: int) -> None:
        """The new release takes `share` (floored to a percent: never more than its servers hold)."""
        parts = math.floor(share * WEIGHT_TOTAL + 1e-6)
        if self.exposed and parts == round(self.new_share * WEIGHT_TOTAL):
            return
        self._set(
            {self.old: WEIGHT_TOTAL - parts, self.own: parts} if self.old else {self.own: WEIGHT_TOTAL}, step=step
        )

    def back(self, share: float, since: float) -> None:
        """An abort: the new release keeps `share` (ceiled: the old side takes no more than it holds)."""
        parts = math.ceil(share * WEIGHT_TOTAL - 1e-6)
        if parts != round(self.new_share * WEIGHT_TOTAL):
            self._set(
                {self.old or "": WEIGHT_TOTAL - parts, self.own: parts}, seconds=round(time.monotonic() - since, 1)
            )

    def only_new(self) -> None:
        """Completion: the route names only the new release, as its rendered form does."""
        self._set({self.own: WEIGHT_TOTAL})

    def current(self) -> dict[str, int]:
        try:
            now = _call(self.target.api, "GET", object_path(self.route))
        except KubernetesError as exc:
            if exc.status == 404:
                return {}
            raise
        return {b["name"]: b.get("weight", 1) for rule in now["spec"]["rules"] for b in rule.get("backendRefs", [])}

    def load(self) -> None:
        """Take the weights the route has now as this rollout's (a recovery)."""
        self.weights = self.current()
        self.new_share = self.weights.get(self.own, 0) / WEIGHT_TOTAL
        self.exposed = self.new_share > 0

    def _set(self, weights: dict[str, int], **detail: Any) -> None:
        if weights == self.weights:
            return
        route = copy.deepcopy(self.route)
        template = route["spec"]["rules"][0]["backendRefs"][0]
        route["spec"]["rules"][0]["backendRefs"] = [
            {**template, "name": name, "weight": weight} for name, weight in weights.items()
        ]
        _call(
            self.target.api,
            "PATCH",
            object_path(route),
            body=route,
            content_type=APPLY_PATCH,
            query={"fieldManager": self.target.field_manager, "force": "true"},
        )
        self.weights = weights
        self.new_share = weights.get(self.own, 0) / WEIGHT_TOTAL
        self.exposed = self.new_share > 0
        at_s = round(time.monotonic() - self.started, 1)
        if self.new_share >= 1 and self.all_new_after_s is None:
            self.all_new_after_s = at_s
        self.events.append(("traffic", {"weights": weights, "at_s": at_s, **detail}))
        log.info(
            "route %s: %s",
            route["metadata"]["name"],
            ", ".join(f"{n} {w / WEIGHT_TOTAL:.2%}" for n, w in weights.items()),
        )


def next_wave(
    number: int, step: ServerStep, new: int, old: int, new_share: float, live: int, spare: int
) -> tuple[int, int]:
    """The controller's next wave within step `number`: (new servers it starts, old servers kept
    while they start). Old servers stop only where the old release's share (1 - `new_share`, the
    route's now) no longer needs them, and only to make room within live + spare; RolloutFailed
    where no new server fits."""
    budget = live + spare
    need = _servers_for(1 - new_share, live)
    wave = min(max(1, spare), step.new_servers - new, budget - new - need)
    if wave < 1:
        raise RolloutFailed(
            f"step {number}: {need} old servers hold the old share while {new} new run; "
            f"rollout.spare_servers ({spare}) leaves no room to start another"
        )
    return wave, max(need, min(old, budget - new - wave))


def waves_problems(steps: list[ServerStep], live: int, spare: int) -> list[str]:
    """Each step's problem as the controller would meet it ('' where its waves fit): the rollout
    run on paper, with the route's weights as the controller sets them, so `rollout-plan` refuses
    before anything starts what the controller would refuse halfway."""
    full = max(1, steps[-1].new_servers)
    new, old = 0, live
    problems: list[str] = []
    for number, step in enumerate(steps, 1):
        try:
            while new < step.new_servers:
                share = math.floor(min(step.fraction, new / full) * WEIGHT_TOTAL + 1e-6) / WEIGHT_TOTAL
                wave, old = next_wave(number, step, new, old, share, live, spare)
                new += wave
        except RolloutFailed as exc:
            return problems + [str(exc)] + [""] * (len(steps) - number)
        old = min(old, kept_while_judged(step, live, live + spare))
        problems.append("")
    return problems


def kept_while_judged(step: ServerStep, live_servers: int, budget: int) -> int:
    """Old servers a step keeps while it is judged: every one the budget leaves beside the step's
    new servers, never fewer than its share needs (nor more than the live fleet). `rollout-plan`
    prints the same figure."""
    return min(
        live_servers,
        max(step.old_servers, _servers_for(1 - step.fraction, live_servers), budget - step.new_servers),
    )


def _servers_for(share: float, live_servers: int) -> int:
    """Old servers that hold `share` of what the live fleet held (a weight's rounding, one part in
    WEIGHT_TOTAL, does not ask for another server)."""
    return max(0, math.ceil(share * live_servers - 1e-3))


def _release_objects(manifests: list[dict]) -> tuple[dict, list[dict], str, dict[str, str]]:
    """(the model's route, the release's Deployments, its release label, the labels every release
    of the model shares) from its rendered objects."""
    deps = [obj for obj in manifests if obj["kind"] == "Deployment"]
    instance = {k: deps[0]["metadata"]["labels"][k] for k in (INSTANCE_LABEL, MANAGED_BY_LABEL)}
    return _route_of(manifests), deps, _release_of(deps[0]), instance


def _route_of(manifests: list[dict]) -> dict:
    route = next((obj for obj in manifests if obj["kind"] == "HTTPRoute"), None)
    if route is None:
        raise ReleaseError(
            "manifests: no HTTPRoute (the model's address on the Gateway): render them again with promotion.gateway set"
        )
    return route
