"""A reviewer's Continue / Abort on every rollout step, in the Airflow UI (Required actions).

One mapped task per step of the release DAG: it waits, deferred to the triggerer (no worker slot
held while the new release loads), until the controller has judged the step, then, as Airflow's
own HITLOperator, puts the step's analysis to the spec's reviewers with the verdict as the
default, for `rollout.review_timeout`; the answer goes into the registry, where the controller
holding the step reads it (pipeline/release/step_review.py). A step the rollout never reaches
(an earlier one aborted) is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import task
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowSkipException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from pipeline.airflow.approval import PLUGIN_PATH, comment_form
from pipeline.airflow.rest import SETTLE_S
from pipeline.core import platform
from pipeline.core.specs import SloSpec
from pipeline.records import edge
from pipeline.records.edge import Json
from pipeline.records.release import ReleaseRef
from pipeline.records.rollout import PendingStep, StepReview

log = logging.getLogger(__name__)

CONTINUE, ABORT = "Continue", "Abort"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def body(release_id: int, pending: PendingStep, slo: SloSpec, base_url: str) -> str:
    """The step's evidence in markdown: the new release beside the old one in the same window."""
    step = pending.analysis
    q = {k: v.value for k, v in step.queries.items()}
    verdict = "passed" if step.passed else "FAILED"
    if step.inconclusive:
        verdict = "inconclusive (too little traffic: Continue only if you know why)"
    reasons = "".join(f"- {r}\n" for r in step.reasons)
    return (
        f"**Release {release_id}, rollout step {step.step}: {step.fraction:.0%} of traffic on it.** "
        f"Live analysis over {step.window_s} s: **{verdict}**.\n\n"
        f"| | new release | old release | SLO |\n|---|---|---|---|\n"
        f"| p90 TTFT | {_ms(q.get('new_p90_ttft'))} | {_ms(q.get('old_p90_ttft'))} | {slo.max_p90_ttft_ms:g} ms |\n"
        f"| p90 TPOT | {_ms(q.get('new_p90_tpot'))} | {_ms(q.get('old_p90_tpot'))} | {slo.max_p90_tpot_ms:g} ms |\n"
        f"| requests finished | {q.get('new_requests') or 0:.0f} | {q.get('old_requests') or 0:.0f} | |\n\n"
        + (f"{reasons}\n" if reasons else "")
        + f"No answer in {pending.timeout_s:.0f} s: **{CONTINUE if step.passed else ABORT}** "
        f"(the analysis verdict). The step holds its traffic until then.\n\n"
        f"[Release report]({base_url.rstrip('/')}{PLUGIN_PATH}/releases/{release_id})"
    )


class StepJudged(BaseTrigger):
    """Fires once the controller has judged the step (the PendingStep), or once the rollout ended
    without it; never sooner than `settle_s` after it started (rest.SETTLE_S: the scheduler must
    have taken in the deferred attempt's exit before the task resumes). Runs in the triggerer, so
    the wait holds no worker slot; a reschedule-mode sensor, re-run every poke, failed now and then
    on the same scheduler race."""

    def __init__(self, release_id: int, step: int, poll_s: float = 2.0, settle_s: float = SETTLE_S):
        super().__init__()
        self.release_id, self.step, self.poll_s, self.settle_s = release_id, step, poll_s, settle_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"release_id": self.release_id, "step": self.step, "poll_s": self.poll_s, "settle_s": self.settle_s},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from pipeline.entry import flow  # the triggerer imports this module; the registry only when it runs

        started = time.monotonic()
        while (found := await asyncio.to_thread(flow.pending_step, self.release_id, self.step)) is False:
            await asyncio.sleep(self.poll_s)
        await asyncio.sleep(max(0.0, started + self.settle_s - time.monotonic()))
        judged = {"status": "judged", "pending": edge.to_json(found)}
        yield TriggerEvent({"status": "ended"} if found is None else judged)


