"""Is a client that holds N requests in flight the same load as an engine of max-num-seqs N?

    .venv/bin/python benchmarks/batch_limit.py [--limit 8] [--rates 90,115,140,180] [--rounds 2] [--out DIR]

Why: layouts of small batches (max-num-seqs 8) were over-predicted by 20-30% (README, the planner's
run log), and the profile measures its shapes on one engine of the spec's first layout. A load at
N in flight from vLLM's client (--max-concurrency) would be a batch-limited shape without a
second engine start, if the engine saw it as an engine of max-num-seqs N sees a queue. This
measures both in alternating rounds (engine limited, client limited, ...: a machine drifting
through the run lands on both alike) at the same offered Poisson rates, and prints per rate the
mean over rounds of what vLLM's client and the engine's own histograms read, and the ratio
client-held / engine-held. A ratio near 1 in TPOT and carried rate says the cheaper shape would do.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.files import atomic_write
from pipeline.core.specs import load_spec
from pipeline.stages import benchmark, sources

PROBE_SECONDS = 8
SEED = 5  # not a seed the profile's loads use


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default=str(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml"))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--rates", default="90,115,140,180", help="offered req/s, the last past the limit's capacity")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each: engine-held, then client-held")
    parser.add_argument("--out", help="where the engines' logs and the client's results go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_spec(args.spec)
    spec, hw = loaded.spec, loaded.hardware
    model = Path(sources.materialize(spec, loaded.path.parent).path)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="batch-limit-"))
    rates = [float(r) for r in args.rates.split(",")]
    first = spec.layouts[0]
    held_by = {
        "engine": first.model_copy(update={"engine_args": {**first.engine_args, "max-num-seqs": args.limit}}),
        "client": first,  # its own max-num-seqs (the spec's), the client holding args.limit in flight
    }
    rows: list[dict[str, float | str]] = []
    for round_ in range(args.rounds):
        for held, layout in held_by.items():
            limit = ("--max-concurrency", str(args.limit)) if held == "client" else ()
            with benchmark.running_layout(spec, hw, layout, model, out / f"{round_}-{held}") as (_, prober):
                for index, rate in enumerate([rates[0], *rates]):  # the first once unrecorded: a warm-up
                    probe = prober(rate, int(rate * PROBE_SECONDS), SEED + index, client_args=limit)
                    seen = probe.engine
                    row = {
                        "round": round_ + 1,
                        "held": held,
                        "rate": rate,
                        "achieved": probe.achieved_rate,
                        "mean_tpot_ms": json.loads(Path(probe.result_file).read_text())["mean_tpot_ms"],
                        "p90_ttft_ms": probe.p90_ttft_ms,
                        # scheduled to last token, as the engine saw it: how long a request holds its slot
                        "engine_held_ms": (seen.mean_prefill_ms or 0.0) + (seen.mean_decode_ms or 0.0)
                        if seen
                        else math.nan,
                    }
                    if index:
                        rows.append(row)
                        print(
                            f"round {row['round']} {held}-held {rate:g} req/s: carried {row['achieved']:.1f},"
                            f" mean TPOT {row['mean_tpot_ms']:.2f} ms, p90 TTFT {row['p90_ttft_ms']:.1f} ms,"
                            f" a request in the engine {row['engine_held_ms']:.1f} ms",
                            flush=True,
                        )
    atomic_write(out / "rows.json", json.dumps(rows, indent=1))
    print(f"\n{args.limit} in flight, held by the client (engine max-num-seqs {first.engine_args.get('max-num-seqs')})")
    print(f"vs by the engine (max-num-seqs {args.limit}); means over {args.rounds} rounds, ratio client / engine:")
    print(f"{'offered':>8} {'carried':>24} {'mean TPOT ms':>24} {'ms a request in the engine':>28}")
    ratios: list[dict[str, float]] = []
    for rate in rates:

        def mean(held: str, key: str, rate: float = rate) -> float:
            return statistics.mean(float(r[key]) for r in rows if r["held"] == held and r["rate"] == rate)

        cells = []
        ratio = {"offered": rate}
        for key in ("achieved", "mean_tpot_ms", "engine_held_ms"):
            by_engine, by_client = mean("engine", key), mean("client", key)
            cells.append(f"{by_client:.3g} / {by_engine:.3g} = {by_client / by_engine:.2f}")
            ratio[f"{key} client/engine"] = by_client / by_engine
        ratios.append(ratio)
        print(f"{rate:8g} {cells[0]:>24} {cells[1]:>24} {cells[2]:>28}")
    print(f"(rows: {out / 'rows.json'})")
    path = measurements.record(
        "batch_limit",
        {"limit": args.limit, "rounds": args.rounds, "ratios": ratios, "rows": rows},
        summary=f"{args.limit} in flight held by the client vs by the engine: carried "
        + ", ".join(f"{r['achieved client/engine']:.2f}" for r in ratios)
        + f" at {args.rates} req/s offered",
    )
    print(f"record: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
