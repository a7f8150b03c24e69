"""Atomic file writes: a reader (a reviewer's browser, nginx reloading, the next task) sees
the old file or the whole new one, never half of it, and two writers never share a temp file."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write to a unique temporary name in the target directory, fsync, rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other users (a pod, nginx's workers)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_json(path: Path, data: Any) -> Path:
    """JSON, indented and key-sorted (diffable), through `atomic_write`."""
    return atomic_write(path, json.dumps(data, indent=2, sort_keys=True, default=str))
