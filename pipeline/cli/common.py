"""What every command group shares: where results are printed, the argument types that refuse a
value before anything starts, and the checks of a directory or artifact a command is given."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel

from pipeline.core.errors import ReleaseError
from pipeline.records import edge

# Results go to the real stdout; while a command runs, sys.stdout points at stderr, because the
# libraries we drive (llmcompressor's loguru sink, tqdm, lm-eval) print progress to stdout.
_results = sys.stdout


def emit(text: str) -> None:
    print(text, file=_results, flush=True)


def emit_record(record: BaseModel) -> None:
    """A command's result record as its JSON (`records.edge`): what a step pod's XCom holds."""
    emit(json.dumps(edge.to_json(record), indent=2))


@contextmanager
def results_apart() -> Iterator[None]:
    """While a command runs: `emit` to the real stdout, everything else printed to stdout to stderr."""
    global _results
    _results = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = _results


# Argument types: a value no command can use is refused by argparse itself, one line naming the
# option (exit 2), before anything loads or starts.


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def need_dir(path: str | None, option: str) -> None:
    """A model or artifact directory a command reads, checked before anything loads or starts: a
    typo is one line, not a model loader's traceback from deep inside an engine start. (Not an
    argparse type: the pod commands' arguments are parsed where their paths do not exist.)"""
    if path is not None and not Path(path).is_dir():
        raise ReleaseError(f"{option} {path}: no such directory")


def hash_of(path: str) -> str:
    """A given artifact directory's content hash, verified against its manifest."""
    from pipeline.core import artifacts

    return artifacts.verify(Path(path)).content_hash()
