"""Stage a published artifact to network storage (S3 / DigitalOcean Spaces, NFS) and fetch it back.

Both backends keep one rule: `manifest.json` goes last and is the commit marker. A prefix or
directory without it is not a release artifact, so a serving pod never reads half an upload.

This module is the door (stage, fetch, verify_staged) and the NFS and fetch sides; the S3 upload
(read once, Content-MD5 and ETag checks, resumed multipart uploads, the digest cache) is
`s3_upload.py`, the client and its errors `s3.py`, the sizes and thread counts `transfer.py`.

Memory: a stage holds at most (WORKERS + READERS) parts of PART_SIZE, a fetch (WORKERS + 1)
ranges of FETCH_PART (144 MiB and 288 MiB with the defaults). A fetch downloads ranges in
parallel and writes and hashes them in order, so no file is read back from disk to verify it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core import artifacts
from pipeline.core.errors import ArtifactError, ReleaseError
from pipeline.core.files import atomic_json
from pipeline.core.s3 import _check_object, _remote_manifest, fetch_manifest_or_none, parse_s3_uri, s3_client, s3_errors
from pipeline.core.s3_upload import stage_s3
from pipeline.core.specs import NfsTarget, S3Target, StagingSpec
from pipeline.core.transfer import FETCH_PART, WORKERS, Progress

log = logging.getLogger(__name__)


class StagedArtifact(BaseModel):
    manifest_hash: str
    s3_uri: str | None = None
    nfs_path: str | None = None
    total_bytes: int
    bytes_sent: int = Field(0, description="bytes actually transferred this run (0 when already staged)")
    files_sent: int = 0
    files_skipped: int = 0
    seconds: float = 0.0


class FetchResult(BaseModel):
    path: str
    manifest_hash: str
    bytes_fetched: int
    files_fetched: int
    files_skipped: int
    seconds: float


# ---------------------------------------------------------------- stage


def stage(artifact: Path, staging: StagingSpec, name: str | None = None) -> StagedArtifact:
    """Stage a verified artifact to every configured target; the manifest goes last on each."""
    manifest = artifacts.verify(artifact, deep=False)
    name = name or artifact.name
    result = StagedArtifact(manifest_hash=manifest.content_hash(), total_bytes=manifest.total_bytes)
    started = time.monotonic()
    if staging.s3 is not None:
        # stage_s3 checks every local file's sha256 in the pass that reads it for the upload (or from
        # the digest cache) and commits no manifest unless all match
        uri, sent, files_sent, skipped = stage_s3(artifact, manifest, staging.s3, name)
        result.s3_uri, result.bytes_sent, result.files_sent, result.files_skipped = uri, sent, files_sent, skipped
    if staging.nfs is not None:
        if staging.s3 is None:
            artifacts.verify(artifact)
        path, sent, files_sent, skipped = stage_nfs(artifact, manifest, staging.nfs, name)
        result.nfs_path = path
        result.bytes_sent += sent
        result.files_sent += files_sent
        result.files_skipped += skipped
    result.seconds = round(time.monotonic() - started, 2)
    return result


# ---------------------------------------------------------------- NFS


def stage_nfs(artifact: Path, manifest: artifacts.Manifest, target: NfsTarget, name: str) -> tuple[str, int, int, int]:
    """Copy into `<path>/.partial-<name>` (kept across runs, so a re-run resumes), fsync, manifest last, rename."""
    root = Path(target.path)
    if not root.is_dir():
        raise ReleaseError(f"staging.nfs.path: {root} is not a mounted directory")
    final = root / name
    if artifacts.is_complete(final):
        if artifacts.read_manifest(final).content_hash() == manifest.content_hash():
            artifacts.verify(final, deep=False)
            log.info("stage: %s already holds this artifact; nothing to copy", final)
            return str(final), 0, 0, len(manifest.files)
        raise ArtifactError(f"{final}: holds a different artifact under the same name")
    partial = root / f".partial-{name}"

    def copy(entry: artifacts.FileEntry, tmp: Path) -> None:
        shutil.copyfile(artifact / entry.path, tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())

    partial.mkdir(parents=True, exist_ok=True)
    sent, files, skipped = _place_files(manifest, partial, copy, Progress(f"stage {final}", manifest.total_bytes))
    shutil.copyfile(artifact / artifacts.MANIFEST, partial / artifacts.MANIFEST)
    artifacts.verify(partial)
    os.rename(partial, final)
    _fsync_dir(root)
    return str(final), sent, files, skipped


def _place_files(manifest: artifacts.Manifest, root: Path, transfer, progress: Progress) -> tuple[int, int, int]:
    """Put every file of `manifest` under `root`, in parallel: a file already there and matching
    is skipped (a re-run resumes); any other lands under a temporary name, which `transfer(entry,
    tmp)` fills (and may check), and is renamed into place only then. Returns (bytes, files, skipped)."""
    counts = {"bytes": 0, "files": 0, "skipped": 0}
    lock = threading.Lock()

    def one(entry: artifacts.FileEntry) -> None:
        dst = root / entry.path
        if artifacts.file_matches(dst, entry):
            with lock:
                counts["skipped"] += 1
            progress.add(entry.size)
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            transfer(entry, tmp)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        with lock:
            counts["bytes"] += entry.size
            counts["files"] += 1
        progress.add(entry.size)

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(one, manifest.files))
    return counts["bytes"], counts["files"], counts["skipped"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- fetch


def fetch(uri: str, dest: Path, target: S3Target | None = None) -> FetchResult:
    """What a serving pod's init container runs: download, verify every file, refuse on mismatch.

    Files already present and matching the manifest are skipped; each download lands under a
    temporary name and is renamed only after its sha256 matched; the manifest is written last.
    """
    started = time.monotonic()
    dest.mkdir(parents=True, exist_ok=True)
    if uri.startswith("s3://"):
        bucket, prefix = parse_s3_uri(uri)
        target = target or S3Target(bucket=bucket)
        client = s3_client(target)
        with s3_errors(uri):
            body = _remote_manifest(client, bucket, f"{prefix.rstrip('/')}/{artifacts.MANIFEST}")
        if body is None:
            raise ArtifactError(f"{uri}: no {artifacts.MANIFEST}; not a (finished) release artifact")
        manifest = body
        (dest / artifacts.MANIFEST).unlink(missing_ok=True)  # incomplete until every file is verified
        progress = Progress(f"fetch {uri}", manifest.total_bytes)
        fetched, files, skipped = _fetch_s3(
            client, bucket, prefix.rstrip("/"), uri.rstrip("/"), manifest, dest, progress
        )
    else:
        src = Path(uri.removeprefix("file://"))
        manifest = artifacts.read_manifest(src)

        def checked(entry: artifacts.FileEntry, tmp: Path) -> None:
            shutil.copyfile(src / entry.path, tmp)
            _check_fetched(uri, entry, tmp.stat().st_size, artifacts.sha256_file(tmp))

        (dest / artifacts.MANIFEST).unlink(missing_ok=True)
        fetched, files, skipped = _place_files(manifest, dest, checked, Progress(f"fetch {uri}", manifest.total_bytes))
    atomic_json(dest / artifacts.MANIFEST, json.loads(manifest.model_dump_json()))
    return FetchResult(
        path=str(dest),
        manifest_hash=manifest.content_hash(),
        bytes_fetched=fetched,
        files_fetched=files,
        files_skipped=skipped,
        seconds=round(time.monotonic() - started, 2),
    )


def _check_fetched(uri: str, entry: artifacts.FileEntry, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise ArtifactError(
            f"{uri}/{entry.path}: downloaded bytes do not match the manifest "
            f"(sha256 {digest[:12]}…, expected {entry.sha256[:12]}…); refusing it"
        )


@dataclass
class _Landing:
    """One file being fetched: its temporary name, open handle and running sha256."""

    entry: artifacts.FileEntry
    dst: Path
    tmp: Path
    handle: Any
    sha: Any = field(default_factory=hashlib.sha256)
    size: int = 0


def _fetch_s3(
    client, bucket: str, prefix: str, uri: str, manifest: artifacts.Manifest, dest: Path, progress: Progress
) -> tuple[int, int, int]:
    """Download every file not already present: WORKERS ranged GETs in flight, consumed in order, so
    each range is written once and hashed as it is written (no file is read back to verify it).
    Memory: at most WORKERS + 1 ranges of FETCH_PART. Returns (bytes, files, skipped)."""
    todo = []
    for entry in manifest.files:
        if artifacts.file_matches(dest / entry.path, entry):
            progress.add(entry.size)
        else:
            todo.append(entry)
    ranges = iter([(entry, offset) for entry in todo for offset in range(0, max(entry.size, 1), FETCH_PART)])

    def get(entry: artifacts.FileEntry, offset: int) -> bytes:
        extra = {"Range": f"bytes={offset}-{offset + FETCH_PART - 1}"} if entry.size > FETCH_PART else {}
        with s3_errors(f"{uri}/{entry.path}"):
            return client.get_object(Bucket=bucket, Key=f"{prefix}/{entry.path}", **extra)["Body"].read()

    landing: _Landing | None = None
    fetched = 0
    pool = ThreadPoolExecutor(WORKERS)
    pending: deque = deque()
    try:
        for entry, offset in itertools.islice(ranges, WORKERS):
            pending.append((entry, offset, pool.submit(get, entry, offset)))
        while pending:
            entry, offset, future = pending.popleft()
            data = future.result()
            for nxt_entry, nxt_offset in itertools.islice(ranges, 1):
                pending.append((nxt_entry, nxt_offset, pool.submit(get, nxt_entry, nxt_offset)))
            if offset == 0:
                dst = dest / entry.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.part")
                landing = _Landing(entry, dst, tmp, open(tmp, "wb", buffering=0))
            assert landing is not None and landing.entry is entry
            landing.handle.write(data)
            landing.sha.update(data)
            landing.size += len(data)
            progress.add(len(data))
            if offset + FETCH_PART >= entry.size or not data:
                landing.handle.close()
                _check_fetched(uri, entry, landing.size, landing.sha.hexdigest())
                os.replace(landing.tmp, landing.dst)
                fetched += entry.size
                landing = None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if landing is not None:
            landing.handle.close()
            landing.tmp.unlink(missing_ok=True)
    return fetched, len(todo), len(manifest.files) - len(todo)


# ---------------------------------------------------------------- verify in place


def verify_staged(
    manifest_hash: str, s3_uri: str | None = None, nfs_path: str | None = None, target: S3Target | None = None
) -> artifacts.Manifest:
    """Check, without downloading, that the staged artifact is whole and is the one expected:
    its manifest hashes to `manifest_hash` and every file it lists is there with its size and
    sha256 (S3: the object metadata written at upload; NFS: sizes, plus the manifest itself)."""
    if s3_uri:
        bucket, prefix = parse_s3_uri(s3_uri)
        target = target or S3Target(bucket=bucket)
        client = s3_client(target)
        with s3_errors(s3_uri):
            manifest = fetch_manifest_or_none(client, bucket, prefix)
            if manifest is None:
                raise ArtifactError(f"{s3_uri}: no {artifacts.MANIFEST}; the staged artifact is gone or unfinished")
            for entry in manifest.files:
                with s3_errors(f"{s3_uri.rstrip('/')}/{entry.path}"):
                    _check_object(client, bucket, f"{prefix.rstrip('/')}/{entry.path}", entry)
        where = s3_uri
    elif nfs_path:
        if not Path(nfs_path).is_dir():
            raise ArtifactError(f"{nfs_path}: staged artifact directory is gone")
        manifest = artifacts.verify(Path(nfs_path), deep=False)
        where = nfs_path
    else:
        raise ArtifactError("no staging location recorded (neither s3_uri nor nfs_path)")
    if manifest.content_hash() != manifest_hash:
        raise ArtifactError(
            f"{where}: manifest hash {manifest.content_hash()[:16]}… is not the release's "
            f"{manifest_hash[:16]}…; the staged artifact was replaced"
        )
    return manifest
