"""Materialize the spec's model source as a local directory with a manifest hash.

The hash of the source's manifest is what content-addresses everything derived from it
(quantized artifacts, cached baseline evaluations).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from pipeline.core import artifacts
from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_json
from pipeline.core.paths import home, models_dir
from pipeline.core.specs import ReleaseSpec, local_source
from pipeline.records.sources import ModelSource
from pipeline.stages import tiny_model

log = logging.getLogger(__name__)

BUILTINS = {"tiny-qwen3-moe"}


def materialize(spec: ReleaseSpec, spec_dir: Path | None = None) -> ModelSource:
    uri = spec.model.source
    if uri.startswith("builtin://"):
        name = uri.removeprefix("builtin://")
        if name not in BUILTINS:
            raise ReleaseError(f"model.source: unknown builtin model {name!r} (known: {', '.join(sorted(BUILTINS))})")
        path = tiny_model.reference()
        manifest = artifacts.verify(path, deep=False)
    elif uri.startswith("hf://"):
        path = _from_hub(uri)
        manifest = _manifest_of(path)
    elif uri.startswith("s3://"):
        raise ReleaseError(
            f"model.source: {uri}: s3:// sources are fetched by the storage stage, which is not built yet"
        )
    else:
        path = local_source(uri, spec_dir or Path.cwd()) or Path(uri)
        if not (path / "config.json").is_file():
            raise ReleaseError(f"model.source: {path}: not a model directory (no config.json)")
        manifest = artifacts.verify(path) if artifacts.is_complete(path) else _manifest_of(path)
    log.info("model source %s at %s: %d files, %.1f MB", uri, path, len(manifest.files), manifest.total_bytes / 1e6)
    return ModelSource(
        uri=uri,
        path=str(path),
        manifest_hash=manifest.content_hash(),
        total_bytes=manifest.total_bytes,
        files=len(manifest.files),
    )


def _from_hub(uri: str) -> Path:
    """Download a hub snapshot (production workers only; the embedded default has no hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = uri.removeprefix("hf://").partition("@")
    target = models_dir() / repo.replace("/", "--")
    try:
        return Path(snapshot_download(repo, revision=revision or None, local_dir=target))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ReleaseError(f"model.source: {uri}: cannot download from the hub: {str(exc).splitlines()[0]}") from None


def _manifest_of(path: Path) -> artifacts.Manifest:
    """Scan a directory we do not own; cache the result by (path, sizes, mtimes) so re-runs are cheap."""
    stat_key = json.dumps(
        [
            (p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))
            if p.is_file()
        ]
    )
    key = hashlib.sha256(f"{path.resolve()}\n{stat_key}".encode()).hexdigest()[:16]
    cache = home() / "manifests" / f"{key}.json"
    if cache.exists():
        return artifacts.Manifest.model_validate_json(cache.read_text())
    cache.parent.mkdir(parents=True, exist_ok=True)
    manifest = artifacts.Manifest(kind="model", files=artifacts.scan(path))
    atomic_json(cache, manifest.model_dump())
    return manifest
