"""Benchmark stage: per layout, the highest Poisson request rate that holds the p90 SLO.

Load comes from vLLM's own client (`vllm bench serve`, random prompts at the spec's input and
output lengths, `--ignore-eos`, Poisson arrivals); this module only decides which rates to
probe and reads the JSON it saves. The search keeps its whole state as typed records
(`Probe`, `LayoutResult`): they feed the report, the plot, the gate and the tests alike.

Why this search: latency against offered load is flat, then bends up sharply near capacity.
A saturation probe (every request at once) measures that capacity, which brackets the
answer from above; bisection on the offered rate then needs log2(1/resolution) probes
instead of a sweep's 1/resolution. Why order statistics: a p90 from n requests is itself a
random quantity; when the SLO limit falls inside its 95% interval the verdict is noise, so
the probe is repeated with more requests before it is trusted.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import ReleaseError
from pipeline.spec import HardwareProfile, Layout, ReleaseSpec, SloSpec, WorkloadSpec

log = logging.getLogger(__name__)

KEEP_UP = 0.90  # achieved throughput must be at least this share of the offered rate
MAX_PROMPT_DOUBLINGS = 2


class Probe(BaseModel):
    """One `vllm bench serve` run at one offered rate."""

    # the saturation probe's rate is inf; JSON (XCom, files) carries it as the string "Infinity"
    model_config = ConfigDict(ser_json_inf_nan="strings")

    rate: float = Field(description="offered Poisson rate, req/s (inf for the saturation probe)")
    num_prompts: int
    achieved_rate: float = Field(description="completed requests / duration")
    completed: int
    failed: int
    failed_fraction: float
    duration_s: float
    output_tok_s: float
    goodput: float | None = None
    p50_ttft_ms: float
    p90_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p90_tpot_ms: float
    p99_tpot_ms: float
    p90_itl_ms: float
    p90_e2el_ms: float
    p90_ttft_ci_ms: tuple[float, float] | None = Field(None, description="95% order-statistic interval of the p90")
    p90_tpot_ci_ms: tuple[float, float] | None = None
    passed: bool = False
    conclusive: bool = Field(True, description="false when a limit still fell inside a p90 interval")
    reasons: list[str] = Field(default_factory=list)
    result_file: str = ""


class LayoutResult(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    layout: str
    tp: int
    dp: int
    ep: int
    pp: int
    replicas: int
    devices: int
    status: str = Field(description="ok, or failed (engine did not start, died, client errors)")
    error: str | None = None
    load_seconds: list[float] = Field(default_factory=list, description="per replica, process start to healthy")
    capacity_rps: float | None = None
    max_slo_rate: float | None = Field(None, description="req/s at the layout's endpoint (all its replicas)")
    per_server: float | None = None
    per_device: float | None = None
    bound_only: bool = Field(False, description="the answer is a bound (probe budget, capacity), not a bisected value")
    stop_reason: str = ""
    probes: list[Probe] = Field(default_factory=list)
    seconds: float = 0.0


class Selection(BaseModel):
    best: str | None
    passed: bool
    reason: str
    layouts: list[LayoutResult]


# ---------------------------------------------------------------- statistics


def quantile_ci(values: list[float], q: float = 0.9, confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the q-quantile from order statistics (binomial ranks)."""
    from scipy.stats import binom

    n = len(values)
    if n < 10:
        return None
    xs = sorted(values)
    alpha = (1 - confidence) / 2
    lo = int(binom.ppf(alpha, n, q))
    hi = int(binom.ppf(1 - alpha, n, q)) + 1
    return xs[max(lo - 1, 0)], xs[min(hi - 1, n - 1)]


def per_request_tpot_ms(data: dict[str, Any]) -> list[float]:
    out = []
    for ttft, latency, n in zip(data.get("ttfts", []), data.get("latencies", []), data.get("output_lens", [])):
        if n and n > 1 and latency:
            out.append((latency - ttft) / (n - 1) * 1000)
    return out


# ---------------------------------------------------------------- running vLLM's client


def bench_command(base: list[str], url: str, model_dir: str, workload: WorkloadSpec, slo: SloSpec, rate: float,
                  num_prompts: int, seed: int, result_dir: Path, name: str) -> list[str]:
    return [
        *base, "bench", "serve", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "model", "--tokenizer", model_dir, "--dataset-name", "random",
        "--random-input-len", str(workload.input_len), "--random-output-len", str(workload.output_len),
        "--ignore-eos", "--num-prompts", str(num_prompts), "--request-rate", "inf" if math.isinf(rate) else f"{rate:.4f}",
        "--burstiness", "1.0" if workload.arrival == "poisson" else "1000", "--seed", str(seed),
        "--metric-percentiles", "50,90,99", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--goodput", f"ttft:{slo.p90_ttft_ms:g}", f"tpot:{slo.p90_tpot_ms:g}",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", name,
        "--disable-tqdm", "--num-warmups", "2", "--ready-check-timeout-sec", "0",
    ]


