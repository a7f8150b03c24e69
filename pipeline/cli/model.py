"""The model's own commands: build the tiny model and score it, materialize the spec's source, quantize it."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from pipeline.cli.common import emit, need_dir, positive_int


def _make_tiny_model(args: argparse.Namespace) -> int:
    from pipeline.core import artifacts
    from pipeline.stages import tiny_model

    # a build stopped with SIGTERM exits through Python, so its half-trained temporary directory is
    # removed rather than left beside the cache
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # only what is asked for overrides TinyConfig: its defaults are the model the suite and the demo use
    given = {"seed": args.seed, "steps": args.steps}
    cfg = tiny_model.TinyConfig(**{k: v for k, v in given.items() if v is not None})
    path = tiny_model.build(Path(args.out) if args.out else None, cfg)
    meta = artifacts.read_manifest(path).meta
    emit(json.dumps({"path": str(path), "accuracy": meta.get("accuracy"), "train_seconds": meta.get("train_seconds")}))
    return 0


def _tiny_accuracy(args: argparse.Namespace) -> int:
    from pipeline.stages import tiny_model

    need_dir(args.model, "--model")
    path = Path(args.model) if args.model else tiny_model.reference()
    for task in args.task:
        acc = tiny_model.greedy_accuracy(path, task, limit=args.limit)
        emit(f"{task}: exact-match accuracy {acc:.3f} on held-out items (chance is below 0.01)")
    return 0


def _materialize(args: argparse.Namespace) -> int:
    from pipeline.core.specs import load_spec
    from pipeline.stages import sources

    loaded = load_spec(args.spec)
    emit(sources.materialize(loaded.spec, loaded.path.parent).model_dump_json(indent=2))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from pipeline.core.specs import load_spec
    from pipeline.stages import quantize, sources

    loaded = load_spec(args.spec)
    source = sources.materialize(loaded.spec, loaded.path.parent)
    emit(quantize.quantize(loaded.spec, source, args.method).model_dump_json(indent=2))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "make-tiny-model", help="build (or reuse) the tiny Qwen3-MoE trained on CPU; prints path and accuracy"
    )
    p.add_argument("--out", help="directory to create (default: cached under MODEL_RELEASE_HOME/models)")
    p.add_argument("--seed", type=int, help="training seed (default: the cached model's)")
    p.add_argument("--steps", type=positive_int, help="training steps (default: the cached model's)")
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("tiny-accuracy", help="greedy exact-match accuracy of the tiny model on its held-out tasks")
    p.add_argument("--model", help="model directory (default: the shipped tiny model)")
    p.add_argument("--task", nargs="+", default=["tiny_add", "tiny_copy"])
    p.add_argument("--limit", type=positive_int)
    p.set_defaults(func=_tiny_accuracy)

    p = sub.add_parser("materialize", help="resolve the spec's model source to a local directory and its manifest hash")
    p.add_argument("spec")
    p.set_defaults(func=_materialize)

    p = sub.add_parser(
        "quantize",
        help="FP8-quantize the spec's model with llmcompressor (or the streaming converter), "
        "verify and publish it content-addressed; a re-run with the same inputs is a no-op",
    )
    p.add_argument("spec")
    p.add_argument(
        "--method", choices=["oneshot", "model_free", "streaming"], help="override quantization.method from the spec"
    )
    p.set_defaults(func=_quantize)
