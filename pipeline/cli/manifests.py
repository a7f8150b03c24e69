"""`manifests`: the Kubernetes objects a promotion applies, rendered and schema-validated."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import emit, positive_float
from pipeline.core.errors import ReleaseError


def _manifests(args: argparse.Namespace) -> int:
    from pipeline.core.specs import load_spec
    from pipeline.k8s import manifests

    loaded = load_spec(args.spec)
    if not (args.layout or args.monitoring):
        raise ReleaseError("manifests: give --layout NAME (or --monitoring)")
    if args.monitoring:  # once per model, beside the releases' objects
        from pipeline.k8s import monitoring

        problems = monitoring.validate_pod_monitor(monitoring.pod_monitor(loaded))
        if problems:
            raise ReleaseError("rendered PodMonitor fails the operator's CRD schema:\n" + "\n".join(problems))
        emit(monitoring.to_yaml(loaded))
        return 0
    staging = loaded.spec.staging
    s3_uri, nfs_path, preview = args.s3_uri, args.nfs_path, ""
    if not (s3_uri or nfs_path):
        # a preview from the spec's own staging targets: where a staged artifact would be
        from pipeline.core import s3

        name = "ARTIFACT"
        nfs_path = str(Path(staging.nfs.path) / name) if staging.nfs else None
        s3_uri = s3.s3_uri(staging.s3, name) if staging.s3 else None
        preview = (
            f"# preview from {loaded.path.name}'s staging targets: artifact name {name!r} and manifest hash "
            f"{args.manifest_hash[:12]}… are placeholders; a promotion renders the staged artifact's "
            "(or pass --nfs-path / --s3-uri / --manifest-hash)\n"
        )
    artifact = manifests.Artifact(s3_uri=s3_uri, nfs_path=nfs_path, manifest_hash=args.manifest_hash)
    objs = manifests.render(
        loaded,
        args.layout,
        args.release_id,
        artifact,
        manifests.RenderOptions(autoscale_rate=args.autoscale_rate, load_seconds=args.load_seconds),
    )
    problems = manifests.validate(objs)
    if problems:
        raise ReleaseError("rendered manifests fail schema validation:\n" + "\n".join(problems))
    emit(preview + manifests.to_yaml(objs))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "manifests",
        help="render (and schema-validate) the Kubernetes objects a promotion applies "
        "for a layout: Deployments per replica group, Service, PDB, weights volume",
    )
    p.add_argument("spec")
    p.add_argument("--layout", help="the layout to render (required unless --monitoring)")
    p.add_argument(
        "--monitoring",
        action="store_true",
        help="instead: the PodMonitor (and the equivalent plain scrape config) through which the cluster's "
        "Prometheus labels each engine's series with its release, as the rollout analysis selects them",
    )
    p.add_argument("--release-id", default="preview")
    p.add_argument("--manifest-hash", default="0" * 64)
    p.add_argument("--s3-uri")
    p.add_argument("--nfs-path")
    p.add_argument(
        "--autoscale-rate",
        type=positive_float,
        help="the release's max SLO req/s per server: also its KEDA ScaledObjects (spec capacity.autoscale), paused",
    )
    p.add_argument(
        "--load-seconds",
        type=positive_float,
        help="the release's measured weights load time (slowest replica): sets the startup probe and the "
        "progress deadline from it instead of from the checkpoint's size",
    )
    p.set_defaults(func=_manifests)
