"""A rollout step's records: its live analysis, a reviewer's decision on it, and the judged step
waiting for that decision (what the controller, the registry and the review task hand each other)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["GatewaySmoke", "PendingStep", "Query", "StepAnalysis", "StepReview"]


class Query(BaseModel):
    promql: str = Field(description="the PromQL asked (the front's counts: what was counted)")
    value: float | None = Field(description="None: no data in the window (no samples, or no requests)")


class StepReview(BaseModel):
    """A person's Continue / Abort on one rollout step, or the analysis verdict when nobody answered."""

    step: int = Field(description="the rollout step, from 1")
    decision: Literal["continue", "abort"] = Field(description="continue: on to the next step; abort: stop the rollout")
    actor: str = Field(description="the reviewer (Airflow user id), or who decided for nobody")
    comment: str = Field("", description="the reviewer's comment, if any")
    by_default: bool = Field(False, description="nobody answered in time: the analysis verdict stood")


class StepAnalysis(BaseModel):
    """One analysis window of one rollout step: the verdict and every query behind it."""

    step: int = Field(description="the rollout step, from 1")
    fraction: float = Field(description="share of the traffic the new release gets in this step")
    window_s: int = Field(description="the analysis window the queries cover, s")
    passed: bool = Field(description="the step's verdict: the analysis', or its reviewer's once decided")
    reasons: list[str] = Field(default_factory=list, description="why it failed; empty when it passed")
    inconclusive: bool = Field(
        False,
        description="too little traffic on either release to judge: never a pass (a reviewer may "
        "Continue it; unanswered, it aborts)",
    )
    queries: dict[str, Query] = Field(description="name -> its PromQL and value (latencies in s, counts in requests)")
    analysis_passed: bool | None = Field(None, description="the PromQL verdict, when a reviewer's decision differs")
    review: StepReview | None = Field(None, description="the decision on it (a reviewer's, or the verdict by default)")

    def decided(self, review: StepReview) -> StepAnalysis:
        """The step as its reviewer decided: Abort fails a step that passed its analysis, Continue
        passes one that failed; the analysis verdict and its reasons stay on record beside it."""
        proceed = review.decision == "continue"
        if review.by_default or proceed == self.passed:
            return self.model_copy(update={"review": review})
        said = f"{review.actor}: {review.comment}" if review.comment else review.actor
        reason = (
            f"continued by reviewer {said} despite the failed analysis" if proceed else f"aborted by reviewer {said}"
        )
        return self.model_copy(
            update={
                "passed": proceed,
                "analysis_passed": self.passed,
                "reasons": [*self.reasons, reason],
                "review": review,
            }
        )

    def summary(self) -> str:
        q = {k: v.value for k, v in self.queries.items()}

        def ms(key: str) -> str:
            v = q.get(key)
            return "-" if v is None else f"{v * 1000:.0f} ms"

        verdict = "inconclusive (too little traffic)" if self.inconclusive else "passed" if self.passed else "FAILED"
        if self.review and not self.review.by_default:
            verdict += f", {self.review.decision} by {self.review.actor}"
        return (
            f"step {self.step} ({self.fraction:.0%} of traffic, {self.window_s} s): {verdict}; "
            f"new p90 TTFT {ms('new_p90_ttft')} (old {ms('old_p90_ttft')}), "
            f"p90 TPOT {ms('new_p90_tpot')} (old {ms('old_p90_tpot')}), "
            f"{q.get('new_requests') or 0:.0f} requests" + (f"; {'; '.join(self.reasons)}" if self.reasons else "")
        )


class PendingStep(BaseModel):
    """A judged step waiting for its reviewer: what the review task shows and how long it waits."""

    analysis: StepAnalysis = Field(description="the step's judged analysis, put to the reviewers")
    timeout_s: float = Field(description="how long the review waits for an answer (rollout.review_timeout), s")


class GatewaySmoke(BaseModel):
    """A smoke completion through the model's Gateway to one named release, and what answered:
    proof that the address users call reaches that release's servers."""

    gateway: str = Field(description="the route's Gateway, namespace/name")
    url: str = Field(description="the address asked: the Gateway's status address and its listener's port")
    release: str = Field(description="the release's Service, named in the request's x-model-release header")
    answered_by: str = Field(description="the x-model-release header of the answer that passed (the rule that served)")
    tries: int = Field(description="requests sent until that answer, this one included")
    wrong: list[str] = Field(
        default_factory=list,
        description="what answered each earlier try instead (the Gateway's data plane not yet serving the rule)",
    )
    text: str = Field(description="the completion's text")
