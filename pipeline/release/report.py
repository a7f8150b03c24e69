"""Reviewer report: one self-contained HTML page per release candidate, readable in a minute.

Top to bottom it answers the reviewer's questions in order: what is this (spec summary), is it
as accurate as the baseline (recovery table + great-expectations outcome), is it fast enough
and how does it compare with what is live (chosen layout, rate per server and per GPU, the
latency-vs-load curves with the SLO lines), what exactly would be deployed (URIs, manifest
hashes, load times), and what has happened so far (audit trail). The plot is embedded, so the
file can be mailed, attached or served by the plugin as is.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import markupsafe

from pipeline.core.files import atomic_write
from pipeline.core.html import environment
from pipeline.core.specs import LoadedSpec
from pipeline.planner import calibration
from pipeline.records import edge
from pipeline.records.benchmark import BenchmarkFile, LayoutResult
from pipeline.records.events import SloGate, TrendPoint
from pipeline.records.selection import ChosenFigures
from pipeline.release.registry import NOTHING_CHOSEN, Registry, Release, ReleaseData
from pipeline.stages import capacity

CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#1d2330}
h1{font-size:1.5em;margin-bottom:4px} h2{font-size:1.15em;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em} td,th{border:1px solid #ddd;padding:4px 8px;text-align:right}
th{background:#f4f6fa} td:first-child,th:first-child{text-align:left}
.pass{color:#0a7a32;font-weight:600} .fail{color:#b3261e;font-weight:600} .muted{color:#667}
.verdict{padding:10px 14px;border-radius:6px;background:#f4f6fa;margin:12px 0} code{font-size:.9em}
img{max-width:100%;border:1px solid #eee} td.t{white-space:nowrap}
"""


def _num(value: Any, fmt: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, str):
        return value
    return format(value, fmt)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def _rate(value: Any, bound: Any) -> str:
    """A max SLO rate: 'at least N' where it is a lower bound (no probe above it failed, or the search's
    budget ran out before a fail narrowed it)."""
    return f"at least {_num(value)}" if bound and isinstance(value, (int, float)) else _num(value)


def _size(fraction: float | None) -> str:
    """An error's size (no sign): a median of |error|."""
    return "—" if fraction is None else f"{fraction:.1%}"


TEMPLATES = Path(__file__).parent / "templates"
ENV = environment(
    TEMPLATES, dict(num=_num, pct=_pct, rate=_rate, size=_size, money=capacity.money, g=lambda v: format(v, "g"))
)


def _macro(name: str, *args: Any) -> str:
    """One section of the page, rendered alone (the page renders them all)."""
    module = ENV.get_template("report_sections.html.j2").make_module()
    return str(getattr(module, name)(*args)).strip()


def _png(path: Path | None) -> str | None:
    return base64.b64encode(path.read_bytes()).decode() if path and path.exists() else None


def _spec_rows(loaded: LoadedSpec) -> list[tuple[str, str]]:
    s, hw = loaded.spec, loaded.hardware
    return [
        (
            "model",
            f"{s.model.name} ({s.model.architecture.params_b:g} B params, "
            f"{s.model.architecture.num_experts} experts, top-{s.model.architecture.num_experts_per_tok})",
        ),
        ("source", s.model.source),
        ("quantization", f"{s.quantization.scheme} via {s.quantization.method}"),
        ("hardware", f"{hw.name}: {hw.devices} x {hw.kind} ({hw.device_memory_gb:g} GB)"),
        ("workload", f"{s.workload.input_len} in / {s.workload.output_len} out, {s.workload.arrival} arrivals"),
        (
            "SLO",
            f"p90 TTFT ≤ {s.slo.max_p90_ttft_ms:g} ms, p90 TPOT ≤ {s.slo.max_p90_tpot_ms:g} ms, "
            f"≥ {s.slo.min_rate_per_server:g} req/s per server",
        ),
        (
            "target",
            f"{s.promotion.target} (namespace {s.promotion.namespace})"
            if s.promotion.target == "kubernetes"
            else f"{s.promotion.target} (port {s.serving.port})",
        ),
        ("reviewers", ", ".join(s.promotion.reviewers) or "—"),
        ("spec file", str(loaded.path)),
    ]


def _load_view(facts: ChosenFigures, live_id: int | None, theirs: ChosenFigures | None) -> dict[str, Any] | None:
    """The slowest replica's load time, split by its engine log, beside the live release's: what a
    scale-out or a rollback waits for (#48)."""
    load = max(facts.load_seconds or [], default=None)
    if load is None:
        return None
    live_load = max(theirs.load_seconds or [], default=None) if theirs else None
    return {
        "seconds": load,
        "source": facts.weights_source,
        "phases": facts.load_split.phases() if facts.load_split else "",
        "live_id": live_id if live_load else None,
        "live_seconds": live_load,
        "live_phases": theirs.load_split.phases() if theirs and theirs.load_split else "",
        "ratio": load / live_load if live_load else None,
    }


