"""The planner held to the engine on this machine, in one run: profile, predict, then measure.

    .venv/bin/python benchmarks/planner.py [--spec configs/releases/tiny-qwen3-moe-cpu.yaml]
        [--seqs 64,16,8] [--two-replicas] [--twice] [--drift] [--out DIR]

1. A profiling run (pipeline/planner/profile.py) on the spec's first layout fits the step-time
   coefficients to this machine's engine (nothing is kept in the registry).
2. The planner predicts each layout's max SLO rate with them, and with the hardware profile's own
   figures for comparison; both are written to disk before any measurement starts.
3. Each layout's SLO search (the release's own benchmark_layout, its bracket started from the
   prediction, as the release DAG starts it) measures it.
Prints predicted vs measured max SLO rate per layout, the error, and both rankings (for each pair
measured in the other order, whether the two layouts' measurements overlap); and this core's
speed (a fixed pure-Python workload) and the memory bandwidth (a 64 MB copy) around the profile and
around each layout's measurement, with
the error the layout would show at the profile's speed: a diagnostic of a shared, drifting machine. The layouts are
the spec's first at several max-num-seqs (the knob the planner's scheduler simulation turns on) and,
with --two-replicas, the spec's two-replica layout. With --drift, the first layout is measured again
and the profile run again after the rest: what one run's truth and calibration move by, the floor
under any prediction's error on this machine. With --twice, every layout is measured twice in a balanced
order (A B C D D C B A): the machine's slow drift within the run lands on every layout's mean alike
instead of on whichever came last, and each layout shows its own repeatability beside its error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.files import atomic_write
from pipeline.core.specs import Layout, load_spec
from pipeline.planner import plan as planner
from pipeline.planner import profile as profiling
from pipeline.records.benchmark import LayoutResult
from pipeline.stages import benchmark, sources

SPEED_LOOPS = 300_000


def speed() -> float:
    """This core's speed now, in loops of a fixed pure-Python workload a millisecond (median of 7
    runs of ~30 ms): the machine is shared, and its speed halved and recovered within minutes in
    earlier runs. Read around the profile and around each layout's measurement (never during one),
    so a miss can be told apart from the machine having changed speed in between."""
    times = []
    for _ in range(7):
        started = time.perf_counter()
        total = 0
        for i in range(SPEED_LOOPS):
            total += i * i % 7
        times.append(time.perf_counter() - started)
    return SPEED_LOOPS / statistics.median(times) / 1e3


BANDWIDTH_MB = 64


def bandwidth() -> float:
    """This machine's memory bandwidth now, GB/s copying a 64 MB array (median of 7): the machine slowed
    under earlier runs (the same layout held 24% less nine minutes later) while the core speed above and
    the CPU steal read unchanged; a neighbour on the memory bus would show here, not there."""
    import numpy as np

    source = np.ones(BANDWIDTH_MB * 2**20 // 8)
    target = np.empty_like(source)
    times = []
    for _ in range(7):
        started = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - started)
    return 2 * source.nbytes / statistics.median(times) / 1e9  # read + write


def had_kept(readings: dict[str, list[float]], name: str, rate: float | None, predicted: float) -> str:
    """The error layout `name` would show had the machine kept the profile's reading: a diagnostic beside
    the error, never a correction of the prediction. By the core's speed for a CPU-bound engine, and by
    the memory bus's bandwidth (run 10 on 2026-12-04: 45 GB/s around the profile, 29-36 around the last
    layouts, which held ~20% less than predicted; the core speed unchanged)."""
    if not rate or not predicted:
        return "n/a"
    ratio = statistics.mean(readings["profile"]) / statistics.mean(readings[name])
    return f"{rate * ratio / predicted - 1:+.1%}"


def span(readings: list[float], form: str) -> str:
    """Readings around a layout's measurements: both where there are two, else the lowest-highest."""
    if len(readings) <= 2:
        return " / ".join(format(v, form) for v in readings)
    return f"{min(readings):{form}}-{max(readings):{form}}"


