"""Preflight: everything a release needs from the cluster, checked before any GPU pod starts.

Two halves. `gather` reads the cluster (the official client, through kubeapi.py's connection
helpers) into a `Cluster`: the objects as the API server returns them, or the one-line error a
read got. Each check in `CHECKS` is then a pure function of the spec and that `Cluster`, and
returns its problems, one line each: the object, what is wrong, the fix. A test hands the checks
real-shaped objects with exactly one piece missing and sees that check, and only it, fail.

The workers' rights are asked of the API server for the workers' own ServiceAccount
(SubjectAccessReview), not the caller's: an SRE with cluster-admin would otherwise pass a
preflight the promote task then fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.errors import ClusterUnreachable, KubernetesError, PreflightFailed, ReleaseError
from pipeline.core.specs import LoadedSpec
from pipeline.k8s import install, manifests
from pipeline.k8s.kubeapi import _call, api_client
from pipeline.k8s.pods import ClusterSettings

__all__ = [
    "CHECKS",
    "Cluster",
    "Outcome",
    "connect",
    "gather",
    "preflight",
    "require",
    "run",
    "servers_at_once",
]

INSTALL_FIX = (
    "apply the platform install (model-release platform SPEC --nfs-server H --nfs-path P | kubectl apply -f -)"
)
ROUTE_FEATURES = {"timeouts": "HTTPRouteRequestTimeout"}  # a field of the model's route -> Gateway API feature
# a filter type of the model's route -> its Gateway API feature (the named-release rules' answer header)
FILTER_FEATURES = {"ResponseHeaderModifier": "HTTPRouteResponseHeaderModification"}


@dataclass
class Cluster:
    """What the cluster holds, as the API server answered: objects (None: not found), or for a
    read that failed, its one-line error in `errors` under the same key."""

    version: dict | None = None
    unreachable: str | None = None
    namespaces: dict[str, dict | None] = field(default_factory=dict)
    access: dict[str, bool] = field(default_factory=dict)  # rule text -> allowed for the workers' account
    gateway_class: dict | None = None
    gateway: dict | None = None
    crds: dict[str, dict | None] = field(default_factory=dict)
    volumes: list[dict] = field(default_factory=list)
    claim: dict | None = None
    secrets: dict[str, dict | None] = field(default_factory=dict)  # namespace/name -> metadata only
    connections: dict[str, bool | None] = field(default_factory=dict)  # None: cannot tell from here
    nodes: list[dict] = field(default_factory=list)
    prometheus: dict | None = None  # the answer to `up`, by release
    deployments: list[dict] = field(default_factory=list)  # the model's, in the promotion namespace
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    passed: list[str]
    failed: list[str]  # one line per problem, prefixed by its check's name

    @property
    def ok(self) -> bool:
        return not self.failed


# ---------------------------------------------------------------- what the spec needs


def servers_at_once(loaded: LoadedSpec) -> tuple[int, str]:
    """The servers a rollout may run at once before a rate is measured, and how that was counted:
    the most the fleet may grow to (capacity.max_servers, else min_servers) plus the spare budget."""
    spec = loaded.spec
    spare = spec.rollout.spare_servers
    if spec.capacity is not None and spec.capacity.max_servers is not None:
        return (
            spec.capacity.max_servers + spare,
            f"capacity.max_servers {spec.capacity.max_servers} + rollout.spare_servers {spare}",
        )
    fleet = spec.capacity.min_servers if spec.capacity is not None else 1
    return fleet + spare, f"capacity.min_servers {fleet} + rollout.spare_servers {spare}"


def _crds_needed(loaded: LoadedSpec) -> dict[str, str]:
    spec = loaded.spec
    out = {
        "gateways.gateway.networking.k8s.io": "v1",
        "httproutes.gateway.networking.k8s.io": "v1",
    }
    if spec.rollout.prometheus_url:
        out["podmonitors.monitoring.coreos.com"] = "v1"
    if spec.capacity is not None and spec.capacity.autoscale is not None:
        out["scaledobjects.keda.sh"] = "v1alpha1"
    return out


def _connections_needed(loaded: LoadedSpec) -> list[str]:
    spec = loaded.spec
    ids = [spec.promotion.kubernetes_conn_id] if spec.promotion.kubernetes_conn_id else []
    if spec.staging.s3 is not None:
        ids += [spec.staging.s3.connection_id, spec.staging.s3.read_connection_id or ""]
    return [i for i in dict.fromkeys(ids) if i]


def _rule_text(namespace: str, access: install.Access, verb: str) -> str:
    resource = f"{access.resource}.{access.group}" if access.group else access.resource
    names = f" {'/'.join(access.names)}" if access.names else ""
    return f"{verb} {resource}{names} in {namespace or 'the cluster'}"


def _accesses(loaded: LoadedSpec, settings: ClusterSettings) -> list[tuple[str, install.Access, str]]:
    return [
        (namespace, access, verb)
        for namespace, access in install.worker_access(loaded.spec, settings)
        for verb in access.verbs
    ]


# ---------------------------------------------------------------- the checks (pure)


@dataclass
class Context:
    loaded: LoadedSpec
    settings: ClusterSettings
    worker_account: str


def _read_error(cluster: Cluster, key: str) -> list[str]:
    return [cluster.errors[key]] if key in cluster.errors else []


def check_namespaces(ctx: Context, cluster: Cluster) -> list[str]:
    spec = ctx.loaded.spec
    wanted = {
        ctx.settings.namespace: "the step pods' (MODEL_RELEASE_NAMESPACE)",
        spec.promotion.namespace: "promotion.namespace",
        install.gateway_namespace(spec): "the Gateway's (promotion.gateway.namespace)",
    }
    out = []
    for name, what in wanted.items():
        out += _read_error(cluster, f"namespace/{name}")
        if f"namespace/{name}" not in cluster.errors and cluster.namespaces.get(name) is None:
            out.append(f"Namespace {name} ({what}): not found: {INSTALL_FIX}")
    return out


def check_access(ctx: Context, cluster: Cluster) -> list[str]:
    account = f"{ctx.settings.namespace}/{ctx.worker_account}"
    out = _read_error(cluster, "access")
    for namespace, access, verb in _accesses(ctx.loaded, ctx.settings):
        text = _rule_text(namespace, access, verb)
        if not cluster.access.get(text, False) and "access" not in cluster.errors:
            out.append(f"ServiceAccount {account}: may not {text}: {INSTALL_FIX}")
    return out


def _condition(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions", []) if c.get("type") == kind), {})


def check_gateway_class(ctx: Context, cluster: Cluster) -> list[str]:
    if cluster.gateway is None:
        return []  # the gateway check names the missing Gateway; its class is unknown without it
    name = cluster.gateway["spec"]["gatewayClassName"]
    if "gatewayclass" in cluster.errors:
        return [cluster.errors["gatewayclass"]]
    if cluster.gateway_class is None:
        return [
            f"GatewayClass {name}: not found: enable the cluster's Gateway API (DOKS: VPC-native, 1.33+) "
            "or pass the class that exists (model-release platform SPEC --gateway-class NAME)"
        ]
    accepted = _condition(cluster.gateway_class, "Accepted")
    if accepted.get("status") != "True":
        why = accepted.get("message") or accepted.get("reason") or "no Accepted condition in its status"
        return [f"GatewayClass {name}: not Accepted by its controller ({why}): check the Gateway controller"]
    return []


def check_gateway(ctx: Context, cluster: Cluster) -> list[str]:
    gateway = ctx.loaded.spec.promotion.gateway
    if gateway is None:
        return ["promotion.gateway: not set: name the Gateway the model's HTTPRoute attaches to"]
    where = f"Gateway {install.gateway_namespace(ctx.loaded.spec)}/{gateway.name}"
    if "gateway" in cluster.errors:
        return [cluster.errors["gateway"]]
    if cluster.gateway is None:
        return [f"{where} (promotion.gateway): not found: {INSTALL_FIX}"]
    programmed = _condition(cluster.gateway, "Programmed")
    if programmed.get("status") != "True":
        why = programmed.get("message") or programmed.get("reason") or "no Programmed condition in its status"
        return [f"{where}: not Programmed ({why}): see `kubectl describe gateway` and its class's controller"]
    return []


def _origin(listener: dict) -> str:
    return ((listener.get("allowedRoutes") or {}).get("namespaces") or {}).get("from", "Same")


def _admits(listener: dict, route_ns: str, gateway_ns: str, ns_labels: dict[str, str]) -> bool:
    allowed = listener.get("allowedRoutes") or {}
    kinds = allowed.get("kinds")
    if kinds and not any(k.get("kind") == "HTTPRoute" for k in kinds):
        return False
    if not kinds and listener.get("protocol") not in ("HTTP", "HTTPS"):
        return False
    namespaces = allowed.get("namespaces") or {}
    origin = _origin(listener)
    if origin == "All":
        return True
    if origin == "Same":
        return route_ns == gateway_ns
    selector = namespaces.get("selector") or {}
    if selector.get("matchExpressions"):
        return False  # not evaluated here: reported, never assumed to admit
    return all(ns_labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def check_listener(ctx: Context, cluster: Cluster) -> list[str]:
    spec = ctx.loaded.spec
    if cluster.gateway is None or spec.promotion.gateway is None:
        return []
    section = spec.promotion.gateway.section_name
    listeners = [
        listener for listener in cluster.gateway["spec"].get("listeners", []) if section in (None, listener["name"])
    ]
    route_ns, gateway_ns = spec.promotion.namespace, install.gateway_namespace(spec)
    labels = ((cluster.namespaces.get(route_ns) or {}).get("metadata") or {}).get("labels") or {}
    labels = {install.NAMESPACE_NAME_LABEL: route_ns, **labels}
    if any(_admits(listener, route_ns, gateway_ns, labels) for listener in listeners):
        return []
    described = ", ".join(f"{listener['name']} (from: {_origin(listener)})" for listener in listeners)
    return [
        f"Gateway {gateway_ns}/{spec.promotion.gateway.name}: no listener{f' {section}' if section else ''} admits "
        f"HTTPRoutes from namespace {route_ns} ({described or 'none'}): set allowedRoutes.namespaces to select "
        f"{route_ns} ({INSTALL_FIX})"
    ]


def check_route_features(ctx: Context, cluster: Cluster) -> list[str]:
    """The Gateway API features the model's route uses, against what its class says it supports
    (status.supportedFeatures; a class that lists none is taken at its word for the core ones)."""
    if cluster.gateway_class is None or ctx.loaded.spec.promotion.gateway is None:
        return []
    route = manifests.route(ctx.loaded.spec, {"release": 1})
    rules = route["spec"]["rules"]
    used = {feature for key, feature in ROUTE_FEATURES.items() for rule in rules if key in rule}
    used |= {
        FILTER_FEATURES[f["type"]] for rule in rules for f in rule.get("filters", []) if f["type"] in FILTER_FEATURES
    }
    listed = (cluster.gateway_class.get("status") or {}).get("supportedFeatures")
    if listed is None:
        return []
    supported = {f["name"] if isinstance(f, dict) else f for f in listed}
    name = cluster.gateway_class["metadata"]["name"]
    return [
        f"GatewayClass {name}: does not support {feature}, which the model's HTTPRoute uses: choose a class that "
        "does (model-release platform SPEC --gateway-class NAME)"
        for feature in sorted(used - supported)
    ]


def check_crds(ctx: Context, cluster: Cluster) -> list[str]:
    out = []
    fixes = {
        "gateway.networking.k8s.io": "enable the cluster's Gateway API (DOKS manages its CRDs: VPC-native, 1.33+)",
        "monitoring.coreos.com": "install kube-prometheus-stack (DigitalOcean's 1-Click monitoring)",
        "keda.sh": "install KEDA (helm install keda kedacore/keda --version 2.20.2 -n keda --create-namespace)",
    }
    for name, version in _crds_needed(ctx.loaded).items():
        out += _read_error(cluster, f"crd/{name}")
        crd = cluster.crds.get(name)
        if f"crd/{name}" in cluster.errors:
            continue
        group = name.split(".", 1)[1]
        if crd is None:
            out.append(f"CustomResourceDefinition {name}: not found: {fixes[group]}")
        elif not any(v.get("name") == version and v.get("served") for v in crd["spec"].get("versions", [])):
            out.append(f"CustomResourceDefinition {name}: does not serve {version}: upgrade it ({fixes[group]})")
    return out


def _quantity_gi(text: str) -> float:
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10, "Pi": 2**20, "G": 1e9 / 2**30, "T": 1e12 / 2**30}
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text) / 2**30


def check_weights(ctx: Context, cluster: Cluster) -> list[str]:
    """The serving claim binds to a static ReadOnlyMany volume on the export the step pods stage to."""
    spec = ctx.loaded.spec
    if spec.staging.nfs is None:
        return []
    out = _read_error(cluster, "volumes")
    if out:
        return out
    name = manifests.weights_claim_name(spec)
    claim_ns = spec.promotion.namespace
    step_volume = next(
        (
            v
            for v in cluster.volumes
            if ((v["spec"].get("claimRef") or {}).get("name"), (v["spec"].get("claimRef") or {}).get("namespace"))
            == (ctx.settings.pvc, ctx.settings.namespace)
        ),
        None,
    )
    volume = next((v for v in cluster.volumes if v["metadata"]["name"] == name), None)
    where = f"PersistentVolume {name} (for claim {claim_ns}/{name})"
    if volume is None:
        return [f"{where}: not found: {INSTALL_FIX}"]
    vspec = volume["spec"]
    problems = []
    if "ReadOnlyMany" not in vspec.get("accessModes", []):
        problems.append(f"access modes {vspec.get('accessModes')} lack ReadOnlyMany, which the claim asks")
    ref = vspec.get("claimRef") or {}
    if ref and (ref.get("namespace"), ref.get("name")) != (claim_ns, name):
        problems.append(f"bound to {ref.get('namespace')}/{ref.get('name')}, not the model's claim")
    if vspec.get("storageClassName", "") != manifests.RenderOptions().storage_class:
        problems.append(f"storageClassName {vspec.get('storageClassName')!r} differs from the claim's")
    size = _quantity_gi(str((vspec.get("capacity") or {}).get("storage", "0")))
    if size < manifests.weights_claim_gi(spec):
        problems.append(f"capacity {size:g}Gi below the claim's {manifests.weights_claim_gi(spec)}Gi")
    nfs, staged = vspec.get("nfs"), (step_volume or {}).get("spec", {}).get("nfs")
    if nfs is None:
        problems.append("not an NFS volume: the staged weights are on the NFS share")
    elif staged is None:
        problems.append(f"the step pods' volume (bound to {ctx.settings.namespace}/{ctx.settings.pvc}) is missing")
    elif (nfs.get("server"), nfs.get("path")) != (staged.get("server"), staged.get("path")):
        problems.append(
            f"exports {nfs.get('server')}:{nfs.get('path')}, not the share the weights are staged to "
            f"({staged.get('server')}:{staged.get('path')})"
        )
    if cluster.claim is not None:
        bound = cluster.claim["spec"].get("volumeName")
        if bound and bound != name:
            problems.append(f"the claim exists bound to {bound}")
    return [f"{where}: {problem}: {INSTALL_FIX}" for problem in problems]


def check_secrets(ctx: Context, cluster: Cluster) -> list[str]:
    out = []
    for where, (use, keys) in install.secrets_needed(ctx.loaded.spec, ctx.settings).items():
        out += _read_error(cluster, f"secret/{where}")
        if f"secret/{where}" in cluster.errors:
            continue
        secret = cluster.secrets.get(where)
        namespace, name = where.split("/", 1)
        if secret is None:
            out.append(
                f"Secret {where} ({use}): not found: kubectl -n {namespace} create secret generic {name} "
                + " ".join(f"--from-literal={key}=..." for key in keys)
            )
            continue
        missing = [key for key in keys if key not in (secret.get("data") or {})]
        if missing:
            out.append(f"Secret {where} ({use}): lacks key(s) {', '.join(missing)}: recreate it with them")
    return out


def check_connections(ctx: Context, cluster: Cluster) -> list[str]:
    return [
        f"Airflow connection {conn_id!r}: not defined: add it (Admin > Connections, or AIRFLOW_CONN_"
        f"{conn_id.upper()} in the Helm values' env)"
        for conn_id, found in cluster.connections.items()
        if found is False
    ]


def check_gpus(ctx: Context, cluster: Cluster) -> list[str]:
    hw = ctx.loaded.hardware
    out = _read_error(cluster, "nodes")
    if out or not hw.device_resource:
        return out
    need, why = servers_at_once(ctx.loaded)
    schedulable = [n for n in cluster.nodes if not (n.get("spec") or {}).get("unschedulable")]
    allocatable = [
        int(((n.get("status") or {}).get("allocatable") or {}).get(hw.device_resource, 0)) for n in schedulable
    ]
    held = sum(gpus // hw.devices for gpus in allocatable)
    if held >= need:
        return []
    selector = ",".join(f"{k}={v}" for k, v in hw.node_labels.items()) or "(any node)"
    return [
        f"GPU capacity: the rollout runs up to {need} servers at once ({why}) of {hw.devices} {hw.device_resource} "
        f"each ({need * hw.devices}); nodes with {selector} hold {held} ({sum(allocatable)} allocatable "
        f"{hw.device_resource} on {len(schedulable)} schedulable node(s)): let the GPU node pool reach {need} nodes "
        f"(doctl kubernetes cluster node-pool update CLUSTER POOL --auto-scale --min-nodes 1 --max-nodes {need}; "
        "and the account's GPU Droplet quota) or lower capacity.max_servers"
    ]


def check_prometheus(ctx: Context, cluster: Cluster) -> list[str]:
    spec = ctx.loaded.spec
    service = install.prometheus_service(spec)
    if not spec.rollout.prometheus_url or service is None:
        return []  # not a Service address: the controller reaches it directly, preflight cannot from here
    out = _read_error(cluster, "prometheus")
    if out:
        return out
    answer = cluster.prometheus or {}
    if answer.get("status") != "success":
        return [f"Prometheus {spec.rollout.prometheus_url}: no answer to a query ({answer.get('error', answer)})"]
    scraped = {(s.get("metric") or {}).get("release") for s in answer.get("data", {}).get("result", [])}
    live = sorted(
        {
            d["metadata"].get("labels", {}).get(manifests.RELEASE_LABEL, "")
            for d in cluster.deployments
            if (d.get("spec") or {}).get("replicas", 1) > 0
        }
        - {""}
    )
    return [
        f"Prometheus {spec.rollout.prometheus_url}: scrapes no engine of live release {release} (no `up` series "
        f"with release={release!r}): apply the PodMonitor ({INSTALL_FIX}) and check its label selects it "
        "(kube-prometheus-stack: release: <its Helm release>)"
        for release in live
        if release not in scraped
    ]


Check = Callable[[Context, Cluster], list[str]]
CHECKS: dict[str, Check] = {
    "namespaces": check_namespaces,
    "access": check_access,
    "gateway": check_gateway,
    "gateway-class": check_gateway_class,
    "listener": check_listener,
    "route-features": check_route_features,
    "crds": check_crds,
    "weights": check_weights,
    "secrets": check_secrets,
    "connections": check_connections,
    "gpus": check_gpus,
    "prometheus": check_prometheus,
}


def run(
    loaded: LoadedSpec, cluster: Cluster, settings: ClusterSettings, worker_account: str = "airflow-worker"
) -> Outcome:
    """Every check over what was gathered; an unreachable API server is the one line there is."""
    if cluster.unreachable:
        return Outcome([], [f"api: {cluster.unreachable}"])
    ctx = Context(loaded, settings, worker_account)
    passed, failed = ["api"], []
    for name, check in CHECKS.items():
        problems = check(ctx, cluster)
        if problems:
            failed += [f"{name}: {problem}" for problem in problems]
        else:
            passed.append(name)
    return Outcome(passed, failed)


# ---------------------------------------------------------------- gather (I/O)


def _get(api, path: str, cluster: Cluster, key: str, query: dict[str, str] | None = None) -> Any:
    """One read; None when not found; a failed read's line goes to `cluster.errors[key]`."""
    try:
        return _call(api, "GET", path, query=query)
    except KubernetesError as exc:
        if exc.status == 404:
            return None
        if exc.status in (401, 403):
            cluster.errors[key] = f"cannot read {path}: forbidden for this caller ({exc}): bind it the platform's reads"
        else:
            cluster.errors[key] = f"cannot read {path}: {exc}"
        return None


