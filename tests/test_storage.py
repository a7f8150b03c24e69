"""Staging to a real S3-protocol server (moto server mode, over HTTP) and to an NFS-style directory."""

from __future__ import annotations

import base64
import os
import uuid
import zlib
from pathlib import Path

import pytest

from pipeline.core import artifacts, s3_upload, storage
from pipeline.core.errors import ArtifactError, ReleaseError
from pipeline.core.specs import NfsTarget, S3Target, StagingSpec
from testkit.s3server import FaultProxy, MotoServer

MB = 1024 * 1024


@pytest.fixture(autouse=True)
def aws_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # small parts so a test file exercises multipart (S3's minimum part is 5 MiB)
    # (each in the module that reads it: the upload's part sizes, the fetch's range)
    monkeypatch.setattr(s3_upload, "PART_SIZE", 5 * MB)
    monkeypatch.setattr(s3_upload, "MULTIPART_THRESHOLD", 5 * MB)
    monkeypatch.setattr(storage, "FETCH_PART", 5 * MB)  # and fetch them in several ranges


@pytest.fixture
def artifact(tmp_path) -> Path:
    root = tmp_path / "fp8-model-abc"
    root.mkdir()
    rng = __import__("random").Random(0)
    (root / "model-00001-of-00002.safetensors").write_bytes(rng.randbytes(17 * MB))
    (root / "model-00002-of-00002.safetensors").write_bytes(rng.randbytes(6 * MB + 123))
    (root / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (root / "tokenizer.json").write_text("{}")
    artifacts.write_manifest(root, kind="fp8-model")
    return root


def target_for(url: str, **kw) -> S3Target:
    return S3Target(
        connection_id="not-configured",
        bucket=kw.pop("bucket", f"b-{uuid.uuid4().hex[:8]}"),
        prefix="releases",
        endpoint_url=url,
        create_bucket=kw.pop("create_bucket", True),
        **kw,
    )


class FlipProxy(FaultProxy):
    """Forwards like FaultProxy, but flips the one byte of the client's stream at offset `flip_at`:
    damage on the way, which a server that does not check Content-MD5 (moto) stores as sent."""

    def __init__(self, upstream_port: int, flip_at: int):
        self.flip_at = flip_at
        super().__init__(upstream_port)

    def _pipe(self, src, dst, count: bool) -> None:
        if not count:
            return super()._pipe(src, dst, count)
        try:
            while data := src.recv(65536):
                with self.lock:
                    start, self.forwarded = self.forwarded, self.forwarded + len(data)
                if start <= self.flip_at < start + len(data):
                    i = self.flip_at - start
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(__import__("socket").SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def keys(client, bucket: str) -> set[str]:
    return {o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_round_trip_stage_fetch_verify(s3, artifact, tmp_path):
    target = target_for(s3.url)
    staged = storage.stage(artifact, StagingSpec(s3=target))
    assert staged.s3_uri == f"s3://{target.bucket}/releases/{artifact.name}"
    assert staged.bytes_sent == staged.total_bytes and staged.files_sent == 4
    client = storage.s3_client(target)
    assert f"releases/{artifact.name}/manifest.json" in keys(client, target.bucket)
    fetched = storage.fetch(staged.s3_uri, tmp_path / "pod", target)
    assert fetched.manifest_hash == staged.manifest_hash == artifacts.read_manifest(artifact).content_hash()
    artifacts.verify(tmp_path / "pod")
    again = storage.fetch(staged.s3_uri, tmp_path / "pod", target)
    assert again.files_skipped == 4 and again.bytes_fetched == 0


def test_restage_is_a_no_op(s3, artifact):
    target = target_for(s3.url)
    storage.stage(artifact, StagingSpec(s3=target))
    again = storage.stage(artifact, StagingSpec(s3=target))
    assert again.bytes_sent == 0 and again.files_sent == 0 and again.files_skipped == 4


def test_restage_repairs_an_artifact_damaged_after_its_commit(s3, artifact):
    from pipeline.core.errors import ReleaseError

    target = target_for(s3.url)
    staged = storage.stage(artifact, StagingSpec(s3=target))
    client = storage.s3_client(target)
    client.delete_object(Bucket=target.bucket, Key=f"releases/{artifact.name}/tokenizer.json")
    with pytest.raises(ReleaseError, match="tokenizer.json"):
        storage.verify_staged(staged.manifest_hash, staged.s3_uri, target=target)
    repaired = storage.stage(artifact, StagingSpec(s3=target))
    assert repaired.files_sent == 1 and repaired.files_skipped == 3  # only what was lost goes again
    storage.verify_staged(staged.manifest_hash, staged.s3_uri, target=target)


@pytest.mark.parametrize("victim", ["config.json", "model-00001-of-00002.safetensors"])  # single PUT, multipart
def test_restage_repairs_bytes_overwritten_with_their_metadata_kept(s3, artifact, victim, tmp_path):
    target = target_for(s3.url)
    staged = storage.stage(artifact, StagingSpec(s3=target))
    client = storage.s3_client(target)
    key = f"releases/{artifact.name}/{victim}"
    head = client.head_object(Bucket=target.bucket, Key=key)
    data = bytearray((artifact / victim).read_bytes())
    data[7] ^= 0xFF  # same size, same sha256 metadata: only the ETag can tell
    client.put_object(Bucket=target.bucket, Key=key, Body=bytes(data), Metadata=head["Metadata"])
    assert client.head_object(Bucket=target.bucket, Key=key)["Metadata"]["sha256"] == head["Metadata"]["sha256"]
    repaired = storage.stage(artifact, StagingSpec(s3=target))
    assert (repaired.files_sent, repaired.files_skipped) == (1, 3)
    storage.fetch(staged.s3_uri, tmp_path / "pod", target)  # every byte checked against the manifest


def test_interrupted_upload_resumes_without_resending_and_commits_last(s3, artifact, monkeypatch):
    monkeypatch.setattr(s3_upload, "WORKERS", 1)  # parts in order, so the cut lands after two whole parts
    monkeypatch.setattr(s3_upload, "READERS", 1)
    target = target_for(s3.url)
    proxy = FaultProxy(s3.port, cut_after=14 * MB)
    try:
        with pytest.raises(ReleaseError):
            storage.stage(artifact, StagingSpec(s3=target.model_copy(update={"endpoint_url": proxy.url})))
    finally:
        proxy.close()
    client = storage.s3_client(target)
    assert f"releases/{artifact.name}/manifest.json" not in keys(client, target.bucket)
    assert storage.fetch_manifest_or_none(client, target.bucket, f"releases/{artifact.name}") is None

    resumed = storage.stage(artifact, StagingSpec(s3=target))
    total = resumed.total_bytes
    assert 0 < resumed.bytes_sent <= total - 10 * MB, (resumed.bytes_sent, total)  # committed parts/files not re-sent
    assert f"releases/{artifact.name}/manifest.json" in keys(client, target.bucket)
    assert client.list_multipart_uploads(Bucket=target.bucket).get("Uploads", []) == []


@pytest.mark.parametrize("status", ["503 Slow Down", "500 Internal Server Error"])  # moto answers 500s under load
def test_transient_server_errors_are_retried(s3, artifact, status):
    target = target_for(s3.url)
    storage.stage(artifact, StagingSpec(s3=target.model_copy(update={"create_bucket": True})))  # bucket exists now
    other = artifact.parent / "other"
    other.mkdir()
    (other / "x.bin").write_bytes(b"x" * 1000)
    artifacts.write_manifest(other, kind="fp8-model")
    proxy = FaultProxy(s3.port, fail_first=3, fail_status=status)
    try:
        staged = storage.stage(other, StagingSpec(s3=target.model_copy(update={"endpoint_url": proxy.url})))
    finally:
        proxy.close()
    assert proxy.failed == 3 and staged.files_sent == 1


def test_corrupted_object_is_refused_on_fetch(s3, artifact, tmp_path):
    target = target_for(s3.url)
    staged = storage.stage(artifact, StagingSpec(s3=target))
    client = storage.s3_client(target)
    client.put_object(Bucket=target.bucket, Key=f"releases/{artifact.name}/config.json", Body=b'{"model_type": "evil"}')
    with pytest.raises(ArtifactError, match=r"config\.json: downloaded bytes do not match the manifest"):
        storage.fetch(staged.s3_uri, tmp_path / "pod", target)
    assert not (tmp_path / "pod" / "config.json").exists()
    assert not (tmp_path / "pod" / "manifest.json").exists()


def test_prefix_without_manifest_is_not_an_artifact(s3, artifact, tmp_path):
    target = target_for(s3.url)
    storage.stage(artifact, StagingSpec(s3=target))
    client = storage.s3_client(target)
    client.delete_object(Bucket=target.bucket, Key=f"releases/{artifact.name}/manifest.json")
    with pytest.raises(ArtifactError, match="no manifest.json; not a"):
        storage.fetch(f"s3://{target.bucket}/releases/{artifact.name}", tmp_path / "pod", target)


def test_missing_bucket_is_a_clear_error(s3, artifact):
    target = target_for(s3.url, create_bucket=False)
    with pytest.raises(ReleaseError, match=rf"staging\.s3\.bucket: bucket '{target.bucket}' does not exist"):
        storage.stage(artifact, StagingSpec(s3=target))


def test_bad_credentials_are_a_clear_error(artifact, monkeypatch):
    server = MotoServer(env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0"))
    try:
        with pytest.raises(ReleaseError, match=r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|Forbidden|403"):
            storage.stage(artifact, StagingSpec(s3=target_for(server.url)))
    finally:
        server.stop()


def test_local_bytes_that_do_not_match_the_manifest_are_never_committed(s3, artifact):
    shard = artifact / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[12345] ^= 0xFF  # same size: only the sha256 can tell
    shard.write_bytes(bytes(data))
    target = target_for(s3.url)
    with pytest.raises(ArtifactError, match=r"model-00001-of-00002\.safetensors: sha256 does not match"):
        storage.stage(artifact, StagingSpec(s3=target))
    assert f"releases/{artifact.name}/manifest.json" not in keys(storage.s3_client(target), target.bucket)
    (artifact / "config.json").write_text('{"model_type": "changed, longer"}')
    with pytest.raises(ArtifactError, match=r"config\.json: size"):
        storage.stage(artifact, StagingSpec(s3=target))


def test_nfs_stage_is_atomic_resumable_and_fetchable(artifact, tmp_path):
    share = tmp_path / "share"
    share.mkdir()
    # a killed earlier run left part of the copy behind
    partial = share / f".partial-{artifact.name}"
    partial.mkdir()
    (partial / "config.json").write_bytes((artifact / "config.json").read_bytes())
    (partial / "model-00002-of-00002.safetensors").write_bytes(b"half")
    staged = storage.stage(artifact, StagingSpec(nfs=NfsTarget(path=str(share))))
    assert staged.nfs_path == str(share / artifact.name) and staged.files_skipped == 1 and staged.files_sent == 3
    assert not partial.exists()
    artifacts.verify(share / artifact.name)
    again = storage.stage(artifact, StagingSpec(nfs=NfsTarget(path=str(share))))
    assert again.bytes_sent == 0
    fetched = storage.fetch(str(share / artifact.name), tmp_path / "pod")
    assert fetched.files_fetched == 4 and artifacts.verify(tmp_path / "pod")


def test_nfs_path_must_exist(artifact, tmp_path):
    with pytest.raises(ReleaseError, match=r"staging\.nfs\.path: .* is not a mounted directory"):
        storage.stage(artifact, StagingSpec(nfs=NfsTarget(path=str(tmp_path / "nope"))))


def test_fetch_names_an_object_deleted_from_the_bucket_in_one_line(s3, artifact, tmp_path):
    target = target_for(s3.url)
    staged = storage.stage(artifact, StagingSpec(s3=target))
    storage.s3_client(target).delete_object(Bucket=target.bucket, Key=f"releases/{artifact.name}/tokenizer.json")
    with pytest.raises(ReleaseError) as exc:
        storage.fetch(staged.s3_uri, tmp_path / "pod", target)
    assert str(exc.value) == (
        f"{staged.s3_uri}/tokenizer.json: NoSuchKey: no such object (not staged there, or deleted since)"
    )
    assert not (tmp_path / "pod" / "manifest.json").exists()


def test_verify_staged_passes_a_whole_artifact_and_names_what_is_missing(s3, artifact, monkeypatch, capsys):
    """`model-release verify-staged`: a streaming pod's init container, before vLLM reads the objects itself."""
    from pipeline.cli import main

    target = target_for(s3.url)
    staged = storage.stage(artifact, StagingSpec(s3=target))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    assert main(["verify-staged", staged.s3_uri, "--manifest-hash", staged.manifest_hash]) == 0
    assert f"{len(artifacts.read_manifest(artifact).files)} objects match" in capsys.readouterr().out
    assert main(["verify-staged", staged.s3_uri, "--manifest-hash", "0" * 64]) != 0  # another release's artifact
    assert "the staged artifact was replaced" in capsys.readouterr().err
    key = f"releases/{artifact.name}/model-00002-of-00002.safetensors"
    storage.s3_client(target).delete_object(Bucket=target.bucket, Key=key)
    assert main(["verify-staged", staged.s3_uri, "--manifest-hash", staged.manifest_hash]) != 0
    assert "model-00002-of-00002.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("part_checksum", [None, "crc32"])  # moto checks neither Content-MD5 nor the CRC32
def test_a_part_damaged_on_the_way_is_refused_naming_its_file_and_never_committed(
    s3, artifact, monkeypatch, tmp_path, part_checksum
):
    """The payload is no longer SHA-256-signed: the server's ETag (the MD5 of what it stored) must
    equal the MD5 of the local part, and a flipped byte fails that check even on moto."""
    monkeypatch.setattr(s3_upload, "WORKERS", 1)  # one request at a time, files in order
    monkeypatch.setattr(s3_upload, "READERS", 1)
    target = target_for(s3.url, part_checksum=part_checksum)
    proxy = FlipProxy(s3.port, flip_at=3 * MB)  # inside the first shard's first part
    try:
        with pytest.raises(ArtifactError, match=r"model-00001-of-00002\.safetensors: part 1: the server stored bytes"):
            storage.stage(artifact, StagingSpec(s3=target.model_copy(update={"endpoint_url": proxy.url})))
    finally:
        proxy.close()
    client = storage.s3_client(target)
    assert f"releases/{artifact.name}/manifest.json" not in keys(client, target.bucket)
    repaired = storage.stage(artifact, StagingSpec(s3=target))  # the damaged part is not kept on resume
    assert (repaired.files_sent, repaired.files_skipped) == (2, 2)  # the small files went up whole before
    storage.fetch(repaired.s3_uri, tmp_path / "pod", target)  # every byte checked against the manifest


def composite_crc32(data: bytes, part: int) -> str:
    """S3's composite checksum of a multipart object, computed here from the local bytes: the CRC32
    of its parts' CRC32s."""
    crcs = b"".join(zlib.crc32(data[i : i + part]).to_bytes(4, "big") for i in range(0, len(data), part))
    return base64.b64encode(zlib.crc32(crcs).to_bytes(4, "big")).decode()


def test_crc32_parts_leave_the_store_a_composite_checksum_of_the_local_bytes(s3, artifact, tmp_path):
    target = target_for(s3.url, part_checksum="crc32")
    staged = storage.stage(artifact, StagingSpec(s3=target))
    client = storage.s3_client(target)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        head = client.head_object(Bucket=target.bucket, Key=f"releases/{artifact.name}/{name}", ChecksumMode="ENABLED")
        assert head["ChecksumCRC32"] == composite_crc32((artifact / name).read_bytes(), 5 * MB), name
    storage.fetch(staged.s3_uri, tmp_path / "pod", target)


def test_an_unfinished_upload_that_declared_no_checksum_is_started_afresh_under_crc32(s3, artifact):
    """A store refuses parts whose checksum the upload did not declare: such an upload is not resumed."""
    target = target_for(s3.url, part_checksum="crc32")
    client = storage.s3_client(target)
    client.create_bucket(Bucket=target.bucket)
    name = "model-00001-of-00002.safetensors"
    key = f"releases/{artifact.name}/{name}"
    upload = client.create_multipart_upload(Bucket=target.bucket, Key=key)["UploadId"]  # no checksum
    client.upload_part(
        Bucket=target.bucket, Key=key, UploadId=upload, PartNumber=1, Body=(artifact / name).read_bytes()[: 5 * MB]
    )
    staged = storage.stage(artifact, StagingSpec(s3=target))
    assert staged.bytes_sent == staged.total_bytes  # its part was not taken into the new upload
    assert client.list_multipart_uploads(Bucket=target.bucket).get("Uploads", []) == []
    head = client.head_object(Bucket=target.bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] == composite_crc32((artifact / name).read_bytes(), 5 * MB)


def test_restage_of_an_unchanged_artifact_reads_no_local_bytes(s3, artifact, monkeypatch):
    target = target_for(s3.url)
    storage.stage(artifact, StagingSpec(s3=target))

    def no_reading(*args, **kwargs):
        raise AssertionError(f"read {args[0]} again")

    monkeypatch.setattr(s3_upload, "open", no_reading, raising=False)  # digests come from the stat-keyed cache
    again = storage.stage(artifact, StagingSpec(s3=target))
    assert (again.bytes_sent, again.files_skipped) == (0, 4)


def test_a_file_changed_in_place_with_its_mtime_restored_is_not_taken_from_the_digest_cache(s3, artifact):
    target = target_for(s3.url)
    storage.stage(artifact, StagingSpec(s3=target))
    shard = artifact / "model-00002-of-00002.safetensors"
    before = shard.stat()
    data = bytearray(shard.read_bytes())
    data[99] ^= 0xFF
    shard.write_bytes(bytes(data))  # same inode, same size
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # same mtime: only ctime moved
    with pytest.raises(ArtifactError, match=r"model-00002-of-00002\.safetensors: sha256 does not match"):
        storage.stage(artifact, StagingSpec(s3=target))


class _CountingHashlib:
    """storage's hashlib, counting the bytes it sha256es (what a recorded sha256 saves)."""

    def __init__(self):
        import hashlib

        self.md5, self.sha256_bytes, self._sha256 = hashlib.md5, 0, hashlib.sha256

    def sha256(self, data: bytes = b""):
        counter, real = self, self._sha256(data)
        counter.sha256_bytes += len(data)

        class Counted:
            def update(self, more: bytes) -> None:
                counter.sha256_bytes += len(more)
                real.update(more)

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Counted()


@pytest.fixture
def settled(artifact) -> Path:
    """The artifact with its manifest written again once its files are older than RACY_NS, as a
    publish step leaves it: every sha256 recorded by stat."""
    __import__("time").sleep(2 * artifacts.RACY_NS / 1e9)
    artifacts.write_manifest(artifact, kind="fp8-model")
    return artifact


def test_a_stage_after_the_manifest_does_not_sha256_the_shards_again(s3, settled, monkeypatch, tmp_path):
    counting = _CountingHashlib()
    monkeypatch.setattr(s3_upload, "hashlib", counting)
    staged = storage.stage(settled, StagingSpec(s3=target_for(s3.url)))
    # the shards (17 and 6 MB, multipart) were read once, for their MD5s only; what was sha256ed is
    # the small files (single PUTs) and the digest cache's file names
    assert 0 < counting.sha256_bytes < MB
    storage.fetch(staged.s3_uri, tmp_path / "pod", target_for(s3.url, bucket=staged.s3_uri.split("/")[2]))


def test_a_shard_changed_after_its_recorded_sha256_is_hashed_and_refused(s3, settled):
    """The recorded sha256 is not taken for a file written since (same size, mtime put back): the
    stage hashes it, finds the damage and names the file; nothing is committed."""
    shard = settled / "model-00001-of-00002.safetensors"
    before = shard.stat()
    with open(shard, "r+b") as handle:
        handle.seek(7 * MB)
        byte = handle.read(1)
        handle.seek(7 * MB)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    target = target_for(s3.url)
    with pytest.raises(ArtifactError, match=r"model-00001-of-00002\.safetensors: sha256 does not match"):
        storage.stage(settled, StagingSpec(s3=target))
    assert f"releases/{settled.name}/manifest.json" not in keys(storage.s3_client(target), target.bucket)


def test_a_shard_written_while_it_is_staged_on_a_recorded_sha256_is_refused(s3, settled, monkeypatch):
    """With the sha256 taken from the record, the bytes sent are not hashed against the manifest:
    a write during the upload moves the file's stat, and that refuses the file, naming it."""
    shard = settled / "model-00001-of-00002.safetensors"
    real_open = open

    def open_then_write(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        if Path(path) == shard:
            with real_open(shard, "r+b") as writer:  # another process, as the upload starts reading
                writer.seek(12 * MB)
                writer.write(b"\0" * 16)
        return handle

    monkeypatch.setattr(s3_upload, "open", open_then_write, raising=False)
    target = target_for(s3.url)
    with pytest.raises(ArtifactError, match=r"model-00001-of-00002\.safetensors: changed while it was read"):
        storage.stage(settled, StagingSpec(s3=target))
    assert f"releases/{settled.name}/manifest.json" not in keys(storage.s3_client(target), target.bucket)
