"""Production mode: the step pods of `execution: kubernetes` specs, and the DAG that runs them.

No cluster here: the DAG files are imported by a real DagBag, every pod is built by the real
KubernetesPodOperator (templates rendered, `build_pod_request_obj`) and validated against the
Kubernetes OpenAPI schema in strict mode, and the docs' objects and Helm values are checked
against the names the code uses.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest
import yaml

from pipeline import __version__, cli
from pipeline.core.errors import GateFailed, ReleaseError
from pipeline.core.paths import PROJECT_ROOT
from pipeline.core.specs import load_spec
from pipeline.entry import flow, pod_steps
from pipeline.k8s import pods
from pipeline.k8s.manifests import s3_secret_name
from pipeline.records import edge
from pipeline.records.benchmark import LayoutResult, Probe
from pipeline.records.evaluate import EvalResult
from pipeline.records.events import detail_of
from pipeline.records.pods import Remeasured
from pipeline.records.release import StagedRef
from pipeline.release.registry import ReleaseData
from tests.conftest import PROD_SPEC

K8S_VERSION = "1.31"
DAG_ID = "model_release_k8s__qwen3_235b_a22b_fp8"
STEPS = ["quantize", "evaluate_baseline", "evaluate_candidate", "stage", "fetch"]
BENCHMARKS = ["benchmark[tp8-ep8]", "benchmark[tp4-ep4-x2]"]  # one mapped pod per layout measured
HEAVY = [*STEPS, *BENCHMARKS]
LIGHT = [
    "validate",
    "preflight",
    "preflight_promotion",
    "plan",
    "layout_names",
    "benchmark_arguments",
    "accuracy_gate",
    "record_staged",
    "select_layout",
    "slo_gate",
    "report",
    "approve",
    "promote",
    "verify",
    # a reviewer's Continue / Abort per rollout step, beside promote: a deferred wait, then a HITL task; no pods
    "review_steps",
    "review_step",
]
RUN_ID = "manual__2026-01-12T10:00:00+00:00"
HASH = "ab" * 32
ARTIFACT = "/var/lib/model-release/artifacts/qwen3-235b-a22b-fp8-0123456789abcdef"
# What the upstream pods print (their XCom), for rendering the templates that pull from them.
XCOMS = {
    "quantize": {"path": ARTIFACT, "manifest_hash": HASH},
    "stage": {
        "s3_uri": "s3://model-release-weights/qwen3-235b-a22b-fp8/qwen3-235b-a22b-fp8-0123456789abcdef/",
        "nfs_path": "/mnt/models/qwen3-235b-a22b-fp8-0123456789abcdef",
        "manifest_hash": HASH,
    },
    "fetch": {"path": f"/var/lib/model-release/serving-cache/{HASH[:16]}", "manifest_hash": HASH},
}
# Sub-commands the pods run that pipeline/cli/ does not have yet (issue #10 hands them over).


@pytest.fixture(scope="module")
def prod():
    return load_spec(PROD_SPEC)


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow-home")))
        mp.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
        for name in (
            "MODEL_RELEASE_WORKER_IMAGE",
            "MODEL_RELEASE_QUANTIZE_IMAGE",
            "MODEL_RELEASE_NAMESPACE",
            "MODEL_RELEASE_PVC",
        ):
            mp.delenv(name, raising=False)
        from airflow.dag_processing.dagbag import DagBag

        yield DagBag(dag_folder=str(PROJECT_ROOT / "dags"))


class FakeTI:
    """Just enough of a task instance for rendering: XCom comes from XCOMS, and only from tasks
    upstream of the one being rendered (a template pulling from anywhere else is a bug)."""

    def __init__(self, dag, task):
        self.dag_id, self.task_id, self.run_id = dag.dag_id, task.task_id, RUN_ID
        self.try_number, self.map_index = 1, -1
        self._upstream = task.get_flat_relative_ids(upstream=True)

    def xcom_pull(self, task_ids, **kwargs):
        assert task_ids in self._upstream, f"{self.task_id} pulls XCom from {task_ids}, which is not upstream"
        return XCOMS[task_ids]


PREDICTIONS = (
    f"s3://model-release-weights/qwen3-235b-a22b-fp8/runs/{flow.run_dir(RUN_ID).name}/benchmark/predictions.json"
)


def benchmark_pod(loaded, arguments: list[str]) -> dict:
    """A mapped benchmark pod: the DAG's partial arguments with one of `benchmark_arguments`' lists."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    op = KubernetesPodOperator(
        task_id="benchmark",
        arguments=arguments,
        **pods.pod_operator_partial_kwargs(loaded, "benchmark", settings=pods.ClusterSettings()),
    )
    return kubernetes.client.ApiClient().sanitize_for_serialization(op.build_pod_request_obj({}, dry_run=True))


