"""The reviewer's decision, in the Airflow UI: Airflow's own human-in-the-loop ApprovalOperator.

Subclassed only to do at run time what a DAG file cannot know at parse time: who may answer
(the spec's reviewers, from the release the run opened), what the question and the evidence
are (subject and markdown body from the registry), how long to wait (the spec's
approval_timeout, default answer Reject), and to write the answer, with the responding user and
comment, into the registry before Airflow acts on it (Reject skips promotion).
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict

from pipeline.core import platform
from pipeline.core.specs import LoadedSpec, duration_seconds
from pipeline.records import edge
from pipeline.records.events import ApprovalRequested, Approved, Rejected
from pipeline.records.release import ReleaseRef
from pipeline.records.selection import ChosenFigures
from pipeline.release.registry import NOTHING_CHOSEN, Release, ReleaseData
from pipeline.stages import capacity

log = logging.getLogger(__name__)

PLUGIN_PATH = "/model-releases"


def _fmt(value: Any, fmt: str = ".3g") -> str:
    return "—" if value is None else format(value, fmt)


def fleet_phrase(facts: ReleaseData) -> str:
    """'; 3 -> 2 servers, -33% $/M output tokens' (or the fleet alone when nothing is live)."""
    plan = facts.capacity
    if plan is None:
        return ""
    if plan.change:
        return f"; {plan.change.summary()}"
    return f"; {plan.candidate.servers} servers at peak" if plan.candidate else ""


def fleet_lines(facts: ReleaseData) -> str:
    """The fleet and cost table in markdown, live first."""
    plan = facts.capacity
    if plan is None:
        return ""
    money = capacity.money
    rows = "\n".join(
        f"| {r.name} | {_fmt(r.rate_per_server)} | {r.servers} | {money(r.usd_per_hour)} | "
        f"{money(r.usd_per_m_input_at_slo)} | {money(r.usd_per_m_output_at_slo)} |"
        for r in (plan.live, plan.candidate)
        if r is not None
    )
    price = f"${plan.price_per_server_hour:g}/server-hour" if plan.price_per_server_hour else "no price"
    change = f" **{plan.change.summary()}**." if plan.change else ""
    return (
        f"Fleet for a peak of {plan.peak_rps:g} req/s + {plan.headroom:.0%} headroom at {price}:{change}\n\n"
        f"| | req/s per server | servers | $/hour | $/M input @SLO | $/M output @SLO |\n|---|---|---|---|---|---|\n"
        f"{rows}\n\n"
    )


def read_with_care(chosen: ChosenFigures) -> str:
    """What the chosen rate must be read with, as the report marks it: runs that disagreed (unsteady),
    a load client that sent late (client-bound); empty for neither."""
    notes = [
        text
        for flagged, text in (
            (chosen.unsteady, "**unsteady**: its runs disagreed beyond workload.max_spread even at the longer probes"),
            (chosen.client_bound, "**client-bound**: the load client sent requests late in the runs that decided it"),
        )
        if flagged
    ]
    return f"Read this rate with care: {'; '.join(notes)} (see the report).\n\n" if notes else ""


def body(rel: Release, live: Release | None, loaded: LoadedSpec, base_url: str) -> str:
    """The evidence in markdown: short enough to decide from, with a link to the full report."""
    facts, slo = rel.data, loaded.spec.slo
    acc, chosen = facts.accuracy, facts.chosen or NOTHING_CHOSEN
    rows = "\n".join(
        f"| {t.task} | {t.baseline:.3f} | {t.candidate:.3f} | "
        f"{_fmt(t.recovery, '.3f')} | {t.min_recovery:.2f} | {'pass' if t.passed else 'FAIL'} |"
        for t in (acc.tasks if acc else [])
    )
    theirs = live.data.chosen.rate_per_server if live is not None and live.data.chosen else None
    if live is not None and theirs:
        ratio = f"**{chosen.rate_per_server / theirs:.2f}x**" if chosen.rate_per_server else "—"
        vs_live = f"live release {live.id} ({live.data.layout}): {_fmt(theirs)} req/s per server → {ratio}"
    else:
        vs_live = "no live release yet"
    link = f"{base_url.rstrip('/')}{PLUGIN_PATH}/releases/{rel.id}"
    return (
        f"**Release {rel.id}: {loaded.spec.model.name} → {loaded.spec.promotion.target}**\n\n"
        f"Accuracy gate: **{'passed' if acc and acc.passed else 'FAILED'}** (lm-eval, great-expectations)\n\n"
        f"| task | baseline | FP8 | recovery | min | result |\n|---|---|---|---|---|---|\n{rows}\n\n"
        f"Chosen layout **{chosen.layout}**: **{'at least ' if chosen.bound_only else ''}"
        f"{_fmt(chosen.rate_per_server)} req/s per server** "
        f"({_fmt(chosen.per_device)} per {loaded.hardware.kind.upper()}) within the SLO; {vs_live}.\n\n"
        f"{read_with_care(chosen)}"
        f"At that rate: p90 TTFT {_fmt(chosen.p90_ttft_ms, '.0f')} ms (limit {slo.max_p90_ttft_ms:g}), "
        f"p90 TPOT {_fmt(chosen.p90_tpot_ms, '.1f')} ms (limit {slo.max_p90_tpot_ms:g}).\n\n"
        f"{fleet_lines(facts)}"
        f"Artifact `{facts.s3_uri or facts.nfs_path}` (manifest {str(facts.manifest_hash)[:16]}…)\n\n"
        f"[Full report and audit trail]({link})"
    )


def comment_form() -> dict[str, Param]:
    """The reviewer's one form field: a comment for the audit trail."""
    return {"comment": Param("", type="string", title="Comment", description="Recorded in the release's audit trail")}


