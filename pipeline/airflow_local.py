"""Run this repo's DAGs in a real, local Airflow (embedded default, tests, the demo).

One place knows how the embedded Airflow is configured: its home under MODEL_RELEASE_HOME,
this repo's dags/ and plugins/, no example DAGs, and the venv's bin on PATH (Airflow
launches its own components from PATH).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline import local_s3
from pipeline.paths import PROJECT_ROOT, home


def airflow_env(airflow_home: Path | None = None) -> dict[str, str]:
    airflow_home = airflow_home or home() / "airflow"
    airflow_home.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PROJECT_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "MODEL_RELEASE_HOME": str(home()),
        "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
    })
    env.update(local_s3.env())
    return env


def airflow(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "airflow"), *args], env=env, **kwargs)


def ensure_db(env: dict[str, str]) -> None:
    """`airflow db migrate` is idempotent and takes seconds on SQLite."""
    airflow(["db", "migrate"], env, check=True, capture_output=True)