@pytest.fixture(scope="module")
def rendered(dagbag, prod):
    """task id -> the pod the operator would create, as the JSON it would send; the benchmark pods
    from the arguments the `benchmark_arguments` task makes for the spec's two layouts."""
    dag = dagbag.dags[DAG_ID]
    out = {}
    for task_id in STEPS:
        op = copy.deepcopy(dag.get_task(task_id))
        context = {"ti": FakeTI(dag, op), "run_id": RUN_ID, "dag": dag, "task": op, "dag_run": None}
        op.render_template_fields(context)
        pod = op.build_pod_request_obj(context, dry_run=True)  # dry run: no kube config needed
        out[task_id] = kubernetes.client.ApiClient().sanitize_for_serialization(pod)
    layouts = [task_id.removeprefix("benchmark[").removesuffix("]") for task_id in BENCHMARKS]
    plan = {"layouts": [], "file": PREDICTIONS}
    arguments = edge.call(pod_steps.benchmark_arguments, str(PROD_SPEC), layouts, XCOMS["fetch"], plan, RUN_ID)
    for task_id, args in zip(BENCHMARKS, arguments, strict=True):
        out[task_id] = benchmark_pod(prod, args)
    return out


def container(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "base")


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(pod)["env"]}


def mounts_of(pod: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container(pod)["volumeMounts"]}


def cli_argv(pod: dict) -> list[str]:
    return script_argv(container(pod)["args"])


def script_argv(arguments: list[str]) -> list[str]:
    """The `model-release` argv inside a pod's `sh -c` arguments (`pods.shell`)."""
    [script] = arguments
    match = re.fullmatch(
        r"set -e; model-release (.*) > /airflow/xcom/return\.json; cat /airflow/xcom/return\.json", script
    )
    assert match, script
    return shlex.split(match.group(1))


# ---------------------------------------------------------------- the DAGs


def test_both_dag_files_import_without_errors(dagbag):
    files = {"model_release.py", "model_release_k8s.py"}
    assert {path: error for path, error in dagbag.import_errors.items() if path.rsplit("/", 1)[-1] in files} == {}
    assert {"model_release", DAG_ID} <= set(dagbag.dag_ids)


def test_local_dag_runs_nothing_as_a_pod(dagbag):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    tasks = dagbag.dags["model_release"].tasks
    assert tasks and not any(isinstance(task, KubernetesPodOperator) for task in tasks)


def test_kubernetes_dag_has_one_dag_per_kubernetes_spec(dagbag, prod):
    assert [pods.dag_id(loaded) for loaded in pods.kubernetes_specs()] == [DAG_ID]  # the tiny spec runs locally
    assert pods.dag_id(prod) == DAG_ID
    assert sorted(d for d in dagbag.dag_ids if d.startswith("model_release_k8s__")) == [DAG_ID]


def test_kubernetes_dag_has_the_release_graph_with_heavy_steps_as_pods(dagbag):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    dag = dagbag.dags[DAG_ID]
    assert set(dag.task_ids) == {*STEPS, "benchmark", *LIGHT}
    for task_id in STEPS:
        assert isinstance(dag.get_task(task_id), KubernetesPodOperator), task_id
    benchmark = dag.get_task("benchmark")  # mapped over the layouts the plan chose, one pod at a time
    assert issubclass(benchmark.operator_class, KubernetesPodOperator) and benchmark.max_active_tis_per_dagrun == 1
    for task_id in LIGHT:
        assert not isinstance(dag.get_task(task_id), KubernetesPodOperator), task_id

    def up(task_id):
        return dag.get_task(task_id).upstream_task_ids

    assert up("preflight") == {"validate"} and up("quantize") == up("evaluate_baseline") == {"preflight"}
    assert up("evaluate_candidate") == {"quantize", "evaluate_baseline"}  # one GPU step at a time
    assert up("accuracy_gate") == {"validate", "evaluate_baseline", "evaluate_candidate"}
    assert up("stage") == {"accuracy_gate"} and up("fetch") == {"stage"}
    # the planner before any GPU time: its predictions choose the layouts and start each search
    assert up("plan") == {"validate"} and up("layout_names") == {"validate", "plan"}
    assert up("benchmark_arguments") == {"layout_names", "fetch", "plan"} and up("benchmark") == {"benchmark_arguments"}
    assert up("select_layout") == {"validate", "benchmark"} and up("slo_gate") == {"validate", "select_layout"}
    # the same review and promotion tail as the local DAG: gates in code, a reviewer, then DOKS
    assert (
        up("approve") == {"validate", "report"}  # the release it asks about: validate's output
        and up("preflight_promotion") == {"validate", "approve"}  # the cluster checked again before it changes
        and up("promote") == {"validate", "preflight_promotion"}
        and up("verify") == {"validate", "promote"}
    )
    local = dagbag.dags["model_release"]
    for task_id in ("report", "approve", "promote", "verify"):  # one definition: the tails cannot drift apart
        assert type(dag.get_task(task_id)) is type(local.get_task(task_id)), task_id
        assert dag.get_task(task_id).outlets == local.get_task(task_id).outlets, task_id
    assert [a.name for a in dag.get_task("promote").outlets] == ["model-release://live-release"]  # wakes re-benchmarks


