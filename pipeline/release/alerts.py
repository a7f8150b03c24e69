"""Alerts on re-benchmark verdicts, through Airflow's own notifiers.

The registry always gets an `alert` event (the embedded default stops there, and logs it);
with `rebenchmark.notify.kind: smtp` the providers' SmtpNotifier sends it through an Airflow
SMTP connection, with `slack` the Slack provider's webhook notifier. The text carries release,
layout, expected vs measured figures, and the link to the release's page.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline.core import platform
from pipeline.core.specs import LoadedSpec
from pipeline.records.events import Alert
from pipeline.records.rebenchmark import Promoted, Remeasure, Verdict
from pipeline.release.registry import Registry, Release
from pipeline.stages import benchmark

log = logging.getLogger(__name__)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def _rate(figures: Promoted | Remeasure | None) -> str:
    """A max SLO rate, 'at least N' where it is a lower bound, '(unsteady)' / '(client-bound)' where marked."""
    if figures is None or figures.max_slo_rate is None:
        return _fmt(None)
    if isinstance(figures, Promoted):
        return benchmark.rate_text(figures.max_slo_rate, figures.bound_only)
    return benchmark.rate_text(figures.max_slo_rate, figures.bound_only, figures.unsteady, figures.client_bound)


def text(rel: Release, verdict: Verdict, base_url: str) -> tuple[str, str]:
    """(subject, body) of the alert: what happened and the figures, readable in a pager."""
    what = "DEGRADED" if verdict.status == "degraded" else "re-benchmark FAILED"
    subject = f"[model-release] {rel.name} release {rel.id} ({rel.data.layout}): {what}"
    m, e = verdict.measured, verdict.expected
    lines = [subject, ""] + [f"- {r}" for r in verdict.reasons] + [""]
    if m is not None:
        lines += [
            f"max SLO rate:  expected {_rate(e)} req/s, measured {_rate(m)}"
            + (" (a lower bound: the engine may hold more)" if m.bound_only else ""),
            f"p90 TTFT at promoted rate: expected {_fmt(e.p90_ttft_ms if e else None)} ms, "
            f"measured {_fmt(m.p90_ttft_ms_at_promoted_rate)}",
            f"p90 TPOT at promoted rate: expected {_fmt(e.p90_tpot_ms if e else None)} ms, "
            f"measured {_fmt(m.p90_tpot_ms_at_promoted_rate)}",
        ]
    lines += [
        f"versions: {json.dumps(verdict.versions)}",
        f"report: {base_url.rstrip('/')}/model-releases/releases/{rel.id}",
    ]
    return subject, "\n".join(lines)


def send(reg: Registry, rel: Release, loaded: LoadedSpec, verdict: Verdict, context: Any = None) -> Alert:
    notify = loaded.spec.rebenchmark.notify
    subject, body = text(rel, verdict, platform.current().base_url())
    log.warning("ALERT %s", body)
    sent = Alert(channel=notify.kind, subject=subject, body=body)
    if notify.kind != "log" and notify.connection_id:
        if notify.kind == "smtp":
            sent.to = notify.to
        platform.current().notify(
            notify.kind,
            notify.connection_id,
            subject,
            body,
            notify.to,
            notify.from_email or "model-release@localhost",
            context,
        )
    reg.record(rel.id, sent, "rebenchmark")
    return sent
