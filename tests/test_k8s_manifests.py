"""Rendered Kubernetes objects for the production spec: valid against the API schema, and
carrying the layout, placement, weights and identity the release needs."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import load_spec
from pipeline.k8s import crds, manifests, pods
from pipeline.k8s.manifests import Artifact, RenderOptions
from pipeline.stages import drain
from testkit import http_stub
from tests.conftest import PROD_SPEC, TINY_SPEC

HASH = "3f" * 32
RELEASE = "manual__2026-01-12T10:00:00+00:00"
NFS_ARTIFACT = Artifact(
    nfs_path="/mnt/models/qwen3-235b-a22b-fp8-3f3f", s3_uri="s3://model-release-weights/qwen3/x", manifest_hash=HASH
)
S3_ARTIFACT = Artifact(s3_uri="s3://model-release-weights/qwen3-235b-a22b-fp8/3f3f", manifest_hash=HASH)


@pytest.fixture(scope="module")
def prod():
    return load_spec(PROD_SPEC)


def of_kind(objs, kind):
    return [obj for obj in objs if obj["kind"] == kind]


def pod(deployment):
    return deployment["spec"]["template"]["spec"]


def container(deployment):
    return pod(deployment)["containers"][0]


@pytest.mark.parametrize("layout, groups, gpus", [("tp8-ep8", 1, 8), ("tp4-ep4-x2", 2, 4)])
def test_each_layout_renders_one_deployment_per_replica_group_and_passes_strict_schema(prod, layout, groups, gpus):
    objs = manifests.render(prod, layout, RELEASE, NFS_ARTIFACT)
    assert manifests.validate(objs, "1.31") == []
    deployments = of_kind(objs, "Deployment")
    assert len(deployments) == groups
    assert len({d["metadata"]["name"] for d in deployments}) == groups
    for d in deployments:
        assert d["spec"]["replicas"] == 1
        # never Recreate (offline for the whole load); a restart of a pod needs no spare server
        assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        resources = container(d)["resources"]
        assert resources["limits"] == {"amd.com/gpu": gpus} and resources["requests"]["amd.com/gpu"] == gpus
        argv = container(d)["command"]
        assert argv[:3] == ["vllm", "serve", "/models/qwen3-235b-a22b-fp8-3f3f"]
        assert argv[argv.index("--tensor-parallel-size") + 1] == str(gpus)
        assert "--enable-expert-parallel" in argv
        assert argv[argv.index("--port") + 1] == "8000"
        assert argv[argv.index("--served-model-name") + 1] == "qwen3-235b-a22b-fp8"
        assert container(d)["image"] == prod.spec.serving.engine_image
        assert d["metadata"]["namespace"] == "llm-serving"
    assert [o["kind"] for o in objs] == [
        "PersistentVolumeClaim",
        *["Deployment"] * groups,
        "Service",  # the release's own
        "PodDisruptionBudget",
        "HTTPRoute",  # the model's address, as it stands once this release is live
    ]
    yaml_docs = list(yaml.safe_load_all(manifests.to_yaml(objs)))
    assert yaml_docs == objs and "&id" not in manifests.to_yaml(objs)


def test_engine_flags_and_env_come_from_the_spec_with_aiter(prod):
    objs = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT)
    c = container(of_kind(objs, "Deployment")[0])
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_ROCM_USE_AITER"] == "1" and env["VLLM_ROCM_USE_AITER_MOE"] == "1"
    assert env["VLLM_USE_TRITON_FLASH_ATTN"] == "0" and env["HIP_FORCE_DEV_KERNARG"] == "1"  # spec and hardware env
    assert "HIP_VISIBLE_DEVICES" not in env  # the device plugin picks the pod's GPUs
    argv = c["command"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert argv[argv.index("--compilation-config") + 1] == '{"full_cuda_graph":false,"max_capture_size":32768}'
    assert "--enable-prefix-caching" in argv


def test_placement_from_the_hardware_profile(prod):
    objs = manifests.render(prod, "tp4-ep4-x2", RELEASE, NFS_ARTIFACT)
    for group, d in enumerate(of_kind(objs, "Deployment")):
        spec = pod(d)
        assert spec["nodeSelector"] == {"doks.digitalocean.com/gpu-model": "mi325x"}
        assert spec["tolerations"] == [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        # both groups fit one server: no hostname anti-affinity, each is annotated with its NUMA half
        assert "affinity" not in spec
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["model-release/numa-group"] == str(group)
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container(d)["volumeMounts"]


def test_groups_that_cannot_share_a_server_prefer_different_hosts(prod):
    small = prod.model_copy(update={"hardware": prod.hardware.model_copy(update={"devices": 4})})
    objs = manifests.render(small, "tp4-ep4-x2", RELEASE, NFS_ARTIFACT)
    terms = pod(of_kind(objs, "Deployment")[0])["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert manifests.validate(objs) == []


def test_probes_give_the_large_model_its_load_time_and_the_tiny_one_a_short_wait(prod, spec_file):
    objs = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT)
    c = container(of_kind(objs, "Deployment")[0])
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 40 * 60
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"

    def on_gpu(data):
        data["hardware"] = "mi325x-8"

    tiny = load_spec(spec_file(TINY_SPEC, on_gpu))
    tiny_objs = manifests.render(tiny, "single", "r1", S3_ARTIFACT)
    tiny_startup = container(of_kind(tiny_objs, "Deployment")[0])["startupProbe"]
    assert tiny_startup["failureThreshold"] * tiny_startup["periodSeconds"] <= 5 * 60
    assert manifests.validate(tiny_objs) == []


def test_a_measured_load_time_sets_the_startup_probe_and_the_progress_deadline(prod):
    """A release that measured its load (9 minutes for the slowest replica) waits 2 x 540 + 120 s,
    not the 42 minutes its 235 GB would be given unmeasured."""
    sized = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT)
    measured = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT, manifests.RenderOptions(load_seconds=540))
    waits = []
    for objs in (sized, measured):
        deployment = of_kind(objs, "Deployment")[0]
        startup = container(deployment)["startupProbe"]
        waits.append(
            (startup["failureThreshold"] * startup["periodSeconds"], deployment["spec"]["progressDeadlineSeconds"])
        )
    assert waits[1][0] == 1200 and waits[0][0] >= 40 * 60  # 2 x 540 + 120, in whole probe periods
    assert waits[1][1] - waits[1][0] == waits[0][1] - waits[0][0] > 0  # the deadline adds the same pull and fetch time
    assert manifests.validate(measured) == []


def test_nfs_weights_are_a_read_only_claim_on_the_share(prod):
    objs = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT, RenderOptions(volume_name="models-share"))
    [claim] = of_kind(objs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert claim["spec"]["storageClassName"] == "nfs" and claim["spec"]["volumeName"] == "models-share"
    d = of_kind(objs, "Deployment")[0]
    volume = next(v for v in pod(d)["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(d)["volumeMounts"]
    assert "initContainers" not in pod(d)
    other = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT, RenderOptions(storage_class="do-nfs"))
    assert of_kind(other, "PersistentVolumeClaim")[0]["spec"]["storageClassName"] == "do-nfs"


def test_without_nfs_an_init_container_fetches_from_s3_with_secret_credentials(spec_file):
    def no_nfs(data):
        del data["staging"]["nfs"]

    loaded = load_spec(spec_file(PROD_SPEC, no_nfs))
    objs = manifests.render(
        loaded, "tp4-ep4-x2", RELEASE, NFS_ARTIFACT.model_copy(update={"s3_uri": S3_ARTIFACT.s3_uri})
    )
    assert manifests.validate(objs) == []
    assert of_kind(objs, "PersistentVolumeClaim") == []
    for d in of_kind(objs, "Deployment"):
        [init] = pod(d)["initContainers"]
        assert init["command"] == ["model-release", "fetch", S3_ARTIFACT.s3_uri, f"/models/{HASH}"]
        assert init["image"] == manifests.DEFAULT_WORKER_IMAGE != container(d)["image"]  # the image with the CLI
        assert init["envFrom"] == [{"secretRef": {"name": "spaces-default-s3"}}]
        assert all("KEY" not in e["name"] and "SECRET" not in e["name"] for e in init["env"])
        assert {"name": "AWS_ENDPOINT_URL", "value": "https://nyc3.digitaloceanspaces.com"} in init["env"]
        volume = next(v for v in pod(d)["volumes"] if v["name"] == "models")
        assert "emptyDir" in volume and "medium" not in volume["emptyDir"]  # node-local disk, not RAM
        argv = container(d)["command"]
        assert argv[2] == f"/models/{HASH}"
        assert container(d)["resources"]["requests"]["ephemeral-storage"] == volume["emptyDir"]["sizeLimit"]


def test_init_containers_run_the_worker_image_the_airflow_components_name(spec_file, monkeypatch):
    """promote renders in the Airflow process, whose MODEL_RELEASE_WORKER_IMAGE is the one the step pods run."""
    monkeypatch.setenv("MODEL_RELEASE_WORKER_IMAGE", "reg.example.com/mr/worker-rocm:9.9")

    def no_nfs(data):
        del data["staging"]["nfs"]

    loaded = load_spec(spec_file(PROD_SPEC, no_nfs))
    objs = manifests.render(loaded, "tp8-ep8", RELEASE, S3_ARTIFACT)
    assert {init["image"] for d in of_kind(objs, "Deployment") for init in pod(d)["initContainers"]} == {
        "reg.example.com/mr/worker-rocm:9.9"
    }
    assert pods.ClusterSettings.from_env().image == "reg.example.com/mr/worker-rocm:9.9"


def test_streamed_weights_are_checked_first_and_read_with_a_read_only_key(spec_file):
    """staging.s3.stream: vLLM streams the objects (runai_streamer) with the read-only connection's key, after
    an init container checked the manifest and every object; nothing is copied to the node."""

    def streamed(data):
        del data["staging"]["nfs"]
        data["staging"]["s3"] |= {"stream": True, "read_connection_id": "spaces_read"}

    loaded = load_spec(spec_file(PROD_SPEC, streamed))
    objs = manifests.render(loaded, "tp4-ep4-x2", RELEASE, S3_ARTIFACT)
    assert manifests.validate(objs) == []
    read_only = [{"secretRef": {"name": "spaces-read-s3"}}]
    for d in of_kind(objs, "Deployment"):
        [init] = pod(d)["initContainers"]
        assert init["command"] == ["model-release", "verify-staged", S3_ARTIFACT.s3_uri, "--manifest-hash", HASH]
        assert init["image"] == manifests.DEFAULT_WORKER_IMAGE  # the engine image has no model-release CLI
        assert init["envFrom"] == read_only and container(d)["envFrom"] == read_only
        argv, env = container(d)["command"], {e["name"]: e.get("value") for e in container(d)["env"]}
        assert argv[2] == S3_ARTIFACT.s3_uri and argv[argv.index("--load-format") + 1] == "runai_streamer"
        assert env["RUNAI_STREAMER_S3_ENDPOINT"] == env["AWS_ENDPOINT_URL"] == "https://nyc3.digitaloceanspaces.com"
        assert not any("KEY" in name or "SECRET" in name for name in env)
        assert "ephemeral-storage" not in container(d)["resources"]["requests"]  # no copy of the weights
    # the staging key can write: a streaming spec without a read-only connection is refused, naming the field
    with pytest.raises(ReleaseError, match="read_connection_id"):
        load_spec(spec_file(PROD_SPEC, lambda d: d["staging"]["s3"].update(stream=True), name="no-read.yaml"))


def test_labels_carry_release_id_and_manifest_hash_and_names_are_dns_safe(prod):
    objs = manifests.render(prod, "tp4-ep4-x2", RELEASE, NFS_ARTIFACT)
    release_label = manifests.label_value(RELEASE)
    assert release_label != RELEASE and len(release_label) <= 63
    for obj in objs:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "qwen3-235b-a22b-fp8"
        assert labels["app.kubernetes.io/name"] == "vllm"
        if obj["kind"] in ("PersistentVolumeClaim", "HTTPRoute"):
            assert "model-release/release-id" not in labels
            continue  # shared by every release of the model: the claim on the share, the route
        assert labels["model-release/release-id"] == release_label
        assert labels["model-release/layout"] == "tp4-ep4-x2"
        assert HASH.startswith(labels["model-release/manifest-hash"])
        assert obj["metadata"]["annotations"]["model-release/manifest-hash"] == HASH
        assert obj["metadata"]["annotations"]["model-release/release-id"] == RELEASE
        assert obj["metadata"]["annotations"]["model-release/artifact-uri"] == NFS_ARTIFACT.nfs_path
    (own,) = of_kind(objs, "Service")
    (route,) = of_kind(objs, "HTTPRoute")
    # the address clients call: the Gateway's route, all of it on this release's Service once live
    assert route["metadata"]["name"] == "qwen3-235b-a22b-fp8"
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference", "namespace": "gateway-system"}
    ]
    rule, named = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "", "kind": "Service", "name": own["metadata"]["name"], "port": 8000, "weight": 10_000}
    ]
    # its answers carry the weights it routes by (what the rollout asks the Gateway's data plane for)
    tag = {"name": manifests.WEIGHTS_HEADER, "value": f"{own['metadata']['name']}=10000"}
    assert rule["filters"] == [{"type": "ResponseHeaderModifier", "responseHeaderModifier": {"set": [tag]}}]
    # and a rule of its own, which a request naming the release takes (the rollout's checks through the
    # Gateway), whose answers the Gateway marks with the same name
    header = {"type": "Exact", "name": manifests.RELEASE_HEADER, "value": own["metadata"]["name"]}
    assert named["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}, "headers": [header]}]
    assert named["backendRefs"] == [{**rule["backendRefs"][0], "weight": 1}]
    assert named["filters"] == [
        {
            "type": "ResponseHeaderModifier",
            "responseHeaderModifier": {"set": [{"name": manifests.RELEASE_HEADER, "value": own["metadata"]["name"]}]},
        }
    ]
    assert manifests.route_weights(route) == {own["metadata"]["name"]: 10_000}
    assert manifests.named_releases(route) == [own["metadata"]["name"]]
    # as the rollout sets it: a release's own rule with no backend in the default one (before a first
    # release's share: the Gateway answers 503), and two releases weighted, each with its own rule
    name = own["metadata"]["name"]
    for weights, named in (({}, [name]), ({"other-r1": 9000, name: 1000}, ["other-r1", name])):
        changed = manifests.with_backends(route, weights, named)
        assert crds.problems(changed) == []
        assert (manifests.route_weights(changed), manifests.named_releases(changed)) == (weights, named)
    # this release's own objects carry its id in their names, beside the live release's
    assert own["spec"]["selector"]["model-release/release-id"] == release_label
    assert own["metadata"]["name"].startswith("qwen3-235b-a22b-fp8-r")
    assert own["spec"]["ports"][0]["port"] == 8000
    for d in of_kind(objs, "Deployment"):
        assert d["metadata"]["name"].startswith(own["metadata"]["name"] + "-")
        template_labels = d["spec"]["template"]["metadata"]["labels"]
        assert all(template_labels[k] == v for k, v in own["spec"]["selector"].items())
        # no label of the pods decides traffic: only the route's weights, set by the rollout
        assert not any(k.endswith("/serving") for k in template_labels)
        assert d["spec"]["selector"]["matchLabels"]["model-release/release-id"] == release_label
        assert all(template_labels[k] == v for k, v in d["spec"]["selector"]["matchLabels"].items())
    pdb = of_kind(objs, "PodDisruptionBudget")[0]
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == own["spec"]["selector"]
    assert len({(o["kind"], o["metadata"]["name"]) for o in objs}) == len(objs)


def test_sanitizing_names_and_label_values():
    assert manifests.dns_name("Qwen3.235B_fp8") == "qwen3-235b-fp8"
    assert manifests.dns_name("3b-model") == "m-3b-model"
    assert len(manifests.dns_name("x" * 100)) == 63
    long_id = "scheduled__" + "2026-01-12T10:00:00+00:00" * 4
    assert len(manifests.label_value(long_id)) <= 63
    assert manifests.label_value(long_id) != manifests.label_value(long_id + "x")
    assert manifests.label_value("r-42") == "r-42"


def test_the_validator_catches_broken_objects(prod):
    objs = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT)
    broken = copy.deepcopy(objs)
    d = of_kind(broken, "Deployment")[0]
    d["spec"]["replicas"] = "one"
    container(d)["imagePullPolicy2"] = "Always"  # unknown field: strict mode
    problems = manifests.validate(broken)
    assert any("replicas" in p for p in problems), problems
    unknown = copy.deepcopy(objs)
    container(of_kind(unknown, "Deployment")[0])["imagePullPolicy2"] = "Always"
    assert any("imagePullPolicy2" in p for p in manifests.validate(unknown))
    bad_name = copy.deepcopy(objs)
    of_kind(bad_name, "Service")[0]["metadata"]["name"] = "Bad_Name"
    assert any("Service/Bad_Name: metadata.name" in p for p in manifests.validate(bad_name))
    # the route against the Gateway API's own CRD schema (vendored), not skipped as an unknown kind
    bad_route = copy.deepcopy(objs)
    backend = of_kind(bad_route, "HTTPRoute")[0]["spec"]["rules"][0]["backendRefs"][0]
    backend["weight"] = 2_000_000
    backend["portt"] = 8000
    problems = manifests.validate(bad_route)
    assert any("HTTPRoute/qwen3-235b-a22b-fp8: spec.rules.0.backendRefs.0.weight" in p for p in problems), problems


def test_a_kubernetes_spec_without_a_gateway_is_refused_naming_the_field(spec_file):
    from pipeline.core.errors import SpecError

    path = spec_file(PROD_SPEC, lambda d: d["promotion"].pop("gateway"))
    with pytest.raises(SpecError, match=r"promotion\.gateway: name the Gateway"):
        load_spec(path)


def test_unknown_layout_and_missing_weights_are_user_errors(prod):
    with pytest.raises(ReleaseError, match="no layout named 'tp2'.*tp8-ep8"):
        manifests.render(prod, "tp2", RELEASE, NFS_ARTIFACT)
    with pytest.raises(ReleaseError, match="no nfs_path"):
        manifests.render(prod, "tp8-ep8", RELEASE, Artifact(manifest_hash=HASH))


def test_the_readme_command_renders_a_preview_from_the_spec_alone(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "manifests", str(PROD_SPEC), "--layout", "tp4-ep4-x2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# preview from qwen3-235b-a22b-fp8-mi325x.yaml's staging targets: artifact name")
    assert "are placeholders" in out.stdout
    objs = [o for o in yaml.safe_load_all(out.stdout) if o]
    assert manifests.validate(objs) == []
    kinds = sorted({o["kind"] for o in objs})
    assert "Deployment" in kinds and "Service" in kinds
    assert "/mnt/models/ARTIFACT" in out.stdout  # the spec's NFS share, where the staged weights would be


def test_a_pod_drains_before_sigterm_within_a_grace_period_above_the_routes_timeout(prod, spec_file):
    """The production image's vLLM (0.11.2) aborts what it runs on SIGTERM and has no
    --shutdown-timeout: its pods wait in preStop until the engine's own /metrics shows nothing
    running, bounded by the route's request timeout, and the kubelet waits longer than that."""
    objs = manifests.render(prod, "tp8-ep8", RELEASE, NFS_ARTIFACT)
    c = container(of_kind(objs, "Deployment")[0])
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["python3", "-c"]  # the engine image's interpreter; no curl in it to count on
    port, bound, lag = hook[3:]
    assert port == "8000" and float(bound) == drain.REQUEST_TIMEOUT_S
    route = of_kind(objs, "HTTPRoute")[0]
    assert {r["timeouts"]["request"] for r in route["spec"]["rules"]} == {f"{drain.REQUEST_TIMEOUT_S}s"}
    grace = pod(of_kind(objs, "Deployment")[0])["terminationGracePeriodSeconds"]
    assert grace > float(lag) + float(bound) + drain.SHUTDOWN_TIMEOUT_S
    assert "--shutdown-timeout" not in c["command"]  # vLLM 0.11.2 would refuse it
    assert manifests.validate(objs, "1.31") == []

    # the hook itself, run as the kubelet runs it (this venv's python: prometheus-client, as vLLM's
    # image has), against an engine busy for its first scrapes: it returns once the engine is idle
    busy, scrapes = 3, []

    def draining() -> bytes:  # an engine's /metrics: `busy` requests running for its first scrapes, then none
        scrapes.append(1)
        running = busy if len(scrapes) <= busy else 0
        return f'vllm:num_requests_running{{engine="0"}} {running}.0\nvllm:num_requests_waiting 0.0\n'.encode()

    server = http_stub.serve(draining)
    try:
        run = [sys.executable, "-c", hook[2], str(server.server_address[1]), "60", "0"]
        done = subprocess.run(run, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert "'in_flight': 3.0" in done.stdout and "'left': 0.0" in done.stdout, done.stdout
    assert len(scrapes) == busy + 2  # it kept asking until the engine read idle twice

    # an image whose vLLM drains on SIGTERM itself gets the flag too; a spec that sets it keeps its own
    newer = load_spec(spec_file(PROD_SPEC, lambda d: d["serving"].update(engine_image="vllm/vllm-openai:v0.18.0")))
    argv = container(of_kind(manifests.render(newer, "tp8-ep8", RELEASE, NFS_ARTIFACT), "Deployment")[0])["command"]
    assert argv[argv.index("--shutdown-timeout") + 1] == str(drain.SHUTDOWN_TIMEOUT_S)

    def own(d):
        d["serving"].update(engine_image="vllm/vllm-openai:v0.18.0")
        d["serving"]["engine_args"]["shutdown-timeout"] = 5

    argv = container(
        of_kind(manifests.render(load_spec(spec_file(PROD_SPEC, own)), "tp8-ep8", RELEASE, NFS_ARTIFACT), "Deployment")[
            0
        ]
    )["command"]
    assert argv.count("--shutdown-timeout") == 1 and argv[argv.index("--shutdown-timeout") + 1] == "5"


@pytest.mark.parametrize(
    "image, version",
    [
        ("rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210", (0, 11)),  # the production spec's
        ("model-release/vllm-cpu:0.32.0", (0, 32)),  # the tiny spec's (the test engine, .venv-serve)
        ("vllm/vllm-openai:v0.18.0", (0, 18)),
        ("registry.example:5000/vllm:0.19.1", (0, 19)),
        ("registry.digitalocean.com/model-release/vllm@sha256:" + "0" * 64, None),  # pinned by digest: unknown
        ("nginx:1.27", None),
    ],
)
def test_the_engine_images_vllm_version_is_read_from_its_reference(image, version):
    assert drain.image_vllm_version(image) == version
    assert bool(drain.shutdown_flags(image, {})) == (version is not None and version >= (0, 18))
