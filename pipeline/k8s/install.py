"""The platform install: what a cluster admin applies once per model before the first release.

Rendered from the release spec and this package's own names (the claim manifests.py asks for,
the Secrets pods.py and manifests.py reference, the PodMonitor monitoring.py renders, the Gateway
the spec names), so the install cannot drift from what the pipeline sends; `model-release
platform SPEC --nfs-server H --nfs-path P | kubectl apply -f -` applies it. Not a kustomize
base or a Helm chart: Helm cannot be installed where this is developed and tested, and Debian's
kubectl is too old to rely on for kustomize; plain YAML needs only `kubectl apply`.

What it holds, and why:
- the namespaces: the Airflow workers' (step pods) and the promotion namespace, and the
  Gateway's where the spec puts it elsewhere;
- RBAC for the Airflow workers' ServiceAccount (the chart's `airflow-worker`, created by the
  chart, which would refuse to adopt one created here): exactly the verbs `WORKER_ACCESS` lists,
  the rollout controller's (k8s/deploy.py), the rollout lock's Lease (coordination.k8s.io, issue
  #60), the step pods' launch (KubernetesPodOperator), and what `preflight` reads; the same list
  is what preflight asks the API server about, for that account (SubjectAccessReview);
- the Gateway: its class a value (DOKS's managed Cilium class by default), an internal
  DigitalOcean load balancer unless asked otherwise (vLLM runs without an API key: never an open
  public endpoint), one HTTP listener whose `allowedRoutes` admits the promotion namespace only;
- the NFS share twice, as two static PersistentVolumes on the same export: ReadWriteMany for the
  step pods' claim (`model-release-nfs`, created here), and ReadOnlyMany pre-bound (claimRef) to
  the model's serving claim `<spec.name>-models`, which the rendered claim names back
  (`volumeName`); both sides bound by name, so no provisioner hands the claim an empty directory;
- the PodMonitor that labels each engine's series with its release (monitoring.py);
- the Secrets only as their shape (names and keys, in comments with the commands that create
  them): an applied Secret without values would overwrite the real one.
CRDs are not shipped: DOKS manages the Gateway API's; kube-prometheus-stack and KEDA bring theirs.
"""

from __future__ import annotations

from typing import Literal, NamedTuple
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import LoadedSpec, ReleaseSpec
from pipeline.k8s import manifests, monitoring
from pipeline.k8s.pods import ClusterSettings

__all__ = [
    "WORKER_ACCESS",
    "Access",
    "PlatformOptions",
    "prometheus_service",
    "render",
    "secrets_needed",
    "to_yaml",
    "validate",
    "worker_access",
]

MANAGED = {"app.kubernetes.io/managed-by": "model-release", "app.kubernetes.io/part-of": "model-release-platform"}
DO_LB_NETWORK = "service.beta.kubernetes.io/do-loadbalancer-network"  # DigitalOcean CCM: INTERNAL | EXTERNAL
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
STEP_PVC_SIZE = "2Ti"


class Access(NamedTuple):
    """One RBAC check: `verb` on `resource` (with its subresource after a `/`) of `group`, in
    `namespace` ("" cluster-wide), limited to `names` where the rule names objects."""

    scope: str  # "worker" | "promotion" | "gateway" | "prometheus" | "cluster": where, resolved per spec
    group: str
    resource: str
    verbs: tuple[str, ...]
    names: tuple[str, ...] = ()


