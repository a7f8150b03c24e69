"""Production files that cannot be built here (no Docker engine): their contents are checked."""

from __future__ import annotations

import re

import yaml

from pipeline.paths import PROJECT_ROOT

DOCKER = PROJECT_ROOT / "docker"


def test_airflow_image_pins_the_locked_airflow_version():
    locked = re.search(r"^apache-airflow==(\S+)$", (PROJECT_ROOT / "requirements" / "main.lock").read_text(), re.M).group(1)
    text = (DOCKER / "airflow.Dockerfile").read_text()
    assert f"ARG AIRFLOW_VERSION={locked}" in text
    assert "FROM apache/airflow:${AIRFLOW_VERSION}" in text
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
