"""A reviewer's Continue / Abort on every rollout step, in the Airflow UI (Required actions).

One mapped task group per step of the release DAG: a sensor (reschedule mode: no worker slot
held while the new release loads) waits until the controller has judged the step, then Airflow's
own HITLOperator puts the step's analysis to the spec's reviewers with the verdict as the
default, for `rollout.review_timeout`, and the answer goes into the registry, where the
controller holding the step reads it (pipeline/release/step_review.py). A step the rollout never
reaches (an earlier one aborted, nothing live to roll over) is skipped.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import PokeReturnValue, task, task_group
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowSkipException

from pipeline.airflow.approval import PLUGIN_PATH, comment_form
from pipeline.core import platform

log = logging.getLogger(__name__)

CONTINUE, ABORT = "Continue", "Abort"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def body(release_id: int, pending: dict[str, Any], slo: Any, base_url: str) -> str:
    """The step's evidence in markdown: the new release beside the old one in the same window."""
    step = pending["analysis"]
    q = {k: v.get("value") for k, v in step["queries"].items()}
    verdict = "passed" if step["passed"] else "FAILED"
    if step.get("inconclusive"):
        verdict = "inconclusive (no traffic)"
    reasons = "".join(f"- {r}\n" for r in step.get("reasons", []))
    return (
        f"**Release {release_id}, rollout step {step['step']}: {step['fraction']:.0%} of traffic on it.** "
        f"Live analysis over {step['window_s']} s: **{verdict}**.\n\n"
        f"| | new release | old release | SLO |\n|---|---|---|---|\n"
        f"| p90 TTFT | {_ms(q.get('new_p90_ttft'))} | {_ms(q.get('old_p90_ttft'))} | {slo.p90_ttft_ms:g} ms |\n"
        f"| p90 TPOT | {_ms(q.get('new_p90_tpot'))} | {_ms(q.get('old_p90_tpot'))} | {slo.p90_tpot_ms:g} ms |\n"
        f"| requests finished | {q.get('new_requests') or 0:.0f} | {q.get('old_requests') or 0:.0f} | |\n\n"
        + (f"{reasons}\n" if reasons else "")
        + f"No answer in {pending['timeout_s']:.0f} s: **{CONTINUE if step['passed'] else ABORT}** "
        f"(the analysis verdict). The step holds its traffic until then.\n\n"
        f"[Release report]({base_url.rstrip('/')}{PLUGIN_PATH}/releases/{release_id})"
    )


class RolloutStepReview(HITLOperator):
    """Continue or abort one step of a release's rollout; defaults to the step's analysis verdict.

    `release`: the run's validated spec record (XComArg); `pending`: the judged step from the
    sensor before it (XComArg). Both are templated fields, resolved when the task runs."""

    template_fields = (*HITLOperator.template_fields, "release", "pending")

    def __init__(self, *, release: Any, pending: Any, **kwargs: Any):
        kwargs.pop("params", None)
        super().__init__(
            subject="Rollout step", options=[CONTINUE, ABORT], defaults=CONTINUE, params=comment_form(), **kwargs
        )
        self.release, self.pending = release, pending

    def _own_form(self) -> None:
        """Only the comment field (the DAG's run params are merged into every task's)."""
        self.params = ParamsDict(comment_form())

    def execute(self, context):
        from pipeline.entry import flow  # at run time: DAG files import this module and parse light
        from pipeline.release.promote import release_spec

        self._own_form()
        release_id = int(self.release["release_id"])
        step = self.pending["analysis"]
        loaded = release_spec(flow.registry().get(release_id))
        reviewers = loaded.spec.promotion.reviewers
        self.assigned_users = [{"id": name, "name": name} for name in reviewers] or None
        self.defaults = [CONTINUE if step["passed"] else ABORT]
        self.subject = (
            f"Release {release_id}, rollout step {step['step']} ({step['fraction']:.0%} of traffic): "
            f"analysis {'passed' if step['passed'] else 'FAILED'}. Continue?"
        )
        self.body = body(release_id, self.pending, loaded.spec.slo, platform.current().base_url())
        self.response_timeout = timedelta(seconds=float(self.pending["timeout_s"]))
        log.info(
            "step %d of release %d: asking %s; %s in %.0f s if nobody answers",
            step["step"],
            release_id,
            reviewers,
            self.defaults[0],
            self.pending["timeout_s"],
        )
        return super().execute(context)

    def execute_complete(self, context, event: dict[str, Any]) -> Any:
        from pipeline.entry import flow

        self._own_form()
        release_id = int(self.release["release_id"])
        step = self.pending["analysis"]
        user = event.get("responded_by_user") or {}
        chosen = (event.get("chosen_options") or [CONTINUE if step["passed"] else ABORT])[0]
        by_default = not user
        review = {
            "step": step["step"],
            "decision": "continue" if chosen == CONTINUE else "abort",
            # Airflow authorises assigned users by id; record the id
            "actor": user.get("id") or user.get("name") or f"timeout (default: {chosen})",
            "comment": (event.get("params_input") or {}).get("comment", ""),
            "by_default": by_default,
        }
        flow.record_step_review(release_id, review)
        log.info("step %d of release %d: %s by %s", step["step"], release_id, chosen, review["actor"])
        return super().execute_complete(context, event)


@task.sensor(poke_interval=5, timeout=12 * 3600, mode="reschedule")
def step_judged(spec: dict, step: int) -> PokeReturnValue:
    """Waits (slot-free) until the controller has judged this step; skips when the rollout ends first."""
    from pipeline.entry import flow

    found = flow.pending_step(int(spec["release_id"]), step)
    if found is None:
        raise AirflowSkipException(f"rollout step {step} was never reached (an earlier step ended the rollout)")
    return PokeReturnValue(is_done=bool(found), xcom_value=found or None)


@task
def review_steps(spec: dict) -> list[int]:
    """One review per step of this release's rollout; none without `rollout.review_timeout` or a live release."""
    from pipeline.entry import flow

    return flow.review_steps(int(spec["release_id"]))


@task_group
def review_step(spec: dict, step: int) -> None:
    """Wait for the step's analysis, then ask a reviewer."""
    RolloutStepReview(
        task_id="review",
        release=spec,
        pending=step_judged(spec, step),
        doc_md="A reviewer continues or aborts this rollout step; no answer in time means the analysis verdict.",
    )
