"""What a probe costs beyond its load: the tiny model's `single` layout, vLLM's bench client
through `vllm_cli.py bench-server`, a few probes at fixed rates, in one run.

    .venv/bin/python benchmarks/probe_overhead.py [--probes 4] [--rate 30]

Prints each probe's wall seconds (our call, fork to parsed result) against the load's own
duration (vLLM's `duration`) and the ratio of the medians. The first call pays the client's
one-time vLLM import and is listed apart. Ratios within one run hold on a noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.specs import load_spec
from pipeline.stages import benchmark, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument("--rate", type=float, default=30.0)
    args = parser.parse_args()
    loaded = load_spec(ROOT / "configs" / "releases" / "tiny-qwen3-moe-cpu.yaml")
    model = tiny_model.reference()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        with benchmark.running_layout(loaded.spec, loaded.hardware, loaded.layout("single"), model, Path(tmp)) as (
            _,
            prober,
        ):
            print(f"engine healthy after {time.monotonic() - started:.1f} s")
            rows = []
            for i in range(args.probes + 1):
                t = time.monotonic()
                probe = prober(args.rate, 40, 100 + i)
                rows.append((time.monotonic() - t, probe.duration_s))
                label = "first (client import)" if i == 0 else f"probe {i}"
                print(f"{label:22} wall {rows[-1][0]:6.2f} s   load {probe.duration_s:5.2f} s")
    walls, loads = [w for w, _ in rows[1:]], [d for _, d in rows[1:]]
    wall, load = statistics.median(walls), statistics.median(loads)
    print(f"median wall {wall:.2f} s / median load {load:.2f} s = {wall / load:.2f} (overhead {wall - load:.2f} s)")
    path = measurements.record(
        "probe_overhead",
        {
            "rate": args.rate,
            "first_probe": {"wall_s": rows[0][0], "load_s": rows[0][1]},
            "probes": [{"wall_s": w, "load_s": d} for w, d in rows[1:]],
            "median_wall_s": wall,
            "median_load_s": load,
            "ratio_wall_load": wall / load,
        },
        summary=f"a probe's wall time over its load's: {wall / load:.2f} ({wall - load:.2f} s of fixed cost per probe)",
    )
    print(f"record: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
