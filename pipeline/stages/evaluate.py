"""Accuracy gate: lm-eval on the baseline and the FP8 candidate, same tasks and settings.

Recovery per task is candidate / baseline with its uncertainty propagated from lm-eval's
stderr on both sides; the gate decision is great-expectations' validation of the results
table (`pipeline/stages/gx_suite.py`), so what a reviewer sees and what the gate decided are the
same record. Results are cached by (model manifest hash, tasks, settings), reused only for bytes
that verify against that manifest.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import artifacts
from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_json
from pipeline.core.paths import CONFIGS_DIR, home
from pipeline.core.specs import EvalTask, EvaluationSpec
from pipeline.records.evaluate import Endpoint, EvalResult, GateDecision, TaskScore, TaskVerdict

log = logging.getLogger(__name__)

EVAL_DIR = CONFIGS_DIR / "eval"


# ---------------------------------------------------------------- running lm-eval


def task_config(task: EvalTask) -> str | dict[str, Any]:
    """A task shipped in configs/eval/ becomes a config dict with absolute data paths; others are names."""
    path = EVAL_DIR / f"{task.name}.yaml"
    if not path.exists():
        return task.name
    config = yaml.safe_load(path.read_text())
    files = config.get("dataset_kwargs", {}).get("data_files", {})
    for split, rel in files.items():
        data = (path.parent / rel).resolve()
        if not data.is_file():
            raise ReleaseError(f"evaluation.tasks: {task.name}: data file {data} is missing")
        files[split] = str(data)
    return config


def expected_samples(task: EvalTask, evaluation: EvaluationSpec) -> int | None:
    """How many samples a shipped task has (or the limit); None for tasks we do not ship."""
    path = EVAL_DIR / f"{task.name}.yaml"
    if not path.exists():
        return evaluation.limit
    config = yaml.safe_load(path.read_text())
    data = EVAL_DIR / next(iter(config["dataset_kwargs"]["data_files"].values()))
    count = sum(1 for line in data.read_text().splitlines() if line.strip())
    return min(count, evaluation.limit) if evaluation.limit else count


def settings(evaluation: EvaluationSpec) -> dict[str, Any]:
    return {
        "tasks": [t.model_dump(include={"name", "num_fewshot", "metric"}) for t in evaluation.tasks],
        "limit": evaluation.limit,
        "seed": evaluation.seed,
        "backend": evaluation.backend,
        "lm_eval": importlib.metadata.version("lm_eval"),
        "items": True,  # results keep the metric per item (older cached results do not)
    }


def cache_key(model_hash: str, evaluation: EvaluationSpec) -> str:
    return hashlib.sha256(
        json.dumps({"model": model_hash, **settings(evaluation)}, sort_keys=True).encode()
    ).hexdigest()[:20]


def evaluate(
    model_path: Path,
    model_hash: str,
    evaluation: EvaluationSpec,
    *,
    use_cache: bool = False,
    base_url: str | None = None,
) -> EvalResult:
    """Run lm-eval's Python API on one model; with `use_cache`, reuse an identical earlier run.

    A hit is used only when the model's files verify (sha256) against a manifest of that hash:
    the same bytes, tasks and settings give the same greedy scores, so measuring again proves nothing.
    """
    cache = home() / "eval-cache" / f"{cache_key(model_hash, evaluation)}.json"
    if use_cache and cache.exists() and _same_bytes(model_path, model_hash):
        log.info("evaluate: reusing cached results for %s (%s)", model_path, cache.name)
        return EvalResult.model_validate_json(cache.read_text()).model_copy(update={"cached": True})
    scores: list[TaskScore] = []
    started = time.monotonic()
    for i, task in enumerate(evaluation.tasks, start=1):
        log.info(
            "evaluate: %s task %d/%d %s (%d-shot)",
            model_path.name,
            i,
            len(evaluation.tasks),
            task.name,
            task.num_fewshot,
        )
        scores.append(run_task(model_path, task, evaluation, base_url))
        log.info(
            "evaluate: %s %s = %.4f ± %.4f on %d samples (%.0f s so far)",
            model_path.name,
            task.name,
            scores[-1].score,
            scores[-1].stderr or 0,
            scores[-1].samples,
            time.monotonic() - started,
        )
    result = EvalResult(
        model_path=str(model_path),
        model_manifest_hash=model_hash,
        backend=evaluation.backend,
        scores=scores,
        settings=settings(evaluation),
        seconds=round(time.monotonic() - started, 1),
    )
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_json(cache, result.model_dump())
    return result


def _same_bytes(model_path: Path, model_hash: str) -> bool:
    """The directory's files match its manifest, and that manifest is the one the cache key names."""
    if not artifacts.is_complete(model_path):
        return True  # a source we do not own (hub, local dir): materialize hashed its files just now
    try:
        return artifacts.verify(model_path).content_hash() == model_hash
    except artifacts.ArtifactError as exc:
        log.warning("evaluate: not reusing cached results: %s", exc)
        return False


