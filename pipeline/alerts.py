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

from pipeline.errors import ReleaseError
from pipeline.registry import Registry, Release
from pipeline.spec import LoadedSpec

log = logging.getLogger(__name__)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def text(rel: Release, verdict, base_url: str) -> tuple[str, str]:
    """(subject, body) of the alert: what happened and the figures, readable in a pager."""
    what = "DEGRADED" if verdict.status == "degraded" else "re-benchmark FAILED"
    subject = f"[model-release] {rel.name} release {rel.id} ({rel.data.get('layout')}): {what}"
    m, e = verdict.measured, verdict.expected
    lines = [subject, ""] + [f"- {r}" for r in verdict.reasons] + [""]
    if m:
        lines += [f"max SLO rate:  expected {_fmt(e.get('max_slo_rate'))} req/s, measured {_fmt(m.get('max_slo_rate'))}",
                  f"p90 TTFT at promoted rate: expected {_fmt(e.get('p90_ttft_ms'))} ms, "
                  f"measured {_fmt(m.get('p90_ttft_ms_at_promoted_rate'))}",
                  f"p90 TPOT at promoted rate: expected {_fmt(e.get('p90_tpot_ms'))} ms, "
                  f"measured {_fmt(m.get('p90_tpot_ms_at_promoted_rate'))}"]
    lines += [f"versions: {json.dumps(verdict.versions)}",
              f"report: {base_url.rstrip('/')}/model-releases/releases/{rel.id}"]
    return subject, "\n".join(lines)


def _base_url() -> str:
    try:
        from airflow.configuration import conf

        return conf.get("api", "base_url", fallback="http://localhost:8080")
    except Exception:  # noqa: BLE001 - outside Airflow the link is still useful with the default
        return "http://localhost:8080"


def send(reg: Registry, rel: Release, loaded: LoadedSpec, verdict, context: Any = None) -> dict[str, Any]:
    notify = loaded.spec.rebenchmark.notify
    subject, body = text(rel, verdict, _base_url())
    log.warning("ALERT %s", body)
    sent = {"channel": notify.kind, "subject": subject}
    if notify.kind == "smtp":
        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        notifier = SmtpNotifier(to=notify.to, from_email=notify.from_email or "model-release@localhost",
                                subject=subject, html_content=f"<pre>{body}</pre>", smtp_conn_id=notify.connection_id)
        notifier.notify(context or {})
        sent["to"] = notify.to
    elif notify.kind == "slack":
        try:
            from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier
        except ImportError:
            raise ReleaseError("rebenchmark.notify.kind slack needs apache-airflow-providers-slack installed") from None
        SlackWebhookNotifier(slack_webhook_conn_id=notify.connection_id, text=body).notify(context or {})
    reg.record(rel.id, "alert", "rebenchmark", {**sent, "body": body})
    return sent
