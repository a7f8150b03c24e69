"""Stage a published artifact to network storage (S3 / DigitalOcean Spaces, NFS) and fetch it back.

Both backends keep one rule: `manifest.json` goes last and is the commit marker. A prefix or
directory without it is not a release artifact, so a serving pod never reads half an upload.

S3 uploads send every part with its Content-MD5, which the server checks before it accepts
the bytes (Spaces, AWS and moto all do). Large files go up as multipart uploads whose parts
are resumed across runs: after an interruption a re-run lists the parts the server already
holds, keeps those whose MD5 matches the local bytes and sends only the rest. boto3's
transfer manager cannot resume a multipart upload from another process, so uploads use the
client's multipart calls directly; downloads use the transfer manager.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core import artifacts, platform
from pipeline.core.errors import ArtifactError, ReleaseError
from pipeline.core.files import atomic_json
from pipeline.core.spec import NfsTarget, S3Target, StagingSpec

log = logging.getLogger(__name__)

PART_SIZE = 64 * 1024 * 1024
MULTIPART_THRESHOLD = 64 * 1024 * 1024
WORKERS = 8


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


# ---------------------------------------------------------------- progress


@dataclass
class Progress:
    """Thread-safe byte counter that logs what, how far and how fast, at most every few seconds."""

    what: str
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last_log: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last_log >= 3 or self.done >= self.total:
                self.last_log = now
                rate = self.done / 1e6 / max(now - self.started, 1e-9)
                log.info(
                    "%s: %.1f/%.1f MB (%.0f%%), %.1f MB/s",
                    self.what,
                    self.done / 1e6,
                    self.total / 1e6,
                    100 * self.done / max(self.total, 1),
                    rate,
                )


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


# ---------------------------------------------------------------- S3 client


def s3_client(target: S3Target):
    """A boto3 S3 client for the target: credentials from the Airflow connection if one exists,
    else the standard AWS environment; endpoint from the spec, else the connection."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": 6},  # transient 5xx / throttling, with backoff
        max_pool_connections=WORKERS * 2,
        # S3-compatible stores (Spaces, moto) do not all speak the newer default CRC checksums;
        # every upload here carries Content-MD5 instead, which they all verify.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )
    session_kwargs, endpoint = _airflow_credentials(target.connection_id)
    session = boto3.session.Session(**session_kwargs)
    return session.client(
        "s3",
        endpoint_url=target.endpoint_url or endpoint,
        region_name=target.region or session_kwargs.get("region_name") or "us-east-1",
        config=config,
    )


def _airflow_credentials(conn_id: str) -> tuple[dict[str, Any], str | None]:
    """Read an amazon-provider connection (login = key id, password = secret, extra endpoint_url/region_name)."""
    conn = platform.current().connection(conn_id)
    if conn is None:
        log.debug("no connection %r; using the AWS environment", conn_id)
        return {}, None
    kwargs: dict[str, Any] = {}
    if conn.login:
        kwargs["aws_access_key_id"] = conn.login
        kwargs["aws_secret_access_key"] = conn.password.get_secret_value() if conn.password else None
    if conn.extra.get("region_name"):
        kwargs["region_name"] = conn.extra["region_name"]
    endpoint = conn.extra.get("endpoint_url") or (
        conn.extra.get("service_config", {}).get("s3", {}).get("endpoint_url")
    )
    return kwargs, endpoint


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> ("bucket", "some/key"); a ReleaseError naming the URI if it is not one."""
    if not uri.startswith("s3://") or not uri.removeprefix("s3://").partition("/")[0]:
        raise ReleaseError(f"{uri}: not an s3://bucket/key URI")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


@contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """botocore's errors inside the block become one ReleaseError naming `what` (a URI) with a hint:
    the one place S3 failures are translated, as httpx maps transport errors in one place."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise _client_error(exc, what) from None


