"""`validate`: a spec's types, then its feasibility; one line per problem."""

from __future__ import annotations

import argparse
import sys

from pipeline.cli.common import emit
from pipeline.core.errors import SpecError


def _validate(args: argparse.Namespace) -> int:
    from pipeline.core.specs import load_spec

    failed = False
    for path in args.spec:
        try:
            loaded = load_spec(path)
        except SpecError as exc:
            failed = True
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            continue
        spec = loaded.spec
        emit(
            f"{path}: ok: {spec.model.name} {spec.quantization.scheme}, {len(spec.layouts)} layouts"
            f" ({', '.join(layout.name for layout in spec.layouts)}) on {loaded.hardware.name}"
        )
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "validate", help="check release specs: types, then feasibility (fits the node, weights fit memory)"
    )
    p.add_argument("spec", nargs="+", help="release spec YAML (configs/releases/*.yaml)")
    p.set_defaults(func=_validate)
