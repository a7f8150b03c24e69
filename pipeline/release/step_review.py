"""A person's say on every rollout step: the controller waits for a Continue / Abort in the registry.

The release DAG maps one review task per step (pipeline/airflow/step_review.py): it waits for the
step's analysis to be recorded here, puts it to the spec's reviewers in Airflow's Required actions
with the verdict as the default answer, and records the answer. The controller holding the step
(local or Kubernetes) waits for that answer, and goes on with the analysis verdict if no answer
comes, so a broken or missing review task can delay a rollout but never wedge it. That fallback is
recorded as the step's review, and an answer that comes after it (a review task late on a loaded
scheduler) is logged, not recorded: the trail holds one decision per step, the one the rollout took,
in the order the steps were taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pipeline.records.events import JudgedStep, StepReviewed
from pipeline.records.rollout import PendingStep, StepAnalysis, StepReview
from pipeline.release.registry import Registry

log = logging.getLogger(__name__)

JUDGED = "rollout_step_judged"  # a step's analysis, awaiting its review
REVIEWED = "step_review"
# the rollout is over (or never began): a step not yet judged never will be
ENDED = ("deploy_finished", "deploy_failed", "rollout_aborted", "promotion_refused", "rejected", "rollback_finished")
STARTED = ("deploy_started", "rollback_started", "approved")  # where this rollout's events begin
# beyond the review's own timeout: the scheduler's timeout sweep (15 s), a task start, the answer's write
GRACE_S = 120.0

# a step's analysis -> a reviewer's Continue / Abort (the verdict when nobody answers)
Reviewer = Callable[[StepAnalysis], StepReview]


def default(verdict: StepAnalysis, actor: str) -> StepReview:
    return StepReview(
        step=verdict.step, decision="continue" if verdict.passed else "abort", actor=actor, by_default=True
    )


def registry_reviewer(
    reg: Registry, release_id: int, timeout_s: float, poll_s: float = 1.0, grace_s: float = GRACE_S
) -> Reviewer:
    """Record each step's analysis for its review task, then wait for the answer; with none within
    the review's timeout and `grace_s`, the analysis verdict stands."""

    def review(verdict: StepAnalysis) -> StepReview:
        reg.record(release_id, JudgedStep(**verdict.model_dump(), review_timeout_s=timeout_s), "pipeline")
        log.info(
            "release %d, step %d: analysis %s; waiting up to %.0f s for a reviewer's Continue / Abort",
            release_id,
            verdict.step,
            "passed" if verdict.passed else "FAILED",
            timeout_s,
        )
        deadline = time.monotonic() + timeout_s + grace_s
        while True:
            answer = decided(reg, release_id, verdict.step)  # since the analysis just recorded
            if answer is not None:
                decision = StepReview.model_validate(answer.model_dump(exclude={"kind"}))
                log.info(
                    "release %d, step %d: %s (%s)",
                    release_id,
                    verdict.step,
                    decision.decision,
                    "nobody answered: the analysis verdict" if decision.by_default else f"by {decision.actor}",
                )
                return decision
            if time.monotonic() > deadline:
                log.warning(
                    "release %d, step %d: no review answer within %.0f s; the analysis verdict stands",
                    release_id,
                    verdict.step,
                    timeout_s + grace_s,
                )
                fallback = default(verdict, "pipeline (no review answer)")
                record(reg, release_id, fallback)
                return fallback
            time.sleep(poll_s)

    return review


def pending(reg: Registry, release_id: int, step: int) -> PendingStep | None | bool:
    """The step's analysis once this rollout has judged it; False while it has not yet; None when
    the rollout ended without judging it (an earlier step aborted, nothing live to roll over).

    Only this rollout counts: the newest events back to its start (or to the approval, before it
    starts), so an earlier attempt's steps or failure are never taken for this one's."""
    for e in reversed(reg.events(release_id)):
        if e.kind == JUDGED and (judged := e.detail_as(JudgedStep)).step == step:
            analysis = StepAnalysis.model_validate(judged.model_dump(exclude={"kind", "review_timeout_s"}))
            return PendingStep(analysis=analysis, timeout_s=judged.review_timeout_s)
        if e.kind in ENDED:
            return None
        if e.kind in STARTED:
            return False
    return False


def decided(reg: Registry, release_id: int, step: int) -> StepReviewed | None:
    """The review recorded for the step since its analysis, if any (the rollout's decision on it)."""
    for e in reversed(reg.events(release_id)):
        if e.kind == REVIEWED and (review := e.detail_as(StepReviewed)).step == step:
            return review
        if e.kind == JUDGED and e.detail_as(JudgedStep).step == step:
            return None
    return None


def record(reg: Registry, release_id: int, review: StepReview) -> bool:
    """Record a step's review; False (and a warning) where the step was decided already: the
    controller went on without an answer, and a later one changes nothing the rollout did."""
    earlier = decided(reg, release_id, review.step)
    if earlier is not None:
        log.warning(
            "release %d, step %d: %s by %s came after the step was decided (%s by %s): not recorded",
            release_id,
            review.step,
            review.decision,
            review.actor,
            earlier.decision,
            earlier.actor,
        )
        return False
    reg.record(release_id, StepReviewed(**review.model_dump()), review.actor)
    return True
