"""The Kubernetes objects that serve one release in one layout: pure functions, plain dicts out.

One Deployment per replica group (each one pod holding its group's GPUs, as in the reference
deployment: two `amd.com/gpu: 4` pods per 8-GPU server for two TP4+EP4 replicas), a Service
in front of all of them, a PodDisruptionBudget, and the weights from the NFS share (a read-only
claim), fetched from S3 into node-local disk by an init container, or streamed from S3 by vLLM
itself (`staging.s3.stream`) once an init container checked the objects against the manifest.

Every release has objects of its own beside the live release's (`<spec.name>-r<release>-<group>`
Deployments, a `<spec.name>-r<release>` Service and PodDisruptionBudget), so a new release takes
traffic in steps and the old one keeps serving until it has (pipeline.k8s.deploy): never an
in-place `Recreate` that takes the model offline for the whole image pull and weight load. The
model's one address is an HTTPRoute (`<spec.name>`, Gateway API) on the spec's Gateway whose
backends are the releases' own Services, weighted: a new release's pods are Ready long before
they take traffic, and only the rollout controller, once they answered its checks, gives their
Service a weight. Once a release is live the route names only its Service, so a pod that dies is
replaced by its ReplicaSet and takes traffic when Ready with no controller running. Each
Deployment runs one pod per server (`RenderOptions.servers`); the rollout scales them. The release
id and the artifact's manifest hash travel as labels and annotations. A pod scaled away drains
first (a preStop that waits until the engine's own /metrics shows nothing running, bounded by the
route's request timeout, within a grace period above that bound): no wave, undo or rollback cuts a
stream its pods hold.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, Field

from pipeline import __version__
from pipeline.core.errors import ReleaseError
from pipeline.core.rollout import WEIGHT_TOTAL
from pipeline.core.specs import BYTES_PER_PARAM, HardwareProfile, Layout, LoadedSpec, ReleaseSpec
from pipeline.k8s import autoscaler, crds
from pipeline.stages import drain, serving

MODELS_MOUNT = "/models"
FIELD_PREFIX = "model-release"
RELEASE_LABEL = f"{FIELD_PREFIX}/release-id"
GATEWAY_API = "gateway.networking.k8s.io/v1"
# a streamed answer of a long context may run for minutes; Gateway implementations' own default
# request timeouts (Envoy's is 15 s) would cut it
ROUTE_REQUEST_TIMEOUT = f"{drain.REQUEST_TIMEOUT_S}s"
# a pod scaled away first drains (its preStop: the engine's own /metrics until nothing runs, bounded
# by the route's request timeout), then gets SIGTERM; the kubelet SIGKILLs it this long after the
# deletion: above the preStop's bound and vLLM's own drain, where the image has one
TERMINATION_GRACE_S = drain.ENDPOINT_LAG_S + drain.REQUEST_TIMEOUT_S + drain.SHUTDOWN_TIMEOUT_S + 15
# a request naming a release's Service in this header reaches that release only, through the model's
# HTTPRoute on the Gateway, and its answer carries the header back, set by the Gateway's rule
RELEASE_HEADER = "x-model-release"
# the default rule's answers carry its weights (`weights_tag`), set by the Gateway's rule: a client's
# answer says which weights the data plane that routed it serves, whatever the route's status says
WEIGHTS_HEADER = "x-model-release-weights"
# served by every rendered engine: the rollout's accuracy check uses the engine's own tokenizer
TOKENIZER_INFO_FLAG = "--enable-tokenizer-info-endpoint"
# vLLM start-up: engine init, graph capture and kernel warm-up, then reading the weights at a
# conservative ~100 MB/s from NFS; ~240 GB of FP8 weights get ~42 minutes, the tiny model 3.
STARTUP_BASE_S = 180
STARTUP_S_PER_GB = 10
LOAD_FACTOR, LOAD_MARGIN_S = 2.0, 120  # a measured load time's margin: x2, +2 minutes
PROBE_PERIOD_S = 10
# Before the probe starts: image pull (ROCm images are tens of GB) and the S3 fetch.
PULL_AND_FETCH_S = 1800

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class Artifact(BaseModel):
    """Where the staged weights are; a `storage.StagedArtifact` dump fits (extra keys are ignored)."""

    s3_uri: str | None = None
    nfs_path: str | None = None
    manifest_hash: str


# The images' tags are the package version: bump `pipeline.__version__` to ship new ones
# (docker/images.sh). The worker image carries the `model-release` CLI the serving pods' init
# containers run; the engine image (serving.engine_image) does not.
DEFAULT_WORKER_IMAGE = f"registry.digitalocean.com/model-release/worker-rocm:{__version__}"
DEFAULT_QUANTIZE_IMAGE = f"registry.digitalocean.com/model-release/quantize:{__version__}"


def worker_image() -> str:
    """The worker image the Airflow components are configured with (MODEL_RELEASE_WORKER_IMAGE),
    the same one the step pods run (pods.ClusterSettings)."""
    return os.environ.get("MODEL_RELEASE_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE


class RenderOptions(BaseModel):
    """Cluster facts the release spec does not hold."""

    storage_class: str = Field("nfs", description="storage class of the claim on the NFS share")
    volume_name: str | None = Field(
        None,
        description="PersistentVolume of the NFS share to bind the claim to; default: the model's own, "
        "`<spec.name>-models`, which the platform install creates pre-bound to this claim (pipeline.k8s.install)",
    )
    fetch_image: str = Field(
        default_factory=worker_image,
        description="image with the model-release CLI for the S3 init containers (fetch, verify-staged): "
        "the worker image (MODEL_RELEASE_WORKER_IMAGE); the engine image has no such CLI",
    )
    servers: int = Field(1, ge=0, description="pods per replica group, one per server (the rollout scales them)")
    load_seconds: float | None = Field(
        None,
        ge=0,
        description="the release's measured load time (slowest replica, process start to healthy, on this "
        "hardware): the startup probe and progress deadline follow it, with a margin; None: from the weights' size",
    )
    autoscale_rate: float | None = Field(
        None,
        gt=0,
        description="the release's measured max SLO req/s per server: with the spec's capacity.autoscale, its "
        "KEDA ScaledObjects come too, born paused at `servers` (the rollout controller resumes them)",
    )


class _Weights(NamedTuple):
    model_path: str
    volume: dict
    init_containers: list[dict]
    requests: dict[str, Any]
    objects: list[dict]
    engine_flags: list[str] = []  # noqa: RUF012 (a NamedTuple default, never mutated)
    engine_env: list[dict] = []  # noqa: RUF012
    engine_env_from: list[dict] = []  # noqa: RUF012


# ---------------------------------------------------------------- names


def dns_name(text: str, max_len: int = 63) -> str:
    """A DNS-1035 label (what a Service name must be, so valid for every kind here)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not name[:1].isalpha():
        name = f"m-{name}"
    return name[:max_len].rstrip("-")


