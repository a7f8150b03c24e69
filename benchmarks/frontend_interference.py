"""Does CPU work on the frontend core slow the engine, whatever its scheduling class? One engine of a
layout, vLLM's client at one rate, rounds of: quiet, then a spinner in SCHED_IDLE pinned to the
frontend core (the class `serving.isolated` moves other processes to while a layout is measured).

    .venv/bin/python benchmarks/frontend_interference.py [--layout single] [--rate 200] [--rounds 3]

Why: the release DAG's answer ran below the other doors' while Airflow was up (#44), though Airflow's
processes were confined to the frontend core and in the idle class. If an idle-class spinner there
still slows the engine (its own p90 TTFT from /metrics, beside the client's), the two cores share
hardware and no priority keeps other work from the measurement: only less work does. Prints each
round's p90 TTFT (client, engine), the spinner's cores, and the ratio spinner / quiet per round;
ratios within one run hold on a noisy machine, absolute figures do not.
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
from pipeline.core.spec import load_spec
from pipeline.stages import benchmark, tiny_model

SPIN = "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass\n"


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
    model = tiny_model.build()
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

                for label in ("quiet", "idle_spinner"):
                    spin = subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=pin) if label != "quiet" else None
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
                row["ratio"] = round(row["idle_spinner"]["p90_ttft_ms"] / row["quiet"]["p90_ttft_ms"], 2)
                rows.append(row)
                q, s = row["quiet"], row["idle_spinner"]
                print(
                    f"round {round_ + 1}: quiet p90 TTFT {q['p90_ttft_ms']:.0f} ms "
                    f"(engine {q['engine_p90_ttft_ms']}) | idle-class spinner on cores {cores}: p90 TTFT "
                    f"{s['p90_ttft_ms']:.0f} ms (engine {s['engine_p90_ttft_ms']}, spinner {s['other_cores']} "
                    f"cores) | spinner / quiet {row['ratio']:.2f}",
                    flush=True,
                )
    median = statistics.median(r["ratio"] for r in rows)
    path = measurements.record(
        "frontend_interference",
        {"layout": args.layout, "rate": args.rate, "seconds": args.seconds, "frontend_cores": cores, "rows": rows},
        summary=f"{args.layout} at {args.rate:g} req/s: p90 TTFT with an idle-class spinner on the frontend core "
        f"/ quiet, median of {len(rows)} rounds {median:.2f}x",
    )
    print(f"median spinner / quiet: {median:.2f}x\nrecord: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
