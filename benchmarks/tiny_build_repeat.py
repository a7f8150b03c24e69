"""Two builds of the tiny model from clean caches: the same bytes? (#44, item 6)

    .venv/bin/python benchmarks/tiny_build_repeat.py [--steps N]

Each build is `model-release make-tiny-model --out DIR` in a fresh process into a fresh directory
(nothing reused: no cached model, a new temporary directory each), one after the other, the first
while another process keeps a core busy (as the suite's tests do beside its background build), the
second on a quiet machine. Prints each build's content hash (the manifest's hash of paths, sizes and
sha256s), seconds and held-out accuracy, whether the two hashes match, and whether they match the
cached build of the same config when there is one; records them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import artifacts, measurements
from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.stages import tiny_model

SPIN = "import time\nwhile True:\n    sum(range(10000))\n"


def one_build(out: Path, steps: int | None, busy: bool) -> dict:
    argv = [sys.executable, "-m", "pipeline.cli", "make-tiny-model", "--out", str(out)]
    argv += ["--steps", str(steps)] if steps else []
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = artifacts.read_manifest(out)
    return {
        "content_hash": manifest.content_hash(),
        "seconds": round(time.monotonic() - started, 1),
        "train_seconds": printed.get("train_seconds"),
        "accuracy": printed.get("accuracy"),
        "beside_a_busy_core": busy,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, help="training steps (default: the shipped config's)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tiny-build-repeat-", dir=home()))
    try:
        builds = []
        for i, busy in enumerate((True, False)):
            print(f"build {i + 1}: {'beside a busy core' if busy else 'quiet'} ...", flush=True)
            builds.append(one_build(work / f"build-{i + 1}", args.steps, busy))
            print(f"  {builds[-1]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = builds[0]["content_hash"] == builds[1]["content_hash"]
    cfg = tiny_model.TinyConfig(**({"steps": args.steps} if args.steps else {}))
    cached = tiny_model.cache_dir(cfg)
    cached_hash = artifacts.read_manifest(cached).content_hash() if artifacts.is_complete(cached) else None
    print(
        f"content hashes: {builds[0]['content_hash'][:16]} / {builds[1]['content_hash'][:16]}: "
        f"{'the same' if same else 'DIFFERENT'}"
    )
    if cached_hash:
        print(
            f"cached build ({cached.name}): {cached_hash[:16]}: "
            f"{'the same' if cached_hash == builds[0]['content_hash'] else 'different'}"
        )
    path = measurements.record(
        "tiny_build_repeat",
        {"config": cfg.model_dump(), "builds": builds, "same_content_hash": same, "cached_hash": cached_hash},
        summary=f"two builds from clean caches: {'same' if same else 'different'} content hash "
        f"({builds[0]['content_hash'][:12]}); {builds[0]['seconds']:.0f} s busy, {builds[1]['seconds']:.0f} s quiet",
    )
    print(f"record: {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