def label_value(text: str) -> str:
    """`text` as a label value; a changed or shortened value ends in a hash of the original, so two
    release ids (`manual__2026-01-12T10:00:00+00:00`) never end up with the same label."""
    if len(text) <= 63 and LABEL_VALUE.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:54].strip("-._")
    return f"{clean}-{digest}" if clean else digest


def s3_secret_name(connection_id: str) -> str:
    """The Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the spec's S3 connection."""
    return dns_name(f"{connection_id}-s3")


# ---------------------------------------------------------------- render


def render(
    loaded: LoadedSpec, layout_name: str, release_id: str, artifact: Artifact, options: RenderOptions | None = None
) -> list[dict]:
    """Every object of the release, in apply order: weights claim (if any), Deployments, its Service,
    PDB, and last the model's HTTPRoute as it stands once this release is live (all its traffic on
    this release's Service; the rollout controller applies it with each step's weights), when the
    spec names its Gateway (a Kubernetes spec must); with `options.autoscale_rate`, its KEDA
    ScaledObjects (pipeline.k8s.autoscaler), one per replica group."""
    spec, hw = loaded.spec, loaded.hardware
    layout = loaded.layout(layout_name)
    if hw.kind != "gpu" or not hw.device_resource:
        raise ReleaseError(f"hardware profile {hw.name!r}: Kubernetes needs a gpu profile with device_resource set")
    options = options or RenderOptions()
    base = dns_name(spec.name)
    own = release_name(spec, release_id)
    weights = _weights(spec, artifact, base, options)
    labels = {**instance_labels(spec), **_release_labels(layout, release_id, artifact)}
    annotations = _annotations(release_id, artifact)
    deployments = [
        _deployment(spec, hw, layout, weights, group, own, labels, annotations, options)
        for group in range(layout.replicas)
    ]
    meta = {"namespace": spec.promotion.namespace, "labels": labels, "annotations": annotations}
    release_selector = {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", RELEASE_LABEL)}

    def service(name: str, selector: dict[str, str], labels: dict[str, str]) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, **meta, "labels": labels},
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [{"name": "http", "port": spec.serving.port, "targetPort": "http", "protocol": "TCP"}],
            },
        }

    # this release's pods only: its checks go here before the route gives it any traffic
    own_service = service(own, release_selector, labels)
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": own, **meta},
        # One replica group at a time may be drained; a crash-looping pod never blocks a node drain.
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": release_selector},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    # a spec for the local target rendered as a preview names no Gateway: no route to attach
    live_route = [route(spec, {own: WEIGHT_TOTAL})] if spec.promotion.gateway else []
    scalers = (
        autoscaler.scaled_objects(loaded, deployments, options.autoscale_rate, paused_replicas=options.servers)
        if options.autoscale_rate is not None
        else []
    )
    # no dict shared between objects
    return copy.deepcopy([*weights.objects, *deployments, own_service, pdb, *live_route, *scalers])


