"""A reviewer's Continue / Abort on every rollout step: the decision on record beside the analysis,
the controller's wait on the registry, the local controller's hold. STEP_DAG runs in the
end-to-end test's Airflow (tests/test_e2e.py), answered over its REST API as a reviewer does."""

from __future__ import annotations

import textwrap
import threading
import time

from pipeline.records.events import StepReviewed, detail_of
from pipeline.records.rollout import Query, StepAnalysis, StepReview
from pipeline.release import step_review
from pipeline.release.registry import Registry
from tests.conftest import TINY_SPEC


def judged(step: int, passed: bool = True) -> StepAnalysis:
    return StepAnalysis(
        step=step,
        fraction=0.5,
        window_s=6,
        passed=passed,
        reasons=[] if passed else ["p90 TTFT 900 ms > SLO 500 ms"],
        queries={"new_p90_ttft": Query(promql="histogram_quantile(...)", value=0.9 if not passed else 0.04)},
    )


def test_a_reviewer_overrides_the_verdict_and_both_stay_on_record():
    aborted = judged(1).decided(StepReview(step=1, decision="abort", actor="reviewer", comment="TPOT creeping up"))
    assert not aborted.passed and aborted.analysis_passed is True
    assert aborted.reasons == ["aborted by reviewer reviewer: TPOT creeping up"]
    assert "FAILED, abort by reviewer" in aborted.summary()

    carried = judged(2, passed=False).decided(StepReview(step=2, decision="continue", actor="sre-oncall"))
    assert carried.passed and carried.analysis_passed is False
    assert (
        carried.reasons[0].startswith("p90 TTFT") and "continued by reviewer sre-oncall despite" in carried.reasons[1]
    )

    failed = judged(3, passed=False)
    kept = failed.decided(step_review.default(failed, "timeout (default: Abort)"))
    assert not kept.passed and kept.analysis_passed is None and kept.reasons == failed.reasons
    assert kept.review is not None and kept.review.by_default and kept.review.decision == "abort"


