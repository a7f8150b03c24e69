"""
### Model release

Takes one model release, described by a spec in `configs/releases/`, from its BF16
checkpoint towards SLO-verified serving: validate the spec, materialize the model source,
quantize it to FP8, gate on accuracy (lm-eval, baseline vs candidate, validated by
great-expectations), stage it to network storage, predict every candidate serving layout's
max SLO rate (the planner), benchmark each with vLLM against the p90 SLO starting from its
prediction and pick the best, write the reviewer report, wait for a
reviewer's approval (human-in-the-loop, in this UI), promote to the spec's target and verify.

Trigger with the `spec` param (a path relative to the project, or absolute); optionally narrow
the layouts or tighten the SLO for this run. Every gate, decision and rollout step is recorded
in the release registry (see "Model releases" in the menu). All logic lives in the `pipeline`
package; this file only wires tasks together.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task

from pipeline.airflow import pools
from pipeline.airflow.review_tasks import STAGED, review_and_promote

DEFAULT_SPEC = "configs/releases/tiny-qwen3-moe-cpu.yaml"


@dag(
    dag_id="model_release",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    doc_md=__doc__,
    tags=["model-release"],
    params={
        "spec": Param(
            DEFAULT_SPEC,
            type="string",
            title="Release spec",
            description="YAML release spec, relative to the project root or absolute",
        ),
        "layouts": Param(
            [],
            type="array",
            items={"type": "string"},
            title="Layouts to benchmark",
            description="Names from the spec's layouts, generated ones too; empty: all, or the spec's candidates.top_k",
        ),
        "p90_ttft_ms": Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title="p90 TTFT limit (ms)",
            description="Override the spec's SLO for this run; empty: the spec's",
        ),
        "p90_tpot_ms": Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title="p90 TPOT limit (ms)",
            description="Override the spec's SLO for this run; empty: the spec's",
        ),
    },
)
def model_release():
    @task
    def validate(params: dict | None = None, run_id: str | None = None) -> dict:
        """Type and feasibility checks (one line per problem); opens the release in the registry."""
        from pipeline.entry import flow

        assert params is not None  # Airflow passes the run's params

        overrides = {k: params.get(k) for k in ("layouts", "p90_ttft_ms", "p90_tpot_ms")}
        return flow.validate_spec(params["spec"], run_id, overrides)

    @task
    def materialize_model(spec: dict) -> dict:
        """Resolve the model source to a local directory and its manifest hash."""
        from pipeline.entry import flow

        return flow.materialize_model(spec["spec_path"])

    @task
    def quantize(spec: dict, source: dict) -> dict:
        """FP8 with llmcompressor; content-addressed, verified, published atomically. XCom: path + hash."""
        from pipeline.entry import flow

        return flow.quantize(spec["spec_path"], source)

    @task
    def evaluate_baseline(spec: dict, source: dict) -> dict:
        """lm-eval on the BF16 source (cached by manifest hash, tasks and settings)."""
        from pipeline.entry import flow

        return flow.evaluate(spec["spec_path"], source, baseline=True)

    @task
    def evaluate_candidate(spec: dict, quantized: dict) -> dict:
        """lm-eval on the FP8 candidate, same tasks, few-shot, limit and seed."""
        from pipeline.entry import flow

        return flow.evaluate(spec["spec_path"], quantized, baseline=False)

    @task(retries=0)
    def accuracy_gate(spec: dict, baseline: dict, candidate: dict, run_id: str | None = None) -> dict:
        """great-expectations validates the per-task recovery table; a failure stops the run here."""
        from pipeline.entry import flow

        return flow.accuracy_gate(spec["spec_path"], baseline, candidate, run_id, spec["release_id"])

    @task(retries=2, retry_delay=pendulum.duration(seconds=30), outlets=[STAGED])
    def stage(spec: dict, quantized: dict, gate: dict, *, outlet_events=None) -> dict:
        """Upload to S3/Spaces and/or NFS, manifest last; retried (network), resumes where it stopped."""
        from pipeline.entry import flow

        staged = flow.stage(spec["spec_path"], quantized, spec["release_id"])
        outlet_events[STAGED].extra = {
            "release": spec["name"],
            "s3_uri": staged["s3_uri"],
            "nfs_path": staged["nfs_path"],
            "manifest_hash": staged["manifest_hash"],
        }
        return staged

    @task
    def layout_names(spec: dict, predictions: dict) -> list[str]:
        """Every layout, or the spec's `candidates.top_k` best predicted (and the live release's)."""
        from pipeline.entry import flow

        return flow.layouts_to_measure(spec["spec_path"], predictions, spec["release_id"])

    @task
    def plan(spec: dict, run_id: str | None = None) -> dict:
        """The planner's max SLO rate per layout, published before any measurement; each search starts there."""
        from pipeline.entry import flow

        return flow.plan_layouts(spec["spec_path"], run_id, spec["release_id"])

    # One mapped task per candidate layout. They run one at a time: layouts are compared on the
    # same machine, and two engines at once would measure each other.
    @task(max_active_tis_per_dagrun=1, pool=pools.BENCHMARK)
    def benchmark(
        spec: dict, staged: dict, predictions: dict, accuracy: dict, layout: str, run_id: str | None = None
    ) -> dict:
        """Serve the staged artifact with this layout; find its highest rate within the p90 SLO, then
        score the gate's tasks at its endpoint (serving-path accuracy)."""
        from pipeline.entry import flow

        return flow.benchmark_layout(spec["spec_path"], staged, layout, run_id, predictions, accuracy)

    @task
    def select_layout(spec: dict, results: list[dict], run_id: str | None = None) -> dict:
        """Best layout by SLO rate per server; JSON, CSV and the latency-vs-rate PNG for the report."""
        from pipeline.entry import flow

        return flow.select_layout(spec["spec_path"], list(results), run_id)

    @task(retries=0)
    def slo_gate(spec: dict, selection: dict) -> dict:
        """Fails the run, with the per-layout table in the log, when no layout meets the SLO."""
        from pipeline.entry import flow

        return flow.slo_gate(selection, spec["release_id"])

    spec = validate()
    source = materialize_model(spec)
    fp8 = quantize(spec, source)
    baseline, candidate = evaluate_baseline(spec, source), evaluate_candidate(spec, fp8)
    gate = accuracy_gate(spec, baseline, candidate)
    staged = stage(spec, fp8, gate)
    accuracy = {"baseline": baseline, "candidate": candidate}  # the in-process scores the serving path is held to
    predictions = plan(spec)
    results = benchmark.partial(spec=spec, staged=staged, predictions=predictions, accuracy=accuracy).expand(
        layout=layout_names(spec, predictions)
    )
    review_and_promote(spec, slo_gate(spec, select_layout(spec, results)), pool=pools.BENCHMARK)


model_release()