def apart(results: list[LayoutResult]) -> str:
    """How far a layout's second measurement lies from its first."""
    rates = [r.max_slo_rate for r in results]
    return f"{rates[1] / rates[0] - 1:+.1%}" if len(rates) == 2 and rates[0] and rates[1] else "n/a"


def swapped(by_prediction: list[str], by_measurement: list[str]) -> list[tuple[str, str]]:
    """Pairs (a, b) the prediction puts a over b and the measurement b over a."""
    place = {name: i for i, name in enumerate(by_measurement)}
    return [(a, b) for i, a in enumerate(by_prediction) for b in by_prediction[i + 1 :] if place[a] > place[b]]


def bounds(results: list[LayoutResult]) -> tuple[float, float]:
    """A layout's lowest and highest measurement (one that found no rate counts as 0)."""
    rates = [r.max_slo_rate or 0.0 for r in results]
    return min(rates), max(rates)


def overlap(a: list[LayoutResult], b: list[LayoutResult]) -> bool:
    """Whether two layouts' measurements (lowest to highest of each) overlap: then this run does not
    order them, whatever their means say."""
    (low_a, high_a), (low_b, high_b) = bounds(a), bounds(b)
    return max(low_a, low_b) <= min(high_a, high_b)


def extent(results: list[LayoutResult]) -> str:
    """A layout's measurements, lowest to highest."""
    low, high = bounds(results)
    return f"{low:.4g}-{high:.4g}" if len(results) > 1 else f"{low:.4g}"


def twice(results: list[LayoutResult]) -> str:
    """A layout's two measurements and how far apart they are."""
    shown = " / ".join(f"{r.max_slo_rate or math.nan:.4g}" for r in results)
    return f"{shown:>15} {apart(results):>7}"


