"""The evidence a promotion stands on, read back from the registry: the spec as it was when the
release was opened, the accuracy gate's recorded results, the last event of a kind, and every
reason a release may not be promoted (the gates `promote.promote` enforces).
"""

from __future__ import annotations

import logging

from pipeline.core import storage
from pipeline.core.errors import ReleaseError
from pipeline.core.specs import LoadedSpec, load_recorded
from pipeline.records.evaluate import EvalResult
from pipeline.records.events import GateVerdict
from pipeline.release.registry import Event, Registry, Release

log = logging.getLogger(__name__)


def release_spec(rel: Release) -> LoadedSpec:
    """The spec as it was when the release was opened: its recorded text, hardware profile and
    resolved model source (registry `inputs`), never the files as they read now: a spec or profile
    edited after the run must not change what gets deployed, rolled back to or re-measured."""
    kept = rel.inputs
    if kept is None:  # opened before releases kept their inputs: the profile on disk now
        log.warning("release %d: no recorded hardware profile; reading %s's from disk", rel.id, rel.spec_path)
    return load_recorded(
        rel.spec_path,
        rel.spec_yaml,
        kept.hardware_path if kept else None,
        kept.hardware_yaml if kept else None,
        kept.model_source if kept else None,
    )


def gate_results(rel: Release) -> tuple[EvalResult, EvalResult] | None:
    """The in-process (baseline, candidate) results the accuracy gate recorded for this release."""
    recorded = rel.data.evaluation
    if recorded is None:
        return None  # released before the registry kept them: the served answers are not checked
    return recorded.pair()


def last_event(reg: Registry, release_id: int, *kinds: str) -> Event | None:
    events = [e for e in reg.events(release_id) if e.kind in kinds]
    return events[-1] if events else None


def gate_problems(reg: Registry, rel: Release, loaded: LoadedSpec) -> list[str]:
    """Every reason this release may not be promoted; empty when it may."""
    problems = []
    acc = last_event(reg, rel.id, "accuracy_gate")
    if acc is None or not (isinstance(acc.detail, GateVerdict) and acc.detail.passed):  # unread: not passed
        problems.append("accuracy gate: " + ("not run" if acc is None else "failed"))
    slo = last_event(reg, rel.id, "slo_gate")
    if slo is None or not (isinstance(slo.detail, GateVerdict) and slo.detail.passed):
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
    if not data.manifest_hash:
        problems.append("artifact: no staged artifact recorded")
    else:
        try:
            storage.verify_staged(data.manifest_hash, data.s3_uri, data.nfs_path, loaded.spec.staging.s3)
        except ReleaseError as exc:
            problems.append(f"artifact: {exc}")
    if rel.status not in ("approved", "candidate", "failed", "rolled_back"):
        problems.append(f"status: release is {rel.status}, not a candidate awaiting promotion")
    return problems
