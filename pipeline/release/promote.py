"""Promotion: the gates, enforced here in code, then the rollout to the spec's target.

A DAG edited by mistake cannot skip a gate: `promote()` reads the evidence from the registry
(accuracy gate, SLO gate, an allowed reviewer's approval) and re-verifies the staged artifact
at its storage URI, and refuses, recording the refusal, when any of them is missing. Every
step of a rollout, and every rollback, is an event in the release's audit trail. What the gates
read back from the registry is `pipeline.release.evidence`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.core.errors import DeployFailed, LeaseHeld, LeaseLost, PromotionRefused, ReleaseError
from pipeline.core.files import atomic_write
from pipeline.core.paths import home
from pipeline.core.rollout import WEIGHT_TOTAL, RolloutOutcome, ServerStep
from pipeline.core.rollout import Event as ControllerEvent
from pipeline.core.specs import EvaluationSpec, LoadedSpec, duration_seconds
from pipeline.k8s import deploy as k8s_deploy
from pipeline.k8s import manifests
from pipeline.records import events as ev
from pipeline.records.evaluate import Endpoint, EvalResult
from pipeline.records.events import KeepWindow, Recovered, RollbackStarted
from pipeline.records.release import StagedRef, Verification
from pipeline.records.rollout import StepAnalysis
from pipeline.records.served_accuracy import ServedAccuracy
from pipeline.release import analysis, controller, local_engines, local_target, lock, rollout_plan, step_review
from pipeline.release.evidence import gate_problems, gate_results, last_event, release_spec
from pipeline.release.registry import Registry, Release, ReleaseData
from pipeline.stages import served_accuracy, serving

log = logging.getLogger(__name__)


def promote(
    reg: Registry,
    release_id: int,
    actor: str = "pipeline",
    k8s_client: Any = None,
    step_reviews: bool = False,
    first_try: bool = True,
    wait_s: float = lock.WAIT_S,
) -> Release:
    """Check every gate, then roll out; returns the release as it ends (live) or raises.

    `step_reviews`: the caller (the release DAG) runs a review task per step, so each step waits
    for a reviewer's Continue / Abort when the spec sets `rollout.review_timeout`. A release left
    "deploying" (its controller died) is recovered instead (`recover`); `first_try` False (the
    task's retry) refuses anything else, so a retry never rolls a release out twice. The model's
    controller lock is held throughout (another controller: waited for up to `wait_s`, then
    LeaseHeld naming it)."""
    named = reg.get(release_id)  # only which model, on which target: its lock is taken before anything is read
    with lock.controlling(named.name, named.target, release_spec(named), actor, k8s_client, wait_s) as held:
        return _promote(reg, release_id, actor, held, step_reviews, first_try)


def _promote(
    reg: Registry, release_id: int, actor: str, held: lock.Held, step_reviews: bool, first_try: bool
) -> Release:
    rel = reg.get(release_id)
    if rel.status == "deploying":  # its controller died (the task killed): picked up, not started again
        rel = _recover(reg, rel.id, actor, held)
        if rel.status == "live":
            return rel
        raise DeployFailed(
            f"release {rel.id}: the rollout's controller died mid-rollout; it was undone from the state it left "
            f"(release is {rel.status}); promote it again in a new run"
        )
    if not first_try:
        raise PromotionRefused(
            f"release {rel.id} is {rel.status}: this promotion already ran; its retry only picks up a rollout "
            "whose controller died"
        )
    loaded = release_spec(rel)
    problems = gate_problems(reg, rel, loaded)
    if problems:
        reg.record(rel.id, ev.PromotionRefusal(reasons=problems), actor)
        raise PromotionRefused(f"release {rel.id} ({rel.name}) not promoted:\n  " + "\n  ".join(problems))
    previous = reg.live(rel.name, rel.target)
    reg.record(
        rel.id,
        ev.DeployStarted(target=rel.target, layout=rel.data.layout, replacing=previous.id if previous else None),
        actor,
        status="deploying",
    )
    review = reviewer(reg, rel, loaded) if step_reviews else None
    try:
        _deploy(reg, rel, loaded, previous, actor, held, review)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the task terminated (SIGTERM, ^C): the target may be mid-rollout
            reg.record(rel.id, ev.ControllerInterrupted(error=f"{type(exc).__name__}: {exc}"[:2000]), actor)
            raise  # left "deploying": the task's retry (or `recover`) brings it to a safe end
        if isinstance(exc, LeaseLost):  # another controller holds the model now: its record is its own
            reg.record(rel.id, ev.LeaseLoss(error=str(exc)[:2000]), actor)
            raise
        # whatever else went wrong (a bug), the release must not stay "deploying" (one conditional update)
        reg.record(
            rel.id,
            ev.DeployFailure(error=f"{type(exc).__name__}: {exc}"[:2000]),
            actor,
            status="failed",
            only_from=("deploying",),
        )
        raise
    return reg.get(rel.id)


def _went_live(
    reg: Registry, rel: Release, previous: Release | None, actor: str, live: ReleaseData, recovered: bool = False
) -> None:
    """The release carries all the traffic: live on record now (keep window or not), its
    predecessor superseded, each by one conditional update. `live`: where it serves (Opened.live_data)."""
    said = {"recovered": True} if recovered else {"target": rel.target}
    finished = ev.DeployFinished.model_validate({**said, **live.model_dump(exclude_unset=True)})
    reg.record(rel.id, finished, actor, status="live", data=live, only_from=("deploying",))
    if previous and previous.id != rel.id:
        reg.record(previous.id, ev.Superseded(by=rel.id), actor, status="superseded", only_from=("live",))


def recover(
    reg: Registry, release_id: int, actor: str = "pipeline", k8s_client: Any = None, wait_s: float = lock.WAIT_S
) -> Release:
    """A release left "deploying" by a controller that died between two actions (its task killed):
    the target is brought to a safe end from the state it holds, idempotently: a rollout that had
    moved everything is finished (live), any other is undone (the previous release serves, nothing
    of the new one is started again). Returns the release as recorded after it. Holds the model's
    controller lock (LeaseHeld naming another holder after `wait_s`)."""
    named = reg.get(release_id)
    with lock.controlling(named.name, named.target, release_spec(named), actor, k8s_client, wait_s) as held:
        return _recover(reg, release_id, actor, held)


def _recover(reg: Registry, release_id: int, actor: str, held: lock.Held) -> Release:
    k8s_client = held.api
    rel = reg.get(release_id)
    if rel.status != "deploying":
        raise ReleaseError(f"release {rel.id} is {rel.status}, not deploying: no rollout to recover")
    loaded = release_spec(rel)
    previous = reg.live(rel.name, rel.target)
    # a rollback whose controller died: undone, its release is back to what it was before it (read
    # now: the undo's own events follow on the trail)
    started = last_event(reg, rel.id, "rollback_started", "deploy_started")
    was = started.detail.was if started is not None and isinstance(started.detail, RollbackStarted) else None
    reg.record(rel.id, ev.RecoveryStarted(target=rel.target), actor)
    with _opened(reg, rel, loaded, previous, actor, k8s_client, "recover") as opened:
        outcome = controller.recover(opened.target) if opened.target is not None else None
        if outcome is not None:
            _record_events(reg, rel.id, outcome.events, actor)
        live = outcome is not None and outcome.status == "live"
        data = opened.live_data() if live else ReleaseData()
    restored = previous is not None and previous.id != rel.id and not live
    if live:
        _went_live(reg, rel, previous, actor, data, recovered=True)
        if was is not None and previous and previous.id != rel.id:  # a rollback's: the other was rolled back
            reg.record(previous.id, ev.RolledBack(restored=rel.id), actor, status="rolled_back")
    else:
        reg.record(
            rel.id,
            ev.DeployFailure(
                error="the rollout's controller died; undone",
                previous_serving=previous.id if restored and previous else None,
            ),
            actor,
            status=was or ("rolled_back" if restored else "failed"),
            only_from=("deploying",),
        )
    return reg.get(rel.id)


def reviewer(reg: Registry, rel: Release, loaded: LoadedSpec) -> step_review.Reviewer | None:
    """Each step's analysis put to the spec's reviewers through the registry; None when the spec
    asks for no step reviews."""
    timeout = loaded.spec.rollout.review_timeout
    return step_review.registry_reviewer(reg, rel.id, duration_seconds(timeout)) if timeout else None


def serving_dir(loaded: LoadedSpec, staged: StagedRef):
    """What the local engines load: the staged artifact, fetched and verified (BF16 copy on CPU)."""
    return serving.serving_copy(loaded, staged.manifest_hash, staged.s3_uri, staged.nfs_path)


def _rollout_check(rel: Release, loaded: LoadedSpec) -> tuple[tuple[EvalResult, EvalResult], EvaluationSpec] | None:
    """The gate's in-process results and the evaluation a rollout step's check runs (the first
    `evaluation.served.rollout_limit` items); None when the spec turns it off or the release
    predates the registry keeping the gate's scores."""
    evaluation = loaded.spec.evaluation
    gate = gate_results(rel)
    if gate is None or not evaluation.served.enabled or evaluation.served.rollout_limit is None:
        return None
    smaller = evaluation.model_copy(
        update={"served": evaluation.served.model_copy(update={"limit": evaluation.served.rollout_limit})}
    )
    return gate, smaller


def _step_dir(rel: Release, step: int) -> Path:
    """Where a rollout step's accuracy table and validation go, on either target."""
    return home() / "releases" / str(rel.id) / "rollout-accuracy" / f"step-{step}"


def step_answers(rel: Release, loaded: LoadedSpec, model_dir: Path | None = None) -> served_accuracy.Answers | None:
    """The served-answers check of each rollout step, at the new release's servers before the step
    moves traffic: the gate's tasks, held to the gate's in-process scores. `model_dir`: the
    tokenizer the local engines load; None asks the engine's own (/tokenizer_info, Kubernetes)."""
    check = _rollout_check(rel, loaded)
    if check is None:
        return None
    gate, smaller = check

    def answers(step: int, endpoint: str | Endpoint, served_name: str) -> ServedAccuracy:
        return served_accuracy.check(endpoint, model_dir, served_name, *gate, smaller, _step_dir(rel, step))

    return answers


def prometheus_judge(
    loaded: LoadedSpec, new_id: str, old_id: str | None, review: step_review.Reviewer | None = None
) -> controller.Judge:
    """Each Kubernetes step judged like a local one, by the cluster's Prometheus: its pod scrape
    labels every engine's series with `release` (the pod's model-release/release-id); then, with
    `review`, put to a person while the step holds its servers."""
    spec = loaded.spec
    url = spec.rollout.prometheus_url
    if not url:
        raise ReleaseError(f"{loaded.path}: rollout.prometheus_url is needed to judge rollout steps on Kubernetes")
    settle = 2 * duration_seconds(spec.rollout.scrape_interval)  # the window's last samples scraped

    def judge(step: int, fraction: float, pods: int) -> StepAnalysis:
        new = f'release="{new_id}"'
        analysis.wait_up(url, new, pods, timeout=60 + 4 * settle)  # the window starts once every new pod is seen
        old = f'release="{old_id}"' if old_id and fraction < 1 else None
        verdict = analysis.after_window(url, new, old, step, fraction, spec.slo, spec.rollout, settle)
        return verdict.decided(review(verdict)) if review else verdict

    return judge


def server_steps(plan: rollout_plan.RolloutPlan) -> list[ServerStep]:
    return [ServerStep(fraction=s.fraction, old_servers=s.old_servers, new_servers=s.new_servers) for s in plan.steps]


def feasible_plan(
    loaded: LoadedSpec, rel: Release, live: Release | None, live_running: int | None = None
) -> rollout_plan.RolloutPlan:
    """The rollout's plan, refused before anything changes when the spare budget cannot hold it."""
    plan = rollout_plan.for_release(loaded, rel, live, live_running)
    if not plan.feasible:
        raise DeployFailed(
            f"release {rel.id}: the rollout cannot hold the fleet: "
            + "; ".join(f"step {s.step}: {s.problem}" for s in plan.steps if not s.ok)
        )
    return plan


def objs_service(objs: list[dict]) -> str:
    return next((o["metadata"]["name"] for o in objs if o["kind"] == "Service"), "?")


# ---------------------------------------------------------------- the targets, opened for the controller

Purpose = Literal["promote", "rollback", "recover", "verify"]


@dataclass
class Opened:
    """A release on its target, ready for the controller: the target's primitives, the steps and
    judge the rollout runs (None: one step, nothing judged), and how the live release is recorded."""

    target: Any  # a controller.Target: local_target.LocalRelease or k8s_deploy.KubernetesRelease
    steps: list[ServerStep] | None
    judge: controller.Judge | None
    spare: int
    scale_down_delay_s: float
    live_data: Callable[[], ReleaseData]  # the release's data once live (its endpoint, its engines)
    smoke: Callable[[], tuple[str, str]]  # (url, completion text) through the live address
    on_live: Callable[[list[ControllerEvent]], None] | None = None  # told once the release carries all the traffic
    wait: Callable[[float], bool | None] = time.sleep  # sleeps the keep window


@contextlib.contextmanager
def _opened_local(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    live: Release | None,
    actor: str,
    client: Any,
    purpose: Purpose,
    review: step_review.Reviewer | None,
) -> Iterator[Opened]:
    spec = loaded.spec
    # the caller holds the model's switch lock (lock.controlling)
    if purpose in ("promote", "rollback"):
        local_target.recover(spec)  # another rollout whose controller died: undone before this one
        model_dir = serving_dir(loaded, rel.staged())
        target = local_target.LocalRelease(
            spec,
            rel.id,
            loaded.hardware,
            loaded.layout(rel.chosen().layout),
            model_dir,
            step_answers(rel, loaded, model_dir),
        )
    else:
        target = local_target.LocalRelease(spec, rel.id)
    kept = purpose == "rollback" and target.state().new_servers > 0  # its engines still run: no steps

    def live_data() -> ReleaseData:
        return ReleaseData(endpoint=local_target.endpoint(spec), deployment=local_target.current(rel.name))

    def smoke() -> tuple[str, str]:
        dep = local_target.current(rel.name)
        if dep is None or dep.release_id != rel.id or not local_target.is_healthy(dep):
            raise ReleaseError(f"release {rel.id}: the local engines are not running or not healthy")
        return local_target.endpoint(spec), local_engines.smoke(local_target.endpoint(spec))

    yield Opened(
        target=target,
        steps=None if kept else local_target.steps(spec),
        # a first local release is not judged: the embedded front has no traffic before it serves
        judge=None if kept or live is None else target.judge(review),
        spare=1,  # one machine: both releases run on it at once
        scale_down_delay_s=duration_seconds(spec.rollout.scale_down_delay) if purpose == "promote" else 0.0,
        live_data=live_data,
        smoke=smoke,
    )


@contextlib.contextmanager
def _opened_kubernetes(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    live: Release | None,
    actor: str,
    client: Any,
    purpose: Purpose,
    review: step_review.Reviewer | None,
) -> Iterator[Opened]:
    spec = loaded.spec
    namespace = spec.promotion.namespace
    running = None
    if purpose == "promote" and live is not None:  # the live fleet as KEDA left it: the new one is never smaller
        client = client or k8s_deploy.api_client(spec.promotion.kubernetes_conn_id)
        running = k8s_deploy.kept_servers(client, live.data.manifests or [])
    plan = feasible_plan(loaded, rel, live, running) if purpose == "promote" else None  # refused before rendering
    objs = _rendered(reg, rel, loaded, actor, plan.new_servers) if plan else rel.data.manifests or []
    client = client or k8s_deploy.api_client(spec.promotion.kubernetes_conn_id)
    cluster = k8s_deploy.KubernetesTarget(client)
    endpoint = f"service/{objs_service(objs)}.{namespace}"

    def smoke() -> tuple[str, str]:
        """Through the Gateway, as clients reach the model, to this release by name."""
        if not objs:
            raise ReleaseError(f"release {rel.id}: no rendered manifests on record; nothing to check")
        checked = k8s_deploy.named_smoke(
            client, objs, cluster.smoke_timeout_s, cluster.route_timeout_s, cluster.smoke_retry_delay_s
        )
        return f"{checked.url} ({manifests.RELEASE_HEADER}: {checked.release})", checked.text

    if purpose == "verify" or (purpose == "recover" and not objs):  # nothing to roll out or recover
        yield Opened(None, None, None, 0, 0.0, lambda: ReleaseData(endpoint=endpoint), smoke)
        return
    if not objs:
        raise ReleaseError(f"release {rel.id}: no rendered manifests on record; nothing to {purpose}")
    target = cluster.release(str(rel.id), objs, step_answers(rel, loaded) if purpose != "recover" else None)
    if purpose == "rollback" and k8s_deploy.kept_servers(client, objs) is None:  # pruned: rolled out again
        plan = feasible_plan(loaded, rel, live)
    # a first release is judged too (no live release: against the SLO's own limits)
    judge = prometheus_judge(loaded, str(rel.id), str(live.id) if live else None, review) if plan else None
    try:
        yield Opened(
            target=target,
            steps=server_steps(plan) if plan else None,
            judge=judge,
            spare=plan.spare_servers if plan else spec.rollout.spare_servers,
            scale_down_delay_s=duration_seconds(spec.rollout.scale_down_delay) if purpose == "promote" else 0.0,
            live_data=lambda: ReleaseData(endpoint=endpoint),
            smoke=smoke,
        )
    except Exception:
        # an error the controller's own undo did not see: what of the release takes no traffic goes to
        # zero (a signal, which leaves the rollout to `recover`, is no Exception)
        with contextlib.suppress(ReleaseError):
            target.take_down()
        raise


_TARGETS = {"local": _opened_local, "kubernetes": _opened_kubernetes}


def _opened(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    live: Release | None,
    actor: str,
    client: Any,
    purpose: Purpose,
    review: step_review.Reviewer | None = None,
) -> contextlib.AbstractContextManager[Opened]:
    """The release's target, opened for `purpose` (the local one holds its switch lock meanwhile)."""
    return _TARGETS[rel.target](reg, rel, loaded, live, actor, client, purpose, review)


def _rendered(reg: Registry, rel: Release, loaded: LoadedSpec, actor: str, servers: int) -> list[dict]:
    """The release's Kubernetes objects for `servers` servers, schema-validated and kept on record."""
    staged = rel.staged()
    artifact = manifests.Artifact(s3_uri=staged.s3_uri, nfs_path=staged.nfs_path, manifest_hash=staged.manifest_hash)
    # with capacity.autoscale, the release's KEDA scalers too, sized from its measured rate per server
    capacity = loaded.spec.capacity
    rate = rel.chosen().rate_per_server if capacity and capacity.autoscale else None
    # the startup probe and progress deadline from the release's own load time, measured on this hardware
    load = rel.data.slowest_load()
    options = manifests.RenderOptions(servers=servers, autoscale_rate=rate, load_seconds=load)
    objs = manifests.render(loaded, rel.chosen().layout, str(rel.id), artifact, options)
    problems = manifests.validate(objs)
    if problems:
        reg.record(rel.id, ev.DeployFailure(error="manifests invalid", problems=problems), actor, status="failed")
        raise DeployFailed(f"release {rel.id}: rendered manifests fail schema validation:\n  " + "\n  ".join(problems))
    kept = home() / "releases" / str(rel.id) / "manifests.yaml"  # the exact objects applied, for humans and audits
    atomic_write(kept, manifests.to_yaml(objs))
    reg.record(
        rel.id,
        ev.ManifestsRendered(
            objects=[f"{o['kind']}/{o['metadata']['name']}" for o in objs], file=str(kept), servers=servers
        ),
        actor,
        data=ReleaseData(manifests=objs, manifests_file=str(kept)),
    )
    return objs


def _run(opened: Opened) -> RolloutOutcome:
    return controller.rollout(
        opened.target, opened.steps, opened.judge, opened.spare, opened.scale_down_delay_s, opened.on_live, opened.wait
    )


def _record_events(reg: Registry, release_id: int, made: list[ControllerEvent], actor: str) -> None:
    """The controller's and the target's events, each read as its kind's record (a detail that does
    not fit is refused, naming the kind and the field), recorded in order."""
    for kind, detail in made:
        reg.record(release_id, ev.detail_of(kind, detail), actor)


def _deploy(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    previous: Release | None,
    actor: str,
    held: lock.Held,
    review: step_review.Reviewer | None = None,
) -> None:
    """The release rolled out over the live one by the controller, on the spec's target; every
    event it made goes on the release's trail. It is live on record as soon as it carries all the
    traffic; the keep window's end is recorded before the wait, which gives the lock back (a
    rollback meanwhile need not wait for it)."""
    recorded = 0

    with _opened(reg, rel, loaded, previous, actor, held.api, "promote", review) as opened:

        def on_live(events: list[ControllerEvent]) -> None:
            nonlocal recorded
            _record_events(reg, rel.id, events[recorded:], actor)
            recorded = len(events)
            _went_live(reg, rel, previous, actor, opened.live_data())

        def keep(delay_s: float) -> bool:
            nonlocal recorded
            _record_events(reg, rel.id, opened.target.events[recorded:], actor)  # scale_down_delay, with its end
            recorded = len(opened.target.events)
            try:
                with held.released(lock.WAIT_S):
                    time.sleep(delay_s)
            except LeaseHeld as exc:  # a rollback or the next rollout holds the model now
                log.warning("after the keep window: %s", exc)
                return False
            return True

        opened.on_live, opened.wait = on_live, keep
        outcome = _run(opened)
        if outcome.status == "live" and reg.get(rel.id).status == "deploying":  # live, and not told so
            on_live(outcome.events)
        _record_events(reg, rel.id, outcome.events[recorded:], actor)
    if outcome.status != "live":
        restored = outcome.status == "rolled_back"
        reg.record(
            rel.id,
            ev.DeployFailure(
                error=(outcome.error or "")[:2000], previous_serving=previous.id if restored and previous else None
            ),
            actor,
            status=outcome.status,
            only_from=("deploying",),
        )
        raise DeployFailed(
            f"release {rel.id}: rollout to {rel.target} failed ({outcome.status}; "
            + (f"release {previous.id} still serving" if restored and previous else "nothing serving")
            + f"): {outcome.error}"
        )


def verify(reg: Registry, release_id: int, actor: str = "pipeline", k8s_client: Any = None) -> Verification:
    """After promotion: the live endpoint answers a completion now (not only at switch time)."""
    rel = reg.get(release_id)
    if rel.status != "live":
        raise ReleaseError(f"release {rel.id} is {rel.status}, not live; nothing to verify")
    loaded = release_spec(rel)
    try:
        with _opened(reg, rel, loaded, rel, actor, k8s_client, "verify") as opened:
            url, text = opened.smoke()
    except ReleaseError as exc:
        # evidence, not a verdict: a retry may pass, and a re-benchmark or a human decides the rest
        reg.record(rel.id, ev.VerifyFailed(error=str(exc)[:2000]), actor)
        raise
    reg.record(rel.id, ev.Verified(url=url, text=text), actor)
    return Verification(release_id=rel.id, endpoint=url, text=text)


def rollback(
    reg: Registry,
    name: str,
    target: str,
    actor: str,
    reason: str,
    to: int | None = None,
    k8s_client: Any = None,
    wait_s: float = lock.WAIT_S,
) -> Release:
    """Put an earlier release back: `to`, or the newest one that served before the live one.

    No new approval is needed (that release passed its gates when it went live); who rolled
    back and why is recorded on both releases. Where the release's servers are still on the
    target (kept through the keep window, or its objects kept at zero on Kubernetes) they come
    back and take the traffic without analysis steps ("kept"); otherwise it is rolled out again,
    in steps ("re-rollout"). The record says which, and when all traffic was back.

    The model's controller lock is taken before the registry is read. A rollback whose controller
    died (its task killed) left its release "deploying" with the record on the target: the retry
    recovers it first, through the same record, and is done where that finished it.
    """
    known = reg.get(to) if to is not None else next(iter(reg.releases(name=name)), None)
    if known is None:
        raise ReleaseError(f"{name} ({target}): no release of this name in the registry")
    with lock.controlling(name, target, release_spec(known), actor, k8s_client, wait_s) as held:
        return _rollback(reg, name, target, actor, reason, to, held)


def _rollback(
    reg: Registry, name: str, target: str, actor: str, reason: str, to: int | None, held: lock.Held
) -> Release:
    k8s_client = held.api
    dead = [r for r in reg.releases(name=name, status="deploying") if r.target == target]
    for stuck in dead:  # a controller died mid-rollout or mid-rollback: brought to a safe end first
        started = last_event(reg, stuck.id, "rollback_started", "deploy_started")
        resumed = _recover(reg, stuck.id, actor, held)
        if resumed.status == "live" and started is not None and started.kind == "rollback_started":
            if to is None or to == stuck.id:
                reg.record(stuck.id, ev.RollbackFinished(reason=reason, path="resumed"), actor)
                return resumed
    live = reg.live(name, target)
    if to is None:
        if live is None:
            raise ReleaseError(f"{name} ({target}): no live release and no --to given; nothing to roll back from")
        prev = reg.previous_live(name, target, before=live.id)
        if prev is None:
            raise ReleaseError(f"{name} ({target}): release {live.id} is live and nothing served before it")
        to = prev.id
    rel = reg.get(to)
    if (rel.name, rel.target) != (name, target):
        raise ReleaseError(f"release {rel.id} is {rel.name} on {rel.target}, not {name} on {target}; refusing")
    if not any(e.kind == "deploy_finished" for e in reg.events(rel.id)):
        raise ReleaseError(f"release {rel.id} never went live; only a release that served can be restored")
    loaded = release_spec(rel)
    before = rel.status
    reg.record(
        rel.id,
        ev.RollbackStarted(reason=reason, from_release=live.id if live else None, was=before),
        actor,
        status="deploying",
    )
    try:
        with _opened(reg, rel, loaded, live, actor, k8s_client, "rollback") as opened:
            path = "re-rollout" if opened.steps else "kept objects"
            outcome = _run(opened)
            _record_events(reg, rel.id, outcome.events, actor)
            if outcome.status != "live":
                raise DeployFailed(f"rollback to release {rel.id} ({path}) failed: {outcome.error}")
            data = opened.live_data()
    except BaseException as exc:
        if not isinstance(exc, Exception) or isinstance(exc, LeaseLost):
            # killed (or fenced off) mid-rollback: left "deploying" with its record on the target, for
            # the task's retry (or `recover`) to bring to a safe end
            reg.record(rel.id, ev.ControllerInterrupted(error=f"{type(exc).__name__}: {exc}"[:2000]), actor)
            raise
        reg.record(
            rel.id,
            ev.RollbackFailed(reason=reason, error=f"{type(exc).__name__}: {exc}"[:2000]),
            actor,
            status=before,
            only_from=("deploying",),
        )  # back to what it was: a failed rollback changes nothing on record
        raise
    made = [ev.detail_of(kind, detail) for kind, detail in outcome.events]
    complete = next((d for d in made if isinstance(d, ev.RolloutComplete)), ev.RolloutComplete())
    finished = ev.RollbackFinished.model_validate(
        {
            "reason": reason,
            "path": path,
            "all_traffic_after_s": complete.all_traffic_after_s,
            "seconds": complete.seconds,
            "events": [d.kind for d in made],
            **data.model_dump(exclude_unset=True),
        }
    )
    reg.record(rel.id, finished, actor, status="live", data=data, only_from=("deploying",))
    for other in reg.releases(name=name, status="live"):  # the cluster serves `rel` only now
        if other.target == target and other.id != rel.id:
            reg.record(
                other.id,
                ev.RolledBack(reason=reason, restored=rel.id),
                actor,
                status="rolled_back",
                only_from=("live",),
            )
    return reg.get(rel.id)


def recover_model(
    reg: Registry, name: str, actor: str, k8s_client: Any = None, wait_s: float = 0.0, now: float | None = None
) -> list[str]:
    """On-call's door (`model-release recover NAME`): with the model's controller lock, every
    release a dead controller left "deploying" brought to a safe end (`recover`), and on Kubernetes
    a keep window whose end passed with nobody left to finish it, finished (the old release to zero
    where the route sends it nothing). Returns what it found and did, one line each; an unknown
    model is a ReleaseError, a model with nothing to recover says so."""
    known = reg.releases(name=name)
    if not known:
        raise ReleaseError(f"model {name!r}: no releases of this name in {reg.safe_url}")
    target = known[0].target
    done: list[str] = []
    with lock.controlling(name, target, release_spec(known[0]), actor, k8s_client, wait_s) as held:
        for rel in reg.releases(name=name, status="deploying"):
            if rel.target != target:
                continue
            after = _recover(reg, rel.id, actor, held)
            found = last_event(reg, rel.id, "recovered")
            state = found.detail_as(Recovered).state if found else Recovered().state
            done.append(f"release {rel.id} was deploying (its controller died): {state}, now {after.status}")
        live = reg.live(name, target)
        if live is not None and target == "kubernetes":
            kept = _finish_keep(reg, live, actor, held, time.time() if now is None else now)
            if kept:
                done.append(kept)
    if not done:
        done.append(
            f"nothing to recover: no release of {name} on {target} is deploying"
            + (f"; release {live.id} is live" if live else "")
            + " and no keep window is left unfinished"
        )
    return done


def _finish_keep(reg: Registry, live: Release, actor: str, held: lock.Held, now: float) -> str | None:
    """The live release's keep window, where its controller died in it: over -> the old release to
    zero (the route names only the live one); not over -> left, and said."""
    last = last_event(reg, live.id, "scale_down_delay", "rollout_complete")
    if last is None or last.kind != "scale_down_delay":
        return None
    until = last.detail_as(KeepWindow).until
    if until > now:
        return f"release {live.id}: the keep window runs until {until:.0f} ({until - now:.0f} s left); left as it is"
    loaded = release_spec(live)
    with _opened(reg, live, loaded, live, actor, held.api, "recover") as opened:
        target = opened.target
        if target is None:
            return None
        fleet = target.state()
        if fleet.weights != {fleet.backend: WEIGHT_TOTAL} or not fleet.old_servers:
            reg.record(live.id, ev.RolloutComplete(keep_window="nothing left to scale down"), actor)
            return None
        target.scale_old(0)
        done = ev.RolloutComplete(keep_window="finished by recover", scaled_to_zero=fleet.old_release)
        reg.record(live.id, done, actor)
    return f"release {live.id}: the keep window ended with nobody to finish it: release {fleet.old_release} to zero"
