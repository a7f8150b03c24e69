"""The pods that run a release's heavy steps on the cluster (`execution: kubernetes`).

In production the Airflow workers are small: quantize, evaluate, stage, fetch and each layout's
benchmark run as pods, from the worker image (docker/worker-rocm.Dockerfile), through the same
`model-release` CLI a developer runs by hand. Everything here is a pure function of the release
spec plus a few cluster facts (`ClusterSettings`), so a test renders every pod without a cluster.

Why the pods look the way they do:
- One shared ReadWriteMany claim (the NFS share) holds MODEL_RELEASE_HOME for every pod: the hub
  download, the quantized artifact and the fetched copy are hundreds of GB and must outlive the
  pod that wrote them. When the spec stages to NFS, the same share is also mounted at
  `staging.nfs.path`. XCom carries only paths, hashes and result URIs.
- A benchmark asks for every device of the node whatever its layout: layouts are compared on a
  whole server (two TP4 replicas against one TP8), and a neighbour on the node would skew it.
- The CLI keeps stdout for its result JSON (logs go to stderr), so the pod copies stdout to
  /airflow/xcom/return.json, where the operator's sidecar picks it up.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml
from kubernetes.client import models as k8s
from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError
from pipeline.core.paths import CONFIGS_DIR, PROJECT_ROOT, run_key
from pipeline.core.specs import LoadedSpec, load_spec
from pipeline.k8s.manifests import DEFAULT_QUANTIZE_IMAGE, DEFAULT_WORKER_IMAGE, label_value, s3_secret_name

Step = Literal["quantize", "evaluate", "stage", "fetch", "benchmark", "rebenchmark"]

POD_HOME = "/var/lib/model-release"  # MODEL_RELEASE_HOME in the worker image
POD_PROJECT = "/opt/model-release"  # the worker image's WORKDIR: configs/ lives here
HOME_SUBPATH = "model-release-home"  # MODEL_RELEASE_HOME's directory on the shared claim
XCOM_FILE = "/airflow/xcom/return.json"
RUN_ID = "{{ run_id }}"  # rendered by Airflow when the task runs
# A first pull of the ~25 GB ROCm worker image takes 10-15 minutes; a GPU node scaled up from
# zero adds a few more. Shorter, and a healthy pod is failed while it is still pulling.
STARTUP_TIMEOUT_S = 45 * 60
# The reference deployment's kernels; the image sets them too, the pod says so explicitly, and
# the hardware profile and the spec's serving.env override them.
AITER_ENV = {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MOE": "1"}
RETRIES = {"stage": 2, "fetch": 2}  # network transfers resume; the GPU steps fail loudly


class ClusterSettings(BaseModel):
    """Cluster facts the release spec does not hold; each can be set in the Airflow components'
    environment (MODEL_RELEASE_WORKER_IMAGE, MODEL_RELEASE_QUANTIZE_IMAGE, MODEL_RELEASE_NAMESPACE,
    MODEL_RELEASE_PVC)."""

    image: str = Field(DEFAULT_WORKER_IMAGE, description="worker image with the model-release CLI")
    quantize_image: str = Field(
        DEFAULT_QUANTIZE_IMAGE, description="quantize image (llmcompressor): the quantize step's pod only"
    )
    namespace: str = Field("model-release", description="namespace the step pods run in")
    pvc: str = Field("model-release-nfs", description="ReadWriteMany claim on the NFS share")
    kube_conn_id: str = Field("kubernetes_default", description="Airflow connection of the cluster")

    @classmethod
    def from_env(cls) -> ClusterSettings:
        names = {
            "image": "MODEL_RELEASE_WORKER_IMAGE",
            "quantize_image": "MODEL_RELEASE_QUANTIZE_IMAGE",
            "namespace": "MODEL_RELEASE_NAMESPACE",
            "pvc": "MODEL_RELEASE_PVC",
        }
        return cls(**{field: os.environ[env] for field, env in names.items() if os.environ.get(env)})


class PodResources(BaseModel):
    gpus: int = Field(description="devices of the hardware profile's device_resource (amd.com/gpu)")
    cpu: str
    memory: str
    shm: str = Field(description="size of the memory-backed /dev/shm (vLLM's workers talk through it)")


# ---------------------------------------------------------------- where results live


def base_uri(loaded: LoadedSpec) -> str:
    s3 = loaded.spec.staging.s3
    if s3 is not None:
        return "s3://" + "/".join(part.strip("/") for part in (s3.bucket, s3.prefix, "runs") if part.strip("/"))
    assert loaded.spec.staging.nfs is not None  # a spec stages to S3 or NFS (spec validation)
    return f"{loaded.spec.staging.nfs.path.rstrip('/')}/runs"


def run_uri(base: str, run_id: str) -> str:
    return f"{base.rstrip('/')}/{run_key(run_id)}"


# ---------------------------------------------------------------- which specs, which templates


def kubernetes_specs(releases: Path = CONFIGS_DIR / "releases") -> list[LoadedSpec]:
    """Every shipped spec with `execution: kubernetes`, fully validated: a broken one fails the
    DAG file's import, so the UI shows its one-line problems instead of a missing DAG."""
    found = []
    for path in sorted(releases.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        if isinstance(raw, dict) and raw.get("execution") == "kubernetes":
            found.append(load_spec(path))
    return found


def dag_id(loaded: LoadedSpec) -> str:
    return "model_release_k8s__" + loaded.spec.name.replace("-", "_").replace(".", "_")


def xcom(task_id: str, key: str) -> str:
    """A Jinja reference to a key of an upstream pod's result, rendered when the task runs."""
    return f'{{{{ ti.xcom_pull(task_ids="{task_id}")["{key}"] }}}}'


def spec_in_image(loaded: LoadedSpec) -> str:
    """The spec's path inside the worker image, which carries the project's configs/ (a spec from
    elsewhere must be at the same absolute path in the image)."""
    if loaded.path.is_relative_to(PROJECT_ROOT):
        return f"{POD_PROJECT}/{loaded.path.relative_to(PROJECT_ROOT).as_posix()}"
    return str(loaded.path)


# ---------------------------------------------------------------- what each pod runs


def cli_args(
    loaded: LoadedSpec,
    step: Step,
    *,
    side: str | None = None,
    layout: str | None = None,
    candidate: str | None = None,
    artifact: str | None = None,
    uri: str | None = None,
    dest: str | None = None,
    model: str | None = None,
    run_id: str = RUN_ID,
    release: int | None = None,
    s3_uri: str | None = None,
    nfs_path: str | None = None,
    manifest_hash: str | None = None,
    promoted_rate: float | None = None,
    predictions: str | None = None,
    evaluation: str | None = None,
) -> list[str]:
    """The `model-release` arguments of a step. Inputs default to the upstream pods' XCom in the
    kubernetes DAG (task ids quantize, stage, fetch); full results go to storage under
    `base_uri(spec)`, and the pod's XCom holds their URI."""
    spec = spec_in_image(loaded)
    if step == "quantize":
        return ["quantize", spec]
    if step == "evaluate":
        if side not in ("baseline", "candidate"):
            raise ValueError(f"evaluate: side must be baseline or candidate, got {side!r}")
        extra = ["--candidate", candidate or xcom("quantize", "path")] if side == "candidate" else []
        return ["evaluate", spec, "--side", side, *extra, "--run-id", run_id, "--results", base_uri(loaded)]
    if step == "stage":
        return ["stage", spec, "--artifact", artifact or xcom("quantize", "path")]
    if step == "fetch":
        return ["fetch", uri or xcom("stage", staged_key(loaded)), dest or serving_cache()]
    if step == "benchmark":
        if layout not in [item.name for item in loaded.spec.layouts]:
            raise ReleaseError(f"{loaded.path}: layouts: no layout named {layout!r}")
        return [
            "benchmark",
            spec,
            "--layout",
            layout,
            "--model",
            model or xcom("fetch", "path"),
            "--run-id",
            run_id,
            "--results",
            base_uri(loaded),
            *(["--predictions", predictions] if predictions else []),
        ]
    if step == "rebenchmark":  # a live release: its figures come from the registry (pod_steps.remeasure_arguments)
        if release is None or not manifest_hash or promoted_rate is None or not (s3_uri or nfs_path):
            raise ValueError("rebenchmark: release, manifest_hash, promoted_rate and s3_uri or nfs_path are required")
        staged = ["--s3-uri", s3_uri] if s3_uri else ["--nfs-path", nfs_path]
        return [
            "remeasure",
            spec,
            "--release",
            str(release),
            "--layout",
            layout,
            *staged,
            "--manifest-hash",
            manifest_hash,
            "--promoted-rate",
            repr(float(promoted_rate)),
            "--run-id",
            run_id,
            "--results",
            base_uri(loaded),
            *(["--evaluation", evaluation] if evaluation else []),
        ]
    raise ValueError(f"unknown step {step!r}")


def staged_key(loaded: LoadedSpec) -> str:
    """Fetch what serving will read: the S3 copy when there is one (verifies the upload end to end)."""
    return "s3_uri" if loaded.spec.staging.s3 else "nfs_path"


def serving_cache(stage_task: str = "stage") -> str:
    """Where fetch puts the artifact, content-addressed like `serving.serving_copy` does locally."""
    return f"{POD_HOME}/serving-cache/" + f'{{{{ ti.xcom_pull(task_ids="{stage_task}")["manifest_hash"][:16] }}}}'


def shell(argv: list[str]) -> list[str]:
    """`sh -c` script: the CLI's stdout (its result JSON only) becomes the pod's XCom, and is
    echoed to the log; `set -e` keeps the CLI's exit status."""
    return [f"set -e; model-release {shlex.join(argv)} > {XCOM_FILE}; cat {XCOM_FILE}"]


# ---------------------------------------------------------------- what each pod needs


def _gi(gb: float) -> str:
    return f"{math.ceil(gb)}Gi"


def resources(loaded: LoadedSpec, step: Step) -> PodResources:
    """Requests sized per step. GPUs only where the step uses them: model_free and streaming
    quantization run on CPUs here, lm-eval's hf backend runs on CPU in float32, and a vLLM
    evaluation needs the widest tensor parallelism any layout uses to hold the weights."""
    spec, hw = loaded.spec, loaded.hardware
    params_b = spec.model.architecture.params_b
    gpu = hw.kind == "gpu"
    if step in ("benchmark", "rebenchmark"):
        return PodResources(gpus=hw.devices if gpu else 0, cpu="64", memory="512Gi", shm="64Gi")
    if step == "evaluate":
        backend = spec.evaluation.backend
        if backend == "vllm":
            tp = spec.evaluation.tensor_parallel_size or max(layout.tp for layout in spec.layouts)
            return PodResources(gpus=tp if gpu else 0, cpu="32", memory="256Gi", shm="64Gi")
        if backend == "hf":
            return PodResources(gpus=0, cpu="16", memory=_gi(params_b * 4 * 1.25 + 16), shm="8Gi")
        return PodResources(gpus=0, cpu="4", memory="16Gi", shm="1Gi")
    if step == "quantize":
        whole_model = spec.quantization.method in ("oneshot", "auto")  # auto may pick oneshot
        return PodResources(
            gpus=1 if whole_model and gpu else 0,
            cpu="16",
            memory=_gi(params_b * 2 * 1.25 + 16) if whole_model else "64Gi",
            shm="8Gi",
        )
    return PodResources(gpus=0, cpu="8", memory="16Gi", shm="1Gi")  # stage, fetch: network and disk


def container_resources(loaded: LoadedSpec, res: PodResources) -> k8s.V1ResourceRequirements:
    requests = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, str] = {}
    if res.gpus:
        device = loaded.hardware.device_resource
        if device is None:
            raise ReleaseError(
                f"{loaded.path}: hardware: profile {loaded.hardware.name!r} has no "
                "device_resource for Kubernetes scheduling"
            )
        requests[device] = limits[device] = str(res.gpus)  # extended resources: requests == limits
    return k8s.V1ResourceRequirements(requests=requests, limits=limits or None)


