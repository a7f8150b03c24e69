"""Stage a published artifact to network storage (S3 / DigitalOcean Spaces, NFS) and fetch it back.

Both backends keep one rule: `manifest.json` goes last and is the commit marker. A prefix or
directory without it is not a release artifact, so a serving pod never reads half an upload.

Every local byte is read once per stage: the buffer read for a part gets its MD5 (in the thread
that sends it) and feeds the file's sha256 (in the reader, in order). A file whose sha256 was
recorded when the manifest was written (`artifacts.scan`, keyed by the file's stat) and whose stat
has not moved since is not sha256ed again: the record is checked against the manifest before a
byte is sent, and the stat again after the last part is read (a write in between refuses the file).
The part goes up with its Content-MD5, which AWS and Spaces verify before they accept it, and the
ETag the server answers (the MD5 of the bytes it stored) must equal the local one, a check that
also holds on servers that do not verify Content-MD5 (moto). The sha256 must match the manifest
before the manifest is committed. With a signed Content-MD5 on every upload, the SigV4 payload
hash (a third pass over the bytes over plain http) is not computed: uploads go as UNSIGNED-PAYLOAD. Large files go up as
multipart uploads resumed across runs and processes: a re-run lists the parts the server already
holds, keeps those whose MD5 matches the local bytes and sends only the rest (boto3's transfer
manager cannot resume another process's upload, so uploads use the client's multipart calls).
Part digests are kept in a local cache keyed by the file's device, inode, size, mtime and ctime,
so re-staging an unchanged artifact reads no local bytes.

Memory: a stage holds at most (WORKERS + READERS) parts of PART_SIZE, a fetch (WORKERS + 1)
ranges of FETCH_PART (144 MiB and 288 MiB with the defaults). A fetch downloads ranges in
parallel and writes and hashes them in order, so no file is read back from disk to verify it.
"""

from __future__ import annotations

import base64
import functools
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
from pipeline.core.paths import home
from pipeline.core.specs import NfsTarget, S3Target, StagingSpec

log = logging.getLogger(__name__)

MiB = 1024 * 1024
PART_SIZE = 16 * MiB  # upload part; S3 allows 10,000 parts, so larger files get larger parts
MULTIPART_THRESHOLD = 16 * MiB
FETCH_PART = 32 * MiB  # download range
WORKERS = 8  # concurrent requests of one stage or fetch; the client's connection pool holds them all
# threads that read (and sha256) local files, each file in order. One: files go up one after another,
# so each multipart upload's completion (slow on moto: it joins the parts) overlaps the next file's
# parts, where four readers left four completions for the end; it reads ~1 GB/s while hashing
READERS = 1
FINISHERS = 2  # threads that complete multipart uploads (slow on some servers) while the readers go on
MAX_PARTS = 10_000


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


def s3_client(target: S3Target, *, signed_payload: bool = True):
    """A boto3 S3 client for the target: credentials from the Airflow connection if one exists,
    else the standard AWS environment; endpoint from the spec, else the connection.

    `signed_payload=False` is for callers that send a Content-MD5 with every body (staging): the
    MD5 header is signed, so the body is still bound to the signature without hashing it twice."""
    import boto3
    import botocore.session
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": 6},  # transient 5xx / throttling, with backoff
        max_pool_connections=WORKERS + READERS + FINISHERS,  # every concurrent request of a stage or fetch
        # S3-compatible stores (Spaces, moto) do not all speak the newer default CRC checksums;
        # every upload here carries Content-MD5 instead, which they all verify.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # unset keeps botocore's default (sign the payload over http, not over https with a checksum)
        s3={"addressing_style": "path", **({} if signed_payload else {"payload_signing_enabled": False})},
    )
    session_kwargs, endpoint = _airflow_credentials(target.connection_id)
    botocore_session = botocore.session.get_session()
    botocore_session.register_component("data_loader", _data_loader())
    session = boto3.session.Session(botocore_session=botocore_session, **session_kwargs)
    return session.client(
        "s3",
        endpoint_url=target.endpoint_url or endpoint,
        region_name=target.region or session_kwargs.get("region_name") or "us-east-1",
        config=config,
    )


