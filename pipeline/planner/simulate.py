"""A discrete-event simulation of one vLLM replica's continuous batching under Poisson arrivals.

Like vLLM's V1 scheduler, every step first gives each decoding sequence its one token, then
continues partly prefilled prompts, then admits waiting requests in arrival order while the step's
token budget (max-num-batched-tokens), the sequence limit (max-num-seqs) and the KV cache allow;
long prompts are prefilled in chunks. A request's first token comes at the end of the step that
finishes its prompt; then one token per step. The step's duration comes from a step-time model.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel

from pipeline.planner.step_time import Batch, Limits

__all__ = ["Limits", "Request", "SimResult", "Slo", "max_slo_rate", "poisson_arrivals", "simulate", "within"]


class StepTimer(Protocol):
    request_overhead_s: float  # the server's way in and out, on every TTFT and latency
    admission_s: float  # engine time a request costs the step that admits it

    def seconds(self, batch: Batch) -> float: ...


class Request(BaseModel):
    arrival: float
    input_len: int
    output_len: int


class SimResult(BaseModel):
    """What a benchmark client would report, plus why the replica could not go faster."""

    rate: float
    requests: int
    duration_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    latency_s: list[float]
    steps: int
    busy_s: float  # time spent in steps (the rest the replica waited for arrivals)
    tokens: int  # new tokens processed over all steps
    blocked_by_seqs: float  # fraction of steps that left a waiting request out for max-num-seqs
    blocked_by_kv: float  # ... for lack of KV cache
    seconds_by_bound: dict[str, float]  # compute / memory / link / overhead, when asked for

    def p(self, name: str, q: float) -> float:
        values = sorted(getattr(self, name))
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]

    @property
    def achieved_rate(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """n arrival times at `rate`; the same seed gives the same unit gaps at every rate (a fair search)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0) / rate
        out.append(t)
    return out


def simulate(
    timer: StepTimer,
    limits: Limits,
    requests: list[Request],
    breakdown: Callable[[Batch], list[tuple[str, float]]] | None = None,
    measure_from: float = 0.0,
) -> SimResult:
    """Run the requests through one replica and record those arriving from `measure_from` on (the
    rest warm the replica up); `breakdown` (the step model's `bounds`) adds time by bound."""
    seqs_cap = limits.max_num_seqs
    budget_cap = max(limits.max_num_batched_tokens, seqs_cap)  # vLLM requires tokens >= seqs
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    arrivals = deque(order)
    waiting: deque[int] = deque()
    prefilling: list[list[int]] = []  # [request index, prompt tokens done]
    finishing: list[tuple[int, int]] = []  # (step that emits its last token, request index)
    first_token = [0.0] * len(requests)
    ttft: list[float] = []
    tpot: list[float] = []
    latency: list[float] = []
    decoding = decode_context = kv_used = 0
    by_bound: dict[str, float] = {}
    now, busy, step, tokens, blocked_seqs, blocked_kv, done = 0.0, 0.0, 0, 0, 0, 0, 0
    while done < len(requests):
        while arrivals and requests[arrivals[0]].arrival <= now:
            waiting.append(arrivals.popleft())
        if not (decoding or prefilling or waiting):
            now = requests[arrivals[0]].arrival
            continue
        budget = budget_cap - decoding
        chunks: list[tuple[int, int, int]] = []  # (request, chunk tokens, earlier prompt tokens)
        for entry in prefilling:
            if budget <= 0:
                break
            index, did = entry
            chunk = min(requests[index].input_len - did, budget)
            chunks.append((index, chunk, did))
            budget -= chunk
        running = decoding + len(prefilling)
        while waiting and budget > 0:
            req = requests[waiting[0]]
            if running >= seqs_cap:
                blocked_seqs += 1
                break
            if kv_used + req.input_len + req.output_len > limits.kv_capacity_tokens and running:
                blocked_kv += 1
                break
            index = waiting.popleft()
            prefilling.append([index, 0])
            kv_used += req.input_len + req.output_len
            running += 1
            chunk = min(req.input_len, budget)
            chunks.append((index, chunk, 0))
            budget -= chunk
        admitted = sum(1 for _, _, did in chunks if did == 0)
        prompt_tokens = sum(c for _, c, _ in chunks)
        completing = [i for i, c, did in chunks if did + c == requests[i].input_len]
        batch = Batch(
            tokens=decoding + prompt_tokens,
            pairs=decode_context + decoding + sum(c * did + c * (c + 1) / 2 for _, c, did in chunks),
            context=decode_context + sum(did for _, _, did in chunks),
            sampled=decoding + len(completing),
        )
        seconds = timer.seconds(batch) + admitted * timer.admission_s
        tokens += batch.tokens
        if breakdown is not None:
            for bound, part_seconds in breakdown(batch):
                by_bound[bound] = by_bound.get(bound, 0.0) + part_seconds
        now += seconds
        busy += seconds
        step += 1
        decode_context += decoding
        while finishing and finishing[0][0] == step:
            _, index = heapq.heappop(finishing)
            req = requests[index]
            decoding -= 1
            decode_context -= req.input_len + req.output_len
            kv_used -= req.input_len + req.output_len
            if req.arrival >= measure_from:
                tpot.append((now - first_token[index]) / (req.output_len - 1))
                latency.append(now - req.arrival + timer.request_overhead_s)
            done += 1
        progress = {i: did + c for i, c, did in chunks}
        still = []
        for entry in prefilling:
            index = entry[0]
            entry[1] = progress.get(index, entry[1])
            req = requests[index]
            if entry[1] < req.input_len:
                still.append(entry)
                continue
            first_token[index] = now
            measured = req.arrival >= measure_from
            if measured:
                ttft.append(now - req.arrival + timer.request_overhead_s)
            if req.output_len <= 1:
                kv_used -= req.input_len + req.output_len
                if measured:
                    latency.append(now - req.arrival + timer.request_overhead_s)
                done += 1
            else:
                decoding += 1
                decode_context += req.input_len + 1
                heapq.heappush(finishing, (step + req.output_len - 1, index))
        prefilling = still
    first = min(r.arrival for r in requests)
    return SimResult(
        rate=len(requests) / max(r.arrival for r in requests) if requests else 0.0,
        requests=sum(r.arrival >= measure_from for r in requests),
        duration_s=now - max(first, measure_from),
        ttft_s=ttft,
        tpot_s=tpot,
        latency_s=latency,
        steps=step,
        busy_s=busy,
        tokens=tokens,
        blocked_by_seqs=blocked_seqs / step if step else 0.0,
        blocked_by_kv=blocked_kv / step if step else 0.0,
        seconds_by_bound=by_bound,
    )