def _model_args(
    model_path: Path | None,
    evaluation: EvaluationSpec,
    base_url: str | Endpoint | None,
    served_name: str | None = None,
) -> tuple[str, dict[str, Any]]:
    if evaluation.backend == "hf":
        return "hf", {"pretrained": str(model_path), "dtype": "float32", "device": "cpu"}
    if evaluation.backend == "vllm":
        return "vllm", {
            "pretrained": str(model_path),
            "dtype": "auto",
            "tensor_parallel_size": evaluation.tensor_parallel_size or 1,
        }
    if not base_url:
        raise ReleaseError("evaluation.backend: local-completions needs a running engine (base_url)")
    common = {
        "model": served_name or str(model_path),
        # text prompts: the engine's own tokenizer is part of the serving path being measured
        "tokenized_requests": False,
        "num_concurrent": evaluation.num_concurrent,
        "max_retries": 1,
    }
    if isinstance(base_url, Endpoint):
        return "local-completions", {**common, **base_url.lm_args(evaluation.num_concurrent)}
    return "local-completions", {
        **common,
        "base_url": f"{base_url}/v1/completions",
        "tokenizer": str(model_path),
        "tokenizer_backend": "huggingface",
    }


@functools.cache
def task_manager(shipped: bool) -> Any:
    """lm-eval's task index, built once per process. Indexing lm-eval's own task folders takes ~12 s
    (measured here), once per task before this; a task shipped in configs/eval/ comes as a config
    and needs no index at all."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=not shipped)


def run_task(
    model_path: Path | None,
    task: EvalTask,
    evaluation: EvaluationSpec,
    base_url: str | Endpoint | None,
    served_name: str | None = None,
) -> TaskScore:
    """One task through lm-eval's Python API with the evaluation's backend, limit and seeds."""
    import lm_eval

    model, model_args = _model_args(model_path, evaluation, base_url, served_name)
    config = task_config(task)
    lm: Any = model
    lm_args: dict[str, Any] | None = model_args
    try:
        if isinstance(base_url, Endpoint):
            # built here, not by simple_evaluate, which logs its arguments: they hold the credentials
            from lm_eval.api.registry import get_model

            lm = get_model(model).create_from_arg_obj(
                model_args, {"batch_size": evaluation.batch_size, "max_batch_size": None, "device": None}
            )
            lm_args = None
        out = lm_eval.simple_evaluate(
            model=lm,
            model_args=lm_args,
            tasks=[config],
            num_fewshot=task.num_fewshot,
            batch_size=evaluation.batch_size,
            limit=evaluation.limit,
            random_seed=evaluation.seed,
            numpy_random_seed=evaluation.seed,
            torch_random_seed=evaluation.seed,
            fewshot_random_seed=evaluation.seed,
            log_samples=True,  # the metric per item: the serving-path check compares the same items
            task_manager=task_manager(shipped=isinstance(config, dict)),
            bootstrap_iters=1000,
        )
    except ReleaseError:
        raise
    except KeyError as exc:
        raise ReleaseError(f"evaluation.tasks: {task.name}: lm-eval does not know this task ({exc})") from None
    except Exception as exc:  # lm-eval's own failure: name the task, keep the cause
        raise ReleaseError(
            f"evaluation.tasks: {task.name}: lm-eval failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    results = (out or {}).get("results", {}).get(task.name)
    if not results:
        raise ReleaseError(f"evaluation.tasks: {task.name}: lm-eval returned no results")
    metric = task.metric or next((k.split(",")[0] for k in results if "," in k and "_stderr" not in k), None)
    value = results.get(f"{metric},none")
    if metric is None or value is None:
        raise ReleaseError(
            f"evaluation.tasks: {task.name}: metric {metric!r} not in lm-eval's results "
            f"({', '.join(k for k in results if ',' in k)})"
        )
    stderr = results.get(f"{metric}_stderr,none")
    samples = out.get("n-samples", {}).get(task.name, {}).get("effective", 0)
    logged = sorted(
        (x for x in out.get("samples", {}).get(task.name, []) if x.get("filter") == "none" and metric in x),
        key=lambda x: x["doc_id"],
    )
    return TaskScore(
        task=task.name,
        metric=metric,
        score=float(value),
        stderr=float(stderr) if isinstance(stderr, (int, float)) else None,
        samples=int(samples),
        items=[float(x[metric]) for x in logged],
        item_hashes=[str(x.get("doc_hash", "")) for x in logged],
    )


# ---------------------------------------------------------------- the gate


def recovery(
    base: float, cand: float, base_se: float | None, cand_se: float | None
) -> tuple[float | None, float | None]:
    if not base or math.isnan(base) or math.isnan(cand):
        return None, None
    r = cand / base
    rel = math.sqrt(((cand_se or 0) / cand) ** 2 + ((base_se or 0) / base) ** 2) if cand else 0.0
    return r, r * rel


def verdicts(baseline: EvalResult, candidate: EvalResult, evaluation: EvaluationSpec) -> list[TaskVerdict]:
    base = {s.task: s for s in baseline.scores}
    cand = {s.task: s for s in candidate.scores}
    out = []
    for task in evaluation.tasks:
        b, c = base.get(task.name), cand.get(task.name)
        if b is None or c is None:
            continue  # a missing task is caught by the GX suite and named there
        r, r_se = recovery(b.score, c.score, b.stderr, c.stderr)
        reasons = []
        if r is None or r < task.min_recovery:
            reasons.append(
                f"recovery {r:.3f} < {task.min_recovery}" if r is not None else "recovery undefined (baseline 0)"
            )
        if c.score < task.floor:
            reasons.append(f"score {c.score:.3f} < floor {task.floor}")
        out.append(
            TaskVerdict(
                task=task.name,
                metric=b.metric,
                baseline=b.score,
                baseline_stderr=b.stderr,
                candidate=c.score,
                candidate_stderr=c.stderr,
                recovery=r,
                recovery_stderr=r_se,
                min_recovery=task.min_recovery,
                floor=task.floor,
                samples_baseline=b.samples,
                samples_candidate=c.samples,
                expected_samples=expected_samples(task, evaluation) or b.samples,
                passed=not reasons,
                reason="; ".join(reasons),
            )
        )
    return out


def gate(baseline: EvalResult, candidate: EvalResult, evaluation: EvaluationSpec, out_dir: Path) -> GateDecision:
    """Validate the results table with great-expectations; its verdict is the gate's."""
    from pipeline.stages import gx_suite

    tasks = verdicts(baseline, candidate, evaluation)
    published = gx_suite.publish(tasks, [t.name for t in evaluation.tasks], out_dir, "accuracy_validation")
    return GateDecision(
        passed=published.passed,
        tasks=tasks,
        failures=published.failures,
        validation_html=str(published.html_path),
        validation_json=str(published.json_path),
    )