def interval(lay: LayoutResult) -> tuple[float, float] | None:
    """The planner's interval around the layout's predicted rate, at the rate the row shows (the
    prediction holds it per server)."""
    p = lay.prediction
    if p is None or p.predicted_low is None or p.predicted_high is None or not p.predicted_per_server:
        return None
    scale = p.predicted_max_slo_rate / p.predicted_per_server
    return p.predicted_low * scale, p.predicted_high * scale


def _performance_view(
    bench: BenchmarkFile | None, facts: ChosenFigures, live: Release | None, loaded: LoadedSpec, png: Path | None
) -> dict[str, Any] | None:
    if not bench:
        return None
    best = bench.selection.best if bench.selection else None
    compare = None
    theirs = live.data.chosen if live else None
    if live and theirs and theirs.rate_per_server is not None and facts.rate_per_server is not None:
        base = theirs.rate_per_server
        compare = {
            "id": live.id,
            "layout": theirs.layout,
            "rate": base,
            "ratio": facts.rate_per_server / base if base else float("nan"),
        }
    rows = []
    for lay in bench.layouts:
        probe = lay.deciding_probe()
        marks = [m for m, on in (("unsteady", lay.unsteady), ("client-bound", lay.client_bound)) if on]
        rows.append(
            {
                "layout": lay.layout,
                "best": lay.layout == best,
                "tp": lay.tp,
                "ep": lay.ep,
                "replicas": lay.replicas,
                "status": lay.status,
                "capacity": lay.capacity_rps,
                "max_slo_rate": lay.max_slo_rate,
                "bound_only": lay.bound_only,
                # what the answer must be read with: runs that disagreed, a client that sent late
                "marks": f" ({', '.join(marks)})" if marks and lay.max_slo_rate is not None else "",
                "predicted": lay.predicted_rate,
                "interval": interval(lay),
                "prediction_error": lay.prediction_error,
                "per_server": lay.per_server,
                "per_device": lay.per_device,
                "p90_ttft_ms": probe.p90_ttft_ms if probe else None,
                "p90_tpot_ms": probe.p90_tpot_ms if probe else None,
                "load_seconds": ", ".join(f"{s:g}" for s in lay.load_seconds),
                "served": lay.served_accuracy,
                "note": lay.error or lay.stop_reason,
            }
        )
    predicted = [lay for lay in bench.layouts if lay.prediction]
    return {
        "passed": bench.selection.passed if bench.selection else None,
        "reason": bench.selection.reason if bench.selection else "",
        "rate": facts.rate_per_server,
        "live": compare,
        "load": _load_view(facts, live.id if live else None, theirs),
        "kind": loaded.hardware.kind.upper(),
        "rows": rows,
        "any_served": any(lay.served_accuracy for lay in bench.layouts),
        "calibrations": [(lay.layout, lay.prediction.calibration) for lay in predicted if lay.prediction],
        "step_times": step_times([lay.prediction.calibration_key if lay.prediction else None for lay in bench.layouts]),
        "png": _png(png),
    }


def _section_performance(
    bench: BenchmarkFile | None, facts: ChosenFigures, live: Release | None, loaded: LoadedSpec, png: Path | None
) -> str:
    return _macro("performance_section", _performance_view(bench, facts, live, loaded, png))


def _measurement_view(bench: BenchmarkFile | None) -> list[dict[str, Any]] | None:
    """How far the figures can be trusted: repeats at the answer, who else used the CPU, the
    engine's own view next to the client's, and every probe (a reviewer's evidence)."""
    if not bench:
        return None
    out = []
    for lay in bench.layouts:
        probes = lay.counted()
        seen = [p.interference for p in probes if p.interference]
        decided = lay.deciding_probe()
        every = []
        for p in lay.probes:
            inter = p.interference
            every.append(
                {
                    "probe": p,
                    "burst": math.isinf(p.rate),
                    "inter": inter,
                    "engine": p.engine,
                    "top": ", ".join(f"{name} {c:.2f}" for name, c in (inter.top_other if inter else [])[:2]),
                    "verdict": "warm-up (not counted)"
                    if p.warmup
                    else ("confirmation: " if p.confirmation else "")
                    + ("pass" if p.passed else "fail")
                    + (" (run again)" if p.superseded else "")
                    + ("" if p.clean else " (unclean)")
                    + (" (client-bound)" if p.client_bound else ""),
                }
            )
        notes = sorted({p.client_note for p in probes if p.client_bound} - {""})
        out.append(
            {
                "layout": lay.layout,
                "deciding": ", ".join(f"{v:.0f}" for v in lay.deciding_p90_ttft_ms),
                "spread": lay.spread,
                "unsteady": lay.unsteady,
                "engine_p90": decided.engine.p90_ttft_ms if decided and decided.engine else None,
                "max_other": max((i.other for i in seen), default=None),
                "max_steal": max((i.steal for i in seen), default=None),
                "unclean": ", ".join(f"{r:.3g}" for r in lay.unclean_rates) or "none",
                "placement": "; ".join(f"{k}: {v}" for k, v in lay.placement.items()),
                "probes": every,
                "client_bound_rates": ", ".join(f"{r:.3g}" for r in lay.client_bound_rates),
                "client_bound": lay.client_bound,
                "client_notes": "; ".join(notes[:3]),
                "confirmation": _confirmation_text(lay),
            }
        )
    return out


