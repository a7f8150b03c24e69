"""The DAGs import cleanly into a real Airflow, and `airflow dags test` runs the release DAG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import local_s3
from pipeline.airflow_local import airflow, airflow_env, ensure_db
from pipeline.paths import PROJECT_ROOT
from tests.conftest import TINY_SPEC
from tests.s3server import MotoServer

DAGBAG_SCRIPT = """
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag()
print(json.dumps({"errors": bag.import_errors, "dags": sorted(bag.dag_ids)}))
"""


@pytest.fixture(scope="module")
def af_env(tmp_path_factory):
    server = MotoServer()
    env = airflow_env(tmp_path_factory.mktemp("airflow-home"))
    env.update(local_s3.env(server.url))
    ensure_db(env)
    yield env
    server.stop()


def test_dagbag_imports_without_errors(af_env):
    out = subprocess.run([sys.executable, "-c", DAGBAG_SCRIPT], env=af_env, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert "model_release" in result["dags"]


def test_dag_files_hold_wiring_only():
    # Business logic lives in pipeline/: a DAG file imports it inside tasks and stays short.
    for path in (PROJECT_ROOT / "dags").glob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "import boto3" not in text, path
        assert len(text.splitlines()) < 250, path


def short_search(data):
    # the DAG test proves the wiring; test_benchmark measures the layouts properly
    data["workload"]["num_prompts"] = 40
    data["workload"]["min_probe_seconds"] = 1
    data["slo"]["resolution"] = 0.25


@pytest.mark.slow
def test_airflow_dags_test_runs_the_release_dag(af_env, tiny_model_dir, spec_file):
    spec = spec_file(TINY_SPEC, short_search)
    result = airflow(
        ["dags", "test", "model_release", "-c", json.dumps({"spec": str(spec)})],
        af_env, capture_output=True, text=True, timeout=1800,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "state=success" in output or "DagRun Finished" in output, output[-4000:]
    assert str(tiny_model_dir) in output
    assert "s3://model-release/tiny-qwen3-moe-fp8/" in output, output[-4000:]
    assert "accuracy gate PASSED" in output
    runs = sorted((Path(af_env["MODEL_RELEASE_HOME"]) / "runs").glob("manual__*"), key=lambda p: p.stat().st_mtime)
    bench = json.loads((runs[-1] / "benchmark" / "benchmark.json").read_text())
    assert [layout["layout"] for layout in bench["layouts"]] == ["single", "two-replicas"]
    assert bench["selection"]["passed"] and bench["selection"]["best"] in ("single", "two-replicas")
    assert (runs[-1] / "benchmark" / "latency_vs_rate.png").exists()


@pytest.mark.slow
def test_bad_spec_fails_the_validate_task(af_env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel:\n  name: a\n   source: y\n")
    result = airflow(["dags", "test", "model_release", "-c", json.dumps({"spec": str(bad)})],
                     af_env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert f"{bad}: line 4, column 10: YAML syntax error" in output, output[-4000:]
    assert "materialize_model" not in output or "upstream_failed" in output
