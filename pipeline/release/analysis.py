"""Live SLO analysis of one rollout step, from vLLM's own Prometheus metrics.

What a reviewer trusts in Argo Rollouts' analysis runs, with the release's SLO as the bar: the new
release's p90 TTFT and p90 TPOT over the step's window (PromQL `histogram_quantile` over `rate()`
of vLLM's histogram buckets), its aborted share, and whether every one of its engines was scraped,
each beside the old release's figure for the same window. Every query and its answer goes into the
verdict, so an abort shows its evidence.
"""

from __future__ import annotations

import logging
import math
import time

import requests

from pipeline.core.errors import PrometheusError
from pipeline.core.specs import RolloutSpec, SloSpec, duration_seconds
from pipeline.records.rollout import Query, StepAnalysis

log = logging.getLogger(__name__)

TTFT = "vllm:time_to_first_token_seconds"
# vLLM's per-request mean time per output token (decode time / (output tokens - 1))
TPOT = "vllm:request_time_per_output_token_seconds"
FINISHED = "vllm:request_success_total"  # label finished_reason: stop, length, abort, error, repetition
# vLLM's API server counts every answered HTTP request (prometheus-fastapi-instrumentator, status
# grouped as 2xx/4xx/5xx): a request that failed before or outside the engine (a 500) never
# reaches FINISHED, so the error share counts these too
HTTP = "http_requests_total"


# A query that errors (no answer, a 5xx, a refusal) is not a failed measurement: it is asked again,
# for the same window, and only more than this many errors in a row abort the step, as Argo
# Rollouts' analysis counts them (its consecutiveErrorLimit, default 4). A query that answers and
# fails the step's bar aborts at once.
CONSECUTIVE_ERROR_LIMIT = 4
RETRY_S = 5.0


def query(url: str, promql: str, timeout: float = 10, at: float | None = None) -> float | None:
    """One instant query through Prometheus' HTTP API; a scalar or a one-series vector, else None.
    `at`: the evaluation time (Unix seconds): a retry asks about the same window."""
    params: dict[str, str | float] = {"query": promql}
    if at is not None:
        params["time"] = f"{at:.3f}"
    try:
        response = requests.get(f"{url}/api/v1/query", params=params, timeout=timeout)
        body = response.json()
    except (requests.RequestException, ValueError) as exc:
        raise PrometheusError(f"Prometheus at {url}: {promql}: {exc}") from None
    if body.get("status") != "success":
        raise PrometheusError(f"Prometheus at {url} refused {promql}: {body.get('error', body)}")
    result = body["data"]["result"]
    if body["data"]["resultType"] == "scalar":
        value = float(result[1])
    elif not result:
        return None
    elif len(result) > 1:
        raise PrometheusError(f"Prometheus at {url}: {promql} returned {len(result)} series, expected one")
    else:
        value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


def queries(new: str, old: str | None, window_s: int) -> dict[str, str]:
    """The step's PromQL; `new` / `old` are label matchers (e.g. `release="12"`) of each release's engines."""
    w = f"{window_s}s"

    def p90(metric: str, sel: str) -> str:
        return f"histogram_quantile(0.9, sum by (le) (rate({metric}_bucket{{{sel}}}[{w}])))"

    out = {
        "new_p90_ttft": p90(TTFT, new),
        "new_p90_tpot": p90(TPOT, new),
        "new_requests": f"sum(increase({FINISHED}{{{new}}}[{w}]))",
        "new_failed": f'sum(increase({FINISHED}{{{new},finished_reason=~"abort|error"}}[{w}])) or vector(0)',
        "new_http_errors": f'sum(increase({HTTP}{{{new},status=~"5.."}}[{w}])) or vector(0)',
        "new_targets_down": f"count(up{{{new}}} == 0) or vector(0)",
        "new_targets": f"count(up{{{new}}})",
    }
    if old:
        out |= {
            "old_p90_ttft": p90(TTFT, old),
            "old_p90_tpot": p90(TPOT, old),
            "old_requests": f"sum(increase({FINISHED}{{{old}}}[{w}]))",
        }
    return out


def query_retried(
    url: str, promql: str, at: float, limit: int = CONSECUTIVE_ERROR_LIMIT, retry_s: float = RETRY_S
) -> tuple[float | None, int]:
    """(the answer, the errors before it): the query pinned at `at`, asked again after each error;
    PrometheusError once more than `limit` errors came in a row."""
    errors = 0
    while True:
        try:
            return query(url, promql, at=at), errors
        except PrometheusError as exc:
            errors += 1
            if errors > limit:
                raise PrometheusError(
                    f"{exc} ({errors} errors in a row, more than the consecutive error limit {limit})"
                ) from None
            log.warning("rollout analysis: query error %d of at most %d in a row, asked again: %s", errors, limit, exc)
            time.sleep(retry_s)


