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
from pipeline.core.rollout import WEIGHT_TOTAL, ServerStep
from pipeline.core.specs import LoadedSpec, duration_seconds
from pipeline.release import controller
from pipeline.release.registry import NOTHING_CHOSEN, Release
from pipeline.stages import capacity, drain


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
    abort_waves: int = Field(
        0, description="waves those reloads take, as the controller's undo runs them (the widest the budget leaves)"
    )
    seconds: float | None = Field(description="expected: waves x load of the new servers + the analysis window")
    terminating: int = Field(
        0,
        description="old servers this step scales away: each holds its GPUs through its drain (preStop, up to "
        "the route's request timeout) and counts against live + spare until it is gone",
    )
    drain_waits: int = Field(0, description="waves whose new servers start only once such a drain has ended")
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
    live_running: int | None = Field(
        None, description="servers the live fleet runs now (KEDA may have grown it): the new fleet has at least as many"
    )
    new_servers: int
    spare_servers: int
    drain_bound_s: int = Field(
        drain.ENDPOINT_LAG_S + drain.REQUEST_TIMEOUT_S,
        description="longest a server scaled away holds its GPUs before it is gone (its preStop's wait)",
    )
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


def plan(loaded: LoadedSpec, candidate: Side, live: Side | None, live_running: int | None = None) -> RolloutPlan:
    """The steps of rolling `candidate` out over `live` (None: nothing live, one step at 100%);
    `live_running`: the servers the live fleet runs now, where known (the cluster's count)."""
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

    def servers(share: float, rate: float | None, running: int = 0) -> int:
        """capacity.fleet_servers: the rule `capacity` and the ScaledObjects size by."""
        if need is None or cap is None or rate is None or share <= 0:
            return max(1, running) if share > 0 else 0
        return capacity.fleet_servers(cap, rate, share, running)

    running = live_running or 0 if live else 0
    # the live fleet as it runs now where known (KEDA may have grown or shrunk it), else as the peak sizes it
    live_servers = (running or servers(1.0, rate_old)) if live else 0
    new_total = servers(1.0, rate_new, running)
    if live and running and running > servers(1.0, rate_old):
        notes.append(
            f"the live fleet runs {running} servers (KEDA grew it above the {servers(1.0, rate_old)} the peak "
            f"needs): the new release gets at least as many, and the budget is {running} + spare"
        )
    budget = live_servers + rollout.spare_servers
    fractions = rollout.steps if live else [1.0]
    steps: list[StepPlan] = []
    started, old_before = 0, live_servers
    for number, fraction in enumerate(fractions, 1):
        # each side holds its share at its rate, and at least its share of its fleet: the controller moves
        # traffic onto new servers by the share of the fleet they are (a fleet KEDA grew has more of them)
        new = new_total if fraction >= 1 else max(servers(fraction, rate_new, 1), _part(fraction, new_total))
        old = (
            min(max(servers(1 - fraction, rate_old, 1), _part(1 - fraction, live_servers)), live_servers)
            if live and fraction < 1
            else 0
        )
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
                abort_waves=_undo_waves(live_servers, kept, new, new_total, rollout.spare_servers) if live else 0,
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
        if all(s.ok for s in steps):
            held = _terminating(steps, live_servers, rollout.spare_servers)
            for s, (stopped, waits) in zip(steps, held, strict=True):
                s.terminating, s.drain_waits = stopped, waits
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
        live_running=live_running if live else None,
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


def _part(share: float, fleet: int) -> int:
    """Servers that are `share` of a fleet of `fleet` (the controller's `servers_for`)."""
    return controller.servers_for(share, fleet)


def _undo_waves(live: int, have: int, new: int, full: int, spare: int) -> int:
    """Waves an undo after a failed analysis takes, as `controller._undo` runs them: the old side
    takes back what its servers hold, the new release keeps what its share needs, and each wave
    is the widest the live + spare budget leaves beside it."""
    waves = 0
    while have < live:
        share = math.ceil((1 - have / live) * WEIGHT_TOTAL - 1e-6) / WEIGHT_TOTAL
        new = min(new, controller.servers_for(share, full))
        wave = controller.reload_wave(live, have, new, spare)
        if wave < 1:
            return waves + live - have  # refused by the controller; the plan's own checks say why
        have, waves = have + wave, waves + 1
    return waves


