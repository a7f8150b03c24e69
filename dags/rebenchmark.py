"""
### Re-benchmark live releases

One DAG per release spec in `configs/releases/`, on the spec's `rebenchmark.schedule` (cron,
default daily), and also when a release goes live or a new serving image is announced
(Assets), or by hand; not on a newly staged artifact, since that run is benchmarking its
layouts right then and two benchmarks on one machine measure each other. For each live
release of that spec: benchmark a fresh instance of its
exact layout and artifact (never the production endpoint), at its promoted rate and with a
short SLO search; append a trend point; mark it `degraded` and alert when it no longer holds
what it was promoted on; roll back by itself when the spec says `auto_rollback: true`.

With `execution: kubernetes` the measurement runs as a pod on a whole GPU node (one per live
release, mapped), from the worker image, and leaves its result in storage; the verdict is
reached here, by the same code as the local measurement's.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from pipeline.airflow import pools
from pipeline.airflow.review_tasks import ENGINE_IMAGE, LIVE
from pipeline.core.specs import load_spec
from pipeline.k8s import pods
from pipeline.records import edge
from pipeline.records.edge import Json
from pipeline.release.rebenchmark import scheduled_specs


def rebenchmark_dag(name: str, spec_path: str, cron: str, execution: str):
    @dag(
        dag_id=f"rebenchmark__{name.replace('-', '_').replace('.', '_')}",
        # no start date: the first scheduled run is the next cron point, not the last one missed. With
        # one, Airflow ran every spec's slot of the day the moment the DAG appeared (two re-benchmarks
        # starting with the embedded Airflow held its SQLite lock 60 s and failed a REST trigger in CI).
        # run_immediately=False still runs a point missed by under a tenth of the interval (2.4 h of a
        # day: apache/airflow#64162); a zero window is the "never" it documents
        schedule=AssetOrTimeSchedule(
            timetable=CronTriggerTimetable(cron, timezone="UTC", run_immediately=timedelta(0)),
            assets=(LIVE | ENGINE_IMAGE),
        ),
        catchup=False,
        max_active_runs=1,
        doc_md=__doc__,
        tags=["model-release", "rebenchmark"],
        params={
            "release_id": Param(
                None,
                type=["null", "integer"],
                title="Release id",
                description="Only this release; empty: every live release of the spec",
            )
        },
    )
    def rebenchmark():
        @task
        def live_releases(params: dict | None = None) -> list[int]:
            """The releases to measure; none live is not an error (the run says so and succeeds)."""
            from pipeline.entry import flow

            assert params is not None  # Airflow passes the run's params

            return flow.live_release_ids(name, params.get("release_id"))

        releases = live_releases()
        if execution == "local":

            @task(max_active_tis_per_dagrun=1, retries=0, pool=pools.BENCHMARK)
            def measure(release_id: int, run_id: str | None = None, **context) -> Json:
                """Fresh instance, short search + check at the promoted rate, verdict, trend point, alert."""
                from pipeline.entry import flow

                return edge.call(flow.rebenchmark, release_id, run_id, context)

            measure.expand(release_id=releases)
            return

        @task
        def pod_arguments(release_ids: list[int], run_id: str | None = None) -> list[list[str]]:
            """Each live release's layout, artifact and promoted rate, from the registry."""
            from pipeline.entry import pod_steps

            return pod_steps.remeasure_arguments(release_ids, run_id)

        @task(retries=0, trigger_rule="all_done")
        def judge(release_id: int, run_id: str | None = None, **context) -> Json:
            """The pod's stored measurement against the promotion figures: trend point, verdict, alert."""
            from pipeline.entry import pod_steps

            return edge.call(pod_steps.judge_remeasured, release_id, run_id, context)

        loaded = load_spec(spec_path)
        measure_in_pod = KubernetesPodOperator.partial(
            task_id="measure", max_active_tis_per_dagrun=1, **pods.pod_operator_partial_kwargs(loaded, "rebenchmark")
        )
        measure_in_pod.expand(arguments=pod_arguments(releases)) >> judge.expand(release_id=releases)

    return rebenchmark()


for _spec in scheduled_specs():
    rebenchmark_dag(_spec["name"], _spec["path"], _spec["schedule"], _spec["execution"])
