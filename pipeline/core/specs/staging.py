"""Where the quantized artifact is staged (`staging:`): an S3 bucket, an NFS path or both."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.specs.base import Strict


class S3Target(Strict):
    connection_id: str = Field("spaces_default", description="Airflow connection (amazon provider type)")
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = Field(
        None, description="default: the connection's extra endpoint_url, else AWS_ENDPOINT_URL"
    )
    region: str | None = None
    create_bucket: bool = Field(
        False, description="create the bucket if missing (embedded default); production buckets exist"
    )
    part_checksum: Literal["crc32"] | None = Field(
        None,
        description="crc32: every part and small object also carries its CRC32 (x-amz-checksum-crc32, the "
        "checksum awscli sends by default), which AWS S3 verifies and keeps as the object's composite "
        "checksum; the Content-MD5 and ETag checks stay. Off by default: not every S3-compatible store "
        "accepts the header (the embedded default's moto and AWS S3 do)",
    )
    stream: bool = Field(
        False,
        description="serving pods stream the weights from the bucket (vLLM's --load-format runai_streamer) "
        "instead of fetching them to node-local disk first; an init container checks every object's size and "
        "sha256 record against the manifest before the engine starts. Ignored where the artifact is on NFS",
    )
    read_connection_id: str | None = Field(
        None,
        description="the connection of a read-only key for the bucket: what serving pods get (required with "
        "stream; the staging connection can write)",
    )

    @model_validator(mode="after")
    def _stream_reads_only(self) -> S3Target:
        if self.stream and not self.read_connection_id:
            raise ValueError("read_connection_id: required with stream: true (engines get read-only credentials)")
        return self


class NfsTarget(Strict):
    path: str


class StagingSpec(Strict):
    s3: S3Target | None = None
    nfs: NfsTarget | None = None

    @model_validator(mode="after")
    def _one_target(self) -> StagingSpec:
        if self.s3 is None and self.nfs is None:
            raise ValueError("set at least one of s3 or nfs")
        return self
