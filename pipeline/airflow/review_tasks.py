"""The review end of every release DAG: report, reviewer approval, promotion, verification.

One definition for the local and the Kubernetes DAG, so what a reviewer relies on (the page,
the approval, the gates re-checked in code, the live-release event) cannot drift apart between
them. The Assets that schedule other DAGs are named here once.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, task

from pipeline.airflow.approval import ReleaseApproval
from pipeline.airflow.step_review import review_each_step
from pipeline.records import edge
from pipeline.records.edge import Json

STAGED = Asset("model-release://staged-artifact")  # a newly staged artifact (URI, manifest hash)
LIVE = Asset("model-release://live-release")  # a promotion or rollback: re-benchmark the new live release
ENGINE_IMAGE = Asset("model-release://engine-image")  # CI emits an event when it pushes a new serving image


@task
def report(spec: Json, gate: Json, run_id: str | None = None) -> Json:
    """The reviewer's page: accuracy, latency-vs-load curves, chosen layout vs live, audit trail."""
    from pipeline.entry import flow

    assert run_id is not None  # Airflow passes the run's id from the context
    return edge.call(flow.report, spec, run_id)


@task(retries=0)
def cluster_preflight(spec: Json) -> Json:
    """The cluster holds what the release needs (namespaces, the workers' rights, Gateway, CRDs, weights
    volume, Secrets, GPUs, Prometheus); each missing piece is one line of the failure."""
    from pipeline.entry import flow

    return edge.call(flow.cluster_preflight, spec)


@task(retries=1, retry_delay=pendulum.duration(seconds=30), outlets=[LIVE])
def promote(spec: Json, run_id: str | None = None, *, ti=None, outlet_events=None) -> Json:
    """Re-checks every gate and the approval in code, then rolls out; restores the previous release on failure.
    Its retry runs only when the first try's controller died (worker killed, task terminated): it
    finishes or undoes that rollout from the state it left, and never rolls out twice."""
    from pipeline.entry import flow

    assert run_id is not None  # Airflow passes the run's id from the context
    first_try = ti is None or ti.try_number <= 1
    outcome = edge.call(flow.promote, spec, run_id, step_reviews=True, first_try=first_try)
    outlet_events[LIVE].extra = outcome  # the PromotionOutcome: release, name, status, endpoint
    return outcome


@task(retries=1, retry_delay=pendulum.duration(seconds=20))
def verify(spec: Json, promoted: Json, run_id: str | None = None) -> Json:
    """The live endpoint answers a completion after the switch, not only during it."""
    from pipeline.entry import flow

    assert run_id is not None  # Airflow passes the run's id from the context
    return edge.call(flow.verify, spec, run_id)


def review_and_promote(spec, gate, pool: str | None = None, preflight: bool = False):
    """Wire report >> approve >> promote >> verify after the SLO gate, with a mapped review task per
    rollout step beside promote; returns verify's output.

    `pool`: where promote and verify take a slot (pools.BENCHMARK on the embedded default, whose
    rollout serves and measures on the machine the benchmarks use). `preflight`: the cluster is
    checked again between the approval and the promotion (hours or days may lie between)."""
    slot = {"pool": pool} if pool else {}
    approve = ReleaseApproval(
        task_id="approve",
        release=spec,
        doc_md="A reviewer named in the spec approves or rejects, "
        "in this UI (Required actions) or over the REST API; no answer in time means Reject.",
    )
    report(spec, gate) >> approve
    promoted = promote.override(**slot)(spec)
    if preflight:
        approve >> cluster_preflight.override(task_id="preflight_promotion")(spec) >> promoted
    else:
        approve >> promoted
    # beside the promotion: a reviewer's Continue / Abort per rollout step (a first local release has none)
    review_each_step(spec, after=approve)
    return verify.override(**slot)(spec, promoted)
