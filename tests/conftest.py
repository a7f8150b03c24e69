"""Shared fixtures. Slow ones (the tiny model, Airflow, vLLM) are built once and cached under
MODEL_RELEASE_HOME, so a second run of the suite reuses them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.paths import PROJECT_ROOT

RELEASES = PROJECT_ROOT / "configs" / "releases"
PROD_SPEC = RELEASES / "qwen3-235b-a22b-fp8-mi325x.yaml"
TINY_SPEC = RELEASES / "tiny-qwen3-moe-cpu.yaml"
SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from pipeline import tiny_model

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


@pytest.fixture
def copy_dir(tmp_path):
    def make(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return make