def _client_error(exc: Exception, what: str) -> ReleaseError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "?")
        if code in ("404", "NotFound"):  # a HEAD (download_file's first call) has no body to name the code
            code = "NoSuchKey"
        hint = {
            "NoSuchBucket": "the bucket does not exist (create it, or set staging.s3.create_bucket)",
            "NoSuchKey": "no such object (not staged there, or deleted since)",
            "InvalidAccessKeyId": "the access key is not known to the server (check the connection's login)",
            "SignatureDoesNotMatch": "the secret key is wrong (check the connection's password)",
            "AccessDenied": "the credentials may not do this",
        }.get(code, exc.response.get("Error", {}).get("Message", ""))
        return ReleaseError(f"{what}: {code}: {hint}")
    if isinstance(exc, NoCredentialsError):
        return ReleaseError(
            f"{what}: no S3 credentials (set the Airflow connection or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
        )
    if isinstance(exc, EndpointConnectionError):
        return ReleaseError(f"{what}: cannot reach the S3 endpoint: {exc}")
    return ReleaseError(f"{what}: {exc}")


# ---------------------------------------------------------------- stage


def stage(artifact: Path, staging: StagingSpec, name: str | None = None) -> StagedArtifact:
    """Stage a verified artifact to every configured target; the manifest goes last on each."""
    manifest = artifacts.verify(artifact, deep=False)
    name = name or artifact.name
    result = StagedArtifact(manifest_hash=manifest.content_hash(), total_bytes=manifest.total_bytes)
    started = time.monotonic()
    # The full sha256 check of the local files runs beside the upload; no manifest is committed
    # anywhere unless it passes, so bytes that do not match their manifest are never published.
    with ThreadPoolExecutor(1) as checker:
        deep = checker.submit(artifacts.verify, artifact)
        if staging.s3 is not None:
            uri, sent, files_sent, skipped = stage_s3(artifact, manifest, staging.s3, name, before_commit=deep.result)
            result.s3_uri, result.bytes_sent, result.files_sent, result.files_skipped = uri, sent, files_sent, skipped
        deep.result()
    if staging.nfs is not None:
        path, sent, files_sent, skipped = stage_nfs(artifact, manifest, staging.nfs, name)
        result.nfs_path = path
        result.bytes_sent += sent
        result.files_sent += files_sent
        result.files_skipped += skipped
    result.seconds = round(time.monotonic() - started, 2)
    return result


def _key(prefix: str, name: str, rel: str) -> str:
    return "/".join(part.strip("/") for part in (prefix, name, rel) if part.strip("/"))


def s3_uri(target: S3Target, name: str) -> str:
    return f"s3://{target.bucket}/{_key(target.prefix, name, '')}"


def stage_s3(
    artifact: Path, manifest: artifacts.Manifest, target: S3Target, name: str, client=None, before_commit=lambda: None
) -> tuple[str, int, int, int]:
    client = client or s3_client(target)
    uri = s3_uri(target, name)
    manifest_key = _key(target.prefix, name, artifacts.MANIFEST)
    with s3_errors(uri):
        _ensure_bucket(client, target)
        remote = _remote_manifest(client, target.bucket, manifest_key)
        progress = Progress(f"stage {uri}", manifest.total_bytes)
        existing = _existing_objects(client, target.bucket, _key(target.prefix, name, "") + "/")
        todo = []
        for entry in manifest.files:
            key = _key(target.prefix, name, entry.path)
            if _object_matches(client, target.bucket, key, entry, existing, artifact / entry.path):
                progress.add(entry.size)
            else:
                todo.append((entry, key))
        if remote is not None and remote.content_hash() == manifest.content_hash():
            if not todo:
                log.info("stage: %s already holds this artifact (manifest and objects match); nothing to send", uri)
                return uri, 0, 0, len(manifest.files)
            # committed once, damaged since: withdraw the manifest so nobody takes it for whole meanwhile
            log.warning("stage: %s: %d of its objects are missing or changed; repairing", uri, len(todo))
            client.delete_object(Bucket=target.bucket, Key=manifest_key)
        sent = _upload_all(client, target.bucket, artifact, todo, progress)
        skipped = len(manifest.files) - len(todo)
        for entry in manifest.files:  # check what the server holds before committing
            _check_object(client, target.bucket, _key(target.prefix, name, entry.path), entry)
        before_commit()
        body = (artifact / artifacts.MANIFEST).read_bytes()
        client.put_object(
            Bucket=target.bucket, Key=manifest_key, Body=body, ContentMD5=_b64md5(body), ContentType="application/json"
        )
    log.info("stage: committed %s (%d files sent, %d already there, %.1f MB sent)", uri, len(todo), skipped, sent / 1e6)
    return uri, sent, len(todo), skipped


