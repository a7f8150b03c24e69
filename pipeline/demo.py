"""`make demo`: one release of the tiny model through the real Airflow DAG, on this machine.

Runs as far as the pipeline is built today and says which stages are not built yet.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from pipeline import flow, local_s3, tiny_model
from pipeline.airflow_local import airflow, airflow_env, ensure_db
from pipeline.errors import ReleaseError
from pipeline.paths import runs_dir

log = logging.getLogger("demo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo")
    parser.add_argument("--spec", default="configs/releases/tiny-qwen3-moe-cpu.yaml")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    started = time.monotonic()
    try:
        info = flow.validate_spec(args.spec)
    except ReleaseError as exc:
        print(exc, file=sys.stderr)
        return 1
    log.info("spec ok: %s", json.dumps(info))
    model = tiny_model.build()
    log.info("tiny model at %s", model)
    log.info("local S3 server at %s", local_s3.ensure_running())
    try:
        env = airflow_env()
        ensure_db(env)
        log.info("running DAG model_release in Airflow (AIRFLOW_HOME=%s)", env["AIRFLOW_HOME"])
        result = airflow(["dags", "test", "model_release", "-c", json.dumps({"spec": info["spec_path"]})], env)
    finally:
        local_s3.stop()  # the demo stops what it started
    if result.returncode:
        log.error("DAG run failed (exit %d); the task logs above say why", result.returncode)
        return result.returncode
    log.info("DAG run succeeded in %.0f s", time.monotonic() - started)
    runs = sorted(runs_dir().glob("manual__*"), key=lambda p: p.stat().st_mtime)
    if runs:
        bench = runs[-1] / "benchmark"
        selection = json.loads((bench / "benchmark.json").read_text())["selection"]
        log.info("chosen layout: %s", selection["reason"])
        log.info("accuracy gate report: %s", runs[-1] / "accuracy_validation.html")
        log.info("latency-vs-rate curves: %s; every probe: %s", bench / "latency_vs_rate.png", bench / "benchmark.csv")
    log.info("not built yet: %s", ", ".join(flow.NOT_BUILT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
