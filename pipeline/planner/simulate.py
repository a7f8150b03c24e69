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


class _Rank:
    """One scheduler's state: a replica's, or one dp rank's of a replica that steps in lockstep."""

    def __init__(self) -> None:
        self.waiting: deque[int] = deque()
        self.prefilling: list[list[int]] = []  # [request index, prompt tokens done]
        self.finishing: list[tuple[int, int]] = []  # (step that emits its last token, request index)
        self.decoding = self.decode_context = self.kv_used = 0
        self.chunks: list[tuple[int, int, int]] = []  # this step's (request, chunk tokens, earlier prompt tokens)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.decoding

    def busy(self) -> bool:
        return bool(self.decoding or self.prefilling or self.waiting)

    def schedule(self, requests: list[Request], limits: Limits, budget_cap: int) -> tuple[Batch, int, int, int]:
        """This step's batch, as vLLM's V1 scheduler builds it -> (batch, admitted, blocked by seqs, by KV)."""
        budget = budget_cap - self.decoding
        chunks: list[tuple[int, int, int]] = []
        for index, did in self.prefilling:
            if budget <= 0:
                break
            chunk = min(requests[index].input_len - did, budget)
            chunks.append((index, chunk, did))
            budget -= chunk
        running = self.decoding + len(self.prefilling)
        blocked_seqs = blocked_kv = 0
        while self.waiting and budget > 0:
            req = requests[self.waiting[0]]
            if running >= limits.max_num_seqs:
                blocked_seqs = 1
                break
            if self.kv_used + req.input_len + req.output_len > limits.kv_capacity_tokens and running:
                blocked_kv = 1
                break
            index = self.waiting.popleft()
            self.prefilling.append([index, 0])
            self.kv_used += req.input_len + req.output_len
            running += 1
            chunk = min(req.input_len, budget)
            chunks.append((index, chunk, 0))
            budget -= chunk
        self.chunks = chunks
        completing = sum(1 for i, c, did in chunks if did + c == requests[i].input_len)
        batch = Batch(
            tokens=self.decoding + sum(c for _, c, _ in chunks),
            pairs=self.decode_context + self.decoding + sum(c * did + c * (c + 1) / 2 for _, c, did in chunks),
            context=self.decode_context + sum(did for _, _, did in chunks),
            sampled=self.decoding + completing,
        )
        return batch, sum(1 for _, _, did in chunks if did == 0), blocked_seqs, blocked_kv


def simulate(
    timer: StepTimer,
    limits: Limits,
    requests: list[Request],
    breakdown: Callable[[Batch], list[tuple[str, float]]] | None = None,
    measure_from: float = 0.0,
    ranks: int = 1,
    fast: bool = True,
) -> SimResult:
    """Run the requests through one replica and record those arriving from `measure_from` on (the
    rest warm the replica up); `breakdown` (the step model's `bounds`) adds time by bound. `ranks` > 1:
    a data-parallel replica whose ranks each schedule their own requests (each arrival to the least
    loaded rank, as vLLM's DP coordinator balances) and step together while any has work; the step is
    the timer's `lockstep_seconds` of every rank's batch (the slowest rank's, prefills included).

    `fast` (a timer with `decode_run`/`lockstep_decode_run`, no `breakdown`): a stretch of decode-only
    steps, in which no request arrives, finishes or is admitted, is run by the timer in one call, float for
    float what the step loop would compute (tests/test_planner_speed.py checks it against fast=False)."""
    seqs_cap = limits.max_num_seqs
    budget_cap = max(limits.max_num_batched_tokens, seqs_cap)  # vLLM requires tokens >= seqs
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    arrivals = deque(order)
    group = [_Rank() for _ in range(ranks)]
    first_token = [0.0] * len(requests)
    ttft: list[float] = []
    tpot: list[float] = []
    latency: list[float] = []
    by_bound: dict[str, float] = {}
    now, busy, step, tokens, blocked_seqs, blocked_kv, done = 0.0, 0.0, 0, 0, 0, 0, 0
    while done < len(requests):
        while arrivals and requests[arrivals[0]].arrival <= now:
            min(group, key=lambda r: r.load).waiting.append(arrivals.popleft())
        if not any(rank.busy() for rank in group):
            now = requests[arrivals[0]].arrival
            continue
        if fast and breakdown is None:
            stretch = _decode_stretch(timer, group, requests, limits, budget_cap, step)
            if stretch is not None:
                steps, flags = stretch
                until = requests[arrivals[0]].arrival if arrivals else math.inf
                decoding = [rank.decoding for rank in group]
                if ranks == 1:
                    ran, now, busy = timer.decode_run(  # type: ignore[attr-defined]
                        decoding[0], group[0].decode_context, now, busy, until, steps
                    )
                else:
                    ran, now, busy = timer.lockstep_decode_run(  # type: ignore[attr-defined]
                        decoding, [rank.decode_context for rank in group], now, busy, until, steps
                    )
                if ran:
                    step += ran
                    tokens += ran * sum(decoding)
                    blocked_seqs += ran * flags[0]
                    blocked_kv += ran * flags[1]
                    for rank in group:
                        rank.decode_context += ran * rank.decoding
                        rank.chunks = []
                    continue
        batches, admitted = [], 0
        for rank in group:
            batch, admits, by_seqs, by_kv = rank.schedule(requests, limits, budget_cap)
            batches.append(batch)
            admitted += admits
            blocked_seqs += by_seqs
            blocked_kv += by_kv
        if ranks == 1:
            seconds = timer.seconds(batches[0])
        else:  # a step model of a dp replica (step_time.StepModel.lockstep_seconds)
            seconds = timer.lockstep_seconds(batches)  # type: ignore[attr-defined]
        seconds += admitted * timer.admission_s
        tokens += sum(b.tokens for b in batches)
        if breakdown is not None:
            busiest = max(batches, key=lambda b: b.tokens)
            for bound, part_seconds in breakdown(busiest):
                by_bound[bound] = by_bound.get(bound, 0.0) + part_seconds
        now += seconds
        busy += seconds
        step += 1
        for rank in group:
            rank.decode_context += rank.decoding
            while rank.finishing and rank.finishing[0][0] == step:
                _, index = heapq.heappop(rank.finishing)
                req = requests[index]
                rank.decoding -= 1
                rank.decode_context -= req.input_len + req.output_len
                rank.kv_used -= req.input_len + req.output_len
                if req.arrival >= measure_from:
                    tpot.append((now - first_token[index]) / (req.output_len - 1))
                    latency.append(now - req.arrival + timer.request_overhead_s)
                done += 1
            progress = {i: did + c for i, c, did in rank.chunks}
            still = []
            for entry in rank.prefilling:
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
                    rank.kv_used -= req.input_len + req.output_len
                    if measured:
                        latency.append(now - req.arrival + timer.request_overhead_s)
                    done += 1
                else:
                    rank.decoding += 1
                    rank.decode_context += req.input_len + 1
                    heapq.heappush(rank.finishing, (step + req.output_len - 1, index))
            rank.prefilling = still
    first = min(r.arrival for r in requests)
    steps = step * ranks
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
        blocked_by_seqs=blocked_seqs / steps if steps else 0.0,
        blocked_by_kv=blocked_kv / steps if steps else 0.0,
        seconds_by_bound=by_bound,
    )