class RolloutStepReview(HITLOperator):
    """Continue or abort one step of a release's rollout; defaults to the step's analysis verdict.

    Waits (deferred, no worker slot) until the controller has judged its step, then asks the spec's
    reviewers; skipped when the rollout ends before reaching the step. `release`: the run's
    validated spec record (XComArg, templated), `step`: the step's number (mapped)."""

    template_fields = (*HITLOperator.template_fields, "release")

    def __init__(self, *, release: Any, step: int, poll_s: float = 2.0, **kwargs: Any):
        kwargs.pop("params", None)
        super().__init__(
            subject="Rollout step", options=[CONTINUE, ABORT], defaults=CONTINUE, params=comment_form(), **kwargs
        )
        self.release, self.step, self.poll_s = release, step, poll_s

    def _own_form(self) -> None:
        """Only the comment field (the DAG's run params are merged into every task's)."""
        self.params = ParamsDict(comment_form())

    def _release_id(self) -> int:
        # the run's validated record, or any record naming the release (a ReleaseRef reads either)
        return edge.from_json(ReleaseRef, self.release, f"{self.task_id}'s release").release_id

    def execute(self, context):
        release_id = self._release_id()
        log.info("release %d: waiting for rollout step %d's analysis", release_id, self.step)
        self.defer(
            trigger=StepJudged(release_id, int(self.step), self.poll_s),
            method_name="ask",
            timeout=timedelta(hours=12),  # a rollout's longest plausible run
        )

    def ask(self, context, event: dict[str, Any]):
        """The step is judged: put it to the reviewers (parks the task until an answer or the timeout)."""
        from pipeline.entry import flow  # at run time: DAG files import this module and parse light
        from pipeline.release.promote import release_spec

        if event["status"] == "ended":
            raise AirflowSkipException(f"rollout step {self.step} was never reached (the rollout ended before it)")
        self._own_form()
        pending = edge.from_json(PendingStep, event["pending"], "the step's trigger event")
        release_id = self._release_id()
        step = pending.analysis
        loaded = release_spec(flow.registry().get(release_id))
        reviewers = loaded.spec.promotion.reviewers
        self.assigned_users = [{"id": name, "name": name} for name in reviewers] or None
        self.defaults = [CONTINUE if step.passed else ABORT]
        self.subject = (
            f"Release {release_id}, rollout step {step.step} ({step.fraction:.0%} of traffic): "
            f"analysis {'passed' if step.passed else 'FAILED'}. Continue?"
        )
        self.body = body(release_id, pending, loaded.spec.slo, platform.current().base_url())
        self.response_timeout = timedelta(seconds=pending.timeout_s)
        log.info(
            "step %d of release %d: asking %s; %s in %.0f s if nobody answers",
            step.step,
            release_id,
            reviewers,
            self.defaults[0],
            pending.timeout_s,
        )
        return super().execute(context)

    def execute_complete(self, context, event: dict[str, Any]) -> Any:
        from pipeline.entry import flow

        self._own_form()
        release_id = self._release_id()
        if not event.get("chosen_options"):
            # Airflow 3.3's timeout sweep fills in the defaults; should an event come without them, the
            # verdict is the default (a resumed task is a fresh operator: nothing from ask() survives)
            found = flow.pending_step(release_id, int(self.step))
            passed = isinstance(found, PendingStep) and found.analysis.passed
            event = {**event, "chosen_options": [CONTINUE if passed else ABORT]}
        user = event.get("responded_by_user") or {}
        chosen = event["chosen_options"][0]
        review = StepReview(
            step=int(self.step),
            decision="continue" if chosen == CONTINUE else "abort",
            # Airflow authorises assigned users by id; record the id
            actor=user.get("id") or user.get("name") or f"timeout (default: {chosen})",
            comment=(event.get("params_input") or {}).get("comment", ""),
            by_default=not user,
        )
        flow.record_step_review(release_id, review)
        log.info("step %d of release %d: %s by %s", self.step, release_id, chosen, review.actor)
        return super().execute_complete(context, event)


@task
def review_steps(spec: Json) -> list[int]:
    """One review per step of this release's rollout; none without `rollout.review_timeout` or a live release."""
    from pipeline.entry import flow

    return edge.call(flow.review_steps, spec)


def review_each_step(spec: Any, after: Any) -> Any:
    """The mapped review tasks, one per step `review_steps` lists for this release once `after` is done."""
    steps = review_steps(spec)
    after >> steps
    return RolloutStepReview.partial(
        task_id="review_step",
        release=spec,
        doc_md="A reviewer continues or aborts this rollout step; no answer in time means the analysis verdict.",
    ).expand(step=steps)