def test_the_controller_takes_the_reviewers_answer_or_after_the_timeout_the_verdict(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    rel = reg.open_release("run-1", "tiny", "spec.yaml", "name: tiny\n", "local")
    review = step_review.registry_reviewer(reg, rel.id, timeout_s=0.5, poll_s=0.05, grace_s=0.5)

    def reviewer() -> None:  # the review task, in another process in the DAG: sees the step, answers
        while not isinstance(found := step_review.pending(reg, rel.id, 1), step_review.PendingStep):
            time.sleep(0.05)
        assert found.analysis.passed and found.timeout_s == 0.5
        step_review.record(reg, rel.id, StepReview(step=1, decision="abort", actor="reviewer", comment="no"))

    answering = threading.Thread(target=reviewer)
    answering.start()
    assert review(judged(1)) == StepReview(step=1, decision="abort", actor="reviewer", comment="no")
    answering.join()

    # nobody answers step 2 (no review task, or it died): the controller goes on with the verdict,
    # after the review's timeout and the grace for a late answer, never before
    started = time.monotonic()
    fallback = review(judged(2, passed=False))
    assert fallback.decision == "abort" and fallback.by_default and time.monotonic() - started >= 1.0
    # the fallback is the step's review on record; a review task answering after it (late on a loaded
    # scheduler) records nothing: one decision per step, in the order the rollout took them
    late = StepReview(step=2, decision="continue", actor="reviewer", comment="too late")
    assert step_review.record(reg, rel.id, late) is False
    kinds = [e.kind for e in reg.events(rel.id)]
    assert kinds == ["created", step_review.JUDGED, step_review.REVIEWED, step_review.JUDGED, step_review.REVIEWED]
    on_record = reg.events(rel.id)[-1]
    assert on_record.actor == "pipeline (no review answer)" and on_record.detail_as(StepReviewed).decision == "abort"


def test_a_review_task_sees_only_its_own_rollout(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    rel = reg.open_release("run-1", "tiny", "spec.yaml", "name: tiny\n", "local")
    step1 = {**judged(1).model_dump(), "review_timeout_s": 30}
    reg.record(rel.id, detail_of("approved", None), "reviewer")
    assert step_review.pending(reg, rel.id, 1) is False  # approved, the rollout not yet at step 1
    reg.record(rel.id, detail_of("deploy_started", None), "pipeline")
    reg.record(rel.id, detail_of(step_review.JUDGED, step1), "pipeline")
    found = step_review.pending(reg, rel.id, 1)
    assert isinstance(found, step_review.PendingStep) and found.timeout_s == 30
    assert step_review.pending(reg, rel.id, 2) is False
    reg.record(rel.id, detail_of("deploy_failed", {"error": "aborted at step 1"}), "pipeline")
    assert step_review.pending(reg, rel.id, 2) is None  # never reached: its review task skips
    # a second attempt of the same release: the first attempt's step 1 is not this one's
    reg.record(rel.id, detail_of("approved", None), "reviewer")
    reg.record(rel.id, detail_of("deploy_started", None), "pipeline")
    assert step_review.pending(reg, rel.id, 1) is False


def test_a_local_rollout_step_holds_its_traffic_until_reviewed_and_an_abort_ends_it(monkeypatch):
    """The controller asks after each step's analysis, with the step's traffic split in place, and
    a reviewer's Abort moves the front back (the engines, the front, Prometheus and the analysis
    stand in here; the local-target test runs them for real)."""
    from pipeline.core.rollout import Fleet
    from pipeline.core.specs import load_spec
    from pipeline.release import analysis, controller, local_prometheus, local_target

    spec = load_spec(TINY_SPEC).spec  # steps 50%, 100%
    old, new = (
        local_target.Deployment(release_id=i, layout="single", model_dir="m", pgids=[], ports=[9000 + i], log_dir="l")
        for i in (1, 2)
    )
    events: list[str] = []
    monkeypatch.setattr(local_prometheus, "ensure", lambda root: "http://prometheus")
    monkeypatch.setattr(local_prometheus, "scrape", lambda *a: None)
    monkeypatch.setattr(local_prometheus, "wait_scraped", lambda *a: None)
    monkeypatch.setattr(local_prometheus, "forget", lambda *a: None)
    monkeypatch.setattr(local_target, "_point_front", lambda spec, weights, marker, shares=False: events.append(marker))
    monkeypatch.setattr(local_target, "is_healthy", lambda dep: True)
    monkeypatch.setattr(local_target, "drain", lambda dep, timeout=None: events.append(f"drain {dep.release_id}"))
    monkeypatch.setattr(local_target, "_stop_groups", lambda pgids, grace=None: None)

    def window(url, new_sel, old_sel, step, fraction, slo, rollout, settle_s):
        events.append(f"analysis {step}")
        return judged(step)

    def review(verdict: StepAnalysis) -> StepReview:
        events.append(f"review {verdict.step}")
        return StepReview(step=verdict.step, decision="continue" if verdict.step == 1 else "abort", actor="reviewer")

    monkeypatch.setattr(analysis, "after_window", window)
    target = local_target.LocalRelease(spec, 2)
    target.old, target.new = old, new
    fleet = Fleet(release="2", backend="2", old_release="1", old_backend="1", old_servers=1, new_servers=1)
    monkeypatch.setattr(target, "state", lambda recovering=False: fleet)
    monkeypatch.setattr(target, "mark", lambda record: None)
    monkeypatch.setattr(target, "check", lambda step, servers: events.append(f"check {step}"))
    outcome = controller.rollout(target, local_target.steps(spec), target.judge(review), 1)
    assert outcome.status == "rolled_back" and "at step 2" in (outcome.error or "")
    assert "aborted by reviewer" in (outcome.error or "")
    assert events == [
        "check 1",
        "1=5000,2=5000",
        "analysis 1",
        "review 1",
        "check 2",
        "1=0,2=10000",
        "analysis 2",
        "review 2",
        "1=10000,2=0",  # back at once: the old release kept its engines through the last step
        "drain 2",
    ]
    assert [(s.passed, s.analysis_passed) for s in outcome.steps] == [(True, None), (False, True)]


STEP_DAG = textwrap.dedent(
    '''
    """The release DAG's step reviews beside a controller that judges three steps, each passing its
    analysis, and stops at the first the reviewers abort (the wait and the decision are promote()'s)."""
    import pendulum
    from airflow.sdk import dag, task

    from pipeline.airflow.step_review import review_each_step


    @dag(dag_id="step_reviews", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
    def step_reviews():
        @task
        def release(params=None) -> dict:
            return {"release_id": int(params["release_id"])}

        @task
        def rollout(spec: dict) -> list:
            from pipeline.entry import flow
            from pipeline.release import promote
            from pipeline.records import events as ev
            from pipeline.records.rollout import Query, StepAnalysis

            reg = flow.registry()
            rel = reg.get(spec["release_id"])
            review = promote.reviewer(reg, rel, promote.release_spec(rel))
            steps = []
            for number, fraction in enumerate([0.3, 0.6, 1.0], 1):
                verdict = StepAnalysis(
                    step=number, fraction=fraction, window_s=6, passed=True,
                    queries={"new_p90_ttft": Query(promql="histogram_quantile(...)", value=0.04)},
                )
                decided = verdict.decided(review(verdict))
                steps.append(decided.model_dump(mode="json"))
                reg.record(
                    rel.id,
                    ev.RolloutStep(step=number, fraction=fraction, old_servers=1, new_servers=1, seconds=0.0,
                                   analysis=decided, passed=decided.passed),
                    "pipeline",
                )
                if not decided.passed:
                    reg.record(rel.id, ev.RolloutAbort(error="; ".join(decided.reasons)), "pipeline")
                    break
            return steps

        spec = release()
        rollout(spec)
        review_each_step(spec, after=spec)


    step_reviews()
    '''
)
