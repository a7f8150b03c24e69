"""Stage to S3: an artifact's files up, checked against what the server stored, the manifest last.

Every local byte is read once per stage: the buffer read for a part gets its MD5 (in the thread
that sends it) and feeds the file's sha256 (in the reader, in order). A file whose sha256 was
recorded when the manifest was written (`artifacts.scan`, keyed by the file's stat) and whose stat
has not moved since is not sha256ed again: the record is checked against the manifest before a
byte is sent, and the stat again after the last part is read (a write in between refuses the file).
The part goes up with its Content-MD5, which AWS and Spaces verify before they accept it, and the
ETag the server answers (the MD5 of the bytes it stored) must equal the local one, a check that
also holds on servers that do not verify Content-MD5 (moto). The sha256 must match the manifest
before the manifest is committed. With a signed Content-MD5 on every upload, the SigV4 payload
hash (a third pass over the bytes over plain http) is not computed: uploads go as UNSIGNED-PAYLOAD. With
`part_checksum: crc32` each body also carries its CRC32 (computed from the same buffer, ~4 GB/s), and a
multipart upload declares CRC32 when it starts, so the store keeps a composite checksum (and moto
needs no full-object checksum of its own at completion, the cost that made stage slower than awscli
there). Large files go up as
multipart uploads resumed across runs and processes: a re-run lists the parts the server already
holds, keeps those whose MD5 matches the local bytes and sends only the rest (boto3's transfer
manager cannot resume another process's upload, so uploads use the client's multipart calls).
Part digests are kept in a local cache keyed by the file's device, inode, size, mtime and ctime,
so re-staging an unchanged artifact reads no local bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, Field

from pipeline.core import artifacts
from pipeline.core.errors import ArtifactError, ReleaseError
from pipeline.core.files import atomic_json
from pipeline.core.paths import home
from pipeline.core.s3 import _check_object, _key, _remote_manifest, s3_client, s3_errors, s3_uri
from pipeline.core.specs import S3Target
from pipeline.core.transfer import (
    FINISHERS,
    MAX_PARTS,
    MULTIPART_THRESHOLD,
    PART_SIZE,
    READERS,
    WORKERS,
    Counter,
    MiB,
    Progress,
)

log = logging.getLogger(__name__)


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
        sent = _upload_all(client, target.bucket, artifact, todo, progress, crc32=target.part_checksum == "crc32")
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


# ---------------------------------------------------------------- local digests


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


def _cache_file(path: Path) -> Path:
    return home() / "cache" / "stage-digests" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.json"


def _cached_digest(path: Path) -> LocalDigest | None:
    try:
        record = json.loads(_cache_file(path).read_text())
        if record.get("stat") != artifacts.stat_key(path):
            return None
        digest = LocalDigest.model_validate(record["digest"])
    except (OSError, ValueError, KeyError):
        return None
    return digest if digest.part_size == part_size(digest.size) else None


def _remember_digest(path: Path, stat_before: str, digest: LocalDigest) -> None:
    """Cache the digest only when the file did not change while it was read."""
    if artifacts.stat_key(path) == stat_before:
        atomic_json(_cache_file(path), {"stat": stat_before, "digest": digest.model_dump()})


def _check_sha256(path: Path, entry: artifacts.FileEntry, digest: str) -> None:
    if digest != entry.sha256:
        raise ArtifactError(f"{path}: sha256 does not match the manifest (corrupted or changed)")


def local_digest(path: Path, entry: artifacts.FileEntry) -> LocalDigest:
    """The file's digest from the stat-keyed cache, else from one read; checked against the manifest."""
    digest = _cached_digest(path)
    if digest is None:
        stat_before = artifacts.stat_key(path)
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
        if recorded is not None and artifacts.stat_key(path) != stat_before:
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


# ---------------------------------------------------------------- upload


