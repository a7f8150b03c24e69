"""The accuracy gate's records: a task's score, one model's result, the gate's verdicts and decision,
and an engine endpoint lm-eval scores through (`pipeline/stages/evaluate.py` runs lm-eval and judges).

What the registry keeps per release (`evaluation`, `gate`) and what the serving-path check holds
its served answers to."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field, JsonValue

__all__ = [
    "Endpoint",
    "EvalResult",
    "EvaluationPair",
    "GateDecision",
    "TaskScore",
    "TaskVerdict",
]


class TaskScore(BaseModel):
    task: str = Field(description="the lm-eval task's name (evaluation.tasks)")
    metric: str = Field(description="the lm-eval metric scored (the task's, or its first)")
    score: float = Field(description="the metric over the items scored")
    stderr: float | None = Field(description="lm-eval's standard error of the score; None: it gave none")
    samples: int = Field(description="items scored (lm-eval's effective n-samples)")
    items: list[float] = Field(
        default_factory=list, description="the metric per item, in the task's order: scores on any first N items"
    )
    item_hashes: list[str] = Field(default_factory=list, description="lm-eval's doc_hash per item: the same items?")

    def first(self, n: int | None) -> TaskScore:
        """The score on the first `n` items (all when None), its stderr as lm-eval computes it:
        sample standard deviation / sqrt(n)."""
        if n is None or n >= len(self.items):
            return self
        values = self.items[:n]
        mean = sum(values) / n
        stderr = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else None
        return self.model_copy(
            update={"score": mean, "stderr": stderr, "samples": n, "items": values, "item_hashes": self.item_hashes[:n]}
        )


class EvalResult(BaseModel):
    """One model's scores on the spec's tasks."""

    model_path: str = Field(description="the model directory evaluated")
    model_manifest_hash: str = Field(description="its manifest's content hash: what the cache keys on")
    backend: str = Field(description="lm-eval's backend: hf, vllm or local-completions")
    scores: list[TaskScore] = Field(description="one per task of the spec, in its order")
    settings: dict[str, JsonValue] = Field(
        description="tasks, limit, seed, backend, lm-eval version: the cache key's settings"
    )
    seconds: float = Field(description="lm-eval's wall time over all tasks, s (a cached result keeps its run's)")
    cached: bool = Field(False, description="reused from the evaluation cache: same bytes, tasks and settings")


class EvaluationPair(BaseModel):
    """The accuracy gate's in-process results, both sides: what the registry keeps per release
    (`evaluation`) and what its served answers are held to later (a re-benchmark, a rollout)."""

    baseline: EvalResult = Field(description="the source model's scores")
    candidate: EvalResult = Field(description="the FP8 candidate's scores, in-process")

    def pair(self) -> tuple[EvalResult, EvalResult]:
        return self.baseline, self.candidate


class TaskVerdict(BaseModel):
    task: str = Field(description="the lm-eval task's name")
    metric: str = Field(description="the metric judged")
    baseline: float = Field(description="the baseline's score")
    baseline_stderr: float | None = Field(description="its standard error; None: lm-eval gave none")
    candidate: float = Field(description="the candidate's score (serving path: the served score)")
    candidate_stderr: float | None = Field(description="its standard error; None: lm-eval gave none")
    recovery: float | None = Field(description="candidate / baseline")
    recovery_stderr: float | None = Field(description="propagated from both stderrs (independent samples)")
    min_recovery: float = Field(description="the least recovery that passes (serving path: served_min_recovery)")
    floor: float = Field(description="the candidate's absolute minimum score")
    samples_baseline: int = Field(description="items the baseline was scored on")
    samples_candidate: int = Field(description="items the candidate was scored on")
    expected_samples: int = Field(
        description="items both sides must have scored: the task's data or the limit, else the baseline's"
    )
    passed: bool = Field(description="recovery and floor met (serving path: and within max_difference)")
    reason: str = Field(description="why it failed, rules joined by '; '; empty when it passed")
    in_process: float | None = Field(None, description="serving path: the candidate in-process on the same items")
    in_process_stderr: float | None = Field(None, description="serving path: the in-process score's standard error")
    difference: float | None = Field(None, description="serving path: |served - in_process|")
    max_difference: float | None = Field(None, description="serving path: two combined standard errors")


class GateDecision(BaseModel):
    passed: bool = Field(description="the GX validation of the results table passed: the gate's verdict")
    tasks: list[TaskVerdict] = Field(description="one verdict per task both sides scored")
    failures: list[str] = Field(description="one line per failed expectation or task, naming the task")
    validation_html: str | None = Field(None, description="GX validation result rendered for reviewers")
    validation_json: str | None = Field(None, description="GX validation result as JSON, a path")

    def table(self) -> str:
        head = (
            f"{'task':14} {'metric':12} {'baseline':>14} {'candidate':>14} {'recovery':>16} {'min':>5} {'floor':>5}"
            "  result"
        )
        rows = [head]
        for t in self.tasks:
            rec = f"{t.recovery:.3f}±{t.recovery_stderr or 0:.3f}" if t.recovery is not None else "n/a"
            rows.append(
                f"{t.task:14} {t.metric:12} {t.baseline:7.3f}±{t.baseline_stderr or 0:.3f} "
                f"{t.candidate:7.3f}±{t.candidate_stderr or 0:.3f} {rec:>16} {t.min_recovery:5.2f} "
                f"{t.floor:5.2f}  {'pass' if t.passed else 'FAIL: ' + t.reason}"
            )
        return "\n".join(rows)


class Endpoint(BaseModel):
    """An engine lm-eval scores through `local-completions`, reached through a Kubernetes API
    server's service proxy: the server's credentials and CA go with it, and the tokenizer is the
    engine's own (vLLM's /tokenize, /detokenize, /tokenizer_info), since no model files are where
    the check runs. The headers are secrets: kept out of repr, dumps and logs."""

    url: str = Field(description="the engine's base URL (…/services/NAME:PORT/proxy)")
    headers: dict[str, str] = Field(
        default_factory=dict,
        repr=False,
        exclude=True,
        description="the API client's auth headers (bearer token): secrets",
    )
    ca_cert: str | None = Field(None, description="CA bundle of the API server's certificate")
    verify: bool = Field(True, description="verify the API server's TLS certificate (the client's verify_ssl)")

    def __str__(self) -> str:
        return self.url

    def lm_args(self, num_concurrent: int) -> dict[str, Any]:
        """What `local-completions` takes for this endpoint, besides the model and the concurrency.

        The remote tokenizer sends its own bearer token and CA path (requests). Completions send
        the header and verify with `verify_certificate`: lm-eval hands it to aiohttp when requests
        run concurrently (an SSL context with the CA) and to requests when they do not (the CA path)."""
        import ssl

        token = self.headers.get("Authorization", "")  # deploy.service_endpoint names it so
        verify: Any = self.verify
        if self.verify and self.ca_cert:
            verify = ssl.create_default_context(cafile=self.ca_cert) if num_concurrent > 1 else self.ca_cert
        return {
            "base_url": f"{self.url}/v1/completions",
            "tokenizer_backend": "remote",
            "header": dict(self.headers),
            "auth_token": token.split(" ", 1)[1] if token.lower().startswith("bearer ") else None,
            "ca_cert_path": self.ca_cert,
            "verify_certificate": verify,
        }