def _ensure_bucket(client, target: S3Target) -> None:
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=target.bucket)
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 404 and target.create_bucket:
            log.info("stage: creating bucket %s", target.bucket)
            client.create_bucket(Bucket=target.bucket)
        elif status == 404:
            raise ReleaseError(
                f"staging.s3.bucket: bucket {target.bucket!r} does not exist "
                "(create it, or set staging.s3.create_bucket: true)"
            ) from None
        else:
            raise


def _remote_manifest(client, bucket: str, key: str) -> artifacts.Manifest | None:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise
    return artifacts.Manifest.model_validate_json(body)


def fetch_manifest_or_none(client, bucket: str, prefix: str) -> artifacts.Manifest | None:
    """The committed manifest under `prefix`, or None while the artifact is not (yet) committed."""
    return _remote_manifest(client, bucket, f"{prefix.rstrip('/')}/{artifacts.MANIFEST}")


def _existing_objects(client, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """(size, ETag) of every object under `prefix`, from the listing (no extra request per object)."""
    found: dict[str, tuple[int, str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            found[obj["Key"]] = (obj["Size"], obj.get("ETag", "").strip('"'))
    return found


def _object_matches(
    client, bucket: str, key: str, entry: artifacts.FileEntry, existing: dict[str, tuple[int, str]], local: Path
) -> bool:
    """Skip re-sending only an object with the manifest's size and sha256 metadata whose ETag is that
    of the local bytes: metadata survives an overwrite of the bytes, the ETag does not."""
    size, etag = existing.get(key, (-1, ""))
    if size != entry.size:
        return False
    head = client.head_object(Bucket=bucket, Key=key)
    if head.get("Metadata", {}).get("sha256") != entry.sha256:
        return False
    if etag != expected_etag(local):
        log.warning("stage: s3://%s/%s: ETag %s is not that of the local bytes; sending it again", bucket, key, etag)
        return False
    return True


def expected_etag(path: Path) -> str:
    """The ETag S3 gives this file as this module uploads it: the MD5 of a single PUT, or for a
    multipart upload the MD5 of the parts' MD5s with the part count ("…-N")."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size < MULTIPART_THRESHOLD:
            return hashlib.md5(handle.read()).hexdigest()
        digests = [hashlib.md5(chunk).digest() for chunk in iter(lambda: handle.read(PART_SIZE), b"")]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _check_object(client, bucket: str, key: str, entry: artifacts.FileEntry) -> None:
    head = client.head_object(Bucket=bucket, Key=key)
    if head["ContentLength"] != entry.size or head.get("Metadata", {}).get("sha256") != entry.sha256:
        raise ArtifactError(
            f"s3://{bucket}/{key}: server holds {head['ContentLength']} bytes / sha256 "
            f"{head.get('Metadata', {}).get('sha256')}, manifest says {entry.size} / {entry.sha256}"
        )


def _b64md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _upload_all(
    client, bucket: str, root: Path, todo: list[tuple[artifacts.FileEntry, str]], progress: Progress
) -> int:
    """Upload files in parallel: small ones in one PUT each, large ones as resumable multipart
    uploads whose parts all share one pool. Returns the bytes actually sent."""
    sent = Counter()
    multipart: list[tuple[artifacts.FileEntry, str, str, list[dict]]] = []

    def put_small(entry: artifacts.FileEntry, key: str) -> None:
        body = (root / entry.path).read_bytes()
        client.put_object(
            Bucket=bucket, Key=key, Body=body, ContentMD5=_b64md5(body), Metadata={"sha256": entry.sha256}
        )
        sent.add(len(body))
        progress.add(len(body))

    def put_part(path: Path, key: str, upload_id: str, number: int, offset: int, held, parts: list[dict]) -> None:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(PART_SIZE)
        md5 = hashlib.md5(data).digest()
        if held.get(number) == (md5.hex(), len(data)):
            etag = f'"{md5.hex()}"'  # already on the server with these exact bytes
        else:
            response = client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                ContentMD5=base64.b64encode(md5).decode(),
            )
            etag = response["ETag"]
            sent.add(len(data))
        parts.append({"PartNumber": number, "ETag": etag})
        progress.add(len(data))

    with ThreadPoolExecutor(WORKERS) as pool:
        futures = []
        for entry, key in todo:
            if entry.size < MULTIPART_THRESHOLD:
                futures.append(pool.submit(put_small, entry, key))
                continue
            upload_id, held = _resumable_upload(client, bucket, key, {"sha256": entry.sha256})
            parts: list[dict] = []
            multipart.append((entry, key, upload_id, parts))
            for number, offset in enumerate(range(0, entry.size, PART_SIZE), start=1):
                futures.append(pool.submit(put_part, root / entry.path, key, upload_id, number, offset, held, parts))
        for future in futures:
            future.result()  # re-raise the first failure; finished parts stay on the server for a re-run
    for _entry, key, upload_id, parts in multipart:
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
        )
    return sent.value


def _resumable_upload(client, bucket: str, key: str, meta: dict[str, str]) -> tuple[str, dict[int, tuple[str, int]]]:
    """Reuse an unfinished multipart upload of this key (its parts are checked by MD5), else start one."""
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    uploads = sorted((u for u in uploads if u["Key"] == key), key=lambda u: u["Initiated"])
    for stale in uploads[:-1]:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=stale["UploadId"])
    if uploads:
        upload_id = uploads[-1]["UploadId"]
        held = {}
        for page in client.get_paginator("list_parts").paginate(Bucket=bucket, Key=key, UploadId=upload_id):
            for part in page.get("Parts", []):
                held[part["PartNumber"]] = (part["ETag"].strip('"'), part["Size"])
        log.info("stage: resuming s3://%s/%s with %d parts already on the server", bucket, key, len(held))
        return upload_id, held
    return client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=meta)["UploadId"], {}


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

        def get(entry: artifacts.FileEntry, tmp: Path) -> None:
            from boto3.s3.transfer import TransferConfig

            with s3_errors(f"{uri.rstrip('/')}/{entry.path}"):
                client.download_file(
                    bucket,
                    f"{prefix.rstrip('/')}/{entry.path}",
                    str(tmp),
                    Config=TransferConfig(multipart_chunksize=PART_SIZE, max_concurrency=4),
                )
    else:
        src = Path(uri.removeprefix("file://"))
        manifest = artifacts.read_manifest(src)

        def get(entry: artifacts.FileEntry, tmp: Path) -> None:
            shutil.copyfile(src / entry.path, tmp)

    def checked(entry: artifacts.FileEntry, tmp: Path) -> None:
        get(entry, tmp)
        digest = artifacts.sha256_file(tmp)
        if tmp.stat().st_size != entry.size or digest != entry.sha256:
            raise ArtifactError(
                f"{uri}/{entry.path}: downloaded bytes do not match the manifest "
                f"(sha256 {digest[:12]}…, expected {entry.sha256[:12]}…); refusing it"
            )

    (dest / artifacts.MANIFEST).unlink(missing_ok=True)  # incomplete until every file is verified
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
