"""
### Model release

Takes one model release, described by a spec in `configs/releases/`, from its BF16
checkpoint towards SLO-verified serving: validate the spec, materialize the model source,
quantize it to FP8, stage it to network storage, then (as the stages land) evaluate,
benchmark, approve, promote.

Trigger with the `spec` param (a path relative to the project, or absolute). All logic lives
in the `pipeline` package; this file only wires tasks together.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, Param, dag, task

DEFAULT_SPEC = "configs/releases/tiny-qwen3-moe-cpu.yaml"
# Other DAGs (re-benchmarks) can be scheduled on a newly staged artifact.
STAGED = Asset("model-release://staged-artifact")


@dag(
    dag_id="model_release",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    doc_md=__doc__,
    tags=["model-release"],
    params={
        "spec": Param(DEFAULT_SPEC, type="string", title="Release spec",
                      description="YAML release spec, relative to the project root or absolute"),
    },
)
def model_release():
    @task
    def validate(params: dict | None = None) -> dict:
        """Type and feasibility checks; fails the run with one line per problem."""
        from pipeline import flow

        return flow.validate_spec(params["spec"])

    @task
    def materialize_model(spec: dict) -> dict:
        """Resolve the model source to a local directory and its manifest hash."""
        from pipeline import flow

        return flow.materialize_model(spec["spec_path"])

    @task
    def quantize(spec: dict, source: dict) -> dict:
        """FP8 with llmcompressor; content-addressed, verified, published atomically. XCom: path + hash."""
        from pipeline import flow

        return flow.quantize(spec["spec_path"], source)

    @task(retries=2, retry_delay=pendulum.duration(seconds=30), outlets=[STAGED])
    def stage(spec: dict, quantized: dict, *, outlet_events=None) -> dict:
        """Upload to S3/Spaces and/or NFS, manifest last; retried (network), resumes where it stopped."""
        from pipeline import flow

        staged = flow.stage(spec["spec_path"], quantized)
        outlet_events[STAGED].extra = {"release": spec["name"], "s3_uri": staged["s3_uri"],
                                       "nfs_path": staged["nfs_path"], "manifest_hash": staged["manifest_hash"]}
        return staged

    spec = validate()
    stage(spec, quantize(spec, materialize_model(spec)))


model_release()