def _b64md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _b64crc32(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _check_etag(bucket: str, key: str, what: str, response: dict, md5: str) -> None:
    """The ETag a server answers for an upload is the MD5 of the bytes it stored: it must be ours."""
    etag = response.get("ETag", "").strip('"')
    if etag != md5:
        raise ArtifactError(
            f"s3://{bucket}/{key}: {what}: the server stored bytes with MD5 {etag}, the local bytes have {md5} "
            "(damaged on the way); refusing to commit"
        )


def _upload_all(
    client,
    bucket: str,
    root: Path,
    todo: list[tuple[artifacts.FileEntry, str]],
    progress: Progress,
    *,
    crc32: bool = False,
) -> int:
    """Upload files: READERS threads read each file once, in order, hashing it (sha256) as they go;
    WORKERS threads MD5 and send the parts they hand over; small files go in one PUT each, large
    ones as resumable multipart uploads. At most WORKERS + READERS parts are in memory. `crc32`: every
    body also carries its CRC32 (see the module's docstring). Returns the bytes sent."""
    sent = Counter()
    slots = threading.BoundedSemaphore(WORKERS + READERS)
    failed = threading.Event()  # after a failure nobody reads or sends more
    completed: dict[str, list[dict]] = {}  # key -> its parts on the server

    def checksum(data: bytes) -> dict[str, str]:
        """The CRC32 argument a body carries where the target asks for one (`crc32`)."""
        return {"ChecksumCRC32": _b64crc32(data)} if crc32 else {}

    def send_part(key: str, upload_id: str, number: int, data: bytes, held: dict, digest: LocalDigest) -> None:
        """MD5 the part here, in one of WORKERS threads, so hashing spreads over the cores."""
        try:
            if failed.is_set():
                return
            md5 = hashlib.md5(data).digest()
            digest.part_md5s[number - 1] = md5.hex()
            crc = checksum(data)
            if held.get(number) == (md5.hex(), len(data)):  # already on the server with these exact bytes
                parts = {"PartNumber": number, "ETag": f'"{md5.hex()}"', **crc}
            else:
                response = client.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ContentMD5=base64.b64encode(md5).decode(),
                    **crc,
                )
                _check_etag(bucket, key, f"part {number}", response, md5.hex())
                parts = {"PartNumber": number, "ETag": response["ETag"], **crc}
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
        stat_before = artifacts.stat_key(path)
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
                    **checksum(data),
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
        upload_id, held = _resumable_upload(client, bucket, key, {"sha256": entry.sha256}, "CRC32" if crc32 else None)
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
        elif (
            read == count and artifacts.stat_key(path) != stat_before
        ):  # the recorded sha256 may not be of what was sent
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


def _resumable_upload(
    client, bucket: str, key: str, meta: dict[str, str], algorithm: str | None
) -> tuple[str, dict[int, tuple[str, int]]]:
    """Reuse an unfinished multipart upload of this key (its parts are checked by MD5) started with the
    same checksum algorithm (a store refuses parts whose checksum the upload did not declare), else
    start one."""
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    uploads = sorted((u for u in uploads if u["Key"] == key), key=lambda u: u["Initiated"])
    keep = uploads[-1] if uploads and uploads[-1].get("ChecksumAlgorithm") == algorithm else None
    if uploads and keep is None:
        log.info("stage: s3://%s/%s: its unfinished upload declared another checksum; starting afresh", bucket, key)
    for stale in uploads:
        if stale is not keep:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=stale["UploadId"])
    if keep is not None:
        upload_id = keep["UploadId"]
        held = {}
        for page in client.get_paginator("list_parts").paginate(Bucket=bucket, Key=key, UploadId=upload_id):
            for part in page.get("Parts", []):
                held[part["PartNumber"]] = (part["ETag"].strip('"'), part["Size"])
        log.info("stage: resuming s3://%s/%s with %d parts already on the server", bucket, key, len(held))
        return upload_id, held
    started = client.create_multipart_upload(
        Bucket=bucket, Key=key, Metadata=meta, **({"ChecksumAlgorithm": algorithm} if algorithm else {})
    )
    return started["UploadId"], {}
