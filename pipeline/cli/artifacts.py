"""Moving an artifact: stage it to S3/NFS, fetch and verify it (a serving pod's init container)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import emit, emit_record, need_dir


def _stage(args: argparse.Namespace) -> int:
    from pipeline.entry import flow

    spec_path = str(Path(args.spec).resolve())
    need_dir(args.artifact, "--artifact")
    if args.artifact:
        staged = flow.stage_artifact(spec_path, str(Path(args.artifact).resolve()))
    else:
        staged = flow.stage(flow.validate_spec(spec_path))
    emit_record(staged)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from pipeline.core import storage

    emit(storage.fetch(args.uri, Path(args.dest)).model_dump_json(indent=2))
    return 0


def _verify_staged(args: argparse.Namespace) -> int:
    from pipeline.core import storage

    manifest = storage.verify_staged(args.manifest_hash, s3_uri=args.uri)
    emit(f"{args.uri}: {len(manifest.files)} objects match the manifest {args.manifest_hash[:12]}…")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "stage",
        help="upload the FP8 artifact to the spec's S3/Spaces prefix and/or NFS path; "
        "manifest last, resumable, verified; unchanged artifacts are not re-sent",
    )
    p.add_argument("spec")
    p.add_argument(
        "--artifact", help="artifact directory (default: quantize the spec's model, reusing a finished output)"
    )
    p.set_defaults(func=_stage)

    p = sub.add_parser(
        "fetch",
        help="download an artifact (s3://bucket/prefix or an NFS path) and verify every file "
        "against its manifest; what a serving pod's init container runs",
    )
    p.add_argument("uri")
    p.add_argument("dest")
    p.set_defaults(func=_fetch)

    p = sub.add_parser(
        "verify-staged",
        help="check, without downloading, that a staged S3 artifact is whole and the expected one: its manifest "
        "hash and every object's size and sha256 record; what a streaming serving pod's init container runs",
    )
    p.add_argument("uri", help="s3://bucket/prefix of the staged artifact")
    p.add_argument("--manifest-hash", required=True, help="the release's manifest hash")
    p.set_defaults(func=_verify_staged)
