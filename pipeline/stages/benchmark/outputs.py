"""What a benchmark leaves on disk: the table, benchmark.json, benchmark.csv (one row per probe)
and the latency-vs-rate plot."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from pipeline.core.files import atomic_write
from pipeline.core.specs import SloSpec
from pipeline.records.benchmark import BenchmarkFile, LayoutResult, Selection, SelectionVerdict


def table(results: list[LayoutResult]) -> str:
    rows = [
        f"{'layout':22} {'status':7} {'load s':>8} {'capacity':>9} {'max SLO':>9} {'predicted':>9} {'error':>6} "
        f"{'/server':>9} {'/device':>9} {'probes':>6} {'spread':>6} {'served acc':>10}  note"
    ]
    for r in results:
        fmt = lambda v: f"{v:9.3g}" if v is not None else f"{'-':>9}"  # noqa: E731
        spread_cell = f"{r.spread:6.0%}" if r.spread is not None else f"{'-':>6}"
        error = f"{r.prediction_error:+6.0%}" if r.prediction_error is not None else f"{'-':>6}"
        served = r.served_accuracy
        acc = f"{'pass' if served.passed else 'FAIL'} {served.seconds:4.0f}s" if served else "-"
        rows.append(
            f"{r.layout:22} {r.status:7} {max(r.load_seconds, default=0):8.1f} {fmt(r.capacity_rps)} "
            f"{fmt(r.max_slo_rate)} {fmt(r.predicted_rate)} {error} {fmt(r.per_server)} "
            f"{fmt(r.per_device)} {len(r.probes):6d} {spread_cell} {acc:>10}  "
            f"{r.error.splitlines()[0] if r.error else r.stop_reason}"
        )
    return "\n".join(rows)


def write_outputs(
    results: list[LayoutResult], slo: SloSpec, out_dir: Path, selection: Selection | None = None
) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, png_path = (
        out_dir / "benchmark.json",
        out_dir / "benchmark.csv",
        out_dir / "latency_vs_rate.png",
    )
    verdict = SelectionVerdict.model_validate(selection.model_dump(exclude={"layouts"})) if selection else None
    # strict JSON: inf/nan as strings
    atomic_write(json_path, BenchmarkFile(layouts=results, selection=verdict).model_dump_json(indent=2))
    fields = [
        "layout",
        "rate",
        "num_prompts",
        "achieved_rate",
        "completed",
        "failed",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p90_tpot_ms",
        "p99_tpot_ms",
        "p90_itl_ms",
        "p90_e2el_ms",
        "goodput",
        "output_tok_s",
        "passed",
        "conclusive",
        "clean",
        "superseded",
        "client_lag_p90_ms",
        "client_lag_end_ms",
        "client_cpu_ms_per_request",
        "client_bound",
        "ttft_trend_ms_per_s",
        "backlog_end",
        "projected_p90_ttft_ms",
        "confirmation",
    ]
    with open(csv_path, "w", newline="") as handle:
        extra = ["cpu_engine", "cpu_client", "cpu_other", "cpu_steal", "cpu_load_avg_1m", "engine_p90_ttft_ms"]
        writer = csv.DictWriter(handle, fieldnames=fields + extra)
        writer.writeheader()
        for r in results:
            for p in r.probes:
                seen = (
                    p.interference.model_dump(include={"engine", "client", "other", "steal", "load_avg_1m"})
                    if p.interference
                    else {}
                )
                writer.writerow(
                    {
                        "layout": r.layout,
                        **p.model_dump(include=set(fields)),
                        **{f"cpu_{k}": v for k, v in seen.items()},
                        "engine_p90_ttft_ms": p.engine.p90_ttft_ms if p.engine else None,
                    }
                )
    plot(results, slo, png_path)
    return {"json": str(json_path), "csv": str(csv_path), "png": str(png_path)}


def plot(results: list[LayoutResult], slo: SloSpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, limit, title in (
        (axes[0], "p90_ttft_ms", slo.max_p90_ttft_ms, "p90 TTFT"),
        (axes[1], "p90_tpot_ms", slo.max_p90_tpot_ms, "p90 TPOT"),
    ):
        for r in results:
            # runs measured again (inconclusive, unclean) are not counted; a repeated rate draws its
            # line through the last run and shows the others as dots, so the spread is visible
            counted = [p for p in r.probes if not math.isinf(p.rate) and not p.superseded]
            decisive = {p.rate: p for p in counted}
            points = sorted((rate, getattr(p, metric)) for rate, p in decisive.items())
            if not points:
                continue
            (line,) = ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=r.layout)
            repeats = [p for p in counted if decisive[p.rate] is not p]
            if repeats:
                ax.plot(
                    [p.rate for p in repeats],
                    [getattr(p, metric) for p in repeats],
                    linestyle="none",
                    marker="o",
                    markersize=4,
                    alpha=0.6,
                    color=line.get_color(),
                )
            if r.max_slo_rate in decisive:
                ax.plot(
                    [r.max_slo_rate],
                    [getattr(decisive[r.max_slo_rate], metric)],
                    marker="*",
                    markersize=16,
                    color=line.get_color(),
                    markeredgecolor="black",
                )
        ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs load (star: max rate within SLO)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
