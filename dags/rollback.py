"""
### Roll back a release

Manual trigger: put an earlier release of a model back into service: the one named by
`release_id`, or the one that served before the live one. Kubernetes target: its objects, kept
by the release that replaced it, are scaled up, checked and given the traffic back in waves of
the spare budget (within the keep window only the route moves; rolled out again in steps where
they were pruned); local target: its engines are started and smoke-tested before the switch.
Who triggered the rollback and why is recorded on both releases.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task

from pipeline.airflow.review_tasks import LIVE
from pipeline.records import edge
from pipeline.records.edge import Json


@dag(
    dag_id="rollback",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    doc_md=__doc__,
    tags=["model-release"],
    params={
        "name": Param("tiny-qwen3-moe-fp8", type="string", title="Release name", description="The spec's name"),
        "release_id": Param(
            None,
            type=["null", "integer"],
            title="Release to restore",
            description="Empty: the one that served before the live one",
        ),
        "reason": Param("", type="string", minLength=3, title="Reason", description="Recorded in the audit trail"),
    },
)
def rollback():
    # a retry (the task killed mid-rollback) takes the model's lock, resumes or undoes the dead try
    # through the record it left on the target, then restores what was asked (promote.rollback)
    @task(retries=2, retry_delay=pendulum.duration(seconds=30), outlets=[LIVE])
    def restore(params: dict | None = None, dag_run=None) -> Json:
        from pipeline.entry import flow

        assert params is not None  # Airflow passes the run's params

        actor = getattr(dag_run, "triggering_user_name", None) or "airflow"
        return edge.call(flow.rollback, params["name"], params.get("release_id"), params["reason"], actor)

    @task(retries=1, retry_delay=pendulum.duration(seconds=20))
    def verify(restored: Json, run_id: str | None = None) -> Json:
        from pipeline.entry import flow

        return edge.call(flow.verify, restored, run_id)  # the restored release's PromotionOutcome

    verify(restore())


rollback()