def _core_or_group(group: str) -> str:
    return f"/apis/{group}" if group else "/api/v1"


def gather(
    loaded: LoadedSpec,
    api,
    settings: ClusterSettings,
    worker_account: str = "airflow-worker",
    connections: Callable[[str], bool | None] | None = None,
) -> Cluster:
    """Read what the checks look at. Never raises for the cluster's answers: an unreachable API
    server ends the reading with its one line; every other failed read is kept by its key."""
    spec, cluster = loaded.spec, Cluster()
    try:
        cluster.version = _call(api, "GET", "/version")
    except (ClusterUnreachable, KubernetesError) as exc:
        cluster.unreachable = str(exc)
        return cluster
    for name in dict.fromkeys([settings.namespace, spec.promotion.namespace, install.gateway_namespace(spec)]):
        cluster.namespaces[name] = _get(api, f"/api/v1/namespaces/{name}", cluster, f"namespace/{name}")
    user = f"system:serviceaccount:{settings.namespace}:{worker_account}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{settings.namespace}", "system:authenticated"]
    for namespace, access, verb in _accesses(loaded, settings):
        resource, _, sub = access.resource.partition("/")
        attributes = {"verb": verb, "group": access.group, "resource": resource, "subresource": sub}
        if namespace:
            attributes["namespace"] = namespace
        if access.names:
            attributes["name"] = access.names[0]
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": groups, "resourceAttributes": attributes},
        }
        try:
            answer = _call(api, "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body=review)
        except KubernetesError as exc:
            cluster.errors["access"] = (
                f"cannot ask the API server what {user} may do (SubjectAccessReview: {exc}): "
                "run preflight as a user who may create subjectaccessreviews"
            )
            break
        cluster.access[_rule_text(namespace, access, verb)] = bool((answer.get("status") or {}).get("allowed"))
    gateway = spec.promotion.gateway
    if gateway is not None:
        ns = install.gateway_namespace(spec)
        cluster.gateway = _get(
            api, f"/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/gateways/{gateway.name}", cluster, "gateway"
        )
        if cluster.gateway is not None:
            cls = cluster.gateway["spec"]["gatewayClassName"]
            cluster.gateway_class = _get(
                api, f"/apis/gateway.networking.k8s.io/v1/gatewayclasses/{cls}", cluster, "gatewayclass"
            )
    for name in _crds_needed(loaded):
        cluster.crds[name] = _get(
            api, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}", cluster, f"crd/{name}"
        )
    if spec.staging.nfs is not None:
        listed = _get(api, "/api/v1/persistentvolumes", cluster, "volumes")
        cluster.volumes = (listed or {}).get("items", [])
        claim = manifests.weights_claim_name(spec)
        cluster.claim = _get(
            api, f"/api/v1/namespaces/{spec.promotion.namespace}/persistentvolumeclaims/{claim}", cluster, "claim"
        )
    for where in install.secrets_needed(spec, settings):
        namespace, name = where.split("/", 1)
        secret = _get(api, f"/api/v1/namespaces/{namespace}/secrets/{name}", cluster, f"secret/{where}")
        # keep the keys, never the values
        cluster.secrets[where] = (
            None
            if secret is None
            else {"metadata": secret.get("metadata", {}), "data": dict.fromkeys(secret.get("data") or {}, "")}
        )
    if connections is not None:
        cluster.connections = {conn_id: connections(conn_id) for conn_id in _connections_needed(loaded)}
    hw = loaded.hardware
    selector = ",".join(f"{k}={v}" for k, v in hw.node_labels.items())
    nodes = _get(api, "/api/v1/nodes", cluster, "nodes", query={"labelSelector": selector} if selector else None)
    cluster.nodes = (nodes or {}).get("items", [])
    service = install.prometheus_service(spec)
    if service is not None:
        deployments = _get(
            api,
            f"/apis/apps/v1/namespaces/{spec.promotion.namespace}/deployments",
            cluster,
            "deployments",
            query={"labelSelector": f"app.kubernetes.io/instance={manifests.dns_name(spec.name)}"},
        )
        cluster.deployments = (deployments or {}).get("items", [])
        ns, svc, port = service
        query = f'count by (release) (up{{namespace="{spec.promotion.namespace}"}} == 1)'
        path = f"/api/v1/namespaces/{ns}/services/{svc}:{port}/proxy/api/v1/query"
        try:
            cluster.prometheus = _call(api, "GET", path, query={"query": query})
        except KubernetesError as exc:
            cluster.errors["prometheus"] = (
                f"Prometheus {spec.rollout.prometheus_url}: does not answer through the API server's service proxy "
                f"({exc}): check the Service {ns}/{svc} and its pods"
            )
    return cluster