class Slo(BaseModel):
    p90_ttft_s: float
    p90_tpot_s: float

    def lifetime(self, output_len: int) -> float:
        """A request's life at the SLO's limits: how long a steady state takes to warm up."""
        return self.p90_ttft_s + (output_len - 1) * self.p90_tpot_s


def within(result: SimResult, slo: Slo) -> bool:
    return result.p("ttft_s", 90) <= slo.p90_ttft_s and result.p("tpot_s", 90) <= slo.p90_tpot_s


MAX_SIMULATED_REQUESTS = 20000


def steady_requests(
    rate: float, input_len: int, output_len: int, lifetime: float, seed: int
) -> tuple[list[Request], float]:
    """Enough Poisson arrivals for a steady state: one request lifetime to warm up, three measured.
    -> (requests, when measuring starts)."""
    n = min(MAX_SIMULATED_REQUESTS, max(200, math.ceil(rate * 4 * lifetime)))
    arrivals = poisson_arrivals(rate, n, seed)
    return [Request(arrival=a, input_len=input_len, output_len=output_len) for a in arrivals], min(
        lifetime, arrivals[-1] / 4
    )


class Slowed:
    """A step timer whose every time is `factor` longer (the engine's cores shared with host work)."""

    def __init__(self, timer: StepTimer, factor: float):
        self.timer, self.factor = timer, factor
        self.request_overhead_s = timer.request_overhead_s * factor
        self.admission_s = timer.admission_s * factor

    def seconds(self, batch: Batch) -> float:
        return self.timer.seconds(batch) * self.factor


def workload(
    timer: StepTimer,
    limits: Limits,
    slo: Slo,
    input_len: int,
    output_len: int,
    seed: int,
    slowdown: Callable[[float], float] | None = None,
) -> Callable[..., SimResult]:
    """One replica under Poisson arrivals of one workload, as a function of the rate (and an optional
    `breakdown`), measured in the steady state: what a rate search and a prediction's details run.
    `slowdown(rate)`: how much longer every step takes at that rate (planner/host.py); inf: the
    host cannot carry the rate, every request misses."""
    lifetime = slo.lifetime(output_len)

    def run(rate: float, breakdown: Callable[[Batch], list[tuple[str, float]]] | None = None) -> SimResult:
        requests, warmup = steady_requests(rate, input_len, output_len, lifetime, seed)
        factor = slowdown(rate) if slowdown else 1.0
        if math.isinf(factor):
            missed = [math.inf] * len(requests)
            return SimResult(
                rate=rate, requests=len(requests), duration_s=math.inf, ttft_s=missed, tpot_s=missed,
                latency_s=missed, steps=0, busy_s=0.0, tokens=0, blocked_by_seqs=0.0, blocked_by_kv=0.0,
                seconds_by_bound={},
            )  # fmt: skip
        slowed = timer if factor == 1.0 else Slowed(timer, factor)
        return simulate(slowed, limits, requests, breakdown=breakdown, measure_from=warmup)

    return run


class RateSearch(BaseModel):
    """The highest per-replica rate whose simulated p90s meet the SLO, and how many runs found it."""

    rate: float
    runs: int


def max_slo_rate(
    run: Callable[[float], SimResult],
    slo: Slo,
    start: float = 1.0,
    resolution: float = 0.01,
    floor: float = 1e-4,
    factor: float = 2.0,
) -> RateSearch:
    """Bracket by multiplying or dividing by `factor` from `start`, then bisect to `resolution` (relative).
    A start near the answer (an interval's end beside its central value) brackets faster with a small factor."""
    runs = 0

    def ok(rate: float) -> bool:
        nonlocal runs
        runs += 1
        return within(run(rate), slo)

    lo, hi = 0.0, start
    if ok(start):
        lo = start
        while ok(lo * factor):
            lo *= factor
        hi = lo * factor
    else:
        while hi > floor and not ok(hi / factor):
            hi /= factor
        if hi <= floor:
            return RateSearch(rate=0.0, runs=runs)
        lo = hi / factor
    while (hi - lo) / hi > resolution:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return RateSearch(rate=lo, runs=runs)