def variants(first: Layout, seqs: list[int]) -> list[Layout]:
    return [
        first.model_copy(
            update={"name": f"{first.name}-seqs{n}", "engine_args": {**first.engine_args, "max-num-seqs": n}}
        )
        for n in seqs
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default=str(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml"))
    parser.add_argument("--seqs", default="64,16,8", help="max-num-seqs of the first layout's variants")
    parser.add_argument("--two-replicas", action="store_true", help="also the spec's layout of two replicas")
    parser.add_argument("--out", help="where profiles, predictions and probes go (default: a temporary dir)")
    repeat = parser.add_mutually_exclusive_group()
    repeat.add_argument(
        "--drift",
        action="store_true",
        help="after the measurements, the first layout measured again and the profile run again: how far the"
        " truth and the calibration move within one run (the floor under any prediction's error here)",
    )
    repeat.add_argument(
        "--twice",
        action="store_true",
        help="measure every layout twice, in the order A B C D D C B A; the error is the mean's, and the two"
        " measurements' spread is shown beside it (it measures what --drift's second measurement would)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_spec(args.spec)
    spec, hw = loaded.spec, loaded.hardware
    layouts = variants(spec.layouts[0], [int(n) for n in args.seqs.split(",")])
    if args.two_replicas:
        layouts += [layout for layout in spec.layouts if layout.replicas == 2][:1]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="planner-bench-"))
    model = Path(sources.materialize(spec, loaded.path.parent).path)
    started = time.monotonic()

    speeds: dict[str, list[float]] = {}
    bandwidths: dict[str, list[float]] = {}

    def read(key: str) -> None:
        """The core's speed and the memory bandwidth now, kept under `key` (before and after its step)."""
        bandwidths.setdefault(key, []).append(bandwidth())
        speeds.setdefault(key, []).append(speed())

    read("profile")
    profiled = profiling.run(spec, hw, spec.layouts[0], model, out / "profile")
    read("profile")
    profiling.write(profiled, out / "profile.json")
    at_hand = profiled.hardware_at_hand(hw)
    wl = spec.workload
    predicted = {}
    for layout in layouts:
        fitted = planner.predict(spec, at_hand, layout, wl.input_len, wl.output_len)
        datasheet = planner.predict(spec, hw, layout, wl.input_len, wl.output_len)
        predicted[layout.name] = {
            "profiled": fitted.rate_per_server,
            "datasheet": datasheet.rate_per_server,
            "bound": fitted.bound,
        }
    atomic_write(out / "predictions.json", json.dumps(predicted, indent=2))  # before any measurement
    runs: dict[str, list[LayoutResult]] = {}
    for index, layout in enumerate(layouts + (layouts[::-1] if args.twice else [])):
        folder = out / (layout.name if index < len(layouts) else f"{layout.name}-2")
        read(layout.name)
        result = benchmark.benchmark_layout(spec, hw, layout, model, folder, prior=predicted[layout.name]["profiled"])
        read(layout.name)
        runs.setdefault(layout.name, []).append(result)

    def rate_of(name: str) -> float | None:
        """The layout's max SLO rate: the mean of its measurements, none where one found no rate."""
        rates = [r.max_slo_rate for r in runs[name]]
        return statistics.mean(r for r in rates if r) if all(rates) else None

    again = None
    if args.drift:
        first = layouts[0]
        read(f"{first.name} again")
        again = benchmark.benchmark_layout(
            spec, hw, first, model, out / f"{first.name}-again", prior=predicted[first.name]["profiled"]
        )
        read(f"{first.name} again")
        read("profile again")
        reprofiled = profiling.run(spec, hw, spec.layouts[0], model, out / "profile-again")
        read("profile again")
        profiling.write(reprofiled, out / "profile-again.json")
        for layout in layouts:
            fitted = planner.predict(spec, reprofiled.hardware_at_hand(hw), layout, wl.input_len, wl.output_len)
            predicted[layout.name]["profiled again"] = fitted.rate_per_server
        atomic_write(out / "predictions-again.json", json.dumps(predicted, indent=2))
    atomic_write(out / "speeds.json", json.dumps({"loops_per_ms": speeds, "gb_per_s": bandwidths}, indent=2))
    wall = time.monotonic() - started

    slo = spec.slo
    print(f"\n{spec.name} on {hw.name}: {wl.input_len} in / {wl.output_len} out, p90 TTFT {slo.max_p90_ttft_ms:g} ms,"
          f" p90 TPOT {slo.max_p90_tpot_ms:g} ms; {wall / 60:.1f} min in all")  # fmt: skip
    print(profiling.table(profiled))
    print(profiled.summary())
    print(
        f"core speed around the profile: {span(speeds['profile'], '.0f')} loops/ms;"
        f" memory {span(bandwidths['profile'], '.1f')} GB/s"
    )
    print(
        f"\n{'layout':22} {'datasheet':>10} {'profiled':>10} {'measured':>10} {'error':>8} {'probes':>7}"
        f" {'speed':>11} {'GB/s':>9} {'at profile speed':>16} {'at profile GB/s':>15}"
        + (f" {'1st / 2nd':>15} {'apart':>7}" if args.twice else "")
    )
    errors = []
    for layout in layouts:
        p = predicted[layout.name]
        rate = rate_of(layout.name)
        error = rate / p["profiled"] - 1 if rate and p["profiled"] else None
        if error is not None:
            errors.append(abs(error))
        shown = "n/a" if error is None else f"{error:+.1%}"
        probes = sum(len(r.probes) for r in runs[layout.name])
        adjusted, at_memory = (had_kept(kept, layout.name, rate, p["profiled"]) for kept in (speeds, bandwidths))
        print(
            f"{layout.name:22} {p['datasheet']:10.4g} {p['profiled']:10.4g} {rate or float('nan'):10.4g}"
            f" {shown:>8} {probes:7d} {span(speeds[layout.name], '.0f'):>11} {span(bandwidths[layout.name], '.1f'):>9}"
            f" {adjusted:>16} {at_memory:>15}"
            + (f" {twice(runs[layout.name])}" if args.twice else "")
            + f"  {p['bound']}"
            + "".join(
                f"  (pass {i}: {r.status}: {r.error})" for i, r in enumerate(runs[layout.name], 1) if r.status != "ok"
            )
        )
    by_prediction = sorted(predicted, key=lambda n: -predicted[n]["profiled"])
    by_measurement = sorted(runs, key=lambda n: -(rate_of(n) or 0))
    print(f"ranking predicted: {' > '.join(by_prediction)}")
    print(
        f"ranking measured:  {' > '.join(by_measurement)}  ({'same' if by_prediction == by_measurement else 'differs'})"
    )
    for a, b in swapped(by_prediction, by_measurement):
        pa, pb = predicted[a]["profiled"], predicted[b]["profiled"]
        ma, mb = rate_of(a) or 0.0, rate_of(b) or 0.0
        told = "overlap: this run does not order them" if overlap(runs[a], runs[b]) else "do not overlap"
        said = (
            f"{a} over {b} predicted ({pa:.4g} vs {pb:.4g}, {pa / pb - 1:+.1%}), the other way measured"
            if pa != pb
            else f"{a} and {b} predicted level ({pa:.4g}), measured"
        )
        print(f"  {said} ({ma:.4g} vs {mb:.4g}); their measurements {extent(runs[a])} and {extent(runs[b])} {told}")
    if errors:
        inside = sum(e <= 0.15 for e in errors)
        print(f"within 15%: {inside} of {len(errors)}; largest |error| {max(errors):.1%}")
    if again is not None:
        first = layouts[0].name
        both = [runs[first][0], again]
        rates = " then ".join(f"{r.max_slo_rate or math.nan:.4g}" for r in both)
        print(
            f"\ndrift within this run: {first} measured {rates}"
            f" req/s ({apart(both)}; {len(both[0].probes)} and {len(again.probes)} probes; core speed"
            f" {span(speeds[f'{first} again'], '.0f')}, memory {span(bandwidths[f'{first} again'], '.1f')} GB/s"
            " at the second)"
        )
        print(f"{'layout':22} {'profiled':>10} {'again':>10} {'moved':>8}")
        for layout in layouts:
            p = predicted[layout.name]
            moved = f"{p['profiled again'] / p['profiled'] - 1:+.1%}" if p["profiled"] else "n/a"
            print(f"{layout.name:22} {p['profiled']:10.4g} {p['profiled again']:10.4g} {moved:>8}")
    print(f"files: {out}")
    table = [
        {
            "layout": layout.name,
            "datasheet": predicted[layout.name]["datasheet"],
            "profiled": predicted[layout.name]["profiled"],
            "measured": [r.max_slo_rate for r in runs[layout.name]],
            "error": rate_of(layout.name) / predicted[layout.name]["profiled"] - 1
            if rate_of(layout.name) and predicted[layout.name]["profiled"]
            else None,
            "bound": predicted[layout.name]["bound"],
        }
        for layout in layouts
    ]
    path = measurements.record(
        "planner",
        {
            "minutes": wall / 60,
            "layouts": table,
            "ranking": {"predicted": by_prediction, "measured": by_measurement},
            "within_15pct": sum(e <= 0.15 for e in errors),
            "largest_abs_error": max(errors, default=None),
            "drift_first_layout_again": again.max_slo_rate if again is not None else None,
        },
        summary=f"{sum(e <= 0.15 for e in errors)} of {len(errors)} layouts within 15% of the profiled prediction; "
        f"ranking {'the same' if by_prediction == by_measurement else 'differs'}",
    )
    print(f"record: {path}")


if __name__ == "__main__":
    main()
