"""Production files that cannot be built here (no Docker engine): their contents are checked."""

from __future__ import annotations

import re

import yaml

from pipeline.core.paths import PROJECT_ROOT

DOCKER = PROJECT_ROOT / "docker"


def test_airflow_image_pins_the_locked_airflow_version():
    locked = re.search(
        r"^apache-airflow==(\S+)$", (PROJECT_ROOT / "requirements" / "main.lock").read_text(), re.M
    ).group(1)
    text = (DOCKER / "airflow.Dockerfile").read_text()
    assert f"ARG AIRFLOW_VERSION={locked}" in text
    assert "ARG AIRFLOW_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python3.11" in text and "FROM ${AIRFLOW_IMAGE}" in text
    for path in ("dags", "plugins", "pipeline", "configs"):
        assert (PROJECT_ROOT / path).is_dir() and f"COPY --chown=airflow:root {path} " in text


def test_worker_image_pins_rocm_vllm_in_one_place_and_sets_aiter_defaults():
    text = (DOCKER / "worker-rocm.Dockerfile").read_text()
    tags = re.findall(r"rocm/vllm:\S+", text)
    assert len(tags) == 1 and not tags[0].endswith(":latest")
    assert "FROM ${ROCM_VLLM_IMAGE}" in text
    for env in ("VLLM_ROCM_USE_AITER=1", "VLLM_ROCM_USE_AITER_MOE=1", "SAFETENSORS_FAST_GPU=1"):
        assert env in text
    assert 'ENTRYPOINT ["model-release"]' in text


def test_compose_has_the_airflow_components_on_postgres_without_secrets():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "airflow-init", "api-server", "scheduler", "dag-processor", "triggerer"} <= set(services)
    for name in ("api-server", "scheduler", "dag-processor", "triggerer"):
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
        assert "${POSTGRES_PASSWORD" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]  # from the environment only
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${")


def test_worker_image_carries_the_engine_the_production_spec_names_where_the_pods_expect_it():
    from pipeline.core.specs import load_spec
    from pipeline.k8s import pods
    from tests.conftest import PROD_SPEC

    text = (DOCKER / "worker-rocm.Dockerfile").read_text()
    assert (
        re.search(r"^ARG ROCM_VLLM_IMAGE=(\S+)$", text, re.M).group(1) == load_spec(PROD_SPEC).spec.serving.engine_image
    )
    assert f"MODEL_RELEASE_HOME={pods.POD_HOME}" in text and f"WORKDIR {pods.POD_PROJECT}\n" in text
    # editable installs: `pipeline` finds configs/ next to itself (pipeline.core.paths.CONFIGS_DIR)
    assert '--editable ".[${EXTRA}]"' in text
    assert '--editable "/opt/model-release[${EXTRA}]"' in (DOCKER / "airflow.Dockerfile").read_text()


def test_airflow_extra_pins_the_airflow_its_base_image_carries():
    import tomllib

    extras = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    version = re.search(r"^ARG AIRFLOW_VERSION=(\S+)$", (DOCKER / "airflow.Dockerfile").read_text(), re.M).group(1)
    assert f"apache-airflow=={version}" in extras["airflow"]
    assert f"apache-airflow=={version}" in (DOCKER / "base" / "airflow.txt").read_text().splitlines()


def test_each_image_sends_only_what_it_copies_as_build_context():
    for name in ("airflow", "worker-rocm", "quantize"):
        dockerfile = (DOCKER / f"{name}.Dockerfile").read_text()
        ignore = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().split("\n")
        assert "*" in ignore  # allowlist: .venv, .model-release and .git stay out
        for line in dockerfile.splitlines():
            if line.startswith("COPY "):
                sources = [part for part in line.split()[1:-1] if not part.startswith("--")]
                assert all(f"!{source}" in ignore for source in sources), (name, line)


def test_compose_keeps_the_release_registry_in_its_own_database_on_the_same_postgres():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    mounts = compose["services"]["postgres"]["volumes"]
    init = next(m for m in mounts if "/docker-entrypoint-initdb.d/" in m).split(":")[0]
    database = re.search(r"CREATE DATABASE (\w+)", (DOCKER / init).read_text()).group(1)
    for name in ("api-server", "scheduler", "dag-processor", "triggerer"):
        env = compose["services"][name]["environment"]
        # the runtime role, through the locked driver; the owner only migrates
        assert env["MODEL_RELEASE_REGISTRY_URL"].startswith("postgresql+psycopg://model_release_app:${")
        assert env["MODEL_RELEASE_REGISTRY_URL"].endswith(f"@postgres/{database}")
        assert env["MODEL_RELEASE_WORKER_IMAGE"].startswith("${")  # from the environment, default empty
    migrate = compose["services"]["registry-migrate"]
    assert migrate["command"][-2:] == ["releases", "migrate"]
    assert migrate["environment"]["MODEL_RELEASE_REGISTRY_URL"].startswith("postgresql+psycopg://model_release_owner:")
    assert "registry-migrate" in compose["services"]["airflow-init"]["depends_on"]


def test_images_script_records_each_base_then_builds_from_its_digest_tagged_with_the_package_version(tmp_path):
    """`freeze` pins each base by digest with its packages; a build refuses a base file without one
    (the committed stand-ins), then builds FROM the recorded digest."""
    import os
    import shutil
    import subprocess

    from pipeline import __version__
    from pipeline.k8s import pods

    repo = tmp_path / "repo"  # freeze rewrites docker/base/: run on a copy
    shutil.copytree(DOCKER, repo / "docker")
    (repo / "pipeline").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "pipeline" / "__init__.py", repo / "pipeline")
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(
        '#!/bin/sh\necho "$@" >> "$DOCKER_LOG"\n'
        'case "$1" in image) echo "${5%%:*}@sha256:abc";; run) echo "pip==25.0";; esac\n'
    )
    fake.chmod(0o755)
    log = tmp_path / "docker.log"
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "DOCKER_LOG": str(log)}

    def images(*args):
        return subprocess.run(["sh", "docker/images.sh", *args], cwd=repo, env=env, capture_output=True, text=True)

    refused = images("reg.example.com/mr", "--push")
    assert refused.returncode == 1 and "docker/base/airflow.txt: no base digest recorded" in refused.stderr
    assert not log.exists()  # nothing built on a stand-in
    assert images("freeze").returncode == 0
    base = (repo / "docker" / "base" / "rocm-vllm.txt").read_text()
    assert "# image: rocm/vllm@sha256:abc" in base and "pip==25.0" in base and "stand-in" not in base
    log.unlink()
    out = images("reg.example.com/mr", "--push").stdout.split()
    names = ["airflow", "worker-rocm", "quantize"]
    assert out == [f"reg.example.com/mr/{name}:{__version__}" for name in names]
    assert log.read_text().splitlines() == [
        line
        for name, arg, base in zip(
            names,
            ["AIRFLOW_IMAGE", "ROCM_VLLM_IMAGE", "PYTHON_IMAGE"],
            ["apache/airflow", "rocm/vllm", "python"],
            strict=True,
        )
        for line in (
            f"build -f docker/{name}.Dockerfile --build-arg {arg}={base}@sha256:abc"
            f" -t reg.example.com/mr/{name}:{__version__} .",
            f"push reg.example.com/mr/{name}:{__version__}",
        )
    ]
    assert pods.DEFAULT_WORKER_IMAGE == f"registry.digitalocean.com/model-release/worker-rocm:{__version__}"
    assert pods.DEFAULT_QUANTIZE_IMAGE == f"registry.digitalocean.com/model-release/quantize:{__version__}"
