"""Time to a layout's first probe: vLLM's bench client launched while the engines load (what a
benchmark does) vs launched by the first probe (the reference: what it did before), in one run.

    .venv/bin/python benchmarks/client_start.py [--layout single] [--rounds 2]

Each round starts the tiny model's layout both ways (alternating, fresh engines each time) and
prints the seconds from the start to a client ready for a probe, the engines' own load time
(which the early client must not slow), and the ratio of the medians. One probe at 10 req/s
checks the client answers.
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


class LateClient(benchmark.BenchClient):
    """The reference: ignores the early launch; the first probe starts it."""

    def launch(self, cores: list[int] | None = None) -> None:
        if cores is not None and self.proc is None:
            return
        super().launch(cores)


def late(client: benchmark.BenchClient) -> LateClient:
    return LateClient(client.base, client.env, client.cores)


def to_first_probe(loaded, layout: str, model: Path, work: Path, early: bool) -> tuple[float, float]:
    make = benchmark.bench_client
    if not early:
        benchmark.bench_client = lambda *a, **k: late(make(*a, **k))
    try:
        started = time.monotonic()
        with benchmark.running_layout(loaded.spec, loaded.hardware, loaded.layout(layout), model, work) as (
            engine,
            prober,
        ):
            prober.bench.ensure()
            ready = time.monotonic() - started
            probe = prober(10.0, 20, 7)
            assert probe.completed == 20, probe
            return ready, max(engine.load_seconds)
    finally:
        benchmark.bench_client = make


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="single")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loaded = load_spec(ROOT / "configs" / "releases" / "tiny-qwen3-moe-cpu.yaml")
    model = tiny_model.reference()
    rows: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for early in (False, True):
                ready, load = to_first_probe(loaded, args.layout, model, Path(tmp) / f"{round_}-{early}", early)
                rows[early].append((ready, load))
                label = "early (while loading)" if early else "late (first probe)"
                print(f"round {round_ + 1} {label:22} ready {ready:5.1f} s, engines loaded {load:5.1f} s")
    late, early = (statistics.median(r for r, _ in rows[k]) for k in (False, True))
    late_load, early_load = (statistics.median(load for _, load in rows[k]) for k in (False, True))
    print(f"to first probe: early {early:.1f} s / late {late:.1f} s = {early / late:.2f} (saved {late - early:.1f} s)")
    print(f"engine load:    early {early_load:.1f} s / late {late_load:.1f} s = {early_load / late_load:.2f}")
    path = measurements.record(
        "client_start",
        {
            "layout": args.layout,
            "rounds": [
                {"round": i + 1, "client": label, "ready_s": ready, "engines_loaded_s": load}
                for label, key in (("late (first probe)", False), ("early (while loading)", True))
                for i, (ready, load) in enumerate(rows[key])
            ],
            "to_first_probe_s": {"early": early, "late": late, "ratio": early / late},
            "engine_load_s": {"early": early_load, "late": late_load, "ratio": early_load / late_load},
        },
        summary=f"{args.layout}: to the first probe {early:.1f} s with the client started early vs {late:.1f} s "
        f"(ratio {early / late:.2f}); engines' own load {early_load:.1f} vs {late_load:.1f} s",
    )
    print(f"record: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