def connect(loaded: LoadedSpec, use_kubeconfig: bool = False):
    """The API client the promote task would use (the spec's connection), or kubeconfig / in-cluster."""
    conn_id = None if use_kubeconfig else loaded.spec.promotion.kubernetes_conn_id
    try:
        return api_client(conn_id)
    except ReleaseError:
        raise
    except Exception as exc:  # noqa: BLE001 - a client library's config error is a user's, one line
        raise ReleaseError(f"cannot connect to the Kubernetes API: {type(exc).__name__}: {exc}") from None


def preflight(
    loaded: LoadedSpec,
    api=None,
    settings: ClusterSettings | None = None,
    worker_account: str = "airflow-worker",
    connections: Callable[[str], bool | None] | None = None,
) -> Outcome:
    """Gather, then check. Raises nothing for a cluster's answers; the caller decides what a failure does."""
    settings = settings or ClusterSettings.from_env()
    api = api if api is not None else connect(loaded)
    cluster = gather(loaded, api, settings, worker_account, connections)
    return run(loaded, cluster, settings, worker_account)


def require(outcome: Outcome) -> list[str]:
    """The pass list, or PreflightFailed with every failing line."""
    if not outcome.ok:
        raise PreflightFailed("preflight failed:\n" + "\n".join(outcome.failed))
    return outcome.passed
