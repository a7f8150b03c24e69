"""Manifests, verification and atomic publishing."""

from __future__ import annotations

import pytest

from pipeline.core import artifacts
from pipeline.core.errors import ArtifactError


def make_artifact(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"x" * 1000)
    (root / "sub" / "b.txt").write_text("hello")
    return artifacts.write_manifest(root, kind="test", meta={"k": 1})


def test_manifest_lists_every_file_with_size_and_digest(tmp_path):
    manifest = make_artifact(tmp_path)
    assert [(f.path, f.size) for f in manifest.files] == [("a.bin", 1000), ("sub/b.txt", 5)]
    assert artifacts.verify(tmp_path).content_hash() == manifest.content_hash()


def test_content_hash_ignores_creation_time_but_not_content(tmp_path):
    first = make_artifact(tmp_path / "one")
    second = make_artifact(tmp_path / "two")
    assert first.content_hash() == second.content_hash()
    (tmp_path / "two" / "a.bin").write_bytes(b"y" * 1000)
    assert artifacts.write_manifest(tmp_path / "two", kind="test").content_hash() != first.content_hash()


def test_one_flipped_byte_is_caught_and_named(tmp_path):
    make_artifact(tmp_path)
    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[500] ^= 1
    (tmp_path / "a.bin").write_bytes(bytes(data))
    artifacts.verify(tmp_path, deep=False)  # same size: only the digest can tell
    with pytest.raises(ArtifactError, match=r"a\.bin: sha256 does not match"):
        artifacts.verify(tmp_path)


def test_missing_and_truncated_files_are_named(tmp_path):
    make_artifact(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    with pytest.raises(ArtifactError, match=r"a\.bin: size 10 bytes, manifest says 1000"):
        artifacts.verify(tmp_path, deep=False)
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub" / "b.txt").unlink()
    with pytest.raises(ArtifactError, match=r"b\.txt: missing"):
        artifacts.verify(tmp_path)


def test_directory_without_manifest_is_not_an_artifact(tmp_path):
    (tmp_path / "x").write_text("1")
    with pytest.raises(ArtifactError, match="no manifest.json"):
        artifacts.verify(tmp_path)


def test_publishing_is_all_or_nothing(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with artifacts.publishing(final) as tmp:
            (tmp / "half.bin").write_bytes(b"1")
            raise RuntimeError("killed midway")
    assert not final.exists() and list(tmp_path.iterdir()) == []

    with pytest.raises(ArtifactError, match="without a manifest.json"):
        with artifacts.publishing(final) as tmp:
            (tmp / "half.bin").write_bytes(b"1")
    assert not final.exists()

    with artifacts.publishing(final) as tmp:
        make_artifact(tmp)
    assert artifacts.verify(final).kind == "test"


def test_the_sha256_a_manifest_was_written_with_is_recorded_by_stat_and_only_while_the_file_is_unchanged(tmp_path):
    """`scan` records each file's sha256 under its stat key, so staging next need not read it for
    that: a write since (same size, mtime put back) moves ctime and drops the record; a file
    written within RACY_NS of the scan (it could change again within one timestamp tick) gets none."""
    (tmp_path / "settled.bin").write_bytes(b"s" * 4096)
    __import__("time").sleep(2 * artifacts.RACY_NS / 1e9)
    (tmp_path / "fresh.bin").write_bytes(b"f" * 4096)
    manifest = artifacts.write_manifest(tmp_path, kind="test")
    settled, fresh = tmp_path / "settled.bin", tmp_path / "fresh.bin"
    by_path = {f.path: f.sha256 for f in manifest.files}
    assert artifacts.recorded_sha256(artifacts.stat_key(settled)) == by_path["settled.bin"]
    assert artifacts.recorded_sha256(artifacts.stat_key(fresh)) is None
    before = settled.stat()
    with open(settled, "r+b") as handle:
        handle.write(b"S")  # same inode, same size
    __import__("os").utime(settled, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert artifacts.recorded_sha256(artifacts.stat_key(settled)) is None
