"""Staging and fetch throughput vs `aws s3 cp --recursive`, against the same local S3 server, in one run.

    .venv/bin/python benchmarks/staging.py [--size-gb 1.0] [--runs 3]

Uploads (`model-release stage` vs `aws s3 cp --recursive DIR s3://…`) and downloads (`fetch`, what
every serving pod runs, vs `aws s3 cp --recursive s3://… DIR`) alternate their order run by run
(awscli first in even runs, ours first in odd ones), each to a fresh prefix or directory, and the
medians are compared. Beside MB/s each side's CPU seconds per GB: this process's own CPU time for
ours, the awscli child's (getrusage) for the reference; client and server share the machine's
cores, so CPU per byte moves the ratio as much as the link does. Then the re-stage of the unchanged
artifact (digest cache warm, and cold once), and a cut at 50% of the bytes followed by a resume,
counting the bytes sent twice: those of parts or objects the server held after the cut that the
resume sent again (bytes in flight at the cut were never stored, so they are not counted).

awscli pins its own botocore, so it gets a venv of its own under MODEL_RELEASE_HOME, installed from
requirements/awscli.lock.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import artifacts, measurements, s3, s3_upload, storage
from pipeline.core.errors import ReleaseError
from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.core.specs import S3Target, StagingSpec
from testkit.s3server import FaultProxy, MotoServer

MB = 1024 * 1024
AWSCLI_LOCK = PROJECT_ROOT / "requirements" / "awscli.lock"


def awscli() -> tuple[Path, str]:
    """The pinned awscli (installed on first use), and its version line."""
    venv = home() / "bench-awscli"
    aws = venv / "bin" / "aws"
    pinned = next(line for line in AWSCLI_LOCK.read_text().splitlines() if line.startswith("awscli=="))
    version = subprocess.run([str(aws), "--version"], capture_output=True, text=True).stdout if aws.exists() else ""
    if f"aws-cli/{pinned.split('==')[1]} " not in version:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-r", str(AWSCLI_LOCK)], check=True)
        version = subprocess.run([str(aws), "--version"], capture_output=True, text=True, check=True).stdout
    return aws, version.strip()


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


def timed_child(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a child process run to completion."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(cmd, check=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed_self(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of `fn()`."""
    cpu, started = time.process_time(), time.monotonic()
    fn()
    return time.monotonic() - started, time.process_time() - cpu