def route(spec: ReleaseSpec, weights: dict[str, int]) -> dict:
    """The model's HTTPRoute: `weights` is release Service name -> its weight (its share of requests
    in parts of WEIGHT_TOTAL); each of those Services also gets a rule of its own (`with_backends`).
    Every release's Service is in the route's namespace, so no ReferenceGrant is needed."""
    gateway = spec.promotion.gateway
    if gateway is None:
        raise ReleaseError(
            "promotion.gateway: name the Gateway (Gateway API) that carries the model's traffic; the rollout "
            "moves traffic between releases by the weights of an HTTPRoute attached to it"
        )
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    if gateway.section_name:
        parent["sectionName"] = gateway.section_name
    template = {"group": "", "kind": "Service", "name": "", "port": spec.serving.port, "weight": 0}
    skeleton = {
        "apiVersion": GATEWAY_API,
        "kind": "HTTPRoute",
        "metadata": {
            "name": dns_name(spec.name),
            "namespace": spec.promotion.namespace,
            "labels": instance_labels(spec),
        },
        "spec": {
            "parentRefs": [parent],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": [template]}],
        },
    }
    return with_backends(skeleton, weights, list(weights))


def with_backends(route: dict, weights: dict[str, int], named: list[str]) -> dict:
    """The route (a copy) with its rules set: first the default rule, which every request without
    RELEASE_HEADER takes, sending it to the release Services in `weights` by their weights (none
    given: no backend, so the Gateway answers 503); then, for each Service in `named`, a rule that
    a request naming it in RELEASE_HEADER takes, sent to that Service only, whose answer carries
    RELEASE_HEADER set to it by the Gateway (ResponseHeaderModifier, Extended support). The rollout's
    checks go through the named rules: the Gateway's own address, to one release, and the answer
    says which rule served it. The default rule's answers carry WEIGHTS_HEADER (`weights_tag`): the
    rollout counts a change of weights as made only once the Gateway's answers say it serves them.
    The backend template (group, kind, port) is the route's first."""
    out = copy.deepcopy(route)
    template = next(b for rule in route["spec"]["rules"] for b in rule.get("backendRefs", []))
    default: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "filters": [
            {
                "type": "ResponseHeaderModifier",
                "responseHeaderModifier": {"set": [{"name": WEIGHTS_HEADER, "value": weights_tag(weights)}]},
            }
        ],
    }
    if weights:
        default["backendRefs"] = [{**template, "name": name, "weight": weight} for name, weight in weights.items()]
    out["spec"]["rules"] = [{**default, "timeouts": {"request": ROUTE_REQUEST_TIMEOUT}}] + [
        {
            "matches": [
                {
                    "path": {"type": "PathPrefix", "value": "/"},
                    "headers": [{"type": "Exact", "name": RELEASE_HEADER, "value": name}],
                }
            ],
            "filters": [
                {
                    "type": "ResponseHeaderModifier",
                    "responseHeaderModifier": {"set": [{"name": RELEASE_HEADER, "value": name}]},
                }
            ],
            "backendRefs": [{**template, "name": name, "weight": 1}],
            "timeouts": {"request": ROUTE_REQUEST_TIMEOUT},
        }
        for name in named
    ]
    return out