def env(loaded: LoadedSpec, step: Step, res: PodResources) -> dict[str, str]:
    """AITER defaults < hardware profile < spec's serving.env on GPU pods; the data root on the
    shared claim; the hub reachable for the steps that download (weights, lm-eval datasets)."""
    spec = loaded.spec
    out: dict[str, str] = {}
    if res.gpus:
        out.update(AITER_ENV)
        out.update(loaded.hardware.env)
        out.update(spec.serving.env)
    out["MODEL_RELEASE_HOME"] = POD_HOME
    out["HF_HOME"] = f"{POD_HOME}/hf"
    if step in ("quantize", "evaluate"):
        out["HF_HUB_OFFLINE"] = "0"
    if spec.staging.s3 is not None:  # the CLI's boto3 client reads these when no connection exists
        if spec.staging.s3.endpoint_url:
            out["AWS_ENDPOINT_URL"] = spec.staging.s3.endpoint_url
        if spec.staging.s3.region:
            out["AWS_DEFAULT_REGION"] = spec.staging.s3.region
    return out


def env_from(loaded: LoadedSpec, step: Step) -> list[k8s.V1EnvFromSource]:
    """Credentials by reference only: the S3 Secret named after the spec's connection, and an
    optional `huggingface` Secret (HF_TOKEN) for the steps that read the hub."""
    sources = []
    if loaded.spec.staging.s3 is not None:
        name = s3_secret_name(loaded.spec.staging.s3.connection_id)
        sources.append(k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=name)))
    if step in ("quantize", "evaluate"):
        sources.append(k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name="huggingface", optional=True)))
    return sources