# What the Airflow workers' ServiceAccount does, and nothing more. Secrets' names are filled in
# per spec (secrets_needed); a rule with names grants only those objects.
WORKER_ACCESS: tuple[Access, ...] = (
    # the rollout controller in the promotion namespace (k8s/deploy.py; a test replays a rollout,
    # an abort and a rollback against these rules)
    Access("promotion", "apps", "deployments", ("get", "list", "create", "patch", "delete")),
    Access("promotion", "apps", "deployments/scale", ("patch",)),
    Access("promotion", "", "services", ("get", "list", "create", "patch", "delete")),
    Access("promotion", "", "persistentvolumeclaims", ("get", "list", "create", "patch", "delete")),
    Access("promotion", "", "services/proxy", ("get", "create")),
    Access("promotion", "policy", "poddisruptionbudgets", ("get", "list", "create", "patch", "delete")),
    Access("promotion", "gateway.networking.k8s.io", "httproutes", ("get", "create", "patch")),
    Access("promotion", "keda.sh", "scaledobjects", ("get", "list", "create", "patch", "delete")),
    # pods scaled away that still drain hold their GPUs: counted against the budget (issue #60)
    Access("promotion", "", "pods", ("list",)),
    # one controller per model at a time (issue #60): the rollout lock, compare-and-swap
    Access("promotion", "coordination.k8s.io", "leases", ("get", "create", "update")),
    # the step pods (KubernetesPodOperator: create, watch, logs, the XCom sidecar's exec, delete)
    Access("worker", "", "pods", ("get", "list", "watch", "create", "patch", "delete")),
    Access("worker", "", "pods/log", ("get",)),
    Access("worker", "", "pods/exec", ("get", "create")),
    Access("worker", "", "events", ("list", "watch")),
    # preflight's reads
    Access("gateway", "gateway.networking.k8s.io", "gateways", ("get",)),
    Access("prometheus", "", "services/proxy", ("get",)),
    Access("cluster", "", "namespaces", ("get",)),
    Access("cluster", "", "nodes", ("list",)),
    Access("cluster", "", "persistentvolumes", ("get", "list")),
    Access("cluster", "apiextensions.k8s.io", "customresourcedefinitions", ("get",)),
    Access("cluster", "gateway.networking.k8s.io", "gatewayclasses", ("get",)),
    Access("cluster", "authorization.k8s.io", "subjectaccessreviews", ("create",)),
)


class PlatformOptions(BaseModel):
    """The cluster facts the spec does not hold."""

    nfs_server: str = Field(description="the NFS share's host (DigitalOcean Network File Storage)")
    nfs_path: str = Field(description="the share's export path; the step pods see it at staging.nfs.path")
    gateway_class: str = Field("cilium", description="GatewayClass of the Gateway (DOKS: its managed Cilium)")
    gateway_network: Literal["internal", "external"] = Field(
        "internal",
        description="the Gateway's DigitalOcean load balancer: internal (VPC only) unless an authenticating proxy "
        "sits in front; vLLM itself checks no API key",
    )
    gateway_port: int = Field(80, gt=0, lt=65536)
    worker_account: str = Field("airflow-worker", description="the Airflow workers' ServiceAccount (the chart's)")
    pod_monitor_labels: dict[str, str] = Field(
        default_factory=lambda: dict(monitoring.CHART_SELECTOR),
        description="labels the cluster Prometheus selects PodMonitors by (kube-prometheus-stack: its release)",
    )
    settings: ClusterSettings = Field(default_factory=ClusterSettings.from_env)


def gateway_namespace(spec: ReleaseSpec) -> str:
    gateway = spec.promotion.gateway
    return (gateway.namespace if gateway and gateway.namespace else None) or spec.promotion.namespace


def prometheus_service(spec: ReleaseSpec) -> tuple[str, str, int] | None:
    """(namespace, service, port) of `rollout.prometheus_url` when it is a cluster Service address
    (`http://SVC.NS.svc[.cluster.local]:PORT`), else None."""
    if not spec.rollout.prometheus_url:
        return None
    url = urlsplit(spec.rollout.prometheus_url)
    parts = (url.hostname or "").split(".")
    if len(parts) < 3 or parts[2] != "svc":
        return None
    return parts[1], parts[0], url.port or (443 if url.scheme == "https" else 80)