def _decode_stretch(
    timer: StepTimer, group: list[_Rank], requests: list[Request], limits: Limits, budget_cap: int, step: int
) -> tuple[int, tuple[int, int]] | None:
    """Whether the next steps are decode-only for every rank and admit no one (no rank prefilling; each
    rank's waiting head, if any, held back by max-num-seqs or the KV cache, or no token budget left), as
    schedule() would find -> (how many steps before the first that finishes a request, (ranks blocked
    by max-num-seqs, by KV) per step), or None where the step loop must run the next step itself."""
    if not hasattr(timer, "decode_run" if len(group) == 1 else "lockstep_decode_run"):
        return None
    by_seqs = by_kv = 0
    next_finish = None
    for rank in group:
        if rank.prefilling:
            return None
        if rank.waiting and budget_cap - rank.decoding > 0:
            req = requests[rank.waiting[0]]
            if rank.decoding >= limits.max_num_seqs:
                by_seqs += 1
            elif rank.kv_used + req.input_len + req.output_len > limits.kv_capacity_tokens and rank.decoding:
                by_kv += 1
            else:
                return None  # schedule() admits it
        if rank.finishing and (next_finish is None or rank.finishing[0][0] < next_finish):
            next_finish = rank.finishing[0][0]
    if next_finish is None:
        return None
    steps = next_finish - step - 1  # the steps after which no request finishes
    return (steps, (by_seqs, by_kv)) if steps > 0 else None


class Slo(BaseModel):
    p90_ttft_s: float
    p90_tpot_s: float

    def lifetime(self, output_len: int) -> float:
        """A request's life at the SLO's limits: how long a steady state takes to warm up."""
        return self.p90_ttft_s + (output_len - 1) * self.p90_tpot_s


def within(result: SimResult, slo: Slo) -> bool:
    return result.p("ttft_s", 90) <= slo.p90_ttft_s and result.p("tpot_s", 90) <= slo.p90_tpot_s


SIMULATED_REQUESTS = 600  # at every rate: the same unit gaps scaled by the rate (common random numbers)


def steady_requests(
    rate: float, input_len: int, output_len: int, lifetime: float, seed: int, n: int = SIMULATED_REQUESTS
) -> tuple[list[Request], float]:
    """The same `n` Poisson arrivals at every rate (one sample path, its time scaled by 1/rate): a rate
    search over them sees no new draws as it moves, so a higher rate never meets the SLO by luck; the
    first quarter of them, or one request lifetime if shorter, warms the replica up.
    -> (requests, when measuring starts)."""
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

    def lockstep_seconds(self, batches: list[Batch]) -> float:
        return float(self.timer.lockstep_seconds(batches)) * self.factor  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Callable[..., tuple[int, float, float]]:
        """The timer's decode_run / lockstep_decode_run with every step `factor` longer (absent where the
        timer has none: the simulation then runs those steps one by one)."""
        if name not in ("decode_run", "lockstep_decode_run"):
            raise AttributeError(name)
        run = getattr(self.timer, name)

        def slowed(*args: object) -> tuple[int, float, float]:
            return run(*args, factor=self.factor)

        return slowed


def workload(
    timer: StepTimer,
    limits: Limits,
    slo: Slo,
    input_len: int,
    output_len: int,
    seed: int,
    slowdown: Callable[[float], float] | None = None,
    ranks: int = 1,
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
        return simulate(slowed, limits, requests, breakdown=breakdown, measure_from=warmup, ranks=ranks)

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
