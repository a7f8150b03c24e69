"""The import rule the folders show (pyproject.toml, [tool.importlinter]): the tree keeps it,
and an import that breaks it, even one inside a function, fails the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.paths import PROJECT_ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the `pipeline` package found first on PYTHONPATH (`root`)."""
    return subprocess.run(
        [str(LINT_IMPORTS), str(PROJECT_ROOT / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_the_layering_contracts():
    result = lint(PROJECT_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, statement, contract",
    [
        ("core/paths.py", "from pipeline.entry import flow", "Layers: each imports only the layers below it"),
        (
            "stages/serving/engine.py",
            "import airflow.sdk",
            "Only the Airflow, entry and embedded layers import Airflow",
        ),
        ("release/registry.py", "from pipeline.release import report", "No import cycles between modules or packages"),
        (
            "stages/benchmark/search.py",
            "from pipeline.stages import serving",
            "Benchmark search, verdict and selection stay pure (no I/O)",
        ),
        ("records/__init__.py", "import sqlalchemy", "Records import only pipeline.core and pydantic"),
        ("records/__init__.py", "from pipeline.stages import serving", "Layers: each imports only the layers below it"),
        ("records/evaluate.py", "import lm_eval", "Records import only pipeline.core and pydantic"),
        (
            "core/specs/feasibility.py",
            "from pipeline.core.specs import loading",
            "The spec: sections, then the whole, then feasibility, then loading",
        ),
    ],
)
def test_an_import_against_the_rule_breaks_the_contract(tmp_path, module, statement, contract):
    shutil.copytree(PROJECT_ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "pipeline" / module
    # inside a function: a deferred import counts like any other
    target.write_text(target.read_text() + f"\n\ndef _against_the_rule():\n    {statement}\n")
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout
    # the report names the offending module (a package by its own name)
    named = Path(module).parent.name if Path(module).stem == "__init__" else Path(module).stem
    assert named in result.stdout.partition("Broken contracts")[2]
