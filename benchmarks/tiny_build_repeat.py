"""Does a rebuild of the tiny model on this machine reproduce the shipped bytes, and if not, how far are
its task scores from theirs? (#57) Run it on a lock bump of torch or transformers (a test holds the
shipped build's versions to the lock's) and before re-committing the reference build.

    .venv/bin/python benchmarks/tiny_build_repeat.py [--seed N] [--steps N] [--twice] [--keep DIR]

The build is `model-release make-tiny-model --out DIR` in a fresh process into a fresh directory
(nothing reused). Prints its content hash (the manifest's hash of paths, sizes and sha256s), seconds,
whether it is the shipped build's (`tiny_model.REFERENCE`), and the spec's accuracy tasks (lm-eval, on
this CPU) for the shipped build and the rebuild side by side, each difference in combined standard
errors. `--twice` builds a second time beside a busy core (as the suite's tests ran beside the build
before it shipped) and says whether the two builds match: determinism on one machine. `--keep DIR`
keeps the (first) build there, e.g. to run the suite on it (`MODEL_RELEASE_TEST_TINY_MODEL=DIR`).
The bytes depend on the CPU's instruction set (torch's kernels), so another CPU may differ: that is
what the scores are for. Records the figures under benchmarks/results/tiny_build_repeat/.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import artifacts, measurements
from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.core.specs import load_spec
from pipeline.stages import evaluate, tiny_model

SPIN = "import time\nwhile True:\n    sum(range(10000))\n"
TINY_SPEC = PROJECT_ROOT / "configs" / "releases" / "tiny-qwen3-moe-cpu.yaml"


def one_build(out: Path, seed: int | None, steps: int | None, busy: bool) -> dict:
    argv = [sys.executable, "-m", "pipeline.cli", "make-tiny-model", "--out", str(out)]
    argv += ["--seed", str(seed)] if seed is not None else []
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


def scores(model: Path) -> dict[str, tuple[float, float]]:
    """task -> (score, stderr) for the tiny spec's accuracy tasks, lm-eval on this CPU."""
    evaluation = load_spec(TINY_SPEC).spec.evaluation
    result = evaluate.evaluate(model, artifacts.read_manifest(model).content_hash(), evaluation)
    return {s.task: (s.score, s.stderr or 0.0) for s in result.scores}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, help="training seed (default: the reference build's)")
    parser.add_argument("--steps", type=int, help="training steps (default: the reference build's)")
    parser.add_argument("--twice", action="store_true", help="build twice: the same bytes on this machine?")
    parser.add_argument("--keep", help="keep the (first) build in this directory (must not exist)")
    args = parser.parse_args()
    keep = Path(args.keep).resolve() if args.keep else None
    if keep is not None and keep.exists():
        parser.error(f"--keep {keep}: exists")
    work = Path(tempfile.mkdtemp(prefix="tiny-build-repeat-", dir=home()))
    try:
        builds = []
        for i, busy in enumerate((False, True)[: 2 if args.twice else 1]):
            out = keep if (i == 0 and keep) else work / f"build-{i + 1}"
            print(f"build {i + 1}: {'beside a busy core' if busy else 'quiet'} -> {out} ...", flush=True)
            builds.append(one_build(out, args.seed, args.steps, busy))
            print(f"  {builds[-1]}", flush=True)
        first = keep or work / "build-1"
        own = scores(first)
        shipped = scores(tiny_model.reference())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cfg = tiny_model.TinyConfig(**{k: v for k, v in (("seed", args.seed), ("steps", args.steps)) if v is not None})
    reference_config = cfg == tiny_model.TinyConfig()
    reproduced = builds[0]["content_hash"] == tiny_model.REFERENCE.content_hash
    repeat = builds[0]["content_hash"] == builds[1]["content_hash"] if args.twice else None
    print(
        f"rebuild {builds[0]['content_hash'][:16]} vs shipped {tiny_model.REFERENCE.content_hash[:16]}: "
        + ("the same bytes" if reproduced else "different bytes")
        + ("" if reference_config else " (another config than the reference's)")
    )
    if args.twice:
        print(f"second build {builds[1]['content_hash'][:16]}: {'the same' if repeat else 'DIFFERENT'} as the first")
    rows = {}
    print(f"{'task':<20} {'shipped':>16} {'rebuild':>16} {'diff':>8} {'in SE':>6}")
    for task, (ref, ref_se) in shipped.items():
        got, got_se = own[task]
        se = math.sqrt(ref_se**2 + got_se**2)
        rows[task] = {
            "shipped": round(ref, 4),
            "rebuild": round(got, 4),
            "difference": round(got - ref, 4),
            "in_combined_stderr": round((got - ref) / se, 2) if se else None,
        }
        print(
            f"{task:<20} {ref:>9.4f} ±{ref_se:.4f} {got:>9.4f} ±{got_se:.4f} {got - ref:>+8.4f} "
            f"{rows[task]['in_combined_stderr'] if se else '-':>6}"
        )
    path = measurements.record(
        "tiny_build_repeat",
        {
            "config": cfg.model_dump(),
            "reference": tiny_model.REFERENCE.model_dump(),
            "builds": builds,
            "reproduces_the_shipped_bytes": reproduced,
            "same_bytes_twice": repeat,
            "scores": rows,
        },
        summary=f"rebuild {builds[0]['content_hash'][:12]}: "
        + ("the shipped bytes" if reproduced else "not the shipped bytes")
        + "; largest score difference "
        + f"{max(abs(r['difference']) for r in rows.values()):.3f}",
    )
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
