"""The plan of a progressive rollout, before it starts: what runs at each step, and whether the
fleet still holds the peak at every one of them.

On Kubernetes each side of a step is sized like the fleet (capacity.fleet): the new release gets
enough servers for its share of the peak (plus headroom) at its measured rate per server, at
least one; the old release keeps enough for the rest at its own rate. Within a step new servers
start in waves of `rollout.spare_servers`; as a wave is ready, traffic moves onto it in
proportion to the capacity it adds and the old servers the old share no longer needs stop, so
what serves never drops below the peak and no more than the live fleet plus the spare budget run
at once. A step that cannot be held that way is refused here, before anything starts.
On the local target a step is one old and one new instance with nginx weights.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError
from pipeline.core.rollout import ServerStep
from pipeline.core.spec import LoadedSpec, duration_seconds
from pipeline.release import controller
from pipeline.release.registry import NOTHING_CHOSEN, Release


class StepPlan(BaseModel):
    step: int
    fraction: float = Field(description="share of requests on the new release")
    old_servers: int
    new_servers: int
    at_once: int = Field(
        description="most servers running at once during the step: old ones stop only as new are ready"
    )
    waves: int = Field(description="rounds of starting new servers (at most spare_servers at a time)")
    old_holds_rps: float | None = Field(description="what the old side holds within the SLO (None: not sized)")
    new_holds_rps: float | None
    old_share_rps: float | None = Field(description="its share of the peak + headroom")
    new_share_rps: float | None
    starts_servers: int = Field(description="new servers this step starts (each loads the weights)")
    old_kept: int = Field(
        0, description="old servers kept while the step is judged: the step's own, or more where the budget leaves room"
    )
    abort_reloads: int = Field(
        0, description="old servers an abort at this step starts again (0: instant, traffic goes straight back)"
    )
    seconds: float | None = Field(description="expected: waves x load of the new servers + the analysis window")
    ok: bool
    problem: str = ""


class RolloutPlan(BaseModel):
    name: str
    target: str
    release_id: int | None
    layout: str | None
    rate_per_server: float | None
    live_id: int | None
    live_layout: str | None
    live_rate_per_server: float | None
    need_rps: float | None = Field(description="peak x (1 + headroom); None without capacity:")
    live_servers: int
    new_servers: int
    spare_servers: int
    analysis_window_s: int
    review_timeout_s: int | None = Field(None, description="release DAG: each step waits up to this for a reviewer")
    load_seconds: float | None = Field(description="measured: the release's slowest replica, process start to healthy")
    live_load_seconds: float | None = Field(None, description="the same for the live release: what an abort reloads")
    steps: list[StepPlan]
    keep_window_s: int = Field(0, description="rollout.scale_down_delay: the old release keeps its servers this long")
    rollback_reloads_in_window: int = Field(0, description="old servers a rollback within the keep window starts")
    rollback_reloads_after: int = Field(0, description="old servers a rollback after the keep window starts")
    rollback_in_window_s: float | None = Field(None, description="expected: its waves x the live release's load")
    rollback_after_s: float | None = None
    expected_seconds: float | None
    feasible: bool
    notes: list[str] = Field(default_factory=list)


class Side(BaseModel):
    """One release in a rollout: what the plan needs of it (from the registry, or given)."""

    id: int | None = None
    layout: str | None = None
    rate_per_server: float | None = Field(None, gt=0, description="measured max SLO req/s per server")
    load_seconds: float | None = Field(None, ge=0, description="its slowest replica, process start to healthy")

    @classmethod
    def of(cls, rel: Release) -> Side:
        f = rel.data.chosen or NOTHING_CHOSEN
        return cls(
            id=rel.id,
            layout=rel.data.layout,
            rate_per_server=f.rate_per_server if f.rate_per_server and f.rate_per_server > 0 else None,
            load_seconds=rel.data.slowest_load(),
        )


def plan(loaded: LoadedSpec, candidate: Side, live: Side | None) -> RolloutPlan:
    """The steps of rolling `candidate` out over `live` (None: nothing live, one step at 100%)."""
    spec, rollout = loaded.spec, loaded.spec.rollout
    window = duration_seconds(rollout.analysis_window)
    notes: list[str] = []
    load = candidate.load_seconds
    if load is None:
        notes.append("load time not measured for this release (no benchmark recorded): durations unknown")
    rate_new, rate_old = candidate.rate_per_server, live.rate_per_server if live else None
    cap = spec.capacity
    kubernetes = spec.promotion.target == "kubernetes"
    sized = kubernetes and cap is not None and rate_new is not None and (live is None or rate_old is not None)
    need = cap.peak_rps * (1 + cap.headroom) if sized and cap else None
    if kubernetes and not sized:
        notes.append(
            "servers not sized (needs capacity: in the spec and a measured rate per server on both releases): "
            "one server per side is shown"
        )
    if not kubernetes:
        notes.append("local target: one old and one new instance; a step is nginx's weight split between them")

    def servers(share: float, rate: float | None, at_least: int) -> int:
        if need is None or rate is None or share <= 0:
            return at_least if share > 0 else 0
        return max(at_least, math.ceil(share * need / rate - 1e-9))

    live_servers = servers(1.0, rate_old, cap.min_servers if cap and sized else 1) if live else 0
    new_total = servers(1.0, rate_new, cap.min_servers if cap and sized else 1)
    budget = live_servers + rollout.spare_servers
    fractions = rollout.steps if live else [1.0]
    steps: list[StepPlan] = []
    started, old_before = 0, live_servers
    for number, fraction in enumerate(fractions, 1):
        new = new_total if fraction >= 1 else servers(fraction, rate_new, 1)
        old = min(servers(1 - fraction, rate_old, 1), live_servers) if live and fraction < 1 else 0
        starts = max(0, new - started)
        # old servers stop only as new ones are ready: on Kubernetes new ones start in waves of the
        # spare budget, so no more than live + spare run at once; locally both instances just run
        wave = rollout.spare_servers if kubernetes and live else max(starts, 1)
        waves = math.ceil(starts / wave) if starts and wave else 0
        if kubernetes and live:
            # as pipeline.k8s.deploy runs it: before each wave, old servers the step no longer needs
            # stop to keep live + spare; the first wave of a step sees the most at once
            at_once = max(old + new, min(budget, old_before + started + min(starts, wave)))
        else:
            at_once = max(old_before + min(starts, wave), old + new)
        problem = ""
        if kubernetes and live and starts and not rollout.spare_servers:
            problem = "rollout.spare_servers is 0: a new server could start only where an old one, still needed, stops"
        elif kubernetes and live and old + new > budget:
            problem = (
                f"holds {old} old + {new} new servers; the live fleet is {live_servers} "
                f"and rollout.spare_servers allows {rollout.spare_servers} more"
            )
        elif kubernetes and live and rollout.instant_abort and live_servers + new > budget:
            problem = (
                f"rollout.instant_abort keeps all {live_servers} old servers beside {new} new: "
                f"rollout.spare_servers must be at least {new} (is {rollout.spare_servers})"
            )
        # as pipeline.k8s.deploy judges a step: the old release keeps what the budget leaves it; an
        # abort gives it back every server it had, loading those it gave away (locally it never stops)
        kept = (
            controller.kept_while_judged(
                ServerStep(fraction=fraction, old_servers=old, new_servers=new), live_servers, budget
            )
            if kubernetes and live
            else live_servers
        )
        started, old_before = max(started, new), old
        old_holds = round(old * rate_old, 3) if need is not None and rate_old else None
        new_holds = round(new * rate_new, 3) if need is not None and rate_new else None
        steps.append(
            StepPlan(
                step=number,
                fraction=fraction,
                old_servers=old,
                new_servers=new,
                at_once=at_once,
                waves=waves,
                old_holds_rps=old_holds,
                new_holds_rps=new_holds,
                old_share_rps=round((1 - fraction) * need, 3) if need is not None else None,
                new_share_rps=round(fraction * need, 3) if need is not None else None,
                starts_servers=starts,
                old_kept=kept,
                abort_reloads=live_servers - kept,
                seconds=(waves * load + (window if live else 0)) if load is not None else None,
                ok=not problem,
                problem=problem,
            )
        )
    if kubernetes and live and rollout.spare_servers and all(s.ok for s in steps):
        # the controller's own waves, on paper: the route moves onto new servers only as they hold
        # their share, and old servers stop only where theirs no longer needs them
        on_paper = controller.waves_problems(
            [ServerStep(fraction=s.fraction, old_servers=s.old_servers, new_servers=s.new_servers) for s in steps],
            live_servers,
            rollout.spare_servers,
        )
        for s, problem in zip(steps, on_paper, strict=True):
            if problem:
                s.ok, s.problem = False, problem.removeprefix(f"step {s.step}: ")
    total = None if any(s.seconds is None for s in steps) else sum(s.seconds or 0 for s in steps)
    # a rollback scales the old release's kept objects back up: within the keep window it still
    # runs what the last step left it, after it nothing; its servers start in waves of the budget
    in_window = live_servers - steps[-1].old_kept if live else 0
    after = live_servers

    def rollback_s(reloads: int) -> float | None:
        if not reloads:
            return 0.0
        wave = rollout.spare_servers if kubernetes else reloads
        return math.ceil(reloads / wave) * live.load_seconds if live and live.load_seconds and wave else None

    return RolloutPlan(
        name=spec.name,
        target=spec.promotion.target,
        release_id=candidate.id,
        layout=candidate.layout,
        rate_per_server=rate_new,
        live_id=live.id if live else None,
        live_layout=live.layout if live else None,
        live_rate_per_server=rate_old,
        need_rps=round(need, 3) if need is not None else None,
        live_servers=live_servers,
        new_servers=new_total,
        spare_servers=rollout.spare_servers,
        analysis_window_s=window,
        review_timeout_s=duration_seconds(rollout.review_timeout) if rollout.review_timeout and live else None,
        load_seconds=load,
        live_load_seconds=live.load_seconds if live else None,
        steps=steps,
        keep_window_s=duration_seconds(rollout.scale_down_delay),
        rollback_reloads_in_window=in_window,
        rollback_reloads_after=after,
        rollback_in_window_s=rollback_s(in_window) if live else None,
        rollback_after_s=rollback_s(after) if live else None,
        expected_seconds=total,
        feasible=all(s.ok for s in steps),
        notes=notes,
    )


def table(p: RolloutPlan) -> str:
    def rate(r: float | None) -> str:
        return "not measured" if r is None else f"{r:g} req/s per server"

    def minutes(s: float | None) -> str:
        return "?" if s is None else f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"

    head = [
        f"rollout of release {p.release_id or '(given)'} ({p.layout or '?'}, {rate(p.rate_per_server)}) on {p.target}, "
        + (
            f"replacing live release {p.live_id or '(given)'} ({p.live_layout or '?'}, {rate(p.live_rate_per_server)})"
            if p.live_id or p.live_rate_per_server
            else "nothing live: one step, all traffic at once"
        ),
        f"analysis window {p.analysis_window_s} s per step; load time {minutes(p.load_seconds)}"
        + (
            f"; peak + headroom {p.need_rps:g} req/s; live fleet {p.live_servers} servers, the new one "
            f"{p.new_servers}; spare budget {p.spare_servers}"
            if p.need_rps is not None
            else ""
        ),
    ]
    rows = [
        f"{'step':>4} {'traffic':>7} {'old srv':>7} {'new srv':>7} {'at once':>7} {'old holds/share':>18} "
        f"{'new holds/share':>18} {'waves':>5} {'duration':>9} {'abort':>18}  ok"
    ]

    def abort(s: StepPlan) -> str:
        if not p.live_servers:
            return "-"
        if not s.abort_reloads:
            return f"instant ({s.old_kept} kept)"
        waves = math.ceil(s.abort_reloads / p.spare_servers) if p.spare_servers else s.abort_reloads
        load = p.live_load_seconds * waves if p.live_load_seconds is not None else None
        return f"{s.abort_reloads} reload{'s' if s.abort_reloads > 1 else ''} ({minutes(load)})"

    for s in p.steps:

        def holds(h: float | None, share: float | None) -> str:
            return "-" if h is None or share is None else f"{h:g}/{share:g}"

        rows.append(
            f"{s.step:>4} {s.fraction:>7.0%} {s.old_servers:>7} {s.new_servers:>7} {s.at_once:>7} "
            f"{holds(s.old_holds_rps, s.old_share_rps):>18} {holds(s.new_holds_rps, s.new_share_rps):>18} "
            f"{s.waves:>5} {minutes(s.seconds):>9} {abort(s):>18}  {'yes' if s.ok else 'NO: ' + s.problem}"
        )
    tail = [
        f"expected duration: {minutes(p.expected_seconds)}"
        + (
            f" + up to {minutes(p.review_timeout_s)} per step for a reviewer's Continue / Abort (release DAG)"
            if p.review_timeout_s
            else ""
        )
        + ("" if p.feasible else "; NOT FEASIBLE as planned")
    ]
    if p.live_servers:
        tail.append(
            "abort: traffic goes back to the old release as its servers hold it (its reloads in waves of the spare "
            "budget, the new release giving back servers as they come), then the new one goes to zero; 'instant' "
            "where the old release still runs them all while the step is judged"
        )

        def reloads(n: int, seconds: float | None) -> str:
            return "instant (traffic only moves back)" if not n else f"{n} reloads ({minutes(seconds)})"

        tail.append(
            f"rollback to release {p.live_id or '(given)'} after this rollout: within the keep window "
            f"({minutes(p.keep_window_s)}, rollout.scale_down_delay) "
            f"{reloads(p.rollback_reloads_in_window, p.rollback_in_window_s)}; after it, its objects are kept at "
            f"zero until the next release: {reloads(p.rollback_reloads_after, p.rollback_after_s)}, no analysis steps"
        )
    return "\n".join(head + rows + tail + [f"note: {n}" for n in p.notes])


def for_release(loaded: LoadedSpec, candidate: Release, live: Release | None) -> RolloutPlan:
    """The plan of a release in the registry over what is live now."""
    if candidate.name != loaded.spec.name:
        raise ReleaseError(f"release {candidate.id} is {candidate.name}, not {loaded.spec.name} (the spec's name)")
    return plan(loaded, Side.of(candidate), Side.of(live) if live and live.id != candidate.id else None)