def weights_tag(weights: dict[str, int]) -> str:
    """What the default rule's answers carry in WEIGHTS_HEADER: its backends that take traffic, with
    their weights ("none" without one), so that two rules sending traffic alike carry the same tag."""
    return ",".join(f"{name}={weight}" for name, weight in sorted(weights.items()) if weight > 0) or "none"


def route_weights(route: dict) -> dict[str, int]:
    """The default rule's backends and weights (what requests without RELEASE_HEADER get)."""
    return {b["name"]: b.get("weight", 1) for rule in _default_rules(route) for b in rule.get("backendRefs", [])}


def named_releases(route: dict) -> list[str]:
    """The release Services that have a rule of their own in the route (matched by RELEASE_HEADER)."""
    return [
        header["value"]
        for rule in route["spec"]["rules"]
        for match in rule.get("matches", [])
        for header in match.get("headers", [])
        if header.get("name", "").lower() == RELEASE_HEADER
    ]


def _default_rules(route: dict) -> list[dict]:
    return [rule for rule in route["spec"]["rules"] if not any(m.get("headers") for m in rule.get("matches", []))]


def release_name(spec: ReleaseSpec, release_id: str) -> str:
    """The prefix of one release's objects (its Deployments add `-<group>`)."""
    return dns_name(f"{dns_name(spec.name, 50)}-r{label_value(release_id)}", 58)


def instance_labels(spec: ReleaseSpec) -> dict[str, str]:
    """Stable across releases: Deployment selectors are immutable, and pruning finds our objects by these."""
    return {
        "app.kubernetes.io/name": spec.serving.engine,
        "app.kubernetes.io/instance": dns_name(spec.name),
        "app.kubernetes.io/managed-by": "model-release",
    }


def _release_labels(layout: Layout, release_id: str, artifact: Artifact) -> dict[str, str]:
    return {
        RELEASE_LABEL: label_value(release_id),
        f"{FIELD_PREFIX}/layout": layout.name,
        f"{FIELD_PREFIX}/manifest-hash": artifact.manifest_hash[:16],  # short, to select by; the annotation is whole
    }


def _annotations(release_id: str, artifact: Artifact) -> dict[str, str]:
    return {
        f"{FIELD_PREFIX}/release-id": release_id,
        f"{FIELD_PREFIX}/manifest-hash": artifact.manifest_hash,
        f"{FIELD_PREFIX}/artifact-uri": artifact.nfs_path or artifact.s3_uri or "",
    }


def weights_gb(spec: ReleaseSpec) -> float:
    return spec.model.architecture.params_b * BYTES_PER_PARAM[spec.quantization.scheme]


def startup_seconds(spec: ReleaseSpec, load_seconds: float | None = None) -> int:
    """How long the startup probe waits for /health. From the release's measured load time where
    there is one (its slowest replica, process start to healthy, on the target's hardware): twice
    that plus LOAD_MARGIN_S, for a cold page cache, a busier share and a slower node than the
    measuring one; else from the size of the weights (STARTUP_BASE_S + STARTUP_S_PER_GB per GB)."""
    if load_seconds is not None:
        budget = LOAD_FACTOR * load_seconds + LOAD_MARGIN_S
    else:
        budget = STARTUP_BASE_S + STARTUP_S_PER_GB * weights_gb(spec)
    return PROBE_PERIOD_S * math.ceil(budget / PROBE_PERIOD_S)


# ---------------------------------------------------------------- weights


def _weights(spec: ReleaseSpec, artifact: Artifact, base: str, options: RenderOptions) -> _Weights:
    """NFS when the artifact was staged there (10-15% faster loads than per-pod downloads in the
    reference deployment), else an S3 fetch into node-local disk before the engine starts."""
    if artifact.nfs_path and spec.staging.nfs:
        return _nfs_weights(spec, artifact, base, options)
    if artifact.s3_uri and spec.staging.s3 and spec.staging.s3.stream:
        return _s3_streamed_weights(spec, artifact, options)
    if artifact.s3_uri and spec.staging.s3:
        return _s3_weights(spec, artifact, options)
    raise ReleaseError(
        f"artifact {artifact.manifest_hash[:12]}: no nfs_path (with staging.nfs) or s3_uri "
        "(with staging.s3) to load the weights from"
    )


