"""What the library needs from the platform that runs it, without importing Airflow here.

The library reads named connections (S3 keys, the registry's database, the Kubernetes API),
sends alerts through the platform's notifiers and links to its UI. Inside Airflow, and from the
CLI, the entry layer installs Airflow's implementation (`pipeline.entry.airflow_platform`):
connections from Airflow's secrets backends, the cncf-kubernetes hook, the smtp and slack
notifiers. Without it (a bare script) there are no named connections and callers fall back to
the environment (AWS_*, KUBECONFIG), as they do when a connection is not defined.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, Field, SecretStr

from pipeline.core.errors import ReleaseError


class Connection(BaseModel):
    """The fields of a named connection the library reads; the password never prints."""

    conn_id: str
    login: str | None = None
    password: SecretStr | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    uri: SecretStr = Field(description="the whole connection as a URI (a database URL)")


class Platform(Protocol):
    def connection(self, conn_id: str) -> Connection | None:
        """The named connection, or None when it is not defined."""
        ...

    def kubernetes_api(self, conn_id: str) -> Any | None:
        """A kubernetes ApiClient from the named connection, or None to use in-cluster/kubeconfig."""
        ...

    def notify(
        self, kind: str, conn_id: str, subject: str, body: str, to: list[str], from_email: str, context: Any = None
    ) -> None:
        """Send an alert through the platform's notifier of this kind (smtp, slack)."""
        ...

    def base_url(self) -> str:
        """Where the UI is, for links in alerts."""
        ...


class Bare:
    """No platform: no named connections, no notifiers."""

    def connection(self, conn_id: str) -> Connection | None:
        return None

    def kubernetes_api(self, conn_id: str) -> Any | None:
        return None

    def notify(
        self, kind: str, conn_id: str, subject: str, body: str, to: list[str], from_email: str, context: Any = None
    ) -> None:
        raise ReleaseError(f"cannot send a {kind} alert: no platform installed (run it from Airflow or the CLI)")

    def base_url(self) -> str:
        return "http://localhost:8080"


_current: Platform = Bare()


def use(platform: Platform) -> None:
    global _current
    _current = platform


def current() -> Platform:
    return _current