def _confirmation_text(lay: LayoutResult) -> str:
    """The runs that confirmed the answer (#61), beside the search's: each rate, its length, p90 TTFT and
    trend, verdict; how many step-downs it took."""
    runs = [p for p in lay.probes if p.confirmation and not p.superseded]
    if not runs:
        return "none"
    each = "; ".join(
        f"{p.rate:.3g} req/s x {p.num_prompts}: p90 TTFT {p.p90_ttft_ms:.0f} ms, trend "
        + ("-" if p.ttft_trend_ms_per_s is None else f"{p.ttft_trend_ms_per_s:+.1f} ms/s")
        + f", {'pass' if p.passed else 'fail'}"
        for p in runs
    )
    verdict = "held" if lay.confirmed else "failed: no rate confirmed"
    downs = f", {lay.step_downs} step-down{'s' * (lay.step_downs != 1)}" if lay.step_downs else ""
    under = f" from under the search's {lay.searched_rate:.3g} req/s" if lay.searched_rate else ""
    return f"{lay.confirm_seconds or 0:.0f} s runs{under}, {verdict}{downs}: {each}"


def _section_measurement(bench: BenchmarkFile | None) -> str:
    return _macro("measurement_section", _measurement_view(bench))


def _capacity_view(facts: ReleaseData) -> dict[str, Any] | None:
    """Fleet at the spec's peak and token cost, live vs candidate (spec `capacity:`)."""
    import tempfile

    plan = facts.capacity
    if plan is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        png = _png(capacity.chart(plan, Path(tmp) / "capacity.png"))
    return {
        "plan": plan,
        "price": f"${plan.price_per_server_hour:g} per server-hour" if plan.price_per_server_hour else "no price",
        "refusal": plan.refusal(),
        "rows": capacity.rows(plan),
        "png": png,
    }


def _trend_view(reg: Registry, release_id: int) -> dict[str, Any] | None:
    """Re-benchmarks since promotion (issue: drift after an engine or image upgrade)."""
    import tempfile

    points = trend(reg, release_id)
    if len(points) < 2:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        png = _png(plot_trend(reg, release_id, Path(tmp) / "trend.png"))
    return {"points": points, "png": png}


def step_times(keys: Sequence[str | None]) -> str:
    """Which step times a run's predictions ran on, from their calibration keys (one run, one set of
    figures): a profiling run's, or the datasheet's (also where no key was recorded)."""
    profile = next((calibration.CalibrationKey.parse(k).profile for k in keys if k), None)
    return f"step times fitted by profile {profile}" if profile else "step times from the datasheet figures"


def _planner_view(reg: Registry, rel: Release) -> dict[str, Any] | None:
    """How far the planner has been from the measurements for this release's layout shapes, on this
    hardware and engine, release after release: its own rate, and the calibrated rate each search
    started at (the calibration's worth shows as the second error shrinking)."""
    keys = [c.prediction.calibration_key for c in rel.data.predictions or [] if c.prediction]
    if not keys:
        return None
    found = reg.measured_predictions()
    rows = [o for key in dict.fromkeys(keys) for o in found.of(key)[-10:]]
    if not rows:
        return None
    own, used = calibration.median_abs_errors(rows)
    first = calibration.CalibrationKey.parse(keys[0])
    return {
        "hardware": first.hardware,
        "engine": first.engine,
        "figures": step_times(keys),
        "own": own,
        "used": used,
        "rows": rows,
        "release_id": rel.id,
    }


def _section_planner(reg: Registry, rel: Release) -> str:
    return _macro("planner_section", _planner_view(reg, rel))