def _terminating(steps: list[StepPlan], live: int, spare: int) -> list[tuple[int, int]]:
    """Per step, as the controller runs its waves (`controller.next_wave`): old servers it scales
    away, and the waves whose new servers need the GPUs of one still draining. A server scaled away
    keeps its GPUs until its preStop returns, so within live + spare such a wave's pods stay
    Pending until then: the budget counts them until they are gone."""
    plan = [ServerStep(fraction=s.fraction, old_servers=s.old_servers, new_servers=s.new_servers) for s in steps]
    full = max(1, plan[-1].new_servers)
    new, old, out = 0, live, []
    for number, step in enumerate(plan, 1):
        stopped = waits = 0
        while new < step.new_servers:
            share = math.floor(min(step.fraction, new / full) * WEIGHT_TOTAL + 1e-6) / WEIGHT_TOTAL
            wave, room = controller.next_wave(number, step, new, old, share, live, spare)
            if room < old:  # old servers stop to make this wave's room: it waits for their drain
                stopped, waits = stopped + old - room, waits + 1
            new, old = new + wave, room
        kept = min(old, controller.kept_while_judged(step, live, live + spare))
        stopped, old = stopped + old - kept, kept
        out.append((stopped, waits))
    out[-1] = (out[-1][0] + old, out[-1][1])  # after the keep window the last ones go too
    return out


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
            f"; peak + headroom {p.need_rps:g} req/s; live fleet {p.live_servers} servers"
            + (f" ({p.live_running} running now)" if p.live_running else "")
            + f", the new one {p.new_servers}; spare budget {p.spare_servers}"
            if p.need_rps is not None
            else ""
        ),
    ]
    rows = [
        f"{'step':>4} {'traffic':>7} {'old srv':>7} {'new srv':>7} {'at once':>7} {'old holds/share':>18} "
        f"{'new holds/share':>18} {'waves':>5} {'stopped':>7} {'waits':>5} {'duration':>9} {'abort':>18}  ok"
    ]

    def abort(s: StepPlan) -> str:
        if not p.live_servers:
            return "-"
        if not s.abort_reloads:
            return f"instant ({s.old_kept} kept)"
        waves = s.abort_waves or s.abort_reloads
        load = p.live_load_seconds * waves if p.live_load_seconds is not None else None
        return f"{s.abort_reloads} reload{'s' if s.abort_reloads > 1 else ''} ({minutes(load)})"

    for s in p.steps:

        def holds(h: float | None, share: float | None) -> str:
            return "-" if h is None or share is None else f"{h:g}/{share:g}"

        rows.append(
            f"{s.step:>4} {s.fraction:>7.0%} {s.old_servers:>7} {s.new_servers:>7} {s.at_once:>7} "
            f"{holds(s.old_holds_rps, s.old_share_rps):>18} {holds(s.new_holds_rps, s.new_share_rps):>18} "
            f"{s.waves:>5} {s.terminating:>7} {s.drain_waits:>5} {minutes(s.seconds):>9} {abort(s):>18}  "
            f"{'yes' if s.ok else 'NO: ' + s.problem}"
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
    waits = sum(s.drain_waits for s in p.steps)
    if p.live_servers and p.target == "kubernetes":
        tail.append(
            "at once: servers holding GPUs, those still draining counted. 'stopped': old servers a step scales "
            f"away; each drains first (preStop: until its engine runs nothing, up to {minutes(p.drain_bound_s)}) "
            "and holds its GPUs, within live + spare, until it is gone; 'waits': waves whose new servers wait "
            f"for such a drain" + (f" (up to {minutes(waits * p.drain_bound_s)} more in all)" if waits else "")
        )
    if p.live_servers:
        tail.append(
            "abort: traffic goes back to the old release as its servers hold it (its reloads in the widest waves "
            "the live + spare budget leaves, the new release giving back servers as they come), then the new one "
            "goes to zero; 'instant' where the old release still runs them all while the step is judged"
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


def for_release(
    loaded: LoadedSpec, candidate: Release, live: Release | None, live_running: int | None = None
) -> RolloutPlan:
    """The plan of a release in the registry over what is live now (`live_running`: its servers
    running now, where the caller read them from the cluster)."""
    if candidate.name != loaded.spec.name:
        raise ReleaseError(f"release {candidate.id} is {candidate.name}, not {loaded.spec.name} (the spec's name)")
    other = live if live and live.id != candidate.id else None
    return plan(loaded, Side.of(candidate), Side.of(other) if other else None, live_running if other else None)
