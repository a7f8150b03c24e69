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
import html
import json
import math
from pathlib import Path
from typing import Any

from pipeline.core.files import atomic_write
from pipeline.core.spec import LoadedSpec
from pipeline.planner import calibration
from pipeline.release.registry import Registry, Release
from pipeline.stages import capacity
from pipeline.stages.benchmark.records import LoadSplit

CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#1d2330}
h1{font-size:1.5em;margin-bottom:4px} h2{font-size:1.15em;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em} td,th{border:1px solid #ddd;padding:4px 8px;text-align:right}
th{background:#f4f6fa} td:first-child,th:first-child{text-align:left}
.pass{color:#0a7a32;font-weight:600} .fail{color:#b3261e;font-weight:600} .muted{color:#667}
.verdict{padding:10px 14px;border-radius:6px;background:#f4f6fa;margin:12px 0} code{font-size:.9em}
img{max-width:100%;border:1px solid #eee} td.t{white-space:nowrap}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _num(value: Any, fmt: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, str):
        return _e(value)
    return format(value, fmt)


def _ok(passed: bool | None) -> str:
    if passed is None:
        return '<span class="muted">not run</span>'
    return '<span class="pass">pass</span>' if passed else '<span class="fail">FAIL</span>'


def served_cell(served: dict | None) -> str:
    """One layout's serving-path accuracy: verdict, per task served / in-process, seconds it took."""
    if not served:
        return "—"
    tasks = "<br>".join(
        f"{_e(t['task'])} {t['candidate']:.3f} / {_num(t.get('in_process'), '.3f')}" for t in served["tasks"]
    )
    verdict = "pass" if served["passed"] else "<b>FAIL</b>"
    return f"{verdict} ({served['seconds']:.0f} s)<br>{tasks}"


def chosen_probe(layout: dict[str, Any]) -> dict[str, Any] | None:
    """The probe that decided a layout's max SLO rate (its last run at that rate)."""
    rate = layout.get("max_slo_rate")
    probes = [p for p in layout.get("probes", []) if p.get("rate") == rate]
    return probes[-1] if probes else None


def _section_spec(loaded: LoadedSpec) -> str:
    s, hw = loaded.spec, loaded.hardware
    rows = [
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
            f"p90 TTFT ≤ {s.slo.p90_ttft_ms:g} ms, p90 TPOT ≤ {s.slo.p90_tpot_ms:g} ms, "
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
    return (
        "<h2>Release</h2><table>"
        + "".join(f"<tr><th>{_e(k)}</th><td style='text-align:left'>{_e(v)}</td></tr>" for k, v in rows)
        + "</table>"
    )


def _section_accuracy(gate: dict[str, Any] | None) -> str:
    if not gate:
        return "<h2>Accuracy</h2><p class='muted'>The accuracy gate has not run.</p>"
    rows = [
        "<tr><th>task</th><th>metric</th><th>baseline</th><th>candidate</th><th>recovery</th>"
        "<th>min recovery</th><th>floor</th><th>samples</th><th>result</th></tr>"
    ]
    for t in gate["tasks"]:
        rec = f"{t['recovery']:.3f} ± {t['recovery_stderr'] or 0:.3f}" if t["recovery"] is not None else "—"
        rows.append(
            f"<tr><td>{_e(t['task'])}</td><td>{_e(t['metric'])}</td>"
            f"<td>{t['baseline']:.3f} ± {t['baseline_stderr'] or 0:.3f}</td>"
            f"<td>{t['candidate']:.3f} ± {t['candidate_stderr'] or 0:.3f}</td><td>{rec}</td>"
            f"<td>{t['min_recovery']:.2f}</td><td>{t['floor']:.2f}</td><td>{t['samples_candidate']}</td>"
            f"<td>{_ok(t['passed'])}{'' if t['passed'] else ' ' + _e(t['reason'])}</td></tr>"
        )
    gx = gate.get("validation_html")
    gx_line = f"great-expectations validation: {_ok(gate['passed'])} " + (f"(<code>{_e(gx)}</code>)" if gx else "")
    failures = "".join(f"<li>{_e(f)}</li>" for f in gate.get("failures", []))
    return (
        f"<h2>Accuracy: FP8 candidate vs BF16 baseline {_ok(gate['passed'])}</h2><table>{''.join(rows)}</table>"
        f"<p>{gx_line}</p>" + (f"<ul class='fail'>{failures}</ul>" if failures else "")
    )


def _section_performance(
    bench: dict[str, Any] | None, data: dict[str, Any], live: Release | None, loaded: LoadedSpec, png: Path | None
) -> str:
    if not bench:
        return "<h2>Serving performance</h2><p class='muted'>The benchmark has not run.</p>"
    hw = loaded.hardware
    selection = bench.get("selection") or {}
    best = selection.get("best")
    out = [
        f"<h2>Serving performance {_ok(selection.get('passed'))}</h2>",
        f"<div class='verdict'>{_e(selection.get('reason', ''))}</div>",
    ]
    if live and live.data.get("rate_per_server") is not None and data.get("rate_per_server") is not None:
        ratio = data["rate_per_server"] / live.data["rate_per_server"] if live.data["rate_per_server"] else float("nan")
        out.append(
            f"<p>Live release {live.id} ({_e(live.data.get('layout'))}): "
            f"{live.data['rate_per_server']:.3g} req/s per server; this candidate: "
            f"{data['rate_per_server']:.3g} (<b>{ratio:.2f}x</b>).</p>"
        )
    else:
        out.append("<p class='muted'>No live release to compare with.</p>")
    out.append(_load_time(data, live))
    rows = [
        "<tr><th>layout</th><th>tp/ep x replicas</th><th>status</th><th>capacity req/s</th><th>max SLO req/s</th>"
        "<th>predicted req/s</th><th>prediction error</th>"
        f"<th>per server</th><th>per {_e(hw.kind.upper())}</th><th>p90 TTFT ms</th><th>p90 TPOT ms</th>"
        "<th>model load s</th><th>served accuracy</th><th>note</th></tr>"
    ]
    for lay in bench["layouts"]:
        probe = chosen_probe(lay) or {}
        served = lay.get("served_accuracy")
        mark = " ★" if lay["layout"] == best else ""
        rows.append(
            f"<tr><td>{_e(lay['layout'])}{mark}</td><td>{lay['tp']}/{lay['ep']} x {lay['replicas']}</td>"
            f"<td>{_e(lay['status'])}</td><td>{_num(lay.get('capacity_rps'))}</td>"
            f"<td>{_rate(lay.get('max_slo_rate'), lay.get('bound_only'))}{_marks(lay)}</td>"
            f"<td>{_num(lay.get('predicted_max_slo_rate'))}{_interval(lay.get('predicted_interval'))}</td>"
            f"<td>{'—' if lay.get('prediction_error') is None else format(lay['prediction_error'], '+.0%')}</td>"
            f"<td>{_num(lay.get('per_server'))}</td><td>{_num(lay.get('per_device'))}</td>"
            f"<td>{_num(probe.get('p90_ttft_ms'), '.0f')}</td><td>{_num(probe.get('p90_tpot_ms'), '.1f')}</td>"
            f"<td>{_e(', '.join(f'{s:g}' for s in lay.get('load_seconds', [])))}</td>"
            f"<td>{served_cell(served)}</td>"
            f"<td class='muted' style='text-align:left'>{_e(lay.get('error') or lay.get('stop_reason', ''))}</td></tr>"
        )
    out.append("<table>" + "".join(rows) + "</table>")
    if any(lay.get("served_accuracy") for lay in bench["layouts"]):
        out.append(
            "<p class='muted'>served accuracy: lm-eval at the layout's endpoint after its search, per task "
            "served / in-process score of the candidate on the same items (must agree within two combined "
            "standard errors and meet the gate's recovery and floor); a failure fails the layout.</p>"
        )
    if any(lay.get("predicted_max_slo_rate") for lay in bench["layouts"]):
        how = "".join(
            f"<br>{_e(lay['layout'])}: "
            + (
                f"calibrated {_e(lay['calibration'])}"
                if lay.get("calibration")
                else "uncalibrated (no earlier measurement of this layout shape on this hardware and engine)"
            )
            for lay in bench["layouts"]
            if lay.get("predicted_max_slo_rate")
        )
        out.append(
            "<p class='muted'>predicted: the planner's max SLO rate at the layout's endpoint, published before "
            "the measurement and where its search started: the step-time model ("
            f"{_e(step_times([lay.get('calibration_key') for lay in bench['layouts']]))}), "
            "times the median measured / planner ratio of earlier releases on the same "
            "hardware, engine and layout shape where there are any; error = measured / predicted - 1. "
            "[low–high]: the planner's interval (from its assumed figures' ranges on a datasheet plan, from its "
            "fit's residuals on a profiled one): layouts whose intervals overlap the best one's cannot be ranked "
            f"below it, and top_k measured them too.{how}</p>"
        )
    if png and png.exists():
        encoded = base64.b64encode(png.read_bytes()).decode()
        out.append(
            f"<p><img alt='p90 TTFT and TPOT vs offered rate per layout, with SLO lines' "
            f"src='data:image/png;base64,{encoded}'></p>"
        )
    return "".join(out)


def _split_text(split: dict[str, Any] | None) -> str:
    phases = LoadSplit.model_validate(split).phases() if split else ""
    return f" ({_e(phases)})" if phases else ""


def _load_time(data: dict[str, Any], live: Release | None) -> str:
    """The slowest replica's load time, split by its engine log, beside the live release's: what a
    scale-out or a rollback waits for (#48)."""
    load = max(data.get("load_seconds") or [], default=None)
    if load is None:
        return "<p class='muted'>Model load time: not measured.</p>"
    source = f" from {_e(data['weights_source'])}" if data.get("weights_source") else ""
    split = _split_text(data.get("load_split"))
    text = f"<p>Model load (slowest replica, start to healthy){source}: <b>{load:.3g} s</b>{split}"
    live_load = max(live.data.get("load_seconds") or [], default=None) if live else None
    if live and live_load:
        text += (
            f"; live release {live.id}: {live_load:.3g} s{_split_text(live.data.get('load_split'))}, "
            f"<b>{load / live_load:.2f}x</b>"
        )
    return text + ".</p>"


def _section_measurement(bench: dict[str, Any] | None) -> str:
    """How far the figures can be trusted: repeats at the answer, who else used the CPU, the
    engine's own view next to the client's, and every probe (a reviewer's evidence)."""
    if not bench:
        return ""
    rows = [
        "<tr><th>layout</th><th>p90 TTFT of runs at the answer (ms)</th><th>spread</th>"
        "<th>engine p90 TTFT at the answer</th><th>max other CPU (cores)</th><th>max steal</th>"
        "<th>unclean rates</th><th>placement</th></tr>"
    ]
    details = []
    for lay in bench["layouts"]:
        probes = [p for p in lay.get("probes", []) if not p.get("superseded")]
        seen = [p["interference"] for p in probes if p.get("interference")]
        at_answer = [p for p in probes if p.get("rate") == lay.get("max_slo_rate")]
        engine = (at_answer[-1].get("engine") or {}) if at_answer else {}
        spread = lay.get("spread")
        rows.append(
            f"<tr><td>{_e(lay['layout'])}</td>"
            f"<td>{_e(', '.join(f'{v:.0f}' for v in lay.get('deciding_p90_ttft_ms', [])))}</td>"
            f"<td>{'-' if spread is None else f'{spread:.0%}'}{' unsteady' if lay.get('unsteady') else ''}</td>"
            f"<td>{_num(engine.get('p90_ttft_ms'), '.0f')}</td>"
            f"<td>{_num(max((i['other'] for i in seen), default=None), '.2f')}</td>"
            f"<td>{_num(max((i['steal'] for i in seen), default=None), '.2f')}</td>"
            f"<td>{_e(', '.join(f'{r:.3g}' for r in lay.get('unclean_rates', [])) or 'none')}</td>"
            f"<td class='muted' style='text-align:left'>"
            f"{_e('; '.join(f'{k}: {v}' for k, v in lay.get('placement', {}).items()))}</td></tr>"
        )
        lines = [
            "<tr><th>#</th><th>rate</th><th>requests</th><th>achieved</th><th>p90 TTFT client / engine ms</th>"
            "<th>p90 TPOT ms</th><th>engine queue / prefill / decode ms</th><th>CPU engine / client / other</th>"
            "<th>client send lag p90 / last ms</th><th>client CPU ms/request</th>"
            "<th>steal</th><th>load</th><th>verdict</th></tr>"
        ]
        for i, p in enumerate(lay.get("probes", []), 1):
            inter, eng = p.get("interference") or {}, p.get("engine") or {}
            top = ", ".join(f"{name} {c:.2f}" for name, c in inter.get("top_other", [])[:2])
            verdict = (
                ("pass" if p.get("passed") else "fail")
                + (" (run again)" if p.get("superseded") else "")
                + ("" if p.get("clean", True) else " (unclean)")
                + (" (client-bound)" if p.get("client_bound") else "")
            )
            rate = p.get("rate")
            lines.append(
                f"<tr><td>{i}</td><td>{'burst' if rate in ('Infinity', float('inf')) else _num(rate)}</td>"
                f"<td>{p.get('num_prompts')}</td><td>{_num(p.get('achieved_rate'))}</td>"
                f"<td>{_num(p.get('p90_ttft_ms'), '.0f')} / {_num(eng.get('p90_ttft_ms'), '.0f')}</td>"
                f"<td>{_num(p.get('p90_tpot_ms'), '.1f')}</td>"
                f"<td>{_num(eng.get('mean_queue_ms'), '.0f')} / {_num(eng.get('mean_prefill_ms'), '.0f')} / "
                f"{_num(eng.get('mean_decode_ms'), '.0f')}</td>"
                f"<td>{_num(inter.get('engine'), '.2f')} / {_num(inter.get('client'), '.2f')} / "
                f"{_num(inter.get('other'), '.2f')}{f' ({_e(top)})' if top else ''}</td>"
                f"<td>{_num(p.get('client_lag_p90_ms'), '.0f')} / {_num(p.get('client_lag_end_ms'), '.0f')}</td>"
                f"<td>{_num(p.get('client_cpu_ms_per_request'), '.2f')}</td>"
                f"<td>{_num(inter.get('steal'), '.2f')}</td><td>{_num(inter.get('load_avg_1m'), '.2f')}</td>"
                f"<td>{_e(verdict)}</td></tr>"
            )
        details.append(
            f"<details><summary>{_e(lay['layout'])}: every probe</summary><table>{''.join(lines)}</table></details>"
        )
        if lay.get("client_bound_rates"):
            notes = sorted({p.get("client_note", "") for p in probes if p.get("client_bound")} - {""})
            details.append(
                f"<p class='fail'>{_e(lay['layout'])}: the load client was client-bound at "
                f"{_e(', '.join(f'{r:.3g}' for r in lay['client_bound_rates']))} req/s"
                + (" (the runs deciding the answer among them)" if lay.get("client_bound") else "")
                + f": it sent requests late, so those latencies may be the client's as much as the engine's. "
                f"{_e('; '.join(notes[:3]))}</p>"
            )
    return (
        "<h2>Measurement quality</h2><p class='muted'>Each probe records the CPU used by the engine, the load "
        "client and everything else (cores), the hypervisor's steal, and the engine's own histograms from "
        "/metrics. A probe with too much interference is measured again; the answer is repeated and its "
        "spread shown (runs that differ by more than the spec's allowance are measured again with longer probes, "
        "and marked unsteady if they still do). A probe whose client sent requests late against its schedule by "
        "more than the spec's share of the p90 TTFT limit is marked client-bound.</p><table>"
        + "".join(rows)
        + "</table>"
        + "".join(details)
    )


def _section_capacity(data: dict[str, Any]) -> str:
    """Fleet at the spec's peak and token cost, live vs candidate (spec `capacity:`)."""
    import tempfile

    if not data.get("capacity"):
        return ""
    plan = capacity.CapacityPlan.model_validate(data["capacity"])
    price = f"${plan.price_per_server_hour:g} per server-hour" if plan.price_per_server_hour else "no price"
    out = [
        "<h2>Fleet and cost</h2>",
        f"<p>Peak {plan.peak_rps:g} req/s + {plan.headroom:.0%} headroom, mean {plan.mean_rps:g} req/s, "
        f"{plan.input_len} input / {plan.output_len} output tokens per request; {_e(plan.hardware)} at {_e(price)}"
        + (f" <span class='muted'>({_e(plan.price_note)})</span>" if plan.price_note else "")
        + (f"; at most {plan.max_servers} servers" if plan.max_servers else "")
        + ".</p>",
    ]
    if plan.change:
        c = plan.change
        out.append(
            f"<div class='verdict'>vs live: <b>{_e(c.summary())}</b>; $/hour {_pct(c.usd_per_hour_pct)}, "
            f"$/M input tokens {_pct(c.usd_per_m_input_pct)}</div>"
        )
    refusal = plan.refusal()
    if refusal:
        out.append(f"<div class='verdict fail'>{_e(refusal)}</div>")
    rows = [
        "<tr><th>release / layout</th><th>req/s per server</th><th>servers</th><th>$/hour</th>"
        "<th>$/M input @SLO</th><th>$/M output @SLO</th><th>$/M input @mean</th><th>$/M output @mean</th></tr>"
    ]
    for r in capacity.rows(plan):
        name = r.name
        servers = f"{r.servers}" + ("" if r.within_max else " <span class='fail'>&gt; max</span>")
        rows.append(
            f"<tr><td>{_e(name)}</td><td>{_num(r.rate_per_server)}</td><td>{servers}</td>"
            f"<td>{capacity.money(r.usd_per_hour)}</td><td>{capacity.money(r.usd_per_m_input_at_slo)}</td>"
            f"<td>{capacity.money(r.usd_per_m_output_at_slo)}</td><td>{capacity.money(r.usd_per_m_input_at_mean)}</td>"
            f"<td>{capacity.money(r.usd_per_m_output_at_mean)}</td></tr>"
        )
    out.append("<table>" + "".join(rows) + "</table>")
    with tempfile.TemporaryDirectory() as tmp:
        png = capacity.chart(plan, Path(tmp) / "capacity.png")
        if png:
            encoded = base64.b64encode(png.read_bytes()).decode()
            out.append(
                f"<p><img alt='servers, $/hour and $/M output tokens: live vs candidate' "
                f"src='data:image/png;base64,{encoded}'></p>"
            )
    out.append(
        "<p class='muted'>servers = max(min, ceil(peak x (1 + headroom) / req/s per server)); "
        "$/hour = servers x price; "
        "$/M tokens of a kind charges the whole server-hour to that kind (input and output do not add up): "
        "@SLO one server at its max SLO rate, @mean the peak-sized fleet over the mean traffic.</p>"
    )
    return "".join(out)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def _rate(value: Any, bound: Any) -> str:
    """A max SLO rate: 'at least N' where it is a lower bound (no probe above it failed, or the search's
    budget ran out before a fail narrowed it)."""
    return f"at least {_num(value)}" if bound and isinstance(value, (int, float)) else _num(value)


def _marks(layout: dict[str, Any]) -> str:
    """What a layout's answer must be read with: runs that disagreed (unsteady), a client that sent late
    (client-bound); empty for neither, or where there is no answer."""
    if layout.get("max_slo_rate") is None:
        return ""
    marks = [m for m, key in (("unsteady", "unsteady"), ("client-bound", "client_bound")) if layout.get(key)]
    return f" ({', '.join(marks)})" if marks else ""


def _size(fraction: float | None) -> str:
    """An error's size (no sign): a median of |error|."""
    return "—" if fraction is None else f"{fraction:.1%}"


def _section_trend(reg: Registry, release_id: int) -> str:
    """Re-benchmarks since promotion (issue: drift after an engine or image upgrade)."""
    import tempfile

    points = trend(reg, release_id)
    if len(points) < 2:
        return ""
    rows = [
        "<tr><th>time (UTC)</th><th>max SLO req/s</th><th>p90 TTFT ms</th><th>p90 TPOT ms</th><th>verdict</th></tr>"
    ]
    for p in points:
        rows.append(
            f"<tr><td>{_e(p['at'][:19])}</td><td>{_rate(p['max_slo_rate'], p['bound_only'])}</td>"
            f"<td>{_num(p['p90_ttft_ms'], '.0f')}</td>"
            f"<td>{_num(p['p90_tpot_ms'], '.1f')}</td><td>{_e(p['verdict'])}</td></tr>"
        )
    with tempfile.TemporaryDirectory() as tmp:
        png = plot_trend(reg, release_id, Path(tmp) / "trend.png")
        img = (
            f"<p><img alt='trend' src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'></p>"
            if png
            else ""
        )
    return "<h2>Re-benchmarks since promotion</h2>" + img + "<table>" + "".join(rows) + "</table>"


def step_times(keys: list[str | None]) -> str:
    """Which step times a run's predictions ran on, from their calibration keys (one run, one set of
    figures): a profiling run's, or the datasheet's (also where no key was recorded)."""
    profile = next((calibration.CalibrationKey.parse(k).profile for k in keys if k), None)
    return f"step times fitted by profile {profile}" if profile else "step times from the datasheet figures"


def _section_planner(reg: Registry, rel: Release) -> str:
    """How far the planner has been from the measurements for this release's layout shapes, on this
    hardware and engine, release after release: its own rate, and the calibrated rate each search
    started at (the calibration's worth shows as the second error shrinking)."""
    keys = [p["calibration_key"] for p in rel.data.get("predictions") or [] if p.get("calibration_key")]
    if not keys:
        return ""
    found = reg.measured_predictions()
    rows = [o for key in dict.fromkeys(keys) for o in found.get(key, [])[-10:]]
    if not rows:
        return ""
    own, used = calibration.median_abs_errors(rows)
    first = calibration.CalibrationKey.parse(keys[0])
    figures = step_times(keys)
    out = [
        "<h2>Planner error across releases</h2>",
        f"<p class='muted'>the last measurements of this release's layout shapes on {_e(first.hardware)} "
        f"({_e(first.engine)}; {_e(figures)}); error = measured / predicted - 1. Median |error| over {len(rows)}: "
        f"planner alone {_size(own)}, as predicted (calibrated where earlier measurements existed) {_size(used)}.</p>",
        "<table><tr><th>release</th><th>layout</th><th>planner req/s</th><th>predicted req/s</th>"
        "<th>measured req/s</th><th>planner error</th><th>prediction error</th></tr>",
    ]
    for o in rows:
        mark = " ★" if o.release_id == rel.id else ""
        predicted = _num(o.predicted) + (" (calibrated)" if o.calibrated else "")
        error = o.prediction_error
        out.append(
            f"<tr><td>{o.release_id}{mark}</td><td>{_e(o.layout)}</td><td>{_num(o.planner_rate)}</td>"
            f"<td>{predicted}</td><td>{_num(o.measured)}</td><td>{_pct((o.ratio - 1) * 100)}</td>"
            f"<td>{_pct(None if error is None else error * 100)}</td></tr>"
        )
    return "".join(out) + "</table>"


def _section_artifacts(data: dict[str, Any]) -> str:
    rows = [
        (k, data.get(k))
        for k in (
            "source_path",
            "source_hash",
            "quantized_path",
            "manifest_hash",
            "s3_uri",
            "nfs_path",
            "endpoint",
        )
        if data.get(k)
    ]
    return (
        "<h2>Artifacts</h2><table>"
        + "".join(f"<tr><th>{_e(k)}</th><td style='text-align:left'><code>{_e(v)}</code></td></tr>" for k, v in rows)
        + "</table>"
    )


def _section_audit(reg: Registry, release_id: int) -> str:
    rows = ["<tr><th>time (UTC)</th><th>event</th><th>by</th><th>status</th><th>detail</th></tr>"]
    for ev in reg.events(release_id):
        detail = ", ".join(f"{k}={json.dumps(v, default=str)[:160]}" for k, v in ev.detail.items() if k != "table")
        rows.append(
            f"<tr><td class='t'>{ev.at:%Y-%m-%d %H:%M:%S}</td><td>{_e(ev.kind)}</td><td>{_e(ev.actor)}</td>"
            f"<td>{_e(ev.status_after or '')}</td><td class='muted' style='text-align:left'>{_e(detail)}</td></tr>"
        )
    return "<h2>Audit trail</h2><table>" + "".join(rows) + "</table>"


def render(reg: Registry, rel: Release, loaded: LoadedSpec, bench: dict[str, Any] | None, png: Path | None) -> str:
    data = rel.data
    live = reg.live(rel.name, rel.target)
    live = live if live and live.id != rel.id else None
    headline = (
        f"{_e(loaded.spec.model.name)} FP8 → layout <b>{_e(data.get('layout') or '—')}</b>, "
        f"{_rate(data.get('rate_per_server'), data.get('bound_only'))} req/s per server within the SLO"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Release {rel.id}: {_e(rel.name)}</title>"
        f"<style>{CSS}</style></head><body>"
        f"<h1>Release {rel.id}: {_e(rel.name)} <span class='muted'>({_e(rel.status)})</span></h1>"
        f"<p>{headline}. Run <code>{_e(rel.run_key)}</code>.</p>"
        + _section_spec(loaded)
        + _section_accuracy(data.get("accuracy"))
        + _section_performance(bench, data, live, loaded, png)
        + _section_capacity(data)
        + _section_measurement(bench)
        + _section_planner(reg, rel)
        + _section_trend(reg, rel.id)
        + _section_artifacts(data)
        + _section_audit(reg, rel.id)
        + "</body></html>"
    )


def _interval(ends: list[float] | None) -> str:
    return f" <span class='muted'>[{ends[0]:.3g}–{ends[1]:.3g}]</span>" if ends else ""


def with_intervals(bench: dict[str, Any], predictions: dict[str, Any]) -> dict[str, Any]:
    """Each measured layout's predicted rate with the planner's interval around it (predictions.json,
    published before the measurement, holds it per server: scaled here to the rate the row shows)."""
    by_layout = {p["layout"]: p for p in predictions.get("layouts", [])}
    for lay in bench.get("layouts", []):
        p = by_layout.get(lay["layout"])
        rate = lay.get("predicted_max_slo_rate")
        if p and rate and p.get("predicted_low") is not None and p.get("predicted_high") is not None:
            scale = rate / p["predicted_per_server"]
            lay["predicted_interval"] = [p["predicted_low"] * scale, p["predicted_high"] * scale]
    return bench


def write(reg: Registry, rel: Release, loaded: LoadedSpec, run_dir: Path) -> Path:
    """Render into `run_dir/report.html`, atomically (a reviewer never opens half a page)."""
    bench_json = run_dir / "benchmark" / "benchmark.json"
    bench = json.loads(bench_json.read_text()) if bench_json.exists() else None
    predictions = run_dir / "benchmark" / "predictions.json"
    if bench and predictions.exists():
        bench = with_intervals(bench, json.loads(predictions.read_text()))
    png = run_dir / "benchmark" / "latency_vs_rate.png"
    path = atomic_write(run_dir / "report.html", render(reg, rel, loaded, bench, png))
    return path


def trend(reg: Registry, release_id: int) -> list[dict[str, Any]]:
    """The trend points of a release, oldest first, with the promotion figures as the first point."""
    rel = reg.get(release_id)
    points = [
        {
            "at": rel.updated_at.isoformat(),
            "max_slo_rate": rel.data.get("max_slo_rate"),
            "bound_only": bool(rel.data.get("bound_only")),
            "p90_ttft_ms": rel.data.get("p90_ttft_ms"),
            "p90_tpot_ms": rel.data.get("p90_tpot_ms"),
            "verdict": "promoted",
        }
    ]
    for ev in reg.events(release_id):
        if ev.kind == "slo_gate" and ev.detail.get("passed"):
            points[0]["at"] = ev.at.isoformat()
        if ev.kind == "trend_point":
            points.append(
                {
                    "at": ev.at.isoformat(),
                    "max_slo_rate": ev.detail.get("max_slo_rate"),
                    "bound_only": bool(ev.detail.get("bound_only")),  # a lower bound: no probe above it failed
                    "p90_ttft_ms": ev.detail.get("p90_ttft_ms_at_promoted_rate"),
                    "p90_tpot_ms": ev.detail.get("p90_tpot_ms_at_promoted_rate"),
                    "verdict": ev.detail["verdict"],
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
