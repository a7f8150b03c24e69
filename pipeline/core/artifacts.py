"""Artifacts on disk: a directory of files plus `manifest.json`, written last.

The manifest is the commit marker: a directory without one is not an artifact, whatever
else it holds. Directories are built under a temporary name next to their final place and
renamed into place in one step, so a killed run never leaves something a later step could
take for whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core.errors import ArtifactError
from pipeline.core.files import atomic_write
from pipeline.core.paths import home

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CHUNK = 8 * 1024 * 1024
# A file whose ctime is this close to the moment it was hashed may still change within the same
# timestamp tick and keep its stat: its sha256 is not recorded (git's "racy clean" rule)
RACY_NS = 100_000_000


class FileEntry(BaseModel):
    path: str = Field(description="relative to the artifact root, POSIX separators")
    size: int
    sha256: str


class Manifest(BaseModel):
    kind: str = Field(description="what the artifact is: model, fp8-model, ...")
    files: list[FileEntry]
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    meta: dict[str, Any] = Field(default_factory=dict, description="recipe, versions, timings, checks")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def content_hash(self) -> str:
        """Hash of the file list only (paths, sizes, digests): equal content, equal hash."""
        listing = "\n".join(f"{f.path} {f.size} {f.sha256}" for f in sorted(self.files, key=lambda f: f.path))
        return hashlib.sha256(listing.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stat_key(path: Path) -> str:
    """Changes whenever the file's bytes may have: a write or a utime moves ctime, a replace the inode."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _sha256_record(key: str) -> Path:
    dev, ino = key.split(":")[:2]
    return home() / "cache" / "file-sha256" / f"{dev}-{ino}.json"


def hash_and_record(path: Path) -> str:
    """The file's sha256, read from disk, recorded under its stat key when the stat did not move
    while it was read (and is not racy), so a later step (the stage) need not read it again."""
    now = time.time_ns()
    key = stat_key(path)
    digest = sha256_file(path)
    ctime_ns = int(key.rsplit(":", 1)[1])
    if stat_key(path) == key and ctime_ns < now - RACY_NS:
        try:
            atomic_write(_sha256_record(key), json.dumps({"stat": key, "sha256": digest}))
        except OSError as exc:  # a cache: staging then hashes the file itself
            log.debug("%s: sha256 not recorded: %s", path, exc)
    return digest


def recorded_sha256(key: str) -> str | None:
    """The sha256 `hash_and_record` read for the file whose stat key is `key`, if it recorded one:
    the same device, inode, size, mtime and ctime mean no write since."""
    try:
        record = json.loads(_sha256_record(key).read_text())
    except (OSError, ValueError):
        return None
    return record.get("sha256") if record.get("stat") == key else None


def file_matches(path: Path, entry: FileEntry) -> bool:
    """True when `path` holds exactly the bytes the manifest entry describes (size first: cheap)."""
    return path.is_file() and path.stat().st_size == entry.size and sha256_file(path) == entry.sha256


def scan(root: Path) -> list[FileEntry]:
    """Every regular file under root except the manifest, with size and sha256, in path order
    (each sha256 recorded by stat, so staging the artifact next reads each file once, not twice)."""
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        entries.append(
            FileEntry(path=path.relative_to(root).as_posix(), size=path.stat().st_size, sha256=hash_and_record(path))
        )
    return entries


def write_manifest(
    root: Path, kind: str, meta: dict[str, Any] | None = None, files: list[FileEntry] | None = None
) -> Manifest:
    """Write the manifest atomically (temp file + rename), last; `files` saves a second scan."""
    manifest = Manifest(kind=kind, files=files if files is not None else scan(root), meta=meta or {})
    atomic_write(root / MANIFEST, manifest.model_dump_json(indent=2))
    return manifest


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{root}: no {MANIFEST}; not a finished artifact")
    try:
        return Manifest.model_validate_json(path.read_text())
    except ValueError as exc:
        raise ArtifactError(f"{path}: unreadable manifest: {str(exc).splitlines()[0]}") from None


def verify(root: Path, *, deep: bool = True) -> Manifest:
    """Check every listed file exists with its size (and, if deep, its sha256); name the first bad file."""
    manifest = read_manifest(root)
    for entry in manifest.files:
        path = root / entry.path
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (listed in {root / MANIFEST})")
        size = path.stat().st_size
        if size != entry.size:
            raise ArtifactError(f"{path}: size {size} bytes, manifest says {entry.size}")
        if deep and sha256_file(path) != entry.sha256:
            raise ArtifactError(f"{path}: sha256 does not match the manifest (corrupted or changed)")
    return manifest


def is_complete(root: Path) -> bool:
    return (root / MANIFEST).is_file()


@contextlib.contextmanager
def publishing(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `final`; on success rename it to `final`.

    On any exception the temporary directory is removed and nothing appears at `final`. If
    `final` already exists (another run won the race) the new copy is discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if not is_complete(tmp):
            raise ArtifactError(f"{tmp}: finished without a {MANIFEST}; refusing to publish")
        try:
            os.rename(tmp, final)
        except OSError:
            if is_complete(final):
                log.info("%s was published concurrently; keeping that copy", final)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temps(parent: Path, max_age_s: float = 6 * 3600) -> None:
    """Delete `.tmp-*` directories left by killed runs (older than max_age_s)."""
    if not parent.exists():
        return
    now = time.time()
    for path in parent.glob(".tmp-*"):
        if path.is_dir() and now - path.stat().st_mtime > max_age_s:
            shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