def _nfs_weights(spec: ReleaseSpec, artifact: Artifact, base: str, options: RenderOptions) -> _Weights:
    """The claim stands for the share the staging worker mounts at staging.nfs.path: pods see
    the same tree, read-only, under /models."""
    assert spec.staging.nfs is not None and artifact.nfs_path  # called for an artifact staged to NFS
    root, path = PurePosixPath(spec.staging.nfs.path), PurePosixPath(artifact.nfs_path)
    if not path.is_relative_to(root):
        raise ReleaseError(f"artifact nfs_path {path}: expected a directory under staging.nfs.path {root}")
    claim_name = weights_claim_name(spec)
    # Bound by name to a static volume on the same share, never dynamically provisioned: an NFS CSI
    # class would give the claim a fresh empty directory, not the staged weights.
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadOnlyMany"],
        "storageClassName": options.storage_class,
        "volumeName": options.volume_name or claim_name,
        "resources": {"requests": {"storage": f"{weights_claim_gi(spec)}Gi"}},
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim_name, "namespace": spec.promotion.namespace, "labels": instance_labels(spec)},
        "spec": claim_spec,
    }
    volume = {"name": "models", "persistentVolumeClaim": {"claimName": claim_name, "readOnly": True}}
    return _Weights(f"{MODELS_MOUNT}/{path.relative_to(root)}", volume, [], {}, [claim])


def _s3_weights(spec: ReleaseSpec, artifact: Artifact, options: RenderOptions) -> _Weights:
    """`model-release fetch` verifies every file against the manifest; credentials come from a
    Secret named after the spec's connection, never from the manifests."""
    s3 = spec.staging.s3
    assert s3 is not None  # called for an artifact staged to S3
    dest = f"{MODELS_MOUNT}/{artifact.manifest_hash}"
    env = [{"name": "AWS_ENDPOINT_URL", "value": s3.endpoint_url}] if s3.endpoint_url else []
    env += [{"name": "AWS_DEFAULT_REGION", "value": s3.region}] if s3.region else []
    init = {
        "name": "fetch-weights",
        "image": options.fetch_image,
        "command": ["model-release", "fetch", artifact.s3_uri, dest],
        "envFrom": [{"secretRef": {"name": s3_secret_name(s3.connection_id)}}],
        "env": env,
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT}],
    }
    size = f"{weights_claim_gi(spec)}Gi"
    volume = {"name": "models", "emptyDir": {"sizeLimit": size}}
    return _Weights(dest, volume, [init], {"ephemeral-storage": size}, [])


def _s3_streamed_weights(spec: ReleaseSpec, artifact: Artifact, options: RenderOptions) -> _Weights:
    """vLLM streams the objects itself (`--load-format runai_streamer`): no copy on the node, so no
    fetch to verify bytes on the way. What takes its place: an init container checks the manifest's
    hash and every object's size and sha256 record before the engine starts (`model-release
    verify-staged`). What is lost against a fetch: the bytes the engine reads are not hashed, so an
    object overwritten with its metadata kept, or replaced between the check and the read, goes
    unnoticed; only the staging connection can write the bucket, and pods hold a read-only key."""
    s3 = spec.staging.s3
    assert s3 is not None and s3.read_connection_id and artifact.s3_uri  # spec validation: stream needs both
    env = [{"name": "AWS_ENDPOINT_URL", "value": s3.endpoint_url}] if s3.endpoint_url else []
    env += [{"name": "AWS_DEFAULT_REGION", "value": s3.region}] if s3.region else []
    env_from = [{"secretRef": {"name": s3_secret_name(s3.read_connection_id)}}]
    init = {
        "name": "verify-weights",
        "image": options.fetch_image,
        "command": ["model-release", "verify-staged", artifact.s3_uri, "--manifest-hash", artifact.manifest_hash],
        "envFrom": env_from,
        "env": env,
    }
    # the streamer's own endpoint variable, set explicitly (S3-compatible stores need it, path-style)
    streamer = [{"name": "RUNAI_STREAMER_S3_ENDPOINT", "value": s3.endpoint_url}] if s3.endpoint_url else []
    volume = {"name": "models", "emptyDir": {"sizeLimit": "1Gi"}}  # config and tokenizer files only
    return _Weights(
        artifact.s3_uri, volume, [init], {}, [], ["--load-format", "runai_streamer"], env + streamer, env_from
    )


