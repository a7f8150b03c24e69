"""Shared fixtures. Slow ones (the tiny model, Airflow, vLLM) are built once and cached under
MODEL_RELEASE_HOME, so a second run of the suite reuses them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

import pipeline.entry  # noqa: F401 - installs Airflow as the platform, as every way into the library does
from pipeline.core.paths import PROJECT_ROOT, home

# One vLLM compile cache for the whole suite, also for tests that move MODEL_RELEASE_HOME to a
# temporary directory: it is keyed by the graph, and each cold engine start costs ~35 s here.
os.environ.setdefault("VLLM_CACHE_ROOT", str(home() / "vllm-cache"))

RELEASES = PROJECT_ROOT / "configs" / "releases"
PROD_SPEC = RELEASES / "qwen3-235b-a22b-fp8-mi325x.yaml"
TINY_SPEC = RELEASES / "tiny-qwen3-moe-cpu.yaml"
SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from pipeline.stages import tiny_model

    return tiny_model.build()


@pytest.fixture
def spec_file(tmp_path):
    """Write a variant of a shipped spec: spec_file(PROD_SPEC, lambda d: ...) -> path."""

    def make(base: Path, edit=None, name: str = "variant.yaml") -> Path:
        data = yaml.safe_load(base.read_text())
        if edit:
            edit(data)
        out = tmp_path / "releases" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(data, sort_keys=False))
        return out

    return make


@pytest.fixture(scope="module")
def s3():
    """A real S3-protocol server (moto, over HTTP) for one test module."""
    from tests.s3server import MotoServer

    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def release_env(monkeypatch, tmp_path):
    """S3 credentials for the local server and a registry of the test's own."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")


@pytest.fixture
def small_artifact(tmp_path) -> Path:
    """A tiny artifact with a manifest: enough for staging, verification and gate checks."""
    from pipeline.core import artifacts

    root = tmp_path / "fp8-small"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\0" * 4096)
    (root / "config.json").write_text("{}")
    artifacts.write_manifest(root, kind="fp8-model")
    return root


@pytest.fixture(scope="session")
def fp8_artifact(tiny_model_dir) -> Path:
    """The tiny model's real FP8 artifact (llmcompressor), as the quantize stage publishes it."""
    from pipeline.entry import flow

    return Path(flow.quantize(str(TINY_SPEC), flow.materialize_model(str(TINY_SPEC)))["path"])


@pytest.fixture
def copy_dir(tmp_path):
    def make(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return make