def drop_prefix(client, bucket: str, prefix: str) -> None:
    """Delete what a run uploaded, so the server's disk holds one copy at a time."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects})
    for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def held_after_cut(client, bucket: str, prefix: str) -> dict[tuple[str, int], int]:
    """(key, part number) -> bytes of every part or whole object (part 0) the server holds."""
    held = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            held[(obj["Key"], 0)] = obj["Size"]
    for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
        parts = client.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for part in parts.get("Parts", []):
            held[(upload["Key"], part["PartNumber"])] = part["Size"]
    return held


def summarize(rows: list[dict], total: int) -> dict:
    seconds = statistics.median(r["seconds"] for r in rows)
    cpu = statistics.median(r["cpu_s"] for r in rows)
    return {
        "runs": rows,
        "median_seconds": round(seconds, 2),
        "median_mb_s": round(total / 1e6 / seconds, 1),
        "median_cpu_s_per_gb": round(cpu / (total / 1e9), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3, help="alternated runs of each side (at least 3)")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs: at least 3, so a median means something")
    logging.basicConfig(level=logging.WARNING)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"})
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    aws, aws_version = awscli()
    server = MotoServer()
    work = Path(tempfile.mkdtemp(prefix="staging-bench-"))
    digest_cache = home() / "cache" / "stage-digests"
    try:
        artifact = make_artifact(work / "fp8-bench", args.size_gb)
        manifest = artifacts.read_manifest(artifact)
        total = manifest.total_bytes
        # a CRC32 per part, as awscli's botocore sends by default: the same checksum work on both sides
        target = S3Target(
            bucket="bench", prefix="ours", endpoint_url=server.url, create_bucket=True, part_checksum="crc32"
        )
        client = s3.s3_client(target)
        client.create_bucket(Bucket="bench")
        aws_cp = [str(aws), "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", server.url]
        load_before = os.getloadavg()

        up: dict[str, list[dict]] = {"awscli": [], "stage": []}
        for run in range(args.runs):
            order = ["awscli", "stage"] if run % 2 == 0 else ["stage", "awscli"]
            for side in order:
                if side == "awscli":
                    wall, cpu = timed_child([*aws_cp, str(artifact), f"s3://bench/awscli-{run}/"])
                    drop_prefix(client, "bench", f"awscli-{run}/")
                else:
                    shutil.rmtree(digest_cache, ignore_errors=True)  # a first stage reads every byte
                    run_target = target.model_copy(update={"prefix": f"ours-{run}"})
                    wall, cpu = timed_self(lambda t=run_target: storage.stage(artifact, StagingSpec(s3=t)))
                    if run < args.runs - 1:
                        drop_prefix(client, "bench", f"ours-{run}/")
                up[side].append({"seconds": round(wall, 2), "cpu_s": round(cpu, 2), "order": order.index(side)})
                print(f"upload run {run} {side:7} {wall:7.2f} s {total / 1e6 / wall:7.1f} MB/s cpu {cpu:6.2f} s")

        staged_target = target.model_copy(update={"prefix": f"ours-{args.runs - 1}"})
        uri = s3.s3_uri(staged_target, artifact.name)
        down: dict[str, list[dict]] = {"awscli": [], "fetch": []}
        for run in range(args.runs):
            order = ["awscli", "fetch"] if run % 2 == 0 else ["fetch", "awscli"]
            for side in order:
                dest = work / f"{side}-{run}"
                if side == "awscli":
                    wall, cpu = timed_child([*aws_cp, f"{uri}/", str(dest)])
                else:
                    wall, cpu = timed_self(lambda d=dest: storage.fetch(uri, d, staged_target))
                shutil.rmtree(dest)
                down[side].append({"seconds": round(wall, 2), "cpu_s": round(cpu, 2), "order": order.index(side)})
                print(f"fetch  run {run} {side:7} {wall:7.2f} s {total / 1e6 / wall:7.1f} MB/s cpu {cpu:6.2f} s")

        # re-stage of the unchanged artifact: the digest cache is warm after the last stage
        started = time.monotonic()
        again = storage.stage(artifact, StagingSpec(s3=staged_target))
        restage_s = time.monotonic() - started
        shutil.rmtree(digest_cache, ignore_errors=True)
        started = time.monotonic()
        storage.stage(artifact, StagingSpec(s3=staged_target))
        restage_cold_s = time.monotonic() - started
        drop_prefix(client, "bench", f"ours-{args.runs - 1}/")

        # a cut at 50% of the bytes, then a resume from a fresh client (as another process would)
        shutil.rmtree(digest_cache, ignore_errors=True)
        resume_target = target.model_copy(update={"prefix": "resume"})
        proxy = FaultProxy(server.port, cut_after=total // 2)
        try:
            storage.stage(artifact, StagingSpec(s3=resume_target.model_copy(update={"endpoint_url": proxy.url})))
        except ReleaseError:
            pass
        finally:
            proxy.close()
        held = held_after_cut(client, "bench", "resume/")
        resend = {"bytes": 0, "twice": 0}

        def count(params, **_kw) -> None:
            size = len(params["Body"])
            resend["bytes"] += size
            if (params["Key"], params.get("PartNumber", 0)) in held:
                resend["twice"] += size

        resumer = s3_upload.upload_client(resume_target)
        resumer.meta.events.register("provide-client-params.s3.UploadPart", count)
        resumer.meta.events.register("provide-client-params.s3.PutObject", count)
        resumed = s3_upload.stage_s3(artifact, manifest, resume_target, artifact.name, client=resumer)
        held_bytes = sum(held.values())

        mb = total / 1e6
        ups = {side: summarize(rows, total) for side, rows in up.items()}
        downs = {side: summarize(rows, total) for side, rows in down.items()}
        ratio_up = ups["awscli"]["median_seconds"] / ups["stage"]["median_seconds"]
        ratio_down = downs["awscli"]["median_seconds"] / downs["fetch"]["median_seconds"]
        load = [round(x, 1) for x in (*load_before, *os.getloadavg())]
        print(f"\nartifact: {mb:.0f} MB in {len(manifest.files)} files, local S3 server (moto); {aws_version}")
        print("both clients send a CRC32 with every part (stage: staging.s3.part_checksum crc32; awscli by default)")
        print(f"load average (1/5/15 min) before {load[:3]}, after {load[3:]} on {os.cpu_count()} cores")
        print(f"{'median of ' + str(args.runs) + ' alternated runs':40} {'seconds':>8} {'MB/s':>8} {'CPU s/GB':>9}")
        for label, row in (
            ("aws s3 cp --recursive (upload)", ups["awscli"]),
            ("model-release stage", ups["stage"]),
            ("aws s3 cp --recursive (download)", downs["awscli"]),
            ("fetch", downs["fetch"]),
        ):
            seconds, mb_s, cpu = row["median_seconds"], row["median_mb_s"], row["median_cpu_s_per_gb"]
            print(f"{label:40} {seconds:8.2f} {mb_s:8.1f} {cpu:9.2f}")
        print(f"{'ratio stage / awscli (throughput)':40} {ratio_up:8.2f}x")
        print(f"{'ratio fetch / awscli (throughput)':40} {ratio_down:8.2f}x")
        print(f"{'re-stage unchanged (digest cache warm)':40} {restage_s:8.2f}   (sent {again.bytes_sent} bytes)")
        print(f"{'re-stage unchanged (digest cache cold)':40} {restage_cold_s:8.2f}")
        print(
            f"{'after a cut at 50%: bytes sent twice':40} {resend['twice'] / 1e6:8.1f} MB "
            f"(server held {held_bytes / 1e6:.0f} MB after the cut; the resume sent {resumed[1] / 1e6:.0f} MB)"
        )
        path = measurements.record(
            "staging",
            {
                "artifact_mb": round(mb, 1),
                "files": len(manifest.files),
                "awscli_version": aws_version,
                "part_checksum": target.part_checksum,
                "load_average_before_after": load,
                "upload": {**ups, "ratio_stage_awscli": round(ratio_up, 2)},
                "download": {**downs, "ratio_fetch_awscli": round(ratio_down, 2)},
                "restage_unchanged": {
                    "seconds": round(restage_s, 2),
                    "seconds_cold_digest_cache": round(restage_cold_s, 2),
                    "bytes_sent": again.bytes_sent,
                },
                "resume_after_cut_at_half": {
                    "bytes_held_after_cut": held_bytes,
                    "bytes_sent_by_resume": resumed[1],
                    "bytes_sent_twice": resend["twice"],
                },
            },
            summary=f"{mb:.0f} MB, median of {args.runs} alternated runs: "
            f"stage {ups['stage']['median_mb_s']:.0f} MB/s "
            f"vs awscli {ups['awscli']['median_mb_s']:.0f} ({ratio_up:.2f}x), "
            f"fetch {downs['fetch']['median_mb_s']:.0f} vs {downs['awscli']['median_mb_s']:.0f} ({ratio_down:.2f}x); "
            f"re-stage {restage_s:.1f} s; "
            f"{resend['twice'] / 1e6:.0f} MB sent twice after a cut at 50%",
        )
        print(f"record: {path}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