def weights_claim_name(spec: ReleaseSpec) -> str:
    """The model's read-only weights claim in the promotion namespace, and the name of the static
    PersistentVolume the platform install pre-binds to it."""
    return dns_name(f"{dns_name(spec.name)}-models")


def weights_claim_gi(spec: ReleaseSpec) -> int:
    """What the weights claim requests: the checkpoint's size with a fifth to spare."""
    return math.ceil(weights_gb(spec) * 1.2) + 1


# ---------------------------------------------------------------- deployment


def _engine(
    spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, model_path: str
) -> tuple[list[str], dict[str, str]]:
    """The launcher's own command for replica 0, so pods run exactly what was benchmarked; every
    pod listens on the Service's port and the device plugin, not an env var, picks its GPUs.
    One flag more, which serves a read-only endpoint and changes no kernel: /tokenizer_info, so the
    rollout's accuracy check through the Service uses the engine's own tokenizer (lm-eval's remote
    tokenizer) where no model files are."""
    command = serving.build_commands(spec, hw, layout, model_path, spec.serving.port)[0]
    engine_args = serving.engine_args(spec, layout)
    # and, where the image's vLLM has it, its own drain on SIGTERM (drain.shutdown_flags)
    argv = [*command.argv, TOKENIZER_INFO_FLAG, *drain.shutdown_flags(spec.serving.engine_image, engine_args)]
    argv[argv.index("--served-model-name") + 1] = spec.name
    env = {k: v for k, v in command.env.items() if k != hw.visible_devices_env}
    return argv, env


def _deployment(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    weights: _Weights,
    group: int,
    own: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    options: RenderOptions,
) -> dict:
    group_label = {f"{FIELD_PREFIX}/replica-group": str(group)}
    # a Deployment of its own per release, so its (immutable) selector may name the release
    selector = {**instance_labels(spec), RELEASE_LABEL: labels[RELEASE_LABEL], **group_label}
    pod_annotations = {**annotations, **_placement_annotations(hw, layout, group)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": dns_name(f"{own}-{group}"),
            "namespace": spec.promotion.namespace,
            "labels": {**labels, **group_label},
            "annotations": annotations,
        },
        "spec": {
            "replicas": options.servers,
            # a pod of this release that must restart (node drain, crash) never needs a spare
            # server's GPUs: one goes before its replacement starts; releases never share a Deployment
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "progressDeadlineSeconds": startup_seconds(spec, options.load_seconds) + PULL_AND_FETCH_S,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": {**labels, **group_label},
                    "annotations": pod_annotations,
                },
                "spec": _pod_spec(spec, hw, layout, weights, options.load_seconds),
            },
        },
    }


def _pod_spec(
    spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, weights: _Weights, load_seconds: float | None = None
) -> dict:
    argv, env = _engine(spec, hw, layout, weights.model_path)
    argv += weights.engine_flags
    assert hw.device_resource is not None  # spec validation: a Kubernetes target needs it
    devices: dict[str, Any] = {hw.device_resource: layout.devices_per_replica}
    container = {
        "name": "vllm",
        "image": spec.serving.engine_image,
        "command": argv,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())] + weights.engine_env,
        "ports": [{"name": "http", "containerPort": spec.serving.port, "protocol": "TCP"}],
        "resources": {"limits": dict(devices), "requests": {**devices, **weights.requests}},
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        **_probes(spec, load_seconds),
        "lifecycle": {"preStop": _drain_hook(spec)},
    }
    if weights.engine_env_from:
        container["envFrom"] = weights.engine_env_from
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": [weights.volume, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}],
        "nodeSelector": dict(hw.node_labels),
        "tolerations": [dict(taint) for taint in hw.taints],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    if weights.init_containers:
        pod["initContainers"] = weights.init_containers
    affinity = _anti_affinity(spec, hw, layout)
    if affinity:
        pod["affinity"] = affinity
    return pod