def test_no_pod_running_task_starts_before_the_cluster_preflight(dagbag):
    """Walk upstream of every KubernetesPodOperator (mapped ones included): preflight is there."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    dag = dagbag.dags[DAG_ID]
    pod_tasks = [
        task
        for task in dag.tasks
        if isinstance(task, KubernetesPodOperator)
        or issubclass(getattr(task, "operator_class", object), KubernetesPodOperator)
    ]
    assert {task.task_id for task in pod_tasks} == {*STEPS, "benchmark"}
    for task in pod_tasks:
        assert "preflight" in task.get_flat_relative_ids(upstream=True), task.task_id
    assert "preflight_promotion" in dag.get_task("promote").get_flat_relative_ids(upstream=True)


# ---------------------------------------------------------------- the pods


@pytest.mark.parametrize("task_id", HEAVY)
def test_every_pod_is_a_valid_kubernetes_pod(rendered, task_id):
    pod = rendered[task_id]
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    assert "{{" not in json.dumps(pod), "a template was left unrendered"


def test_a_pod_with_a_wrong_field_fails_validation(rendered):
    bad = copy.deepcopy(rendered["quantize"])
    container(bad)["resource"] = container(bad).pop("resources")  # misspelled field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(rendered["quantize"])
    bad["spec"]["volumes"][0]["persistentVolumeClaim"] = {"claim": "model-release-nfs"}  # claimName missing
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("task_id", BENCHMARKS)
def test_benchmark_pod_takes_the_whole_gpu_node(rendered, prod, task_id):
    pod = rendered[task_id]
    resources = container(pod)["resources"]
    assert (
        resources["limits"]["amd.com/gpu"] == resources["requests"]["amd.com/gpu"] == str(prod.hardware.devices) == "8"
    )
    assert pod["spec"]["nodeSelector"] == {"doks.digitalocean.com/gpu-model": "mi325x"}
    assert pod["spec"]["tolerations"] == [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    env = env_of(pod)
    assert env["VLLM_ROCM_USE_AITER"] == env["VLLM_ROCM_USE_AITER_MOE"] == "1"
    assert env["HIP_FORCE_DEV_KERNARG"] == "1" and env["VLLM_USE_TRITON_FLASH_ATTN"] == "0"  # profile, spec
    assert env["MODEL_RELEASE_HOME"] == pods.POD_HOME
    mounts = mounts_of(pod)
    assert mounts["/dev/shm"]["name"] == "dshm" and mounts[pods.POD_HOME]["subPath"] == pods.HOME_SUBPATH
    assert mounts["/mnt/models"]["name"] == "data"  # staging.nfs.path, the share itself
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "model-release-nfs"}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    layout = task_id.removeprefix("benchmark[").removesuffix("]")
    argv = cli_argv(pod)
    assert argv[:4] == [
        "benchmark",
        "/opt/model-release/configs/releases/qwen3-235b-a22b-fp8-mi325x.yaml",
        "--layout",
        layout,
    ]
    assert argv[argv.index("--model") + 1] == XCOMS["fetch"]["path"]
    assert argv[argv.index("--results") + 1] == "s3://model-release-weights/qwen3-235b-a22b-fp8/runs"
    assert argv[argv.index("--run-id") + 1] == RUN_ID
    assert argv[argv.index("--predictions") + 1] == PREDICTIONS  # where its search starts


@pytest.mark.parametrize("task_id", HEAVY)
def test_every_pod_runs_the_worker_image_with_secrets_by_reference_only(rendered, task_id):
    """Every step but quantize runs the worker image; quantize runs the quantize image (llmcompressor
    needs a transformers the worker's vLLM cannot sit beside: docker/quantize.Dockerfile)."""
    pod = rendered[task_id]
    image = pods.DEFAULT_QUANTIZE_IMAGE if task_id == "quantize" else pods.DEFAULT_WORKER_IMAGE
    assert container(pod)["image"] == image
    assert pod["metadata"]["namespace"] == "model-release"
    assert {"secretRef": {"name": s3_secret_name("spaces_default")}} in container(pod)["envFrom"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & set(env_of(pod))
    assert env_of(pod)["AWS_ENDPOINT_URL"] == "https://nyc3.digitaloceanspaces.com"
    assert container(pod)["command"] == ["/bin/sh", "-c"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "model-release"


def test_cpu_steps_stay_off_the_gpu_nodes_and_gpu_steps_ask_for_what_they_use(rendered):
    for task_id in ("quantize", "stage", "fetch"):  # production spec quantizes with model_free, on CPU
        pod = rendered[task_id]
        assert "amd.com/gpu" not in container(pod)["resources"]["requests"], task_id
        assert not pod["spec"].get("nodeSelector") and not pod["spec"].get("tolerations"), task_id
        assert "VLLM_ROCM_USE_AITER" not in env_of(pod)
    for task_id in ("evaluate_baseline", "evaluate_candidate"):  # vllm backend: the widest tp, 8
        assert container(rendered[task_id])["resources"]["limits"]["amd.com/gpu"] == "8"
    assert env_of(rendered["quantize"])["HF_HUB_OFFLINE"] == "0"  # downloads the BF16 source


def test_pods_pass_the_upstream_results_along(rendered):
    assert cli_argv(rendered["evaluate_candidate"])[:6] == [
        "evaluate",
        "/opt/model-release/configs/releases/qwen3-235b-a22b-fp8-mi325x.yaml",
        "--side",
        "candidate",
        "--candidate",
        ARTIFACT,
    ]
    assert cli_argv(rendered["stage"])[-2:] == ["--artifact", ARTIFACT]
    assert cli_argv(rendered["fetch"]) == ["fetch", XCOMS["stage"]["s3_uri"], XCOMS["fetch"]["path"]]


@pytest.mark.parametrize("task_id", HEAVY)
def test_cli_accepts_each_pod_command(rendered, task_id):
    argv = cli_argv(rendered[task_id])
    cli.parser().parse_args(argv)  # argparse exits on an unknown command or option
    specs = [arg for arg in argv if arg.startswith(pods.POD_PROJECT)]
    assert all((PROJECT_ROOT / spec.removeprefix(pods.POD_PROJECT + "/")).is_file() for spec in specs)


def test_quantize_oneshot_takes_one_gpu_and_hf_evaluation_none(spec_file):
    def edit(data):
        data["quantization"]["method"] = "oneshot"
        data["evaluation"]["backend"] = "local-completions"

    loaded = load_spec(spec_file(PROD_SPEC, edit))
    assert pods.resources(loaded, "quantize").gpus == 1
    assert pods.resources(loaded, "evaluate").gpus == 0
    kwargs = pods.pod_operator_kwargs(loaded, "quantize", settings=pods.ClusterSettings())
    assert kwargs["container_resources"].limits == {"amd.com/gpu": "1"}
    assert kwargs["node_selector"] == {"doks.digitalocean.com/gpu-model": "mi325x"}


def test_worker_image_namespace_and_claim_come_from_the_environment(prod, monkeypatch):
    monkeypatch.setenv("MODEL_RELEASE_WORKER_IMAGE", "registry.example.com/mr/worker-rocm:abc123")
    monkeypatch.setenv("MODEL_RELEASE_PVC", "other-claim")
    kwargs = pods.pod_operator_kwargs(prod, "fetch")
    assert kwargs["image"] == "registry.example.com/mr/worker-rocm:abc123"
    assert kwargs["volumes"][0].persistent_volume_claim.claim_name == "other-claim"
    assert kwargs["namespace"] == "model-release"
    assert pods.DEFAULT_WORKER_IMAGE.endswith(f"/worker-rocm:{__version__}")


def test_nfs_only_spec_fetches_from_nfs_and_keeps_results_there(spec_file, tmp_path):
    def edit(data):
        data["staging"] = {"nfs": {"path": str(tmp_path / "nfs")}}

    loaded = load_spec(spec_file(PROD_SPEC, edit))
    assert pods.cli_args(loaded, "fetch")[1] == pods.xcom("stage", "nfs_path")
    assert pods.base_uri(loaded) == f"{tmp_path}/nfs/runs"
    kwargs = pods.pod_operator_kwargs(loaded, "benchmark", settings=pods.ClusterSettings(), layout="tp8-ep8")
    assert kwargs["env_from"] == [] and "AWS_ENDPOINT_URL" not in {e.name for e in kwargs["env_vars"]}
    assert str(tmp_path / "nfs") in {m.mount_path for m in kwargs["volume_mounts"]}


# ---------------------------------------------------------------- results in storage


def test_light_tasks_select_a_layout_from_the_pods_stored_results(spec_file, tmp_path, monkeypatch):

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "worker-home"))
    loaded = load_spec(spec_file(PROD_SPEC, lambda d: d.update(staging={"nfs": {"path": str(tmp_path / "nfs")}})))
    run = pods.run_uri(pods.base_uri(loaded), RUN_ID)
    assert run.endswith("/" + flow.run_dir(RUN_ID).name)  # same directory name as a local run
    refs = []
    for name, tp, per_server in (("tp8-ep8", 8, 12.5), ("tp4-ep4-x2", 4, 18.1)):  # the fleet fits max_servers
        layout = LayoutResult(
            layout=name,
            tp=tp,
            dp=1,
            ep=tp,
            pp=1,
            replicas=8 // tp,
            devices=8,
            status="ok",
            max_slo_rate=per_server,
            per_server=per_server,
            per_device=per_server / 8,
        )
        uri = pod_steps.write(f"{run}/benchmark/{name}.json", layout, loaded)
        refs.append({"layout": name, "status": "ok", "result_uri": uri})
    release = edge.call(flow.validate_spec, str(loaded.path))
    selection = edge.call(pod_steps.select_layout, release, refs, RUN_ID)
    assert selection["best"] == "tp4-ep4-x2" and selection["passed"]
    assert selection["files"]["json"] == f"{run}/benchmark/benchmark.json"
    assert (
        json.loads(
            (tmp_path / "nfs" / "runs" / flow.run_dir(RUN_ID).name / "benchmark" / "benchmark.json").read_text()
        )["selection"]["best"]
        == "tp4-ep4-x2"
    )


def test_the_plan_is_stored_before_the_pods_and_only_the_top_k_layouts_get_one(spec_file, tmp_path, monkeypatch):
    """The light tasks before the benchmark pods, for real on the production spec with generated
    candidates (staging on an NFS directory here): plan, choose, one pod's arguments per choice."""
    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "worker-home"))
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")

    def edit(data):
        data["staging"] = {"nfs": {"path": str(tmp_path / "nfs")}}
        data["candidates"] = {"max_tp": 8, "top_k": 2}

    path = str(spec_file(PROD_SPEC, edit))
    loaded = load_spec(path)
    validated = edge.call(flow.validate_spec, path, RUN_ID)
    release = validated["release_id"]
    predictions = edge.call(pod_steps.plan_layouts, validated, RUN_ID)
    stored = f"{pods.run_uri(pods.base_uri(loaded), RUN_ID)}/benchmark/predictions.json"
    assert predictions["file"] == stored and json.loads(Path(stored).read_text())["layouts"] == predictions["layouts"]
    ranked = sorted(predictions["layouts"], key=lambda p: -p["predicted_per_server"])
    assert len(ranked) == len(loaded.spec.layouts) > 2  # the spec's two and the generated ones
    names = edge.call(flow.layouts_to_measure, validated, predictions)
    # top_k 2, and (at most 4 more) those the planner cannot rank below the best: their intervals overlap it
    best = ranked[0]
    overlapping = [
        p["layout"]
        for p in ranked[2:]
        if p["predicted_low"] <= best["predicted_high"] and best["predicted_low"] <= p["predicted_high"]
    ][:4]
    assert sorted(names) == sorted([p["layout"] for p in ranked[:2]] + overlapping)
    chosen = next(e.detail.stored() for e in flow.registry().events(release) if e.kind == "layouts_chosen")
    assert set(chosen["skipped"]) == {p["layout"] for p in ranked} - set(names)
    assert len(names) < len(ranked)  # the bound left some out

    arguments = edge.call(pod_steps.benchmark_arguments, path, names, XCOMS["fetch"], predictions, RUN_ID)
    assert len(arguments) == len(names)
    for name, args in zip(names, arguments, strict=True):
        pod = benchmark_pod(loaded, args)
        assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
        parsed = cli.parser().parse_args(cli_argv(pod))
        assert (parsed.layout, parsed.model, parsed.predictions) == (name, XCOMS["fetch"]["path"], stored)
        # what the pod's search starts from: its own layout's prediction, read back from storage
        prior = pod_steps.layout_prediction(parsed.predictions, name, loaded)
        assert prior is not None and prior.predicted_max_slo_rate == next(
            p["predicted_max_slo_rate"] for p in ranked if p["layout"] == name
        )


