"""The accuracy gate's records: a task's score, one model's result, the gate's verdicts and decision,
and an engine endpoint lm-eval scores through (`pipeline/stages/evaluate.py` runs lm-eval and judges).

What the registry keeps per release (`evaluation`, `gate`) and what the serving-path check holds
its served answers to."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

__all__ = [
    "Endpoint",
    "EvalResult",
    "EvaluationPair",
    "GateDecision",
    "TaskScore",
    "TaskVerdict",
]


class TaskScore(BaseModel):
    task: str
    metric: str
    score: float
    stderr: float | None
    samples: int
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

    model_path: str
    model_manifest_hash: str
    backend: str
    scores: list[TaskScore]
    settings: dict[str, Any]
    seconds: float
    cached: bool = False


class EvaluationPair(BaseModel):
    """The accuracy gate's in-process results, both sides: what the registry keeps per release
    (`evaluation`) and what its served answers are held to later (a re-benchmark, a rollout)."""

    baseline: EvalResult
    candidate: EvalResult

    def pair(self) -> tuple[EvalResult, EvalResult]:
        return self.baseline, self.candidate


class TaskVerdict(BaseModel):
    task: str
    metric: str
    baseline: float
    baseline_stderr: float | None
    candidate: float
    candidate_stderr: float | None
    recovery: float | None = Field(description="candidate / baseline")
    recovery_stderr: float | None = Field(description="propagated from both stderrs (independent samples)")
    min_recovery: float
    floor: float
    samples_baseline: int
    samples_candidate: int
    expected_samples: int
    passed: bool
    reason: str
    in_process: float | None = Field(None, description="serving path: the candidate in-process on the same items")
    in_process_stderr: float | None = None
    difference: float | None = Field(None, description="serving path: |served - in_process|")
    max_difference: float | None = Field(None, description="serving path: two combined standard errors")


class GateDecision(BaseModel):
    passed: bool
    tasks: list[TaskVerdict]
    failures: list[str] = Field(description="one line per failed expectation or task, naming the task")
    validation_html: str | None = Field(None, description="GX validation result rendered for reviewers")
    validation_json: str | None = None

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
    headers: dict[str, str] = Field(default_factory=dict, repr=False, exclude=True)
    ca_cert: str | None = Field(None, description="CA bundle of the API server's certificate")
    verify: bool = True

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