def _artifacts(facts: ReleaseData) -> list[tuple[str, str]]:
    """Where the release's bytes are, by name, as the report lists them (those recorded)."""
    named = [
        ("source_path", facts.source_path),
        ("source_hash", facts.source_hash),
        ("quantized_path", facts.quantized_path),
        ("manifest_hash", facts.manifest_hash),
        ("s3_uri", facts.s3_uri),
        ("nfs_path", facts.nfs_path),
        ("endpoint", facts.endpoint),
    ]
    return [(name, value) for name, value in named if value]


def _audit_events(reg: Registry, release_id: int) -> list[dict[str, Any]]:
    return [
        {
            "at": ev.at,
            "kind": ev.kind,
            "actor": ev.actor,
            "status_after": ev.status_after,
            "detail_text": ", ".join(
                f"{k}={json.dumps(v, default=str)[:160]}" for k, v in ev.detail.stored().items() if k != "table"
            ),
        }
        for ev in reg.events(release_id)
    ]


def render(reg: Registry, rel: Release, loaded: LoadedSpec, bench: BenchmarkFile | None, png: Path | None) -> str:
    facts = rel.data
    chosen = facts.chosen or NOTHING_CHOSEN
    live = reg.live(rel.name, rel.target)
    live = live if live and live.id != rel.id else None
    page = ENV.get_template("report.html.j2").render(
        css=markupsafe.Markup(CSS),
        rel=rel,
        model_name=loaded.spec.model.name,
        layout=facts.layout,
        rate_per_server=chosen.rate_per_server,
        bound_only=chosen.bound_only,
        spec_rows=_spec_rows(loaded),
        gate=facts.accuracy,
        performance=_performance_view(bench, chosen, live, loaded, png),
        capacity=_capacity_view(facts),
        measurement=_measurement_view(bench),
        planner=_planner_view(reg, rel),
        trend=_trend_view(reg, rel.id),
        artifacts=_artifacts(facts),
        events=_audit_events(reg, rel.id),
    )
    return page.strip()


def write(reg: Registry, rel: Release, loaded: LoadedSpec, run_dir: Path) -> Path:
    """Render into `run_dir/report.html`, atomically (a reviewer never opens half a page)."""
    bench_json = run_dir / "benchmark" / "benchmark.json"
    bench = edge.from_json(BenchmarkFile, bench_json.read_text(), str(bench_json)) if bench_json.exists() else None
    png = run_dir / "benchmark" / "latency_vs_rate.png"
    return atomic_write(run_dir / "report.html", render(reg, rel, loaded, bench, png))


def trend(reg: Registry, release_id: int) -> list[dict[str, Any]]:
    """The trend points of a release, oldest first, with the promotion figures as the first point."""
    rel = reg.get(release_id)
    facts = rel.data.chosen or NOTHING_CHOSEN
    points = [
        {
            "at": rel.updated_at.isoformat(),
            "max_slo_rate": facts.max_slo_rate,
            "bound_only": bool(facts.bound_only),
            "p90_ttft_ms": facts.p90_ttft_ms,
            "p90_tpot_ms": facts.p90_tpot_ms,
            "verdict": "promoted",
        }
    ]
    for ev in reg.events(release_id):
        if isinstance(ev.detail, SloGate) and ev.detail.passed:
            points[0]["at"] = ev.at.isoformat()
        if ev.kind == "trend_point":
            point = ev.detail_as(TrendPoint)
            points.append(
                {
                    "at": ev.at.isoformat(),
                    "max_slo_rate": point.max_slo_rate,
                    "bound_only": point.bound_only,  # a lower bound: no probe above it failed
                    "p90_ttft_ms": point.p90_ttft_ms_at_promoted_rate,
                    "p90_tpot_ms": point.p90_tpot_ms_at_promoted_rate,
                    "verdict": point.verdict,
                }
            )
    return points


def plot_trend(reg: Registry, release_id: int, path: Path) -> Path | None:
    """Max SLO rate and the p90s at the promoted rate over time: the picture a reviewer scans."""
    points = trend(reg, release_id)
    if len(points) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.pyplot as plt

    times = [datetime.fromisoformat(p["at"]) for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in (
        (axes[0], "max_slo_rate", "max SLO rate (req/s)"),
        (axes[1], "p90_ttft_ms", "p90 TTFT (ms)"),
        (axes[2], "p90_tpot_ms", "p90 TPOT (ms)"),
    ):
        ax.plot(times, [p[key] for p in points], marker="o")
        for t, p in zip(times, points, strict=True):
            if key == "max_slo_rate" and p["bound_only"]:  # at least this: the engine may hold more
                ax.plot([t], [p[key]], marker="^", color="gray", markersize=10)
            if p["verdict"] == "degraded":
                ax.plot([t], [p[key]], marker="x", color="red", markersize=12)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.suptitle(f"release {release_id}: promotion, then re-benchmarks (red x: degraded; ^: a lower bound)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