def test_reading_a_missing_result_names_it(prod, tmp_path):
    from pipeline.core.errors import ReleaseError

    with pytest.raises(ReleaseError, match="no such result"):
        pod_steps.read(EvalResult, str(tmp_path / "missing.json"), prod)


# ---------------------------------------------------------------- docs and Helm values


def test_the_platform_install_holds_the_step_pods_claim_and_validates(prod):
    """The step pods' ReadWriteMany claim comes from the platform install (docs/production.md step 4)."""
    from pipeline.k8s import install

    objects = install.render(prod, install.PlatformOptions(nfs_server="10.0.0.1", nfs_path="/share"))
    for obj in objects:
        if obj["kind"] not in ("Gateway", "PodMonitor"):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert install.validate(objects) == []
    settings = pods.ClusterSettings()
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert (claim["metadata"]["name"], claim["metadata"]["namespace"]) == (settings.pvc, settings.namespace)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_production_doc_names_what_the_code_uses(prod):
    text = (PROJECT_ROOT / "docs" / "production.md").read_text()
    assert "No Docker engine, GPU or Kubernetes cluster was available" in text
    for name in (
        DAG_ID,
        s3_secret_name(prod.spec.staging.s3.connection_id),
        prod.spec.staging.s3.bucket,
        "doks.digitalocean.com/gpu-model=mi325x",
        "amd.com/gpu:NoSchedule",
        "docker/images.sh",
        "MODEL_RELEASE_REGISTRY_URL",
        "docs/helm-values.yaml",
        "spaces_default",
    ):
        assert name in text, name