def parse_result(path: Path, rate: float, num_prompts: int, slo: SloSpec) -> Probe:
    data = json.loads(path.read_text())
    completed, failed = int(data.get("completed", 0)), int(data.get("failed", 0) or 0)
    total = max(completed + failed, num_prompts)
    probe = Probe(
        rate=rate, num_prompts=num_prompts, achieved_rate=float(data["request_throughput"]), completed=completed,
        failed=failed, failed_fraction=(total - completed) / total, duration_s=float(data["duration"]),
        output_tok_s=float(data.get("output_throughput", 0.0)), goodput=data.get("request_goodput"),
        **{f"p{p}_{m}_ms": float(data.get(f"p{p}_{m}_ms", math.nan)) for p in (50, 90, 99) for m in ("ttft", "tpot")},
        p90_itl_ms=float(data.get("p90_itl_ms", math.nan)), p90_e2el_ms=float(data.get("p90_e2el_ms", math.nan)),
        result_file=str(path),
    )
    ttfts = [t * 1000 for t in data.get("ttfts", []) if t]
    probe.p90_ttft_ci_ms = quantile_ci(ttfts)
    probe.p90_tpot_ci_ms = quantile_ci(per_request_tpot_ms(data))
    judge(probe, slo)
    return probe


def judge(probe: Probe, slo: SloSpec) -> None:
    reasons = []
    if probe.p90_ttft_ms > slo.p90_ttft_ms:
        reasons.append(f"p90 TTFT {probe.p90_ttft_ms:.1f} ms > {slo.p90_ttft_ms:g}")
    if probe.p90_tpot_ms > slo.p90_tpot_ms:
        reasons.append(f"p90 TPOT {probe.p90_tpot_ms:.1f} ms > {slo.p90_tpot_ms:g}")
    if probe.failed_fraction > slo.max_failed_fraction:
        reasons.append(f"failed {probe.failed_fraction:.1%} > {slo.max_failed_fraction:.1%}")
    if not math.isinf(probe.rate) and probe.achieved_rate < KEEP_UP * probe.rate:
        reasons.append(f"achieved {probe.achieved_rate:.2f} req/s < {KEEP_UP:.0%} of offered {probe.rate:.2f}")
    probe.reasons = reasons
    probe.passed = not reasons
    inside = [(ci, limit) for ci, limit in ((probe.p90_ttft_ci_ms, slo.p90_ttft_ms), (probe.p90_tpot_ci_ms, slo.p90_tpot_ms))
              if ci is not None and ci[0] <= limit <= ci[1]]
    probe.conclusive = not inside


# ---------------------------------------------------------------- the search


RunProbe = Callable[[float, int, int], Probe]  # (rate, num_prompts, seed) -> Probe


