"""Whether a probe's queue held still, pure: the backlog and the trend of TTFT against send time.

Why: an engine offered more than it serves builds a queue that grows for as long as the load lasts;
a probe that ends before the queue shows passes on its p90 (#61: 8 s probes at 85.4 req/s passed
with p90 TTFT 343 and 403 ms where 30 s at 85 read 3,275 ms). The growth shows earlier than the p90
does, as a trend of TTFT against the time each request was sent.

The statistic, fixed before it was tried on recorded probes (tests/fixtures/steady/):
- the trend is the Theil-Sen slope (median of pairwise slopes) of TTFT (ms) against send time (s)
  over the requests sent in the probe's last three quarters (`TRIM`: the first quarter is the
  queue filling from empty, a rise every probe has); robust to the few slow requests a p90 is made
  of, and with no p-value that would assume independent samples (a queue's are not);
- the threshold: the probe fails when its p90 TTFT plus the trend (when positive) carried over the
  confirmation's length (`workload.confirm_seconds`, at least `SloSpec.confirm_floor_seconds`)
  exceeds the limit, i.e. when a run that long at the same rate would, at that pace, end past it.
An engine a resolution m above its rate has a trend of about 1000 x m ms/s (`confirm_floor_seconds`),
so over the floor's limit / (0.9 m) seconds it adds more than the limit: such a probe fails however
short it was. The backlog (sent, no first token yet, at the last send) is reported beside it."""

from __future__ import annotations

import bisect
import math
from typing import Any, NamedTuple

from pipeline.core.specs import SloSpec, WorkloadSpec

TRIM = 0.25  # share of the send span at the start left out of the trend: the queue filling from empty
MAX_POINTS = 800  # Theil-Sen is quadratic in its points: longer probes are thinned evenly to this many


class QueueView(NamedTuple):
    trend_ms_per_s: float | None  # Theil-Sen slope of TTFT against send time; None with too few requests
    backlog_end: int  # requests sent and not answered at the last send


def requests(data: dict[str, Any]) -> list[tuple[float, float]]:
    """(send time, TTFT), s, of every request that got a first token, by send time, from a client's
    detailed result (vLLM's `start_times` and `ttfts`; the independent client writes the same keys)."""
    starts, ttfts = data.get("start_times") or [], data.get("ttfts") or []
    if len(starts) != len(ttfts):
        return []
    return sorted((float(s), float(t)) for s, t in zip(starts, ttfts, strict=True) if s is not None and t)


def trend(pairs: list[tuple[float, float]]) -> float | None:
    """Theil-Sen slope of TTFT (ms) against send time (s) after the first `TRIM` of the send span."""
    from scipy.stats import theilslopes

    if len(pairs) < 10:
        return None
    first, last = pairs[0][0], pairs[-1][0]
    kept = [p for p in pairs if p[0] >= first + TRIM * (last - first)]
    if len(kept) < 10 or kept[-1][0] <= kept[0][0]:
        return None
    step = max(1, math.ceil(len(kept) / MAX_POINTS))
    kept = kept[::step]
    slope = theilslopes([t * 1000 for _, t in kept], [s for s, _ in kept]).slope
    return round(float(slope), 3)


def backlog_at_end(pairs: list[tuple[float, float]]) -> int:
    """Requests sent by the last send whose first token had not come by then."""
    if not pairs:
        return 0
    end = pairs[-1][0]
    answered = sorted(s + t for s, t in pairs)
    return len(pairs) - bisect.bisect_right(answered, end)


def measure(data: dict[str, Any]) -> QueueView:
    pairs = requests(data)
    return QueueView(trend(pairs), backlog_at_end(pairs))


def confirm_seconds(workload: WorkloadSpec, slo: SloSpec) -> float:
    """The confirmation's length: the spec's, or the floor the SLO sets (`validate` refuses less)."""
    return workload.confirm_seconds if workload.confirm_seconds is not None else slo.confirm_floor_seconds


def projected(p90_ttft_ms: float, trend_ms_per_s: float | None, horizon_s: float) -> float | None:
    """The p90 TTFT with a rising trend carried over `horizon_s` (a falling one counts as flat)."""
    if trend_ms_per_s is None or math.isnan(p90_ttft_ms):
        return None
    return round(p90_ttft_ms + max(0.0, trend_ms_per_s) * horizon_s, 2)