def _drain_hook(spec: ReleaseSpec) -> dict:
    """Before SIGTERM: wait until the engine runs no request (pipeline/stages/drain.py, run by the
    engine image's python3: the production image's vLLM 0.11.2 aborts whatever runs on SIGTERM)."""
    source = Path(drain.__file__).read_text()
    args = [str(spec.serving.port), str(drain.REQUEST_TIMEOUT_S), str(drain.ENDPOINT_LAG_S)]
    return {"exec": {"command": ["python3", "-c", source, *args]}}


def _probes(spec: ReleaseSpec, load_seconds: float | None = None) -> dict[str, dict]:
    """Startup covers the model load; after it, readiness takes a pod out of the Service quickly
    and liveness restarts a hung engine only after minutes."""
    health = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    return {
        "startupProbe": {
            **health,
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": startup_seconds(spec, load_seconds) // PROBE_PERIOD_S,
        },
        "readinessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 30, "failureThreshold": 5},
    }


def _anti_affinity(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout) -> dict | None:
    """Anti-affinity on hostname only when the replica groups cannot share one server.

    The benchmarked layout puts every replica group on one server (two TP4 pods per 8-GPU
    MI325X), so hostname anti-affinity would be wrong: it would demand a second server for the
    second half of the same layout. What keeps the groups apart inside the server is the
    device plugin, which hands each pod an xGMI-connected, NUMA-local GPU subset (with the
    kubelet's topology manager aligning CPUs); Kubernetes affinity cannot address NUMA halves.
    The intended half is recorded as an annotation. Only when the groups need more devices than
    one server has (load_spec rejects such a layout) is spreading over servers preferred.
    """
    if layout.devices <= hw.devices:
        return None
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": instance_labels(spec)},
                    },
                }
            ]
        }
    }


def _placement_annotations(hw: HardwareProfile, layout: Layout, group: int) -> dict[str, str]:
    """The NUMA half (and devices) the launcher would give this group; informational for operators."""
    devices = serving.device_sets(layout, hw)[group]
    out = {f"{FIELD_PREFIX}/devices": ",".join(map(str, devices))}
    for index, numa in enumerate(hw.numa_groups):
        if set(devices) <= set(numa):
            out[f"{FIELD_PREFIX}/numa-group"] = str(index)
    return out


# ---------------------------------------------------------------- output and checks


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(objs: list[dict]) -> str:
    """Multi-document YAML, as `kubectl apply -f` reads it; repeated values are written out, not aliased."""
    return yaml.dump_all(objs, Dumper=_NoAliasDumper, sort_keys=False)


def validate(objs: list[dict], k8s_version: str = "1.31") -> list[str]:
    """Problems against the Kubernetes OpenAPI schema (strict: unknown fields are errors) plus the
    name and label rules the schema does not carry; one line per problem, empty when valid."""
    import kubernetes_validate
    from kubernetes_validate.utils import VersionNotSupportedError

    problems = []
    for obj in objs:
        where = f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"
        if crds.known(obj):  # a custom resource (the HTTPRoute): its project's own CRD schema
            problems += crds.problems(obj) + [f"{where}: {problem}" for problem in _name_problems(obj)]
            continue
        try:
            kubernetes_validate.validate(obj, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            field = ".".join(str(part) for part in exc.absolute_path) or "(top level)"
            problems.append(f"{where}: {field}: {exc.message}")
        except (kubernetes_validate.SchemaNotFoundError, VersionNotSupportedError) as exc:
            problems.append(f"{where}: {exc.message}")
        problems += [f"{where}: {problem}" for problem in _name_problems(obj)]
    return problems


def _name_problems(obj: dict) -> list[str]:
    meta = obj.get("metadata") or {}
    problems = []
    name = str(meta.get("name", ""))
    if len(name) > 63 or not DNS_LABEL.match(name):
        problems.append(f"metadata.name: {name!r} is not a DNS-1035 label (a-z, 0-9, '-', at most 63)")
    template = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
    for where, labels in (
        ("metadata.labels", meta.get("labels")),
        ("spec.template.metadata.labels", template.get("labels")),
    ):
        for key, value in (labels or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
                problems.append(
                    f"{where}.{key}: {value!r} is not a valid label value (at most 63 of A-Z a-z 0-9 - _ .)"
                )
    return problems