def test_helm_values_configure_what_the_pods_and_light_tasks_need(prod):
    values = yaml.safe_load((PROJECT_ROOT / "docs" / "helm-values.yaml").read_text())
    assert values["executor"] == "KubernetesExecutor"
    assert values["dags"]["gitSync"]["enabled"] and values["dags"]["gitSync"]["subPath"] == "dags"
    assert values["images"]["airflow"]["tag"] == values["defaultAirflowTag"] == __version__
    assert values["airflowVersion"] == "3.3.2"
    env = {item["name"]: item["value"] for item in values["env"]}
    settings = pods.ClusterSettings()
    assert env["MODEL_RELEASE_WORKER_IMAGE"] == pods.DEFAULT_WORKER_IMAGE
    assert env["MODEL_RELEASE_NAMESPACE"] == settings.namespace and env["MODEL_RELEASE_PVC"] == settings.pvc
    kube = json.loads(env["AIRFLOW_CONN_KUBERNETES_DEFAULT"])
    assert kube["extra"] == {"in_cluster": True, "namespace": settings.namespace}
    secrets = {item["envName"]: item for item in values["secret"]}
    assert f"AIRFLOW_CONN_{prod.spec.staging.s3.connection_id.upper()}" in secrets
    assert "MODEL_RELEASE_REGISTRY_URL" in secrets
    assert values["postgresql"]["enabled"] is False and values["data"]["metadataSecretName"]
    assert not literal_credentials(values)


