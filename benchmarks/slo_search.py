"""SLO search vs a uniform sweep, against a simulated server with a known true answer, in one run.

    .venv/bin/python benchmarks/slo_search.py [--mu 60] [--ttft-ms 200] [--prompts 300] [--show-probes]
    .venv/bin/python benchmarks/slo_search.py --in-process 200 [--noise 0.1]

The server (testkit/simserver.py) is an M/M/1 prefill queue: p90 TTFT = ln(10)/(mu - rate), so
the true highest rate within the SLO is mu - ln(10)/limit. Load comes from the real
`vllm bench serve` (from .venv-serve) for both methods. Prints, for the search and for a
sweep at the same resolution: runs used, seconds of load, wall seconds, the rate found and
its error vs the truth; then the same search started from a prior (a planner's prediction)
`--prior-off` above and below the truth (default 25%), as the release DAG starts it.
`--in-process` adds 10% either way, and priors drawn across 5-30% off either way (a planner's
error is not one fixed figure).
"""

from __future__ import annotations

import argparse
import logging
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.specs import SloSpec, WorkloadSpec
from pipeline.records.benchmark import Probe
from pipeline.stages import benchmark, serving, tiny_model
from testkit.simserver import true_max_rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mu", type=float, default=60.0, help="prefill service rate, req/s")
    parser.add_argument("--ttft-ms", type=float, default=200.0, help="p90 TTFT limit")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--min-probe-seconds", type=float, default=6.0)
    parser.add_argument("--prior-off", type=float, default=0.25, help="prior = truth x (1 +- this)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the uniform sweep (its many runs)")
    parser.add_argument("--show-probes", action="store_true", help="print each search's probes in order")
    parser.add_argument(
        "--in-process",
        type=int,
        metavar="SEEDS",
        help="instead: the same searches against the M/M/1 model itself (no server, no client), with each "
        "p90 off by up to --noise, over SEEDS seeds: the search's own statistics, free of this machine's noise",
    )
    parser.add_argument("--noise", type=float, default=0.1, help="--in-process: relative p90 noise (uniform)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    slo = SloSpec(max_p90_ttft_ms=args.ttft_ms, max_p90_tpot_ms=50, resolution=0.05)
    workload = WorkloadSpec(
        input_len=16, output_len=8, num_prompts=args.prompts, seed=0, min_probe_seconds=args.min_probe_seconds
    )
    truth = true_max_rate(args.mu, args.ttft_ms)
    if args.in_process:
        return in_process(args, workload, slo, truth)
    tokenizer = tiny_model.reference()
    port = serving.free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "testkit" / "simserver.py"),
            "--port",
            str(port),
            "--mu",
            str(args.mu),
            "--tpot-ms",
            "5",
        ]
    )
    url = f"http://127.0.0.1:{port}"
    while not serving.healthy(url):
        time.sleep(0.2)
    work = Path(tempfile.mkdtemp(prefix="slo-search-"))
    client = [str(serving.SERVE_PYTHON), str(serving.VLLM_CLI)]
    counter = [0]

    def run(rate: float, n: int, seed: int) -> Probe:
        counter[0] += 1
        name = f"p{counter[0]:03d}.json"
        cmd = benchmark.bench_command(client, url, str(tokenizer), workload, slo, rate, n, seed, work, name)
        subprocess.run(cmd, check=True, capture_output=True, env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
        return benchmark.parse_result(work / name, rate, n, slo)

    try:
        started = time.monotonic()
        outcome = benchmark.slo_search(run, workload, slo)
        probes, capacity, found, reason = outcome.probes, outcome.capacity, outcome.max_slo_rate, outcome.stop_reason
        search_wall = time.monotonic() - started
        started = time.monotonic()
        sweep, swept = ([], None) if args.no_sweep else benchmark.uniform_sweep(run, capacity, workload, slo)
        sweep_wall = time.monotonic() - started
        with_prior = []
        for sign in (+1, -1):
            prior = truth * (1 + sign * args.prior_off)
            started = time.monotonic()
            searched = benchmark.slo_search(run, workload, slo, prior=prior)
            with_prior.append((f"from a prior {sign * args.prior_off:+.0%}", searched, time.monotonic() - started))
    finally:
        server.terminate()
    print(
        f"\nsimulated M/M/1 server: mu={args.mu:g} req/s, p90 TTFT limit {args.ttft_ms:g} ms"
        f" -> true max rate {truth:.2f} req/s"
    )
    print(f"highest throughput measured: {capacity:.2f} req/s; search: {reason}")
    print(f"{'method':28} {'runs':>5} {'load s':>8} {'wall s':>8} {'found':>8} {'error':>8}")
    rows = [
        ("bracket + bisection", probes, found, search_wall),
        *([] if args.no_sweep else [("uniform sweep (5% steps)", sweep, swept, sweep_wall)]),
        *((name, o.probes, o.max_slo_rate, wall) for name, o, wall in with_prior),
    ]
    table = []
    for name, ps, rate, wall in rows:
        load = sum(p.duration_s for p in ps)
        err = f"{100 * (rate - truth) / truth:+.1f}%" if rate else "n/a"
        print(f"{name:28} {len(ps):5d} {load:8.1f} {wall:8.1f} {rate or math.nan:8.2f} {err:>8}")
        table.append(
            {
                "method": name,
                "runs": len(ps),
                "load_s": load,
                "wall_s": wall,
                "found": rate,
                "error": (rate - truth) / truth if rate else None,
            }
        )
    if args.show_probes:
        for name, ps, _, _ in rows:
            trail = ", ".join(
                f"{p.rate:.1f}{'+' if p.passed else '-'}({p.p90_ttft_ms:.0f} ms)" for p in ps if not p.superseded
            )
            print(f"{name}: {trail}")
    if sweep:
        print(f"runs ratio search/sweep: {len(probes) / len(sweep):.2f}")
    mean_prior = sum(len(o.probes) for _, o, _ in with_prior) / len(with_prior)
    print(f"runs ratio search from a prior / without (mean of both priors): {mean_prior / len(probes):.2f}")
    path = measurements.record(
        "slo_search",
        {"mu": args.mu, "ttft_limit_ms": args.ttft_ms, "true_max_rate": truth, "methods": table},
        summary=f"against a simulated M/M/1 server (true max {truth:.2f} req/s): the search "
        f"{len(probes)} runs, {found or math.nan:.2f} req/s"
        + (f"; a uniform sweep {len(sweep)} runs" if sweep else ""),
    )
    print(f"record: {path.relative_to(ROOT)}")


def in_process(args: argparse.Namespace, workload: WorkloadSpec, slo: SloSpec, truth: float) -> None:
    """Mean runs and |error| per start over many seeds, against the model's own p90s."""
    from testkit.probes import mm1_run

    logging.disable(logging.WARNING)
    # the prior --prior-off either way (the planner issue's target), and 10% either way: the first step from a
    # prior is 1.25x, so a prior exactly 25% off puts one step on the edge and flatters the search
    offs = [args.prior_off, *([0.1] if args.prior_off != 0.1 else [])]
    priors = [(f"from a prior {sign * off:+.0%}", 1 + sign * off) for off in offs for sign in (1, -1)]
    starts = [("bracket + bisection", None), *priors]
    print(f"M/M/1 model in-process: mu={args.mu:g}, limit {args.ttft_ms:g} ms, p90 noise up to {args.noise:.0%}, "
          f"{args.in_process} seeds; true max rate {truth:.2f} req/s")  # fmt: skip
    print(f"{'start':28} {'mean runs':>9} {'max':>4} {'mean |error|':>12} {'max |error|':>11} {'no answer':>9}")

    def row(name: str, factors: list[float | None]) -> float:
        """Every seed's search from each prior factor (None: no prior): one printed row; its mean runs."""
        runs, errors, missing = [], [], 0
        for factor in factors:
            for seed in range(args.in_process):
                run = mm1_run(args.mu, slo, noise=args.noise, seed=seed)
                found = benchmark.slo_search(run, workload, slo, prior=truth * factor if factor else None)
                runs.append(len(found.probes))
                if found.max_slo_rate is None:
                    missing += 1
                else:
                    errors.append(abs(found.max_slo_rate / truth - 1))
        mean = sum(runs) / len(runs)
        print(f"{name:28} {mean:9.2f} {max(runs):4d} {sum(errors) / max(len(errors), 1):12.1%} "
              f"{max(errors, default=0):11.1%} {missing:9d}")  # fmt: skip
        table.append(
            {
                "start": name,
                "mean_runs": mean,
                "max_runs": max(runs),
                "mean_abs_error": sum(errors) / max(len(errors), 1),
                "max_abs_error": max(errors, default=0),
                "no_answer": missing,
            }
        )
        return mean

    table: list[dict[str, float | str]] = []

    means = {name: row(name, [factor]) for name, factor in starts}
    with_prior = (means[starts[1][0]] + means[starts[2][0]]) / 2
    print(f"runs ratio from a prior {args.prior_off:.0%} off / without: {with_prior / means[starts[0][0]]:.2f}")
    # a planner's error is not a fixed figure: priors 5, 10, ... 30% off either way, each over the same seeds
    row("from priors 5-30% off", [1 + sign * off for off in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3) for sign in (1, -1)])
    path = measurements.record(
        "slo_search_in_process",
        {"mu": args.mu, "ttft_limit_ms": args.ttft_ms, "noise": args.noise, "seeds": args.in_process, "starts": table},
        summary=f"the search against the M/M/1 model over {args.in_process} seeds, p90 noise {args.noise:.0%}: "
        + ", ".join(f"{r['start']} {r['mean_runs']:.2f} runs" for r in table),
    )
    print(f"record: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
