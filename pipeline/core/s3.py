"""The S3 side both directions share: the client, botocore's errors as ReleaseErrors, object keys
and URIs, and the two reads a stage, a fetch and a check all make (the committed manifest, an
object's size and sha256 metadata). The one module that builds a boto3 client, so credentials,
retries and checksum settings are decided once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.core import artifacts, platform
from pipeline.core.errors import ArtifactError, ReleaseError
from pipeline.core.specs import S3Target
from pipeline.core.transfer import FINISHERS, READERS, WORKERS

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------- keys and the reads every direction shares


def _key(prefix: str, name: str, rel: str) -> str:
    return "/".join(part.strip("/") for part in (prefix, name, rel) if part.strip("/"))


def s3_uri(target: S3Target, name: str) -> str:
    return f"s3://{target.bucket}/{_key(target.prefix, name, '')}"


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


def _check_object(client, bucket: str, key: str, entry: artifacts.FileEntry) -> None:
    head = client.head_object(Bucket=bucket, Key=key)
    if head["ContentLength"] != entry.size or head.get("Metadata", {}).get("sha256") != entry.sha256:
        raise ArtifactError(
            f"s3://{bucket}/{key}: server holds {head['ContentLength']} bytes / sha256 "
            f"{head.get('Metadata', {}).get('sha256')}, manifest says {entry.size} / {entry.sha256}"
        )