def slo_search(run: RunProbe, workload: WorkloadSpec, slo: SloSpec, max_probes: int = 12) -> tuple[list[Probe], float | None, float | None, bool, str]:
    """Return (probes, capacity, max SLO rate, bound_only, stop reason)."""
    probes: list[Probe] = []
    seed = workload.seed

    def probe(rate: float) -> Probe:
        nonlocal seed
        # short runs never build a queue and flatter high rates: send at least min_probe_seconds of load
        n = workload.num_prompts if math.isinf(rate) else max(workload.num_prompts, math.ceil(rate * workload.min_probe_seconds))
        for _ in range(MAX_PROMPT_DOUBLINGS + 1):
            seed += 1  # a fresh prompt set each run: cached prefixes must not flatter later probes
            result = run(rate, n, seed)
            probes.append(result)
            log.info("probe %.3g req/s x %d: achieved %.3g, p90 TTFT %.1f ms, p90 TPOT %.1f ms -> %s%s",
                     rate, n, result.achieved_rate, result.p90_ttft_ms, result.p90_tpot_ms,
                     "pass" if result.passed else "fail (" + "; ".join(result.reasons) + ")",
                     "" if result.conclusive else " [limit inside the p90 interval]")
            if result.conclusive or not math.isinf(rate) and result.reasons and any("achieved" in r or "failed" in r for r in result.reasons):
                return result
            n *= 2
        log.warning("probe at %.3g req/s stays inconclusive with %d requests; counting it as a fail", rate, n // 2)
        result.passed = False
        result.reasons.append("inconclusive: SLO limit inside the p90 interval")
        return result

    saturation = probe(math.inf)
    capacity = saturation.achieved_rate
    if capacity <= 0:
        return probes, None, None, False, "no request completed at saturation"
    lo, hi = 0.0, capacity
    first = probe(capacity * 0.25)
    if not first.passed:
        lo_rate = capacity * 0.25
        low = probe(capacity * 0.05)
        if not low.passed:
            return probes, capacity, None, True, f"SLO missed even at {capacity * 0.05:.3g} req/s (5% of capacity)"
        lo, hi = capacity * 0.05, lo_rate
    else:
        lo = capacity * 0.25
        top = probe(capacity)
        if top.passed:
            return probes, capacity, capacity, True, "SLO holds at the measured capacity: the answer is a lower bound"
    # bisect to half the resolution, so the reported (last passing) rate is within the
    # resolution of the true boundary even when the boundary sits at the top of the bracket
    while (hi - lo) / hi > slo.resolution / 2:
        if len(probes) >= max_probes:
            return probes, capacity, lo, True, f"probe budget ({max_probes}) spent; {lo:.3g} is a lower bound"
        mid = (lo + hi) / 2
        if probe(mid).passed:
            lo = mid
        else:
            hi = mid
    return probes, capacity, lo, False, f"bisected to {slo.resolution / 2:.1%}: passes at {lo:.3g}, fails at {hi:.3g}"


def uniform_sweep(run: RunProbe, capacity: float, workload: WorkloadSpec, slo: SloSpec) -> tuple[list[Probe], float | None]:
    """The reference a search is compared with: every rate on a grid of `resolution` x capacity."""
    probes, best = [], None
    steps = int(round(1 / slo.resolution))
    for i in range(1, steps + 1):
        rate = capacity * i / steps
        result = run(rate, workload.num_prompts, workload.seed + i)
        probes.append(result)
        if result.passed:
            best = rate
    return probes, best


# ---------------------------------------------------------------- results


def finish(result: LayoutResult, hw: HardwareProfile) -> LayoutResult:
    if result.max_slo_rate is not None:
        # GPU layouts tile the node; a CPU engine takes the whole machine whatever its core binding
        copies = max(1, hw.devices // result.devices) if hw.kind == "gpu" else 1
        result.per_server = round(result.max_slo_rate * copies, 4)
        result.per_device = round(result.per_server / hw.devices, 4)
    return result


def select(results: list[LayoutResult], slo: SloSpec) -> Selection:
    ok = [r for r in results if r.status == "ok" and r.per_server is not None]
    if not ok:
        return Selection(best=None, passed=False, reason="no layout met the SLO at any rate", layouts=results)
    best = max(ok, key=lambda r: r.per_server or 0)
    if (best.per_server or 0) < slo.min_rate_per_server:
        return Selection(best=best.layout, passed=False, layouts=results,
                         reason=f"best layout {best.layout} holds the SLO up to {best.per_server:.3g} req/s per server, "
                                f"below the required {slo.min_rate_per_server:g}")
    return Selection(best=best.layout, passed=True, layouts=results,
                     reason=f"{best.layout}: {best.per_server:.3g} req/s per server ({best.per_device:.3g} per device)")


def table(results: list[LayoutResult]) -> str:
    rows = [f"{'layout':22} {'status':7} {'load s':>8} {'capacity':>9} {'max SLO':>9} {'/server':>9} {'/device':>9} {'probes':>6}  note"]
    for r in results:
        fmt = lambda v: f"{v:9.3g}" if v is not None else f"{'-':>9}"  # noqa: E731
        rows.append(f"{r.layout:22} {r.status:7} {max(r.load_seconds, default=0):8.1f} {fmt(r.capacity_rps)} "
                    f"{fmt(r.max_slo_rate)} {fmt(r.per_server)} {fmt(r.per_device)} {len(r.probes):6d}  "
                    f"{r.error.splitlines()[0] if r.error else r.stop_reason}")
    return "\n".join(rows)


def write_outputs(results: list[LayoutResult], slo: SloSpec, out_dir: Path, selection: Selection | None = None) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, png_path = out_dir / "benchmark.json", out_dir / "benchmark.csv", out_dir / "latency_vs_rate.png"
    json_path.write_text(json.dumps({
        "layouts": [json.loads(r.model_dump_json()) for r in results],  # strict JSON: inf/nan as strings
        "selection": json.loads(selection.model_dump_json(exclude={"layouts"})) if selection else None,
    }, indent=2))
    fields = ["layout", "rate", "num_prompts", "achieved_rate", "completed", "failed", "p50_ttft_ms", "p90_ttft_ms",
              "p99_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "p90_itl_ms", "p90_e2el_ms", "goodput",
              "output_tok_s", "passed", "conclusive"]
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in results:
            for p in r.probes:
                writer.writerow({"layout": r.layout, **p.model_dump(include=set(fields))})
    plot(results, slo, png_path)
    return {"json": str(json_path), "csv": str(csv_path), "png": str(png_path)}


def plot(results: list[LayoutResult], slo: SloSpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, limit, title in ((axes[0], "p90_ttft_ms", slo.p90_ttft_ms, "p90 TTFT"),
                                     (axes[1], "p90_tpot_ms", slo.p90_tpot_ms, "p90 TPOT")):
        for r in results:
            # a rate probed again with more requests is decided by its last run: plot that one
            decisive = {p.rate: p for p in r.probes if not math.isinf(p.rate)}
            points = sorted((rate, getattr(p, metric)) for rate, p in decisive.items())
            if not points:
                continue
            line, = ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=r.layout)
            if r.max_slo_rate in decisive:
                ax.plot([r.max_slo_rate], [getattr(decisive[r.max_slo_rate], metric)], marker="*", markersize=16,
                        color=line.get_color(), markeredgecolor="black")
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


# ---------------------------------------------------------------- one layout, for real


def benchmark_layout(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, model_dir: Path, out_dir: Path,
                     base_port: int | None = None, max_probes: int = 12,
                     check_rates: list[float] | None = None) -> LayoutResult:
    """Start the layout's engines, run the search against their one endpoint, always tear down.

    `check_rates`: endpoint rates to probe after the search as well (a re-benchmark checks the
    rate the release was promoted at, whatever the search found).
    """
    from pipeline import serving

    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = LayoutResult(layout=layout.name, tp=layout.tp, dp=layout.dp, ep=layout.ep, pp=layout.pp,
                          replicas=layout.replicas, devices=layout.devices, status="ok")
    port = base_port or serving.free_port()
    commands = serving.build_commands(spec, hw, layout, str(model_dir), port)
    if hw.kind == "cpu":
        # pick free ports for every replica
        for cmd in commands:
            new = serving.free_port()
            cmd.argv[cmd.argv.index("--port") + 1] = str(new)
            cmd.port = new
    client = [str(serving.SERVE_PYTHON), str(serving.VLLM_CLI)] if hw.kind == "cpu" else ["vllm"]
    engine = serving.LocalEngine(commands, out_dir / "logs")
    try:
        with engine:
            result.load_seconds = engine.load_seconds

            def run(rate: float, n: int, seed: int) -> Probe:
                if not engine.alive():
                    raise serving.EngineFailed("engine died during the benchmark:\n" + engine.tail(0))
                name = f"probe-{len(result.probes) + 1:02d}.json"
                cmd = bench_command(client, engine.url, str(model_dir), spec.workload, spec.slo, rate, n, seed, out_dir, name)
                env = {**__import__("os").environ, **commands[0].env}
                env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0 or not (out_dir / name).exists():
                    raise ReleaseError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
                probe = parse_result(out_dir / name, rate, n, spec.slo)
                result.probes.append(probe)
                return probe

            _, result.capacity_rps, result.max_slo_rate, result.bound_only, result.stop_reason = slo_search(
                run, spec.workload, spec.slo, max_probes)
            for rate in check_rates or []:
                n = max(spec.workload.num_prompts, math.ceil(rate * spec.workload.min_probe_seconds))
                probe = run(rate, n, spec.workload.seed + 1000 + len(result.probes))
                log.info("check at %.3g req/s: p90 TTFT %.1f ms, p90 TPOT %.1f ms -> %s", rate, probe.p90_ttft_ms,
                         probe.p90_tpot_ms, "pass" if probe.passed else "fail (" + "; ".join(probe.reasons) + ")")
    except (ReleaseError, subprocess.TimeoutExpired) as exc:
        result.status = "failed"
        result.error = str(exc)
        log.error("layout %s failed: %s", layout.name, exc)
    result.seconds = round(time.monotonic() - started, 1)
    finish(result, hw)
    if result.bound_only and result.status == "ok":
        log.warning("layout %s: %s", layout.name, result.stop_reason)
    return result
