"""Where the project keeps its data: one root, MODEL_RELEASE_HOME.

The embedded default is `.model-release/` in the checkout (git-ignored), so a clone is
self-contained; production points it at a volume.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = PROJECT_ROOT / "configs"


def home() -> Path:
    root = os.environ.get("MODEL_RELEASE_HOME")
    path = Path(root) if root else PROJECT_ROOT / ".model-release"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def models_dir() -> Path:
    return _sub("models")


def artifacts_dir() -> Path:
    return _sub("artifacts")


def runs_dir() -> Path:
    return _sub("runs")


def run_key(run_id: str) -> str:
    """A run id as a directory or object-key name: one rule, so a run's local and stored results match."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)


def run_dir(run_id: str) -> Path:
    path = runs_dir() / run_key(run_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sub(name: str) -> Path:
    path = home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