def secrets_needed(spec: ReleaseSpec, settings: ClusterSettings) -> dict[str, tuple[str, list[str]]]:
    """`namespace/name` -> (what uses it, its keys): the Secrets the spec's pods reference."""
    keys = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    out: dict[str, tuple[str, list[str]]] = {}
    s3 = spec.staging.s3
    if s3 is not None:
        out[f"{settings.namespace}/{manifests.s3_secret_name(s3.connection_id)}"] = (
            f"the step pods (staging.s3.connection_id {s3.connection_id})",
            keys,
        )
    promotion = spec.promotion.namespace
    if spec.staging.nfs is None and s3 is not None:  # serving pods load from the bucket
        if s3.stream and s3.read_connection_id:
            out[f"{promotion}/{manifests.s3_secret_name(s3.read_connection_id)}"] = (
                f"the serving pods' read-only key (staging.s3.read_connection_id {s3.read_connection_id})",
                keys,
            )
        else:
            out[f"{promotion}/{manifests.s3_secret_name(s3.connection_id)}"] = (
                "the serving pods' fetch init container",
                keys,
            )
    return out


def scope_namespace(scope: str, spec: ReleaseSpec, settings: ClusterSettings) -> str:
    prometheus = prometheus_service(spec)
    return {
        "worker": settings.namespace,
        "promotion": spec.promotion.namespace,
        "gateway": gateway_namespace(spec),
        "prometheus": prometheus[0] if prometheus else "",
        "cluster": "",
    }[scope]


def worker_access(spec: ReleaseSpec, settings: ClusterSettings) -> list[tuple[str, Access]]:
    """(namespace, rule) for every rule the workers need under this spec, secrets' reads included;
    rules for a part the spec does not use (no Prometheus Service, no autoscaling) are left out."""
    prometheus = prometheus_service(spec)
    gateway = spec.promotion.gateway
    out = []
    for access in WORKER_ACCESS:
        if (access.scope == "prometheus" and prometheus is None) or (access.resource == "gateways" and not gateway):
            continue
        # a proxy's resource name carries the port (`svc:port`): that rule names no object
        names = (gateway.name,) if access.resource == "gateways" and gateway else access.names
        out.append((scope_namespace(access.scope, spec, settings), access._replace(names=names)))
    for where in sorted(secrets_needed(spec, settings)):
        namespace, name = where.split("/", 1)
        out.append((namespace, Access("secret", "", "secrets", ("get",), (name,))))
    return out


# ---------------------------------------------------------------- render


def _meta(name: str, namespace: str | None = None, labels: dict[str, str] | None = None) -> dict:
    meta: dict = {"name": name, "labels": {**MANAGED, **(labels or {})}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _rules(accesses: list[Access]) -> list[dict]:
    rules = []
    for access in accesses:
        rule: dict = {"apiGroups": [access.group], "resources": [access.resource], "verbs": list(access.verbs)}
        if access.names:
            rule["resourceNames"] = list(access.names)
        rules.append(rule)
    return rules


def _rbac(spec: ReleaseSpec, options: PlatformOptions) -> list[dict]:
    settings = options.settings
    subject = {"kind": "ServiceAccount", "name": options.worker_account, "namespace": settings.namespace}
    by_namespace: dict[str, list[Access]] = {}
    for namespace, access in worker_access(spec, settings):
        by_namespace.setdefault(namespace, []).append(access)
    name = f"model-release-{manifests.dns_name(spec.name, 40)}"
    objs: list[dict] = []
    for namespace, accesses in by_namespace.items():
        role_kind, binding_kind = ("Role", "RoleBinding") if namespace else ("ClusterRole", "ClusterRoleBinding")
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": role_kind,
                "metadata": _meta(name, namespace or None),
                "rules": _rules(accesses),
            }
        )
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": binding_kind,
                "metadata": _meta(name, namespace or None),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name},
                "subjects": [subject],
            }
        )
    return objs