def volumes(res: PodResources, settings: ClusterSettings) -> list[k8s.V1Volume]:
    claim = k8s.V1PersistentVolumeClaimVolumeSource(claim_name=settings.pvc)
    shm = k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=res.shm)
    return [k8s.V1Volume(name="data", persistent_volume_claim=claim), k8s.V1Volume(name="dshm", empty_dir=shm)]


def volume_mounts(loaded: LoadedSpec) -> list[k8s.V1VolumeMount]:
    mounts = [
        k8s.V1VolumeMount(name="data", mount_path=POD_HOME, sub_path=HOME_SUBPATH),
        k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
    ]
    if loaded.spec.staging.nfs is not None:
        mounts.append(k8s.V1VolumeMount(name="data", mount_path=loaded.spec.staging.nfs.path))
    return mounts


def placement(loaded: LoadedSpec, res: PodResources) -> tuple[dict[str, str], list[k8s.V1Toleration]]:
    """GPU pods go to the profile's node pool (its labels) and tolerate its taints; CPU-only
    steps stay off the GPU nodes."""
    if not res.gpus:
        return {}, []
    hw = loaded.hardware
    return dict(hw.node_labels), [k8s.V1Toleration(**taint) for taint in hw.taints]


# ---------------------------------------------------------------- the operator's arguments


