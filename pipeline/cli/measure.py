"""What measures a model: the accuracy gate's evaluation and one layout's benchmark or re-benchmark
(each also what a step pod runs, its result to --results)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import emit, emit_record, hash_of, need_dir, positive_float
from pipeline.core.errors import ReleaseError
from pipeline.records.release import ModelRef, StagedRef


def _evaluate(args: argparse.Namespace) -> int:
    from pipeline.entry import flow

    spec_path = str(Path(args.spec).resolve())
    need_dir(args.candidate, "--candidate")
    if args.side:  # one side only, result to storage: what an evaluation pod runs (execution: kubernetes)
        from pipeline.entry import pod_steps

        if not args.results:
            raise ReleaseError("evaluate --side needs --results URI (where the pod writes its result)")
        if args.side == "candidate" and not args.candidate:
            raise ReleaseError("evaluate --side candidate needs --candidate DIR")
        emit_record(pod_steps.evaluate_side(spec_path, args.side, args.results, args.run_id, args.candidate))
        return 0
    # a given candidate is verified before the source is materialized (a tiny-model build takes minutes)
    given = ModelRef(path=args.candidate, manifest_hash=hash_of(args.candidate)) if args.candidate else None
    release = flow.validate_spec(spec_path)
    source = flow.materialize_model(release)
    candidate = given or ModelRef.model_validate(flow.quantize(release, source).model_dump())
    baseline = flow.evaluate(release, ModelRef.model_validate(source.model_dump()), baseline=True)
    result = flow.evaluate(release, candidate, baseline=False)
    decision = flow.accuracy_gate(release, baseline, result, args.run_id)
    emit(f"accuracy gate passed; GX validation report: {decision.validation_html}")
    return 0


def _benchmark(args: argparse.Namespace) -> int:
    """One layout's SLO search; exit 0 even when the layout failed (its result says so)."""
    from pipeline.entry import pod_steps

    need_dir(args.model, "--model")
    emit_record(
        pod_steps.benchmark_layout(
            str(Path(args.spec).resolve()), args.layout, args.model, args.results, args.run_id, args.predictions
        )
    )
    return 0


def _remeasure(args: argparse.Namespace) -> int:
    """A live release's re-benchmark on this node; exit 0 when it could not measure (the stored
    result says why, and the judge task alerts with it)."""
    from pipeline.core.specs import load_spec
    from pipeline.entry import pod_steps

    # the arguments themselves are checked first: a layout or a source that is not there is the
    # caller's mistake (exit 1), not a measurement that could not be made
    load_spec(args.spec).layout(args.layout)
    if not (args.s3_uri or args.nfs_path):
        raise ReleaseError("remeasure: give --s3-uri or --nfs-path (where the release's artifact is staged)")
    staged = StagedRef(s3_uri=args.s3_uri, nfs_path=args.nfs_path, manifest_hash=args.manifest_hash)
    emit_record(
        pod_steps.remeasure(
            str(Path(args.spec).resolve()),
            args.release,
            args.layout,
            staged,
            args.promoted_rate,
            args.results,
            args.run_id,
            args.evaluation,
        )
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "evaluate",
        help="lm-eval on the baseline and the FP8 candidate with the spec's tasks, then the "
        "accuracy gate (great-expectations); exit 1 with the per-task table when it fails",
    )
    p.add_argument("spec")
    p.add_argument(
        "--candidate", help="candidate model directory with a manifest (default: the spec's quantized model)"
    )
    p.add_argument("--run-id", default="cli", help="results go to MODEL_RELEASE_HOME/runs/RUN_ID/")
    p.add_argument(
        "--side",
        choices=["baseline", "candidate"],
        help="evaluate one side only (no gate) and write its result to --results (what an evaluation pod runs)",
    )
    p.add_argument("--results", help="s3://bucket/prefix or a directory for --side results")
    p.set_defaults(func=_evaluate)

    p = sub.add_parser(
        "benchmark",
        help="serve a model with one layout and find its highest rate within the p90 SLO; "
        "the result goes to --results (what a benchmark pod runs)",
    )
    p.add_argument("spec")
    p.add_argument("--layout", required=True)
    p.add_argument("--model", required=True, help="model directory the engine loads")
    p.add_argument("--run-id", required=True)
    p.add_argument("--results", required=True, help="s3://bucket/prefix or a directory")
    p.add_argument(
        "--predictions", help="the planner's predictions (s3:// or a path): the search starts from this layout's"
    )
    p.set_defaults(func=_benchmark)

    p = sub.add_parser(
        "remeasure",
        help="re-benchmark a live release's layout and staged artifact on a fresh "
        "engine (short search + its promoted rate); the result goes to --results (the re-benchmark pod)",
    )
    p.add_argument("spec")
    p.add_argument("--release", type=int, required=True, help="registry id of the release")
    p.add_argument("--layout", required=True)
    p.add_argument("--s3-uri", help="s3:// URI the release was staged to")
    p.add_argument("--nfs-path", help="NFS path the release was staged to")
    p.add_argument("--manifest-hash", required=True)
    p.add_argument("--promoted-rate", type=positive_float, required=True, help="req/s the release was promoted at")
    p.add_argument("--run-id", required=True)
    p.add_argument("--results", required=True, help="s3://bucket/prefix or a directory")
    p.add_argument(
        "--evaluation", help="the accuracy gate's results it was released on (s3:// or a path): answers held to them"
    )
    p.set_defaults(func=_remeasure)
