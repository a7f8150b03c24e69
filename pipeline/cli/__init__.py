"""`model-release`: one command, a sub-command per stage, each a thin call into `pipeline`.

One module per command group registers its sub-commands, their options and handlers (`register`);
`parser()` assembles them in the order the help lists them. Errors a user can fix print one line
per problem and exit 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.cli import artifacts, cluster, common, manifests, measure, model, planning, releases, validate
from pipeline.core.errors import ReleaseError

__all__ = ["main", "parser"]

GROUPS = (validate, model, measure, artifacts, manifests, cluster, planning, releases)  # the help's order


def parser() -> argparse.ArgumentParser:
    """The `model-release` parser: each group's sub-commands, in `GROUPS` order."""
    top = argparse.ArgumentParser(
        prog="model-release",
        description="Take a MoE LLM from a BF16 checkpoint to SLO-verified vLLM serving, one stage at a time.",
    )
    top.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    with common.results_apart():
        try:
            return args.func(args)
        except ReleaseError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
