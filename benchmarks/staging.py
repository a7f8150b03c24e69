"""Staging throughput vs `aws s3 cp --recursive`, against the same local S3 server, in one run.

    .venv/bin/python benchmarks/staging.py [--size-gb 1.0]

Prints MB/s of this project's `stage` and of awscli (the reference), their ratio, the time
to re-stage the unchanged artifact, and the bytes re-sent after an interrupted upload.
awscli pins its own botocore, so it gets a small venv of its own under MODEL_RELEASE_HOME.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import artifacts, measurements, storage
from pipeline.core.errors import ReleaseError
from pipeline.core.paths import home
from pipeline.core.spec import S3Target, StagingSpec
from testkit.s3server import FaultProxy, MotoServer

MB = 1024 * 1024


def awscli() -> Path:
    venv = home() / "bench-awscli"
    aws = venv / "bin" / "aws"
    if not aws.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "awscli"], check=True)
    return aws


def make_artifact(root: Path, size_gb: float) -> Path:
    root.mkdir(parents=True)
    rng = random.Random(0)
    big = int(size_gb * 1e9 / 4)
    block = rng.randbytes(8 * MB)
    for i in range(4):
        with open(root / f"model-{i + 1:05d}-of-00004.safetensors", "wb") as handle:
            written = 0
            while written < big:
                chunk = block[: min(len(block), big - written)]
                handle.write(bytes([i]) + chunk[1:])
                written += len(chunk)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (root / name).write_text("{}" * 100)
    artifacts.write_manifest(root, kind="fp8-model")
    return root


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    aws = awscli()
    server = MotoServer()
    work = Path(tempfile.mkdtemp(prefix="staging-bench-"))
    try:
        artifact = make_artifact(work / "fp8-bench", args.size_gb)
        total = artifacts.read_manifest(artifact).total_bytes
        target = S3Target(bucket="bench", prefix="ours", endpoint_url=server.url, create_bucket=True)
        storage.s3_client(target).create_bucket(Bucket="bench")

        started = time.monotonic()
        subprocess.run(
            [
                str(aws),
                "s3",
                "cp",
                "--recursive",
                "--only-show-errors",
                str(artifact),
                "s3://bench/awscli/",
                "--endpoint-url",
                server.url,
            ],
            check=True,
            env={**os.environ, **env},
        )
        aws_s = time.monotonic() - started

        started = time.monotonic()
        storage.stage(artifact, StagingSpec(s3=target))
        ours_s = time.monotonic() - started

        started = time.monotonic()
        again = storage.stage(artifact, StagingSpec(s3=target))
        restage_s = time.monotonic() - started

        resume_target = target.model_copy(update={"prefix": "resume"})
        proxy = FaultProxy(server.port, cut_after=total // 2)
        try:
            storage.stage(artifact, StagingSpec(s3=resume_target.model_copy(update={"endpoint_url": proxy.url})))
        except ReleaseError:
            pass
        finally:
            proxy.close()
        resumed = storage.stage(artifact, StagingSpec(s3=resume_target))

        mb = total / 1e6
        print(
            f"\nartifact: {mb:.0f} MB in {len(artifacts.read_manifest(artifact).files)} files, local S3 server (moto)"
        )
        print(f"{'what':44} {'seconds':>8} {'MB/s':>8}")
        print(f"{'aws s3 cp --recursive (reference)':44} {aws_s:8.2f} {mb / aws_s:8.1f}")
        print(f"{'model-release stage':44} {ours_s:8.2f} {mb / ours_s:8.1f}")
        print(f"{'ratio stage / awscli (throughput)':44} {aws_s / ours_s:8.2f}x")
        print(f"{'re-stage unchanged artifact':44} {restage_s:8.2f}   (sent {again.bytes_sent} bytes)")
        print(
            f"{'after a cut at 50%: bytes re-sent':44} {resumed.bytes_sent / 1e6:8.1f} MB of {mb:.0f} MB "
            f"({100 * resumed.bytes_sent / total:.0f}%)"
        )
        path = measurements.record(
            "staging",
            {
                "artifact_mb": mb,
                "files": len(artifacts.read_manifest(artifact).files),
                "awscli": {"seconds": aws_s, "mb_s": mb / aws_s},
                "stage": {"seconds": ours_s, "mb_s": mb / ours_s},
                "ratio_stage_awscli": aws_s / ours_s,
                "restage_unchanged": {"seconds": restage_s, "bytes_sent": again.bytes_sent},
                "resume_after_cut_at_half": {"bytes_sent": resumed.bytes_sent, "fraction": resumed.bytes_sent / total},
            },
            summary=f"stage {mb / ours_s:.0f} MB/s vs awscli {mb / aws_s:.0f} MB/s ({aws_s / ours_s:.2f}x) on "
            f"{mb:.0f} MB; after a cut at 50% {100 * resumed.bytes_sent / total:.0f}% re-sent",
        )
        print(f"record: {path}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