def analyze(
    url: str,
    new: str,
    old: str | None,
    step: int,
    fraction: float,
    window_s: int,
    slo: SloSpec,
    rollout: RolloutSpec,
    at: float | None = None,
    retry_s: float = RETRY_S,
) -> StepAnalysis:
    """Judge the window that ended at `at` (now by default): the SLO, errors, scrape health, and (if
    set) the old release. Every query is pinned at that end, so one asked again after an error
    judges the same window."""
    asked = queries(new, old, window_s)
    end = time.time() if at is None else at
    results: dict[str, Query] = {}
    errors = 0
    for name, promql in asked.items():
        value, asked_again = query_retried(url, promql, end, retry_s=retry_s)
        errors += asked_again
        results[name] = Query(promql=promql, value=value)
    if errors:
        log.warning("rollout analysis, step %d: %d query errors asked again", step, errors)
    v = {name: q.value for name, q in results.items()}
    reasons: list[str] = []
    requests_done = v["new_requests"] or 0.0
    if not v["new_targets"]:
        reasons.append(f"no engine of the new release is scraped ({new})")
    elif v["new_targets_down"]:
        reasons.append(f"{v['new_targets_down']:.0f} of {v['new_targets']:.0f} engines of the new release are down")
    http_errors = v["new_http_errors"] or 0.0
    idle = requests_done < rollout.min_requests and (v.get("old_requests") or 0.0) < rollout.min_requests
    if idle:
        # a quiet window (a quiet hour, a demo) holds no evidence either way: not a pass. With step
        # reviews a person may Continue it; otherwise, or unanswered, the step aborts
        reasons.append(
            f"inconclusive: {requests_done:.0f} requests finished on the new release and "
            f"{v.get('old_requests') or 0.0:.0f} on the old in the window, fewer than "
            f"rollout.min_requests ({rollout.min_requests}): nothing to judge, so no pass"
        )
    elif requests_done < rollout.min_requests:
        reasons.append(f"{requests_done:.0f} requests finished in the window, fewer than {rollout.min_requests}")
    if requests_done + http_errors > 0:
        # what did finish is judged too: a release too slow to finish `min_requests` in the window
        # (8 of 10 in a CI run, p90 TTFT 6.6 s) is aborted for its latency, and the record says so.
        # Failed: engine aborts and errors, and HTTP 5xx answers (requests the engine never finished)
        failed = ((v["new_failed"] or 0.0) + http_errors) / (requests_done + http_errors)
        if failed > rollout.max_error_fraction:
            reasons.append(
                f"{failed:.1%} of requests aborted or failed (HTTP 5xx: {http_errors:.0f}) "
                f"> {rollout.max_error_fraction:.1%}"
            )
        for key, limit, label in (("ttft", slo.max_p90_ttft_ms, "TTFT"), ("tpot", slo.max_p90_tpot_ms, "TPOT")):
            value = v[f"new_p90_{key}"]
            if value is None:
                if requests_done >= rollout.min_requests:
                    reasons.append(f"no p90 {label} samples for the new release")
                continue
            if value * 1000 > limit:
                reasons.append(f"p90 {label} {value * 1000:.0f} ms > SLO {limit:g} ms")
            live = v.get(f"old_p90_{key}")
            if rollout.max_vs_live and live and value > live * rollout.max_vs_live:
                reasons.append(
                    f"p90 {label} {value * 1000:.0f} ms > {rollout.max_vs_live:g} x the old release's "
                    f"{live * 1000:.0f} ms in the same window"
                )
    verdict = StepAnalysis(
        step=step,
        fraction=fraction,
        window_s=window_s,
        passed=not reasons,
        reasons=reasons,
        inconclusive=idle,
        queries=results,
    )
    log.info("rollout analysis: %s", verdict.summary())
    return verdict


def with_front(verdict: StepAnalysis, attempts: int, failed: int, rollout: RolloutSpec) -> StepAnalysis:
    """The step's verdict with what the front (the local target's nginx) saw of the new release's
    engines: attempts that got a 5xx or no answer count against rollout.max_error_fraction like
    the engine's own aborts, though a retry elsewhere may have saved the client."""
    queries = {
        **verdict.queries,
        "front_attempts": Query(promql="front access log: requests sent to the new release's engines", value=attempts),
        "front_failed": Query(promql="front access log: of those, answered 5xx or not at all", value=failed),
    }
    reasons = list(verdict.reasons)
    if attempts and failed / attempts > rollout.max_error_fraction:
        reasons.append(
            f"{failed / attempts:.1%} of the front's requests to the new release failed ({failed} of {attempts}: "
            f"5xx or no answer) > {rollout.max_error_fraction:.1%}"
        )
    return verdict.model_copy(update={"queries": queries, "reasons": reasons, "passed": verdict.passed and not reasons})


def wait_up(url: str, selector: str, count: int, timeout: float) -> None:
    """Until Prometheus has scraped `count` engines matching `selector` up: a window that starts
    before a new engine's first scrape would judge it on no data."""
    deadline = time.monotonic() + timeout
    promql = f"count(up{{{selector}}} == 1)"
    seen: float | None = None
    while time.monotonic() < deadline:
        try:
            if (seen := query(url, promql, timeout=5) or 0) >= count:
                return
        except PrometheusError:
            pass
        time.sleep(0.5)
    raise PrometheusError(
        f"Prometheus at {url}: {seen or 0:.0f} of {count} engines ({selector}) scraped up after {timeout:.0f} s"
    )


def after_window(
    url: str,
    new: str,
    old: str | None,
    step: int,
    fraction: float,
    slo: SloSpec,
    rollout: RolloutSpec,
    settle_s: float,
) -> StepAnalysis:
    """Hold the step for its analysis window (plus `settle_s` for the scrapes that close it, logging
    what is left), then judge exactly that window."""
    window = duration_seconds(rollout.analysis_window)
    started = time.monotonic()
    while (left := window + settle_s - (time.monotonic() - started)) > 0:
        time.sleep(min(left, 15))
        if left > 15:
            log.info("step %d: %.0f s of the analysis window left", step, left - 15)
    return analyze(url, new, old, step, fraction, window, slo, rollout)