def image_for(step: Step, settings: ClusterSettings) -> str:
    """The quantize image for the quantize step (llmcompressor needs a newer transformers than the
    worker's vLLM), the worker image for every other step."""
    return settings.quantize_image if step == "quantize" else settings.image


def pod_operator_kwargs(loaded: LoadedSpec, step: Step, settings: ClusterSettings | None = None, **args: Any) -> dict:
    """Keyword arguments for `KubernetesPodOperator(task_id=..., **kwargs)`; `args` go to `cli_args`."""
    return {**pod_operator_partial_kwargs(loaded, step, settings), "arguments": shell(cli_args(loaded, step, **args))}


def pod_operator_partial_kwargs(loaded: LoadedSpec, step: Step, settings: ClusterSettings | None = None) -> dict:
    """Everything but the container arguments: for `KubernetesPodOperator.partial(...)` mapped
    over arguments computed at run time (one re-benchmark pod per live release)."""
    settings = settings or ClusterSettings.from_env()
    res = resources(loaded, step)
    node_selector, tolerations = placement(loaded, res)
    labels = {
        "app.kubernetes.io/name": "model-release",
        "app.kubernetes.io/component": step,
        "model-release/release": label_value(loaded.spec.name),
    }
    return {
        "image": image_for(step, settings),
        "namespace": settings.namespace,
        "kubernetes_conn_id": settings.kube_conn_id,
        "labels": labels,
        "cmds": ["/bin/sh", "-c"],
        "env_vars": [k8s.V1EnvVar(name=k, value=v) for k, v in env(loaded, step, res).items()],
        "env_from": env_from(loaded, step),
        "container_resources": container_resources(loaded, res),
        "volumes": volumes(res, settings),
        "volume_mounts": volume_mounts(loaded),
        "node_selector": node_selector,
        "tolerations": tolerations,
        "image_pull_policy": "IfNotPresent",
        "startup_timeout_seconds": STARTUP_TIMEOUT_S,
        "do_xcom_push": True,
        "get_logs": True,
        "on_finish_action": "delete_succeeded_pod",  # a failed pod stays for `kubectl describe`
        "retries": RETRIES.get(step, 0),
    }
