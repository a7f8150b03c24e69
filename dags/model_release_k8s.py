"""
### Model release on Kubernetes

One DAG per release spec in `configs/releases/` with `execution: kubernetes`, the same flow as
`model_release` up to the SLO gate. The heavy steps run as pods on the cluster, from the worker
image, each one `model-release` CLI sub-command: quantize, evaluate baseline and candidate,
stage, fetch, and one benchmark per layout the planner chose (the spec's `candidates.top_k` best
predicted, and the live release's), each on a whole GPU node and starting from its prediction.
The light steps run here, in the Airflow worker: validate the spec, the planner (seconds, no GPU),
the accuracy gate and the layout selection on the pods' results in storage, the SLO gate.

Pods, resources and placement come from `pipeline/k8s/pods.py`; this file only wires tasks.
"""

from __future__ import annotations

import pendulum
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import chain, dag, task

from pipeline.airflow.review_tasks import cluster_preflight, review_and_promote
from pipeline.core.specs import LoadedSpec
from pipeline.k8s import pods
from pipeline.records import edge
from pipeline.records.edge import Json


def release_dag(loaded: LoadedSpec):
    spec_path = str(loaded.path)

    def pod(task_id: str, step: pods.Step, **args: str) -> KubernetesPodOperator:
        return KubernetesPodOperator(task_id=task_id, **pods.pod_operator_kwargs(loaded, step, **args))

    @dag(
        dag_id=pods.dag_id(loaded),
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        doc_md=__doc__,
        tags=["model-release", "kubernetes", loaded.spec.name],
    )
    def release():
        @task
        def validate(run_id: str | None = None) -> Json:
            """Type and feasibility checks, again at run time; opens the release in the registry."""
            from pipeline.entry import flow

            return edge.call(flow.validate_spec, spec_path, run_id)

        @task(retries=0)
        def accuracy_gate(spec: Json, baseline: Json, candidate: Json, run_id: str | None = None) -> Json:
            """great-expectations on the two evaluation pods' stored scores; a failure stops the run."""
            from pipeline.entry import pod_steps

            return edge.call(pod_steps.accuracy_gate, spec, baseline, candidate, run_id)

        @task
        def record_staged(spec: Json, staged: Json) -> Json:
            from pipeline.entry import flow

            return edge.call(flow.record_staged, spec, staged)

        @task
        def plan(spec: Json, run_id: str | None = None) -> Json:
            """Every layout's max SLO rate, predicted and stored before any GPU time; each search starts there."""
            from pipeline.entry import pod_steps

            return edge.call(pod_steps.plan_layouts, spec, run_id)

        @task
        def layout_names(spec: Json, predictions: Json) -> list[str]:
            """Every layout, or the spec's `candidates.top_k` best predicted (and the live release's)."""
            from pipeline.entry import flow

            return edge.call(flow.layouts_to_measure, spec, predictions)

        @task
        def benchmark_arguments(
            names: list[str], fetched: Json, predictions: Json, run_id: str | None = None
        ) -> list[list[str]]:
            """One benchmark pod's arguments per chosen layout: the fetched copy, the layout's prediction."""
            from pipeline.entry import pod_steps

            return edge.call(pod_steps.benchmark_arguments, spec_path, list(names), fetched, predictions, run_id)

        @task
        def select_layout(spec: Json, refs: list[Json], run_id: str | None = None) -> Json:
            """Best layout by SLO rate per server, from the benchmark pods' stored results."""
            from pipeline.entry import pod_steps

            return edge.call(pod_steps.select_layout, spec, list(refs), run_id)

        @task(retries=0)
        def slo_gate(spec: Json, selection: Json) -> Json:
            """Fails the run, with the per-layout table in the log, when no layout meets the SLO."""
            from pipeline.entry import flow

            return edge.call(flow.slo_gate, spec, selection)

        quantize = pod("quantize", "quantize")
        baseline = pod("evaluate_baseline", "evaluate", side="baseline")
        candidate = pod("evaluate_candidate", "evaluate", side="candidate")
        stage = pod("stage", "stage")
        fetch = pod("fetch", "fetch")

        spec = validate()
        # the cluster holds what the release needs before any pod (and GPU time) starts
        ready = cluster_preflight.override(task_id="preflight")(spec)
        ready >> [quantize, baseline]
        # GPU steps run one after another: one node suffices, and layouts are measured on the same one.
        chain([quantize, baseline], candidate)
        chain(accuracy_gate(spec, baseline.output, candidate.output), stage, fetch)
        stage >> record_staged(spec, stage.output)
        predictions = plan(spec)
        benchmarks = KubernetesPodOperator.partial(
            task_id="benchmark", max_active_tis_per_dagrun=1, **pods.pod_operator_partial_kwargs(loaded, "benchmark")
        ).expand(arguments=benchmark_arguments(layout_names(spec, predictions), fetch.output, predictions))
        review_and_promote(spec, slo_gate(spec, select_layout(spec, benchmarks.output)), preflight=True)

    return release()


for _loaded in pods.kubernetes_specs():
    globals()[pods.dag_id(_loaded)] = release_dag(_loaded)
