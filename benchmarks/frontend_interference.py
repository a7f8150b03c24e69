"""Does CPU work on the frontend core slow the engine, whatever its scheduling class? One engine of a
layout, vLLM's client at one rate, rounds of three probes: quiet; a spinner in SCHED_IDLE pinned to
the frontend core, in a session of its own (as Airflow's processes are: the benchmark's client and
engines lead their own sessions too); the same spinner with its session's autogroup at nice 19.

    .venv/bin/python benchmarks/frontend_interference.py [--layout single] [--rate 200] [--rounds 3]

Why: the release DAG's answer ran below the other doors' while Airflow was up (#44), though Airflow's
processes were confined to the frontend core and in the idle class. With the kernel's autogroups on
(`/proc/sys/kernel/sched_autogroup_enabled`), a core is shared between sessions' groups first, so the
idle class does not reach across sessions: `serving.isolated` therefore also puts the other
sessions' autogroups at nice 19. Prints each round's p90 TTFT (client, engine's own from /metrics),
the spinner's cores, and each spinner / quiet ratio; ratios within one run hold on a noisy machine,
absolute figures do not.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.specs import load_spec
from pipeline.stages import benchmark, tiny_model

SPIN = (
    "import os, sys\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "if sys.argv[1] != '0':\n"
    "    open('/proc/self/autogroup', 'w').write(sys.argv[1])\n"
    "while True: pass\n"
)
SPINNERS = {"idle_spinner": "0", "idle_spinner_group_nice19": "19"}  # label -> its autogroup's nice


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default=str(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml"))
    parser.add_argument("--layout", default="single")
    parser.add_argument("--rate", type=float, default=200.0, help="req/s: near the layout's knee shows it best")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_spec(Path(args.spec))
    layout = loaded.layout(args.layout)
    model = tiny_model.reference()
    n = math.ceil(args.rate * args.seconds)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with benchmark.running_layout(loaded.spec, loaded.hardware, layout, model, Path(tmp)) as (_, prober):
            prober.bench.ensure()
            cores = prober.bench.cores  # the frontend core(s): where the client and the API server run
            for round_ in range(args.rounds):
                row: dict = {"round": round_ + 1}

                def pin() -> None:
                    os.sched_setaffinity(0, cores)

                for label in ("quiet", *SPINNERS):
                    spin = (
                        subprocess.Popen(
                            [sys.executable, "-c", SPIN, SPINNERS[label]], preexec_fn=pin, start_new_session=True
                        )
                        if label != "quiet"
                        else None
                    )
                    try:
                        probe = prober(args.rate, n, 60_000 + round_)
                    finally:
                        if spin:
                            spin.kill()
                            spin.wait()
                    row[label] = {
                        "p90_ttft_ms": round(probe.p90_ttft_ms, 1),
                        "engine_p90_ttft_ms": probe.engine.p90_ttft_ms if probe.engine else None,
                        "other_cores": probe.interference.other if probe.interference else None,
                    }
                q = row["quiet"]
                line = f"round {round_ + 1}: quiet p90 TTFT {q['p90_ttft_ms']:.0f} ms (engine {q['engine_p90_ttft_ms']}"
                line += ")"
                for label in SPINNERS:
                    s = row[label]
                    row[f"ratio_{label}"] = round(s["p90_ttft_ms"] / q["p90_ttft_ms"], 2)
                    line += (
                        f" | {label}: {s['p90_ttft_ms']:.0f} ms (engine {s['engine_p90_ttft_ms']}, spinner "
                        f"{s['other_cores']} cores) {row[f'ratio_{label}']:.2f}x"
                    )
                rows.append(row)
                print(line, flush=True)
    medians = {label: statistics.median(r[f"ratio_{label}"] for r in rows) for label in SPINNERS}
    autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled")
    path = measurements.record(
        "frontend_interference",
        {
            "layout": args.layout,
            "rate": args.rate,
            "seconds": args.seconds,
            "frontend_cores": cores,
            "autogroups_enabled": autogroups.read_text().strip() if autogroups.exists() else None,
            "rows": rows,
            "medians": medians,
        },
        summary=f"{args.layout} at {args.rate:g} req/s, p90 TTFT with an idle-class spinner in its own session on "
        f"the frontend core / quiet, median of {len(rows)} rounds: {medians['idle_spinner']:.2f}x with its "
        f"autogroup at nice 0, {medians['idle_spinner_group_nice19']:.2f}x at nice 19",
    )
    for label, median in medians.items():
        print(f"median {label} / quiet: {median:.2f}x")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
