"""Promotion: the gates, enforced here in code, then the rollout to the spec's target.

A DAG edited by mistake cannot skip a gate: `promote()` reads the evidence from the registry
(accuracy gate, SLO gate, an allowed reviewer's approval) and re-verifies the staged artifact
at its storage URI, and refuses, recording the refusal, when any of them is missing. Every
step of a rollout, and every rollback, is an event in the release's audit trail.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.core import paths, storage
from pipeline.core.errors import ReleaseError, RolloutAborted
from pipeline.core.files import atomic_write
from pipeline.core.paths import home
from pipeline.core.spec import EvaluationSpec, LoadedSpec, duration_seconds, load_spec
from pipeline.k8s import deploy as k8s_deploy
from pipeline.k8s import manifests
from pipeline.release import analysis, local_target, rollout_plan, step_review
from pipeline.release.analysis import StepAnalysis
from pipeline.release.registry import Registry, Release
from pipeline.stages import served_accuracy, serving
from pipeline.stages.evaluate import Endpoint, EvalResult
from pipeline.stages.served_accuracy import ServedAccuracy

log = logging.getLogger(__name__)


class PromotionRefused(ReleaseError):
    """A gate or the approval is missing; nothing was deployed."""


class DeployFailed(ReleaseError):
    """The rollout failed; the previous release (if any) was restored."""


def release_spec(rel: Release) -> LoadedSpec:
    """The spec as it was when the release was opened (its recorded text), not as the file reads
    now: a spec edited after the run must not change what gets deployed, rolled back to or
    re-measured. The file itself is used while it still matches."""
    path = Path(rel.spec_path)
    if path.is_file() and path.read_text() == rel.spec_yaml:
        return load_spec(path)
    copy = paths.home() / "releases" / str(rel.id) / "spec.yaml"
    if not copy.is_file() or copy.read_text() != rel.spec_yaml:
        atomic_write(copy, rel.spec_yaml)
    log.warning(
        "release %d: %s %s since the release was opened; using the recorded spec (%s)",
        rel.id,
        path,
        "changed" if path.is_file() else "is gone",
        copy,
    )
    return load_spec(copy)


def gate_results(rel: Release) -> tuple[EvalResult, EvalResult] | None:
    """The in-process (baseline, candidate) results the accuracy gate recorded for this release."""
    recorded = rel.data.get("evaluation")
    if not recorded:
        return None  # released before the registry kept them: the served answers are not checked
    return evaluation_pair(recorded)


def evaluation_pair(stored: dict[str, Any]) -> tuple[EvalResult, EvalResult]:
    """(baseline, candidate) from their stored form, {"baseline": ..., "candidate": ...} (the
    registry's release data, the release DAG's XCom, a file handed to a pod)."""
    return EvalResult.model_validate(stored["baseline"]), EvalResult.model_validate(stored["candidate"])


def last_event(reg: Registry, release_id: int, *kinds: str) -> Any:
    events = [e for e in reg.events(release_id) if e.kind in kinds]
    return events[-1] if events else None


def gate_problems(reg: Registry, rel: Release, loaded: LoadedSpec) -> list[str]:
    """Every reason this release may not be promoted; empty when it may."""
    problems = []
    acc = last_event(reg, rel.id, "accuracy_gate")
    if acc is None or not acc.detail.get("passed"):
        problems.append("accuracy gate: " + ("not run" if acc is None else "failed"))
    slo = last_event(reg, rel.id, "slo_gate")
    if slo is None or not slo.detail.get("passed"):
        problems.append("SLO gate: " + ("not run" if slo is None else "failed"))
    promotion = loaded.spec.promotion
    if promotion.requires_approval:
        decision = last_event(reg, rel.id, "approved", "rejected")
        if decision is None:
            problems.append("approval: no reviewer has approved this release")
        elif decision.kind == "rejected":
            problems.append(f"approval: rejected by {decision.actor}")
        elif decision.actor not in promotion.reviewers:
            problems.append(
                f"approval: {decision.actor!r} is not an allowed reviewer "
                f"(spec promotion.reviewers: {', '.join(promotion.reviewers)})"
            )
    data = rel.data
    if not data.get("manifest_hash"):
        problems.append("artifact: no staged artifact recorded")
    else:
        try:
            storage.verify_staged(
                data["manifest_hash"], data.get("s3_uri"), data.get("nfs_path"), loaded.spec.staging.s3
            )
        except ReleaseError as exc:
            problems.append(f"artifact: {exc}")
    if rel.status not in ("approved", "candidate", "failed", "rolled_back"):
        problems.append(f"status: release is {rel.status}, not a candidate awaiting promotion")
    return problems


def promote(
    reg: Registry,
    release_id: int,
    actor: str = "pipeline",
    k8s_client: Any = None,
    step_reviews: bool = False,
    first_try: bool = True,
) -> Release:
    """Check every gate, then roll out; returns the release as it ends (live) or raises.

    `step_reviews`: the caller (the release DAG) runs a review task per step, so each step waits
    for a reviewer's Continue / Abort when the spec sets `rollout.review_timeout`. A release left
    "deploying" (its controller died) is recovered instead (`recover`); `first_try` False (the
    task's retry) refuses anything else, so a retry never rolls a release out twice."""
    rel = reg.get(release_id)
    if rel.status == "deploying":  # its controller died (the task killed): picked up, not started again
        rel = recover(reg, rel.id, actor, k8s_client)
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
        reg.record(rel.id, "promotion_refused", actor, {"reasons": problems})
        raise PromotionRefused(f"release {rel.id} ({rel.name}) not promoted:\n  " + "\n  ".join(problems))
    previous = reg.live(rel.name, rel.target)
    reg.record(
        rel.id,
        "deploy_started",
        actor,
        {"target": rel.target, "layout": rel.data["layout"], "replacing": previous.id if previous else None},
        status="deploying",
    )
    review = reviewer(reg, rel, loaded) if step_reviews else None
    try:
        if rel.target == "local":
            _deploy_local(reg, rel, loaded, previous, actor, review)
        else:
            _deploy_kubernetes(reg, rel, loaded, previous, actor, k8s_client, review)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the task terminated (SIGTERM, ^C): the target may be mid-rollout
            reg.record(rel.id, "controller_interrupted", actor, {"error": f"{type(exc).__name__}: {exc}"[:2000]})
            raise  # left "deploying": the task's retry (or `recover`) brings it to a safe end
        # whatever else went wrong (a bug), the release must not stay "deploying"
        if reg.get(rel.id).status == "deploying":
            reg.record(
                rel.id, "deploy_failed", actor, {"error": f"{type(exc).__name__}: {exc}"[:2000]}, status="failed"
            )
        raise
    if previous and previous.id != rel.id:
        reg.record(previous.id, "superseded", actor, {"by": rel.id}, status="superseded")
    return reg.get(rel.id)


def recover(reg: Registry, release_id: int, actor: str = "pipeline", k8s_client: Any = None) -> Release:
    """A release left "deploying" by a controller that died between two actions (its task killed):
    the target is brought to a safe end from the state it holds, idempotently: a rollout that had
    moved everything is finished (live), any other is undone (the previous release serves, nothing
    of the new one is started again). Returns the release as recorded after it."""
    rel = reg.get(release_id)
    if rel.status != "deploying":
        raise ReleaseError(f"release {rel.id} is {rel.status}, not deploying: no rollout to recover")
    loaded = release_spec(rel)
    previous = reg.live(rel.name, rel.target)
    reg.record(rel.id, "recovery_started", actor, {"target": rel.target})
    live = False
    if rel.target == "local":
        with local_target.switching(rel.name):
            local_target.recover(loaded.spec)
            now = local_target.current(rel.name)
        live = now is not None and now.release_id == rel.id and local_target.is_healthy(now)
        data = {"endpoint": local_target.endpoint(loaded.spec), "deployment": now.model_dump()} if live and now else {}
    else:
        objs = rel.data.get("manifests")
        outcome = None
        if objs:
            client = k8s_client or k8s_deploy.api_client(loaded.spec.promotion.kubernetes_conn_id)
            outcome = k8s_deploy.KubernetesTarget(client).recover(objs)
            for kind, detail in outcome.events:
                reg.record(rel.id, kind, actor, detail)
        live = outcome is not None and outcome.status == "live"
        data = {"endpoint": f"service/{objs_service(objs or [])}.{loaded.spec.promotion.namespace}"} if live else {}
    restored = previous is not None and previous.id != rel.id and not live
    if live:
        reg.record(rel.id, "deploy_finished", actor, {"recovered": True}, status="live", data=data)
        if previous and previous.id != rel.id:
            reg.record(previous.id, "superseded", actor, {"by": rel.id}, status="superseded")
    else:
        reg.record(
            rel.id,
            "deploy_failed",
            actor,
            {
                "error": "the rollout's controller died; undone",
                "previous_serving": previous.id if restored and previous else None,
            },
            status="rolled_back" if restored else "failed",
        )
    return reg.get(rel.id)


def reviewer(reg: Registry, rel: Release, loaded: LoadedSpec) -> step_review.Reviewer | None:
    """Each step's analysis put to the spec's reviewers through the registry; None when the spec
    asks for no step reviews."""
    timeout = loaded.spec.rollout.review_timeout
    return step_review.registry_reviewer(reg, rel.id, duration_seconds(timeout)) if timeout else None


def serving_dir(loaded: LoadedSpec, data: dict[str, Any]):
    """What the local engines load: the staged artifact, fetched and verified (BF16 copy on CPU)."""
    staged = {
        "s3_uri": data.get("s3_uri"),
        "nfs_path": data.get("nfs_path"),
        "manifest_hash": data["manifest_hash"],
    }
    return serving.serving_copy(loaded, staged)


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


def rollout_answers(
    reg: Registry, rel: Release, loaded: LoadedSpec, model_dir: Path, actor: str
) -> served_accuracy.Answers | None:
    """The smoke test of each local rollout step: the gate's tasks at the new release's engine,
    held to the gate's in-process scores; each check is a `rollout_accuracy` event."""
    check = _rollout_check(rel, loaded)
    if check is None:
        return None
    gate, smaller = check

    def answers(step: int, endpoint: str | Endpoint, served_name: str) -> ServedAccuracy:
        checked = served_accuracy.check(endpoint, model_dir, served_name, *gate, smaller, _step_dir(rel, step))
        reg.record(
            rel.id,
            "rollout_accuracy",
            actor,
            {"step": step, "summary": checked.summary(), **checked.model_dump(mode="json")},
        )
        return checked

    return answers


def kubernetes_answers(rel: Release, loaded: LoadedSpec) -> served_accuracy.Answers | None:
    """The same check on each Kubernetes rollout step, through the release's own Service (the API
    server's service proxy, the engine's own tokenizer); the controller records each as a
    `rollout_accuracy` event."""
    check = _rollout_check(rel, loaded)
    if check is None:
        return None
    gate, smaller = check

    def answers(step: int, endpoint: str | Endpoint, served_name: str) -> ServedAccuracy:
        return served_accuracy.check(endpoint, None, served_name, *gate, smaller, _step_dir(rel, step))

    return answers


def _local_rollout(
    reg: Registry, rel: Release, loaded: LoadedSpec, actor: str, review: step_review.Reviewer | None = None
) -> tuple[local_target.Deployment, str, list[StepAnalysis]]:
    """The release's serving copy, rolled out over the live local release (a promotion or a rollback)."""
    model_dir = serving_dir(loaded, rel.data)
    return local_target.deploy(
        loaded.spec,
        loaded.hardware,
        loaded.layout(rel.data["layout"]),
        model_dir,
        rel.id,
        answers=rollout_answers(reg, rel, loaded, model_dir, actor),
        review=review,
    )


def _deploy_local(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    previous: Release | None,
    actor: str,
    review: step_review.Reviewer | None = None,
) -> None:
    try:
        dep, text, steps = _local_rollout(reg, rel, loaded, actor, review)
    except ReleaseError as exc:
        if isinstance(exc, RolloutAborted):
            _record_steps(reg, rel.id, exc.steps, actor)
            detail = {"reason": str(exc), "steps": [s.model_dump() for s in exc.steps]}
            reg.record(rel.id, "rollout_aborted", actor, detail)
        now = local_target.current(rel.name)
        restored = (
            previous is not None and now is not None and now.release_id == previous.id and local_target.is_healthy(now)
        )
        status = "rolled_back" if restored else "failed"
        reg.record(
            rel.id,
            "deploy_failed",
            actor,
            {"error": str(exc)[:2000], "previous_serving": previous.id if restored and previous else None},
            status=status,
        )
        raise DeployFailed(
            f"release {rel.id}: local rollout failed; "
            + (f"release {previous.id} still serving" if restored and previous else "nothing serving")
            + f"\n{exc}"
        ) from None
    _record_steps(reg, rel.id, steps, actor)
    url = local_target.endpoint(loaded.spec)
    reg.record(rel.id, "smoke_test", actor, {"ok": True, "url": url, "prompt": local_target.SMOKE_PROMPT, "text": text})
    reg.record(
        rel.id,
        "deploy_finished",
        actor,
        {"endpoint": url, "ports": dep.ports, "load_seconds": dep.load_seconds},
        status="live",
        data={"endpoint": url, "deployment": dep.model_dump()},
    )


def _record_steps(reg: Registry, release_id: int, steps: list[StepAnalysis], actor: str) -> None:
    """One audit event per rollout step: its traffic share, verdict and every PromQL query's answer."""
    for step in steps:
        reg.record(release_id, "rollout_step", actor, step.model_dump())


def prometheus_judge(
    loaded: LoadedSpec, new_id: str, old_id: str | None, review: step_review.Reviewer | None = None
) -> k8s_deploy.Judge:
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


def server_steps(plan: rollout_plan.RolloutPlan) -> list[k8s_deploy.ServerStep]:
    return [
        k8s_deploy.ServerStep(fraction=s.fraction, old_servers=s.old_servers, new_servers=s.new_servers)
        for s in plan.steps
    ]


def feasible_plan(loaded: LoadedSpec, rel: Release, live: Release | None) -> rollout_plan.RolloutPlan:
    """The rollout's plan, refused before anything changes when the spare budget cannot hold it."""
    plan = rollout_plan.for_release(loaded, rel, live)
    if not plan.feasible:
        raise DeployFailed(
            f"release {rel.id}: the rollout cannot hold the fleet: "
            + "; ".join(f"step {s.step}: {s.problem}" for s in plan.steps if not s.ok)
        )
    return plan


def _kubernetes_rollout(
    loaded: LoadedSpec,
    rel: Release,
    live: Release | None,
    objs: list[dict],
    client: Any,
    plan: rollout_plan.RolloutPlan,
    review: step_review.Reviewer | None = None,
) -> k8s_deploy.DeployOutcome:
    """`objs` rolled out over the live release in the planned steps of servers, each judged live."""
    client = client or k8s_deploy.api_client(loaded.spec.promotion.kubernetes_conn_id)
    return k8s_deploy.KubernetesTarget(client).deploy(
        str(rel.id),
        objs,
        server_steps(plan),
        prometheus_judge(loaded, str(rel.id), str(live.id) if live else None, review),
        spare_servers=plan.spare_servers,
        answers=kubernetes_answers(rel, loaded),
        scale_down_delay_s=duration_seconds(loaded.spec.rollout.scale_down_delay),
    )


def _kubernetes_restore(
    loaded: LoadedSpec, rel: Release, live: Release | None, client: Any
) -> tuple[k8s_deploy.DeployOutcome, str]:
    """A rollback on Kubernetes: where the release's objects are still in the cluster (kept by the
    release that replaced it), they scale up beside the live one, are checked, and take the traffic
    back in waves of the spare budget, without analysis steps (that release passed them when it
    went live); where they were pruned, the release is rolled out again in steps. Returns the
    outcome and which path was taken."""
    client = client or k8s_deploy.api_client(loaded.spec.promotion.kubernetes_conn_id)
    objs = rel.data["manifests"]
    if k8s_deploy.kept_servers(client, objs) is None:
        return _kubernetes_rollout(loaded, rel, live, objs, client, feasible_plan(loaded, rel, live)), "re-rollout"
    outcome = k8s_deploy.KubernetesTarget(client).deploy(
        str(rel.id),
        objs,
        spare_servers=loaded.spec.rollout.spare_servers,
        answers=kubernetes_answers(rel, loaded),
    )
    return outcome, "kept objects"


def _deploy_kubernetes(
    reg: Registry,
    rel: Release,
    loaded: LoadedSpec,
    previous: Release | None,
    actor: str,
    client: Any,
    review: step_review.Reviewer | None = None,
) -> None:
    artifact = manifests.Artifact(
        s3_uri=rel.data.get("s3_uri"), nfs_path=rel.data.get("nfs_path"), manifest_hash=rel.data["manifest_hash"]
    )
    plan = feasible_plan(loaded, rel, previous)  # refused here, before anything is rendered or applied
    servers = plan.new_servers
    objs = manifests.render(loaded, rel.data["layout"], str(rel.id), artifact, manifests.RenderOptions(servers=servers))
    problems = manifests.validate(objs)
    if problems:
        reg.record(
            rel.id, "deploy_failed", actor, {"error": "manifests invalid", "problems": problems}, status="failed"
        )
        raise DeployFailed(f"release {rel.id}: rendered manifests fail schema validation:\n  " + "\n  ".join(problems))

    kept = home() / "releases" / str(rel.id) / "manifests.yaml"  # the exact objects applied, for humans and audits
    atomic_write(kept, manifests.to_yaml(objs))
    reg.record(
        rel.id,
        "manifests_rendered",
        actor,
        {"objects": [f"{o['kind']}/{o['metadata']['name']}" for o in objs], "file": str(kept), "servers": servers},
        data={"manifests": objs, "manifests_file": str(kept)},
    )
    outcome = _kubernetes_rollout(loaded, rel, previous, objs, client, plan, review)
    for kind, detail in outcome.events:
        reg.record(rel.id, kind, actor, detail)
    if outcome.status != "live":
        reg.record(rel.id, "deploy_failed", actor, {"error": outcome.error}, status=outcome.status)
        raise DeployFailed(
            f"release {rel.id}: rollout to namespace {loaded.spec.promotion.namespace} failed "
            f"({outcome.status}): {outcome.error}"
        )
    reg.record(
        rel.id,
        "deploy_finished",
        actor,
        {"namespace": loaded.spec.promotion.namespace},
        status="live",
        data={"endpoint": f"service/{objs_service(objs)}.{loaded.spec.promotion.namespace}"},
    )


def objs_service(objs: list[dict]) -> str:
    return next((o["metadata"]["name"] for o in objs if o["kind"] == "Service"), "?")


def verify(reg: Registry, release_id: int, actor: str = "pipeline", k8s_client: Any = None) -> dict[str, Any]:
    """After promotion: the live endpoint answers a completion now (not only at switch time)."""
    rel = reg.get(release_id)
    if rel.status != "live":
        raise ReleaseError(f"release {rel.id} is {rel.status}, not live; nothing to verify")
    loaded = release_spec(rel)
    if rel.target == "local":
        dep = local_target.current(rel.name)
        if dep is None or dep.release_id != rel.id or not local_target.is_healthy(dep):
            # evidence, not a verdict: a retry may pass, and a re-benchmark or a human decides the rest
            reg.record(rel.id, "verify_failed", actor, {"error": "local engines not running or not healthy"})
            raise ReleaseError(f"release {rel.id}: the local engines are not running or not healthy")
        text = local_target.smoke(local_target.endpoint(loaded.spec))
        url = local_target.endpoint(loaded.spec)
    else:
        client = k8s_client or k8s_deploy.api_client(loaded.spec.promotion.kubernetes_conn_id)
        service = objs_service(rel.data.get("manifests", []))
        text = k8s_deploy.smoke(
            client, loaded.spec.promotion.namespace, service, loaded.spec.serving.port, loaded.spec.name
        )
        url = rel.data.get("endpoint", "")
    reg.record(rel.id, "verified", actor, {"url": url, "text": text})
    return {"release_id": rel.id, "endpoint": url, "text": text}


def rollback(
    reg: Registry, name: str, target: str, actor: str, reason: str, to: int | None = None, k8s_client: Any = None
) -> Release:
    """Put an earlier release back: `to`, or the newest one that served before the live one.

    No new approval is needed (that release passed its gates when it went live); who rolled
    back and why is recorded on both releases.
    """
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
    detail: dict[str, Any]
    data: dict[str, Any]
    reg.record(
        rel.id, "rollback_started", actor, {"reason": reason, "from": live.id if live else None}, status="deploying"
    )
    try:
        if target == "local":
            dep, text, steps = _local_rollout(reg, rel, loaded, actor)
            _record_steps(reg, rel.id, steps, actor)
            detail = {"endpoint": local_target.endpoint(loaded.spec), "smoke_text": text}
            data = {"deployment": dep.model_dump()}
        else:
            outcome, path = _kubernetes_restore(loaded, rel, live, k8s_client)
            for kind, event in outcome.events:
                reg.record(rel.id, kind, actor, event)
            if outcome.status != "live":
                raise DeployFailed(f"rollback to release {rel.id} ({path}) failed: {outcome.error}")
            complete = dict(outcome.events).get("rollout_complete", {})
            detail = {
                "path": path,
                "all_traffic_after_s": complete.get("all_traffic_after_s"),
                "seconds": complete.get("seconds"),
                "events": [k for k, _ in outcome.events],
            }
            data = {}
    except BaseException as exc:
        reg.record(
            rel.id,
            "rollback_failed",
            actor,
            {"reason": reason, "error": f"{type(exc).__name__}: {exc}"[:2000]},
            status=before,
        )  # back to what it was: a failed rollback changes nothing on record
        raise
    reg.record(rel.id, "rollback_finished", actor, {"reason": reason, **detail}, status="live", data=data)
    if live and live.id != rel.id:
        reg.record(live.id, "rolled_back", actor, {"reason": reason, "restored": rel.id}, status="rolled_back")
    return reg.get(rel.id)