def _gateway(spec: ReleaseSpec, options: PlatformOptions) -> list[dict]:
    gateway = spec.promotion.gateway
    if gateway is None:
        raise ReleaseError(f"{spec.name}: promotion.gateway: name the Gateway the model's HTTPRoute attaches to")
    listener = gateway.section_name or "http"
    network = "INTERNAL" if options.gateway_network == "internal" else "EXTERNAL"
    return [
        {
            "apiVersion": manifests.GATEWAY_API,
            "kind": "Gateway",
            "metadata": _meta(gateway.name, gateway_namespace(spec)),
            "spec": {
                "gatewayClassName": options.gateway_class,
                # copied by the implementation onto the LoadBalancer Service it creates
                "infrastructure": {"annotations": {DO_LB_NETWORK: network}},
                "listeners": [
                    {
                        "name": listener,
                        "protocol": "HTTP",
                        "port": options.gateway_port,
                        "allowedRoutes": {
                            "namespaces": {
                                "from": "Selector",
                                "selector": {"matchLabels": {NAMESPACE_NAME_LABEL: spec.promotion.namespace}},
                            },
                            "kinds": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}],
                        },
                    }
                ],
            },
        }
    ]


def _volumes(spec: ReleaseSpec, options: PlatformOptions) -> list[dict]:
    settings = options.settings
    nfs = {"server": options.nfs_server, "path": options.nfs_path}
    storage_class = manifests.RenderOptions().storage_class
    objs: list[dict] = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": _meta(settings.pvc),
            "spec": {
                "capacity": {"storage": STEP_PVC_SIZE},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": storage_class,
                "claimRef": {"namespace": settings.namespace, "name": settings.pvc},
                "nfs": dict(nfs),
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(settings.pvc, settings.namespace),
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": storage_class,
                "volumeName": settings.pvc,
                "resources": {"requests": {"storage": STEP_PVC_SIZE}},
            },
        },
    ]
    if spec.staging.nfs is not None:
        claim = manifests.weights_claim_name(spec)
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": _meta(claim, labels=manifests.instance_labels(spec)),
                "spec": {
                    "capacity": {"storage": f"{manifests.weights_claim_gi(spec)}Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": storage_class,
                    # reserved for the serving claim, which promote creates with the first release
                    "claimRef": {"namespace": spec.promotion.namespace, "name": claim},
                    "mountOptions": ["ro"],
                    "nfs": {**nfs, "readOnly": True},
                },
            }
        )
    return objs


def render(loaded: LoadedSpec, options: PlatformOptions) -> list[dict]:
    """Every object of the install, in apply order (namespaces first)."""
    spec = loaded.spec
    namespaces = dict.fromkeys([options.settings.namespace, spec.promotion.namespace, gateway_namespace(spec)])
    objs = [{"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(ns)} for ns in namespaces]
    objs += _rbac(spec, options) + _volumes(spec, options) + _gateway(spec, options)
    if spec.rollout.prometheus_url:
        objs.append(monitoring.pod_monitor(loaded, options.pod_monitor_labels))
    return objs


def validate(objs: list[dict]) -> list[str]:
    """Strict Kubernetes schemas for the built-in kinds, the vendored CRD schemas for the Gateway
    and the PodMonitor (manifests.validate picks by kind); one line per problem."""
    return manifests.validate(objs)


def _secret_shapes(spec: ReleaseSpec, settings: ClusterSettings) -> str:
    lines = ["# Secrets (not applied here: an applied Secret without values would overwrite yours). Create:"]
    for where, (use, keys) in secrets_needed(spec, settings).items():
        namespace, name = where.split("/", 1)
        literals = " ".join(f'--from-literal={key}="${key}"' for key in keys)
        lines.append(f"#   kubectl -n {namespace} create secret generic {name} {literals}   # {use}")
    lines.append(
        f'#   kubectl -n {settings.namespace} create secret generic huggingface --from-literal=HF_TOKEN="$HF_TOKEN"'
        "   # optional: gated models, lm-eval datasets"
    )
    if spec.capacity and spec.capacity.autoscale:
        lines.append(
            "# KEDA (capacity.autoscale): helm install keda kedacore/keda --version 2.20.2 -n keda --create-namespace"
        )
    return "\n".join(lines) + "\n"


def to_yaml(loaded: LoadedSpec, objs: list[dict], options: PlatformOptions) -> str:
    """The install as `kubectl apply -f -` reads it, the Secrets' shape as a comment first."""
    body = yaml.dump_all(objs, Dumper=manifests._NoAliasDumper, sort_keys=False)
    return _secret_shapes(loaded.spec, options.settings) + body