CHART_LITERAL_KEYS = {"pass", "fernetKey", "apiSecretKey", "jwtSecret", "webserverSecretKey", "brokerUrl"}


def literal_credentials(node, path="") -> list[str]:
    """Keys that would hold a credential in the clear: the chart's literal-key fields, passwords."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            literal = str(key) in CHART_LITERAL_KEYS or "password" in str(key).lower()
            if literal and isinstance(value, str) and value:
                found.append(f"{path}.{key}")
            found += literal_credentials(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found += literal_credentials(item, f"{path}[{i}]")
    return found


def test_accuracy_gate_reads_both_sides_from_storage_and_publishes_its_report(spec_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "worker-home"))
    loaded = load_spec(spec_file(PROD_SPEC, lambda d: d.update(staging={"nfs": {"path": str(tmp_path / "nfs")}})))
    run = pods.run_uri(pods.base_uri(loaded), RUN_ID)

    def side(name: str, score: float) -> dict:
        data = {
            "model_path": f"/models/{name}",
            "model_manifest_hash": name * 8,
            "backend": "vllm",
            "settings": {},
            "seconds": 1.0,
            "scores": [
                {"task": t.name, "metric": "acc", "score": score, "stderr": 0.001, "samples": 1000}
                for t in loaded.spec.evaluation.tasks
            ],
        }
        uri = pod_steps.write_bytes(f"{run}/evaluate-{name}.json", json.dumps(data).encode(), loaded)
        return {"side": name, "result_uri": uri, "model_manifest_hash": name * 8}

    release = edge.call(flow.validate_spec, str(loaded.path))
    gate = pod_steps.accuracy_gate
    decision = edge.call(gate, release, side("baseline", 0.90), side("candidate", 0.899), RUN_ID)
    assert decision["passed"] and decision["validation_html"] == f"{run}/accuracy_validation.html"
    with pytest.raises(GateFailed, match="accuracy gate failed"):
        edge.call(gate, release, side("baseline", 0.90), side("candidate", 0.80), RUN_ID)
    assert "FAIL" in (tmp_path / "nfs" / "runs" / flow.run_dir(RUN_ID).name / "accuracy_validation.html").read_text()


# ---------------------------------------------------------------- re-benchmarks as pods

REBENCH_DAG_ID = "rebenchmark__qwen3_235b_a22b_fp8"


def live_prod_release(loaded, staged: dict, rate: float = 2.2, layout: str = "tp4-ep4-x2"):
    """A release of the production spec as promotion leaves it: live, with its figures."""
    reg = flow.registry()
    rel = reg.open_release(
        f"promoted-{layout}", loaded.spec.name, str(loaded.path), loaded.path.read_text(), "kubernetes"
    )
    reg.record(
        rel.id,
        detail_of("slo_gate", {"passed": True}),
        "gate",
        data=ReleaseData.model_validate(
            {
                "layout": layout,
                "max_slo_rate": rate,
                "rate_per_server": rate,
                "p90_ttft_ms": 900.0,
                "p90_tpot_ms": 40.0,
                "manifest_hash": HASH,
                **staged,
            }
        ),
    )
    reg.record(rel.id, detail_of("deploy_finished", None), "pipeline", status="live")
    return reg, reg.get(rel.id)


def test_kubernetes_rebenchmark_dag_measures_each_live_release_in_a_pod(dagbag):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    assert not {p: e for p, e in dagbag.import_errors.items() if p.endswith("rebenchmark.py")}
    dag = dagbag.dags[REBENCH_DAG_ID]
    assert set(dag.task_ids) == {"live_releases", "pod_arguments", "measure", "judge"}
    measure = dag.get_task("measure")
    assert issubclass(measure.operator_class, KubernetesPodOperator)  # mapped: one pod per live release
    assert measure.upstream_task_ids == {"pod_arguments"}
    assert dag.get_task("judge").upstream_task_ids == {"live_releases", "measure"}
    assert dag.get_task("judge").trigger_rule == "all_done"  # a crashed pod is judged (and alerted) too
    local = dagbag.dags["rebenchmark__tiny_qwen3_moe_fp8"]  # the tiny spec measures beside Airflow
    assert set(local.task_ids) == {"live_releases", "measure"}
    assert not issubclass(getattr(local.get_task("measure"), "operator_class", object), KubernetesPodOperator)


def test_rebenchmark_pod_runs_the_release_own_layout_and_artifact_on_a_whole_node(
    prod, release_env, tmp_path, monkeypatch
):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "worker-home"))
    _, rel = live_prod_release(prod, {"s3_uri": XCOMS["stage"]["s3_uri"]})
    [arguments] = pod_steps.remeasure_arguments([rel.id], RUN_ID)
    op = KubernetesPodOperator(
        task_id="measure",
        arguments=arguments,
        **pods.pod_operator_partial_kwargs(prod, "rebenchmark", settings=pods.ClusterSettings()),
    )
    pod = kubernetes.client.ApiClient().sanitize_for_serialization(op.build_pod_request_obj({}, dry_run=True))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    assert container(pod)["resources"]["limits"]["amd.com/gpu"] == "8"
    assert pod["spec"]["nodeSelector"] == {"doks.digitalocean.com/gpu-model": "mi325x"}
    assert env_of(pod)["VLLM_ROCM_USE_AITER"] == "1"
    argv = cli_argv(pod)
    args = cli.parser().parse_args(argv)
    assert (args.release, args.layout, args.s3_uri, args.manifest_hash, args.promoted_rate, args.run_id) == (
        rel.id,
        "tp4-ep4-x2",
        XCOMS["stage"]["s3_uri"],
        HASH,
        2.2,
        RUN_ID,
    )
    assert args.results == "s3://model-release-weights/qwen3-235b-a22b-fp8/runs"


def test_rebenchmark_pod_holds_the_fresh_answers_to_the_gate_results_the_release_was_promoted_on(
    spec_file, release_env, tmp_path, monkeypatch
):
    """The pod has no registry: the light task stores the release's in-process gate results beside
    the run, the pod reads them back (`remeasure --evaluation`) and hands them to the same
    measurement a local re-benchmark runs; a release recorded without them is measured unchecked."""
    from pipeline.records.evaluate import EvalResult, TaskScore
    from pipeline.release import rebenchmark

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "worker-home"))
    loaded = load_spec(spec_file(PROD_SPEC, lambda d: d.update(staging={"nfs": {"path": str(tmp_path / "nfs")}})))
    reg, rel = live_prod_release(loaded, {"nfs_path": XCOMS["stage"]["nfs_path"]})
    _, unchecked = live_prod_release(loaded, {"nfs_path": XCOMS["stage"]["nfs_path"]}, layout="tp8-ep8")

    def side(name: str, score: float) -> dict:
        task = TaskScore(task="gsm8k", metric="exact_match", score=score, stderr=0.01, samples=4, items=[score] * 4)
        found = EvalResult(
            model_path=f"/models/{name}",
            model_manifest_hash=HASH,
            backend="vllm",
            scores=[task],
            settings={},
            seconds=1,
        )
        return found.model_dump(mode="json")

    gate = {"baseline": side("bf16", 0.9), "candidate": side("fp8", 0.88)}
    reg.record(rel.id, detail_of("accuracy_gate", {"passed": True}), "gate", data=ReleaseData(evaluation=gate))

    checked, plain = pod_steps.remeasure_arguments([rel.id, unchecked.id], RUN_ID)
    args = cli.parser().parse_args(script_argv(checked))
    assert args.evaluation == pod_steps.evaluation_uri(pods.base_uri(loaded), RUN_ID, rel.id)
    assert cli.parser().parse_args(script_argv(plain)).evaluation is None

    handed = {}

    def measure(loaded, staged, layout, promoted_rate, out_dir, accuracy=None):
        handed[layout] = accuracy
        raise ReleaseError("engine did not start")  # stored as the pod's result, for the judge

    monkeypatch.setattr(rebenchmark, "measure", measure)
    staged = {"nfs_path": XCOMS["stage"]["nfs_path"], "manifest_hash": HASH}
    for release, layout, evaluation in ((rel, "tp4-ep4-x2", args.evaluation), (unchecked, "tp8-ep8", None)):
        out = pod_steps.remeasure(
            str(loaded.path), release.id, layout, StagedRef(**staged), 2.2, args.results, RUN_ID, evaluation
        )
        assert out.status == "error"
    baseline, candidate = handed["tp4-ep4-x2"]
    assert (baseline.scores[0].score, candidate.scores[0].score) == (0.9, 0.88)
    assert baseline.model_path == "/models/bf16" and handed["tp8-ep8"] is None


def test_rebenchmark_judge_reads_the_pod_result_and_degrades_or_fails_loudly(
    spec_file, release_env, tmp_path, monkeypatch
):
    from pipeline.core.errors import ReleaseError

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path / "worker-home"))
    nfs = tmp_path / "nfs"
    loaded = load_spec(spec_file(PROD_SPEC, lambda d: d.update(staging={"nfs": {"path": str(nfs)}})))
    reg, rel = live_prod_release(loaded, {"nfs_path": str(nfs / "gone")})

    # the pod side, for real: the staged artifact is gone, so it stores the reason instead of figures
    staged = rel.staged()
    stored = pod_steps.remeasure(str(loaded.path), rel.id, "tp4-ep4-x2", staged, 2.2, pods.base_uri(loaded), RUN_ID)
    assert stored.status == "error"
    assert "gone" in (pod_steps.read(Remeasured, stored.result_uri, loaded).error or "")
    with pytest.raises(ReleaseError, match="re-benchmark failed"):
        pod_steps.judge_remeasured(rel.id, RUN_ID)
    assert reg.get(rel.id).status == "live"  # no evidence of degradation
    assert [e.kind for e in reg.events(rel.id)][-2:] == ["rebenchmark_failed", "alert"]

    # a measurement at a third of the promoted capacity: degraded, with a trend point
    slow = LayoutResult(
        layout="tp4-ep4-x2",
        tp=4,
        dp=1,
        ep=4,
        pp=1,
        replicas=2,
        devices=8,
        status="ok",
        max_slo_rate=0.7,
        capacity_rps=0.9,
        per_server=0.7,
        per_device=0.7 / 8,
        probes=[
            Probe(
                rate=2.2,
                num_prompts=200,
                achieved_rate=0.9,
                completed=200,
                failed=0,
                failed_fraction=0.0,
                duration_s=222.0,
                output_tok_s=126.0,
                p50_ttft_ms=6000.0,
                p90_ttft_ms=9000.0,
                p99_ttft_ms=9900.0,
                p50_tpot_ms=40.0,
                p90_tpot_ms=45.0,
                p99_tpot_ms=49.0,
                p90_itl_ms=45.0,
                p90_e2el_ms=15000.0,
                passed=False,
                reasons=["p90 TTFT 9000.0 ms > 3000"],
            )
        ],
    )
    pod_steps.write(
        stored.result_uri, Remeasured(status="ok", result=slow, versions={"engine": "vllm 0.32.0+rocm"}), loaded
    )
    verdict = pod_steps.judge_remeasured(rel.id, RUN_ID)
    assert verdict.status == "degraded" and reg.get(rel.id).status == "degraded"
    assert any("SLO fails at the promoted rate" in r for r in verdict.reasons)
    point = [e for e in reg.events(rel.id) if e.kind == "trend_point"][-1]
    assert point.detail.stored()["max_slo_rate"] == 0.7 and point.detail.stored()["engine"] == "vllm 0.32.0+rocm"

    # a pod that crashed before writing anything: a failed measurement, named
    (nfs / "runs" / flow.run_dir(RUN_ID).name / "rebenchmark" / f"release-{rel.id}.json").unlink()
    with pytest.raises(ReleaseError, match="left no result"):
        pod_steps.judge_remeasured(rel.id, RUN_ID)
