"""Airflow as the platform (`pipeline.core.platform`): connections from Airflow's secrets
backends (environment AIRFLOW_CONN_*, the metadata database, a secrets manager), the
cncf-kubernetes hook, the smtp and slack notifiers, the API server's base URL.

Each piece degrades as the library did before it had a platform: a connection that is not
defined, or no Airflow context to read it from, is None and the caller uses the environment.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.core.errors import ReleaseError
from pipeline.core.platform import Connection

log = logging.getLogger(__name__)


class AirflowPlatform:
    def connection(self, conn_id: str) -> Connection | None:
        try:
            from airflow.sdk import Connection as AirflowConnection

            conn = AirflowConnection.get(conn_id)
        except ImportError:
            return None
        except Exception as exc:  # noqa: BLE001 - not defined, or no Airflow context: the caller uses the environment
            log.debug("no Airflow connection %r (%s)", conn_id, type(exc).__name__)
            return None
        return Connection(
            conn_id=conn_id,
            login=conn.login or None,
            password=conn.password or None,
            extra=conn.extra_dejson or {},
            uri=conn.get_uri(),
        )

    def kubernetes_api(self, conn_id: str) -> Any | None:
        try:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
        except ImportError:
            log.warning("Airflow's cncf-kubernetes provider is not importable; ignoring connection %r", conn_id)
            return None
        return KubernetesHook(conn_id=conn_id).api_client

    def notify(
        self, kind: str, conn_id: str, subject: str, body: str, to: list[str], from_email: str, context: Any = None
    ) -> None:
        context = context or {}  # the task's context when a task sends it; the notifiers accept an empty one
        if kind == "smtp":
            from airflow.providers.smtp.notifications.smtp import SmtpNotifier

            SmtpNotifier(
                to=to, from_email=from_email, subject=subject, html_content=f"<pre>{body}</pre>", smtp_conn_id=conn_id
            ).notify(context)
        elif kind == "slack":
            try:
                from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier
            except ImportError:
                raise ReleaseError(
                    "rebenchmark.notify.kind slack needs apache-airflow-providers-slack installed"
                ) from None
            SlackWebhookNotifier(slack_webhook_conn_id=conn_id, text=body).notify(context)
        else:
            raise ReleaseError(f"rebenchmark.notify.kind: no notifier for {kind!r}")

    def base_url(self) -> str:
        try:
            from airflow.configuration import conf

            return conf.get("api", "base_url", fallback="http://localhost:8080")
        except Exception:  # noqa: BLE001 - outside Airflow the link is still useful with the default
            return "http://localhost:8080"