class ReleaseApproval(ApprovalOperator):
    """Approve or reject the promotion of a release.

    `release` is the validated spec record of the run (the `validate` task's output, passed as
    its XComArg): a templated field, so Airflow resolves it when the task runs and wires the
    dependency, and this operator never names another task.
    """

    template_fields = (*ApprovalOperator.template_fields, "release")

    def __init__(self, *, release: Any, **kwargs: Any):
        kwargs.setdefault("subject", "Promote release?")
        kwargs.pop("params", None)
        super().__init__(defaults=ApprovalOperator.REJECT, params=comment_form(), **kwargs)
        self.release = release

    def _own_form(self) -> None:
        """The DAG merges its run params (spec, layouts, ...) into every task's; the reviewer's
        form must show, and the response be validated against, only the comment field."""
        self.params = ParamsDict(comment_form())

    def _release_id(self, context) -> int:
        # the run's validated record, or any record naming the release (a ReleaseRef reads either)
        return edge.from_json(ReleaseRef, self.release, f"{self.task_id}'s release").release_id

    def execute(self, context):
        # the release machinery loads when the task runs; DAG files import this module, and their
        # parse must stay light (the dag-processor times out imports)
        from pipeline.entry import flow
        from pipeline.release.promote import release_spec

        self._own_form()
        reg = flow.registry()
        rel = reg.get(self._release_id(context))
        loaded = release_spec(rel)
        promotion = loaded.spec.promotion
        if not promotion.requires_approval:
            reg.record(
                rel.id, Approved(comment="spec: promotion.requires_approval is false"), "policy", status="approved"
            )
            return {"chosen_options": [self.APPROVE], "params_input": {}, "responded_by_user": None}
        live = reg.live(rel.name, rel.target)
        self.assigned_users = [{"id": name, "name": name} for name in promotion.reviewers]
        self.subject = (
            f"Promote {loaded.spec.model.name} FP8 as layout {rel.data.layout} at "
            f"{_fmt(rel.data.chosen.rate_per_server if rel.data.chosen else None)} req/s per server"
            f"{fleet_phrase(rel.data)}?"
        )
        self.body = body(rel, live, loaded, platform.current().base_url())
        from datetime import timedelta

        self.response_timeout = timedelta(seconds=duration_seconds(promotion.approval_timeout))
        asked = ApprovalRequested(
            reviewers=promotion.reviewers, timeout=promotion.approval_timeout, subject=self.subject
        )
        reg.record(rel.id, asked, "pipeline")
        log.info(
            "waiting for one of %s to approve release %d (timeout %s, then Reject)",
            promotion.reviewers,
            rel.id,
            promotion.approval_timeout,
        )
        return super().execute(context)

    def execute_complete(self, context, event: dict[str, Any]) -> Any:
        self._own_form()
        from pipeline.entry import flow  # at run time, as in execute

        reg = flow.registry()
        release_id = self._release_id(context)
        if "error" in event:
            reg.record(release_id, Rejected(error=event.get("error_type")), "timeout", status="rejected")
            return super().execute_complete(context, event)
        user = event.get("responded_by_user") or {}
        # Airflow authorises assigned users by id; record the id (the name goes in the detail)
        actor = user.get("id") or user.get("name") or "timeout (default: Reject)"
        chosen = (event.get("chosen_options") or [self.REJECT])[0]
        comment = (event.get("params_input") or {}).get("comment", "")
        approved = chosen == self.APPROVE
        decision = (Approved if approved else Rejected)(
            comment=comment, responded_at=str(event.get("responded_at")), user_name=user.get("name")
        )
        reg.record(release_id, decision, actor, status="approved" if approved else "rejected")
        log.info(
            "release %d %s by %s%s",
            release_id,
            "approved" if approved else "rejected",
            actor,
            f": {comment}" if comment else "",
        )
        return super().execute_complete(context, event)