@functools.cache
def _data_loader():
    """One botocore data loader per process: it caches the service model and endpoint rules it
    parses (~0.3 s of JSON), which a fresh session re-reads for every client otherwise. Sessions
    stay per client, so credentials are resolved afresh each time."""
    import botocore.loaders

    return botocore.loaders.create_loader()


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


def _key(prefix: str, name: str, rel: str) -> str:
    return "/".join(part.strip("/") for part in (prefix, name, rel) if part.strip("/"))


def s3_uri(target: S3Target, name: str) -> str:
    return f"s3://{target.bucket}/{_key(target.prefix, name, '')}"


def upload_client(target: S3Target):
    """The client staging uploads with: every body it sends carries a signed Content-MD5."""
    return s3_client(target, signed_payload=False)


def stage_s3(
    artifact: Path, manifest: artifacts.Manifest, target: S3Target, name: str, client=None
) -> tuple[str, int, int, int]:
    client = client or upload_client(target)
    uri = s3_uri(target, name)
    manifest_key = _key(target.prefix, name, artifacts.MANIFEST)
    with s3_errors(uri):
        _ensure_bucket(client, target)
        remote = _remote_manifest(client, target.bucket, manifest_key)
        progress = Progress(f"stage {uri}", manifest.total_bytes)
        existing = _existing_objects(client, target.bucket, _key(target.prefix, name, "") + "/")
        keys = [_key(target.prefix, name, entry.path) for entry in manifest.files]
        with ThreadPoolExecutor(WORKERS) as pool:  # one HEAD per file, in parallel
            matches = list(
                pool.map(
                    lambda e, key: _object_matches(client, target.bucket, key, e, existing, artifact / e.path),
                    manifest.files,
                    keys,
                )
            )
        todo = []
        for entry, key, match in zip(manifest.files, keys, matches, strict=True):
            if match:
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
        with ThreadPoolExecutor(WORKERS) as pool:  # check what the server holds before committing
            list(pool.map(lambda entry, key: _check_object(client, target.bucket, key, entry), manifest.files, keys))
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
    of the local bytes: metadata survives an overwrite of the bytes, the ETag does not. The local
    digest also checks the local bytes against the manifest (ArtifactError naming the file if not)."""
    size, etag = existing.get(key, (-1, ""))
    if size != entry.size:
        return False
    head = client.head_object(Bucket=bucket, Key=key)
    if head.get("Metadata", {}).get("sha256") != entry.sha256:
        return False
    if etag != local_digest(local, entry).etag():
        log.warning("stage: s3://%s/%s: ETag %s is not that of the local bytes; sending it again", bucket, key, etag)
        return False
    return True


def part_size(size: int) -> int:
    """The part size a file of `size` bytes is uploaded with: the whole file below the multipart
    threshold, else PART_SIZE, grown in MiB steps so no file needs more than S3's 10,000 parts."""
    if size < MULTIPART_THRESHOLD:
        return max(size, 1)
    return max(PART_SIZE, -(-size // MAX_PARTS // MiB) * MiB)


class LocalDigest(BaseModel):
    """What one read of a local file yields: its sha256 and the MD5 of each part it is uploaded in."""

    size: int = Field(description="bytes")
    part_size: int = Field(description="the part size the MD5s were computed with")
    sha256: str = Field(description="of the whole file")
    part_md5s: list[str] = Field(description="hex MD5 of each part, in order (one for a single PUT)")

    def etag(self) -> str:
        """The ETag S3 gives this file as this module uploads it: the MD5 of a single PUT, or for a
        multipart upload the MD5 of the parts' MD5s with the part count ("…-N")."""
        if self.size < MULTIPART_THRESHOLD:
            return self.part_md5s[0]
        joined = b"".join(bytes.fromhex(md5) for md5 in self.part_md5s)
        return f"{hashlib.md5(joined).hexdigest()}-{len(self.part_md5s)}"


def _stat_key(path: Path) -> str:
    return artifacts.stat_key(path)


def _cache_file(path: Path) -> Path:
    return home() / "cache" / "stage-digests" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.json"


def _cached_digest(path: Path) -> LocalDigest | None:
    try:
        record = json.loads(_cache_file(path).read_text())
        if record.get("stat") != _stat_key(path):
            return None
        digest = LocalDigest.model_validate(record["digest"])
    except (OSError, ValueError, KeyError):
        return None
    return digest if digest.part_size == part_size(digest.size) else None


def _remember_digest(path: Path, stat_before: str, digest: LocalDigest) -> None:
    """Cache the digest only when the file did not change while it was read."""
    if _stat_key(path) == stat_before:
        atomic_json(_cache_file(path), {"stat": stat_before, "digest": digest.model_dump()})


def _check_sha256(path: Path, entry: artifacts.FileEntry, digest: str) -> None:
    if digest != entry.sha256:
        raise ArtifactError(f"{path}: sha256 does not match the manifest (corrupted or changed)")


def local_digest(path: Path, entry: artifacts.FileEntry) -> LocalDigest:
    """The file's digest from the stat-keyed cache, else from one read; checked against the manifest."""
    digest = _cached_digest(path)
    if digest is None:
        stat_before = _stat_key(path)
        recorded = artifacts.recorded_sha256(stat_before)  # hashed when the manifest was written
        if recorded is not None:
            _check_sha256(path, entry, recorded)
        size = path.stat().st_size
        sha, md5s = hashlib.sha256(), []
        with open(path, "rb", buffering=0) as handle:
            while data := handle.read(part_size(size)):
                if recorded is None:
                    sha.update(data)
                md5s.append(hashlib.md5(data).hexdigest())
        if recorded is not None and _stat_key(path) != stat_before:
            raise ArtifactError(f"{path}: changed while it was read for staging; run the stage again")
        digest = LocalDigest(
            size=size,
            part_size=part_size(size),
            sha256=recorded or sha.hexdigest(),
            part_md5s=md5s or [hashlib.md5().hexdigest()],
        )
        _remember_digest(path, stat_before, digest)
    _check_sha256(path, entry, digest.sha256)
    return digest


def _check_object(client, bucket: str, key: str, entry: artifacts.FileEntry) -> None:
    head = client.head_object(Bucket=bucket, Key=key)
    if head["ContentLength"] != entry.size or head.get("Metadata", {}).get("sha256") != entry.sha256:
        raise ArtifactError(
            f"s3://{bucket}/{key}: server holds {head['ContentLength']} bytes / sha256 "
            f"{head.get('Metadata', {}).get('sha256')}, manifest says {entry.size} / {entry.sha256}"
        )


def _b64md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _check_etag(bucket: str, key: str, what: str, response: dict, md5: str) -> None:
    """The ETag a server answers for an upload is the MD5 of the bytes it stored: it must be ours."""
    etag = response.get("ETag", "").strip('"')
    if etag != md5:
        raise ArtifactError(
            f"s3://{bucket}/{key}: {what}: the server stored bytes with MD5 {etag}, the local bytes have {md5} "
            "(damaged on the way); refusing to commit"
        )


def _upload_all(
    client, bucket: str, root: Path, todo: list[tuple[artifacts.FileEntry, str]], progress: Progress
) -> int:
    """Upload files: READERS threads read each file once, in order, hashing it (sha256) as they go;
    WORKERS threads MD5 and send the parts they hand over; small files go in one PUT each, large
    ones as resumable multipart uploads. At most WORKERS + READERS parts are in memory. Returns the
    bytes sent."""
    sent = Counter()
    slots = threading.BoundedSemaphore(WORKERS + READERS)
    failed = threading.Event()  # after a failure nobody reads or sends more
    completed: dict[str, list[dict]] = {}  # key -> its parts on the server

    def send_part(key: str, upload_id: str, number: int, data: bytes, held: dict, digest: LocalDigest) -> None:
        """MD5 the part here, in one of WORKERS threads, so hashing spreads over the cores."""
        try:
            if failed.is_set():
                return
            md5 = hashlib.md5(data).digest()
            digest.part_md5s[number - 1] = md5.hex()
            if held.get(number) == (md5.hex(), len(data)):  # already on the server with these exact bytes
                parts = {"PartNumber": number, "ETag": f'"{md5.hex()}"'}
            else:
                response = client.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ContentMD5=base64.b64encode(md5).decode(),
                )
                _check_etag(bucket, key, f"part {number}", response, md5.hex())
                parts = {"PartNumber": number, "ETag": response["ETag"]}
                sent.add(len(data))
            completed[key].append(parts)
            progress.add(len(data))
        except BaseException:
            failed.set()
            raise
        finally:
            slots.release()

    def upload_file(entry: artifacts.FileEntry, key: str) -> None:
        path = root / entry.path
        stat_before = _stat_key(path)
        size = part_size(entry.size)
        sha = hashlib.sha256()
        if entry.size < MULTIPART_THRESHOLD:
            with slots:
                data = path.read_bytes()
                sha.update(data)
                _check_sha256(path, entry, sha.hexdigest())
                md5 = hashlib.md5(data)
                response = client.put_object(
                    Bucket=bucket,
                    Key=key,
                    Body=data,
                    ContentMD5=base64.b64encode(md5.digest()).decode(),
                    Metadata={"sha256": entry.sha256},
                )
                _check_etag(bucket, key, "object", response, md5.hexdigest())
            sent.add(len(data))
            progress.add(len(data))
            digest = LocalDigest(size=entry.size, part_size=size, sha256=entry.sha256, part_md5s=[md5.hexdigest()])
            _remember_digest(path, stat_before, digest)
            return
        recorded = artifacts.recorded_sha256(stat_before)  # hashed when the manifest was written
        if recorded is not None:
            _check_sha256(path, entry, recorded)  # before anything is sent
        upload_id, held = _resumable_upload(client, bucket, key, {"sha256": entry.sha256})
        count = -(-entry.size // size)
        digest = LocalDigest(size=entry.size, part_size=size, sha256=entry.sha256, part_md5s=[""] * count)
        completed[key] = []
        futures, read = [], 0
        with open(path, "rb", buffering=0) as handle:
            for number in range(1, count + 1):
                slots.acquire()
                if failed.is_set():
                    slots.release()
                    break
                try:
                    data = handle.read(size)
                    if recorded is None:
                        sha.update(data)
                except BaseException:
                    slots.release()
                    raise
                read += 1
                futures.append(senders.submit(send_part, key, upload_id, number, data, held, digest))
        if read == count and recorded is None:  # bad bytes: the upload is left unfinished, never committed
            _check_sha256(path, entry, sha.hexdigest())
        elif read == count and _stat_key(path) != stat_before:  # the recorded sha256 may not be of what was sent
            raise ArtifactError(f"{path}: changed while it was read for staging; run the stage again")
        # the reader goes on to the next file while its parts are sent and the upload completed
        finishing.append(finishers.submit(finish, path, stat_before, key, upload_id, futures, digest))

    def finish(path: Path, stat_before: str, key: str, upload_id: str, futures: list, digest: LocalDigest) -> None:
        try:
            for future in futures:
                future.result()  # re-raise the first failure; finished parts stay on the server for a re-run
            if not failed.is_set():
                client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": sorted(completed[key], key=lambda p: p["PartNumber"])},
                )
                _remember_digest(path, stat_before, digest)
        except BaseException:
            failed.set()
            raise

    def guarded(entry: artifacts.FileEntry, key: str) -> None:
        try:
            upload_file(entry, key)
        except BaseException:
            failed.set()
            raise

    finishing: list = []
    with (
        ThreadPoolExecutor(WORKERS) as senders,
        ThreadPoolExecutor(FINISHERS) as finishers,
        ThreadPoolExecutor(READERS) as readers,
    ):
        errors = [job.exception() for job in [readers.submit(guarded, entry, key) for entry, key in todo]]
        errors += [job.exception() for job in finishing]
    first = next((e for e in errors if isinstance(e, ArtifactError)), None) or next((e for e in errors if e), None)
    if first is not None:
        raise first
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
