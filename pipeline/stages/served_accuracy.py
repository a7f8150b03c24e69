"""Accuracy on the serving path: lm-eval against a layout's live endpoint, judged against the
candidate's in-process scores on the same items.

The accuracy gate measures the checkpoint once, in-process. Users get their answers from vLLM
with a given layout, kernels, tokenizer path and engine version, and those can break answers
while the checkpoint is fine. So after a layout's SLO search, while its engines still run, the
spec's tasks go through lm-eval's `local-completions` backend (text prompts: the engine's own
tokenizer is on the path) to that layout's endpoint. A task passes when the served score is
within two combined standard errors of the candidate's in-process score on the same first N
items, and meets the task's minimum recovery (vs the baseline on those items) and floor; the
table is validated by the same great-expectations suite as the gate, with the serving columns.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import EvaluationSpec
from pipeline.records.evaluate import Endpoint, EvalResult, TaskScore
from pipeline.records.served_accuracy import ServedAccuracy
from pipeline.stages import gx_suite
from pipeline.stages.evaluate import run_task, verdicts

log = logging.getLogger(__name__)


# A rollout step's check, on either target: (step, the new release's endpoint as lm-eval reaches
# it, its served model name) -> the served table held to the gate's in-process scores. The caller
# (promotion) holds those scores and records the evidence; a failed check aborts the step.
Answers = Callable[[int, "str | Endpoint", str], ServedAccuracy]


def items_for(evaluation: EvaluationSpec) -> int | None:
    """How many items of each task the serving path scores: the spec's served limit, never more
    than the gate scored."""
    limits = [n for n in (evaluation.served.limit, evaluation.limit) if n]
    return min(limits) if limits else None


def served_evaluation(evaluation: EvaluationSpec) -> EvaluationSpec:
    """The gate's evaluation as the serving-path check runs it: lm-eval's local-completions at the
    endpoint, on the check's items, with the check's own concurrency (not the gate's)."""
    return evaluation.model_copy(
        update={
            "backend": "local-completions",
            "limit": items_for(evaluation),
            "num_concurrent": evaluation.served.num_concurrent,
        }
    )


def reference(result: EvalResult, task: str, n: int | None) -> TaskScore:
    """One side's in-process score on the first `n` items of `task`."""
    score = next((s for s in result.scores if s.task == task), None)
    if score is None:
        raise ReleaseError(f"serving-path accuracy: {task}: no in-process score for {result.model_path}")
    if n is not None and n < score.samples and not score.items:
        raise ReleaseError(
            f"serving-path accuracy: {task}: the in-process result of {result.model_path} has no per-item "
            "scores (an older cached result); run the evaluation again"
        )
    return score.first(n)


def check(
    endpoint: str | Endpoint,
    model_dir: Path | None,
    served_name: str,
    baseline: EvalResult,
    candidate: EvalResult,
    evaluation: EvaluationSpec,
    out_dir: Path,
) -> ServedAccuracy:
    """Score the spec's tasks at `endpoint` and judge them; the table and GX validation go to `out_dir`.

    `model_dir` holds the tokenizer lm-eval uses for an engine it reaches directly; an `Endpoint`
    behind a service proxy brings the engine's own tokenizer endpoints instead (`model_dir` None)."""
    started = time.monotonic()
    n = items_for(evaluation)
    served_spec = served_evaluation(evaluation)
    base_scores, cand_scores, served_scores = [], [], []
    for i, task in enumerate(evaluation.tasks, start=1):
        log.info(
            "serving-path accuracy: task %d/%d %s at %s (%s items)",
            i,
            len(evaluation.tasks),
            task.name,
            endpoint,
            n or "all",
        )
        served = run_task(model_dir, task, served_spec, endpoint, served_name)
        base, cand = reference(baseline, task.name, n), reference(candidate, task.name, n)
        if (
            served.item_hashes
            and cand.item_hashes
            and served.item_hashes != cand.item_hashes[: len(served.item_hashes)]
        ):
            raise ReleaseError(f"serving-path accuracy: {task.name}: the served items are not the in-process ones")
        base_scores.append(base)
        cand_scores.append(cand)
        served_scores.append(served)
        log.info(
            "serving-path accuracy: %s served %.4f ± %.4f, in-process %.4f ± %.4f on %d items (%.0f s so far)",
            task.name,
            served.score,
            served.stderr or 0,
            cand.score,
            cand.stderr or 0,
            served.samples,
            time.monotonic() - started,
        )
    few = [t.model_copy(update={"min_recovery": t.served_min_recovery or t.min_recovery}) for t in evaluation.tasks]
    judged = evaluation.model_copy(update={"limit": n, "tasks": few})
    tasks = verdicts(
        baseline.model_copy(update={"scores": base_scores}),
        candidate.model_copy(update={"scores": served_scores}),
        judged,
    )
    in_process = {s.task: s for s in cand_scores}
    for t in tasks:
        ref = in_process[t.task]
        t.in_process, t.in_process_stderr = ref.score, ref.stderr
        t.difference = abs(t.candidate - ref.score)
        t.max_difference = 2 * math.sqrt((t.candidate_stderr or 0) ** 2 + (ref.stderr or 0) ** 2)
        if t.difference > t.max_difference + 1e-12:
            t.passed = False
            t.reason = "; ".join(
                r
                for r in (
                    t.reason,
                    f"served {t.candidate:.3f} vs in-process {ref.score:.3f}: "
                    f"{t.difference:.3f} > 2 combined stderr {t.max_difference:.3f}",
                )
                if r
            )
    published = gx_suite.publish(tasks, [t.name for t in evaluation.tasks], out_dir, "served_accuracy", served=True)
    return ServedAccuracy(
        passed=published.passed,
        endpoint=str(endpoint),
        limit=n,
        tasks=tasks,
        failures=published.failures,
        seconds=round(time.monotonic() - started, 1),
        validation_json=str(published.json_path),
        validation_html=str(published.html_path),
    )
