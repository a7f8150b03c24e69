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
from pipeline.records import edge
from pipeline.records.edge import Json

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
        "max_p90_ttft_ms": Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title="p90 TTFT limit (ms)",
            description="Override the spec's SLO for this run; empty: the spec's",
        ),
        "max_p90_tpot_ms": Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title="p90 TPOT limit (ms)",
            description="Override the spec's SLO for this run; empty: the spec's",
        ),
    },
)
def model_release():
    # Each task hands its inputs to one `pipeline.entry.flow` function through `records.edge.call`:
    # XCom carries records as JSON, and the function sees them typed (Json: a record's JSON form).
    @task
    def validate(params: dict | None = None, run_id: str | None = None) -> Json:
        """Type and feasibility checks (one line per problem); opens the release in the registry."""
        from pipeline.entry import flow

        assert params is not None  # Airflow passes the run's params
        # a conf from before the limits were named max_ says p90_ttft_ms: Overrides reads it as the limit
        names = ("layouts", "max_p90_ttft_ms", "max_p90_tpot_ms", "p90_ttft_ms", "p90_tpot_ms")
        overrides = {k: params.get(k) for k in names}
        return edge.call(flow.validate_spec, params["spec"], run_id, overrides)

    @task
    def materialize_model(spec: Json) -> Json:
        """Resolve the model source to a local directory and its manifest hash."""
        from pipeline.entry import flow

        return edge.call(flow.materialize_model, spec)

    @task
    def quantize(spec: Json, source: Json) -> Json:
        """FP8 with llmcompressor; content-addressed, verified, published atomically. XCom: path + hash."""
        from pipeline.entry import flow

        return edge.call(flow.quantize, spec, source)

    @task
    def evaluate_baseline(spec: Json, source: Json) -> Json:
        """lm-eval on the BF16 source (cached by manifest hash, tasks and settings)."""
        from pipeline.entry import flow

        return edge.call(flow.evaluate, spec, source, baseline=True)

    @task
    def evaluate_candidate(spec: Json, quantized: Json) -> Json:
        """lm-eval on the FP8 candidate, same tasks, few-shot, limit and seed."""
        from pipeline.entry import flow

        return edge.call(flow.evaluate, spec, quantized, baseline=False)

    @task(retries=0)
    def accuracy_gate(spec: Json, baseline: Json, candidate: Json, run_id: str | None = None) -> Json:
        """great-expectations validates the per-task recovery table; a failure stops the run here."""
        from pipeline.entry import flow

        return edge.call(flow.accuracy_gate, spec, baseline, candidate, run_id)

    @task(retries=2, retry_delay=pendulum.duration(seconds=30), outlets=[STAGED])
    def stage(spec: Json, quantized: Json, gate: Json, *, outlet_events=None) -> Json:
        """Upload to S3/Spaces and/or NFS, manifest last; retried (network), resumes where it stopped."""
        from pipeline.entry import flow

        staged = edge.call(flow.stage, spec, quantized)
        outlet_events[STAGED].extra = staged  # the staged record: URIs and manifest hash
        return staged

    @task
    def layout_names(spec: Json, predictions: Json) -> list[str]:
        """Every layout, or the spec's `candidates.top_k` best predicted (and the live release's)."""
        from pipeline.entry import flow

        return edge.call(flow.layouts_to_measure, spec, predictions)

    @task
    def plan(spec: Json, run_id: str | None = None) -> Json:
        """The planner's max SLO rate per layout, published before any measurement; each search starts there."""
        from pipeline.entry import flow

        return edge.call(flow.plan_layouts, spec, run_id)

    # One mapped task per candidate layout. They run one at a time: layouts are compared on the
    # same machine, and two engines at once would measure each other.
    @task(max_active_tis_per_dagrun=1, pool=pools.BENCHMARK)
    def benchmark(
        spec: Json, staged: Json, predictions: Json, accuracy: Json, layout: str, run_id: str | None = None
    ) -> Json:
        """Serve the staged artifact with this layout; find its highest rate within the p90 SLO, then
        score the gate's tasks at its endpoint (serving-path accuracy)."""
        from pipeline.entry import flow

        return edge.call(flow.benchmark_layout, spec, staged, layout, run_id, predictions, accuracy)

    @task
    def select_layout(spec: Json, results: list[Json], run_id: str | None = None) -> Json:
        """Best layout by SLO rate per server; JSON, CSV and the latency-vs-rate PNG for the report."""
        from pipeline.entry import flow

        return edge.call(flow.select_layout, spec, list(results), run_id)

    @task(retries=0)
    def slo_gate(spec: Json, selection: Json) -> Json:
        """Fails the run, with the per-layout table in the log, when no layout meets the SLO."""
        from pipeline.entry import flow

        return edge.call(flow.slo_gate, spec, selection)

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
