"""One rollout controller per model at a time on a cluster: a `coordination.k8s.io/v1` Lease.

A release DAG, a rollback DAG, a task's retry, a zombie first try and `model-release recover` may
all act on one model at once; each takes this Lease first, the way client-go's leaderelection
does, with compare-and-swap only (no check-then-write): the first create wins (the API server
answers 409 AlreadyExists to the others), and every renewal or takeover is an update carrying the
resourceVersion read, which the API server refuses (409 Conflict) once anyone else wrote it.

Expiry is judged by locally observed time, never by comparing our clock with the holder's
`renewTime`: a holder counts as gone once its record (its resourceVersion) has not changed for
the Lease's `leaseDurationSeconds` of our own monotonic clock since we first saw it so.

The fence: `Fenced` wraps the API client the controller writes through; before every write it
renews the Lease by compare-and-swap, so a controller that lost it (expired while it was stuck,
taken over meanwhile) makes no further write: the write raises `LeaseLost` instead.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pipeline.core.errors import LeaseHeld, LeaseLost, ReleaseError

log = logging.getLogger(__name__)

__all__ = ["DURATION_S", "Fenced", "Lease", "holder_identity", "lease_name"]

DURATION_S = 60  # leaseDurationSeconds: how long a silent holder keeps the model
PREFIX = "model-release-"


def lease_name(model: str) -> str:
    """The model's Lease (a DNS subdomain name, like the model's other objects)."""
    return (PREFIX + model.lower().replace("_", "-").replace(".", "-"))[:63].rstrip("-")


def holder_identity(actor: str) -> str:
    """Who holds it, for the humans a refusal names: the actor, the host and the process."""
    return f"{actor}@{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


def _now() -> str:
    """A MicroTime as the API server writes one (RFC 3339, six fractional digits)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Lease:
    """The model's Lease in `namespace`, as `holder` takes, renews and gives it back."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        model: str,
        holder: str,
        duration_s: int = DURATION_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        from kubernetes.client import CoordinationV1Api

        self.leases = CoordinationV1Api(api)
        self.namespace, self.name, self.holder = namespace, lease_name(model), holder
        self.duration_s, self.clock = duration_s, clock
        self.version: str | None = None  # the resourceVersion of our last write: what the next update carries
        self.transitions = 0
        self.acquired = ""
        self.lost = False
        self._seen: tuple[str | None, str, int] | None = None  # (holder, resourceVersion, its duration) we observe
        self._seen_at = 0.0  # when, on our clock, we first saw that record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------ taking it

    def acquire(self, wait_s: float = 0.0, poll_s: float = 2.0) -> None:
        """Take the Lease, waiting up to `wait_s` for its holder to give it back or go silent;
        LeaseHeld naming the holder otherwise."""
        deadline = self.clock() + wait_s
        while not self.try_acquire():
            if self.clock() >= deadline:
                holder, _, duration = self._seen or (None, "", self.duration_s)
                raise LeaseHeld(
                    f"model {self.name.removeprefix(PREFIX)}: another controller holds Lease "
                    f"{self.namespace}/{self.name}: {holder} (it lapses {duration} s after its last renewal; "
                    f"waited {wait_s:.0f} s)",
                    holder or "?",
                )
            time.sleep(poll_s)
        log.info("lease %s/%s taken by %s", self.namespace, self.name, self.holder)

    def try_acquire(self) -> bool:
        """One compare-and-swap attempt: create, or take over a Lease given back or silent for its
        duration on our clock, or renew our own. False where someone else holds it (or won the race)."""
        from kubernetes.client.exceptions import ApiException

        try:
            current = self.leases.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise _error(exc, f"read Lease {self.namespace}/{self.name}") from None
            return self._create()
        spec, version = current.spec, current.metadata.resource_version
        holder = spec.holder_identity or None
        duration = spec.lease_duration_seconds or self.duration_s
        if holder not in (None, self.holder):
            seen = (holder, version, duration)
            if seen != self._seen:  # it changed (renewed, or a new holder): its clock starts again
                self._seen, self._seen_at = seen, self.clock()
                return False
            if self.clock() - self._seen_at < duration:
                return False
            log.warning("lease %s/%s: %s silent for %d s; taking it over", self.namespace, self.name, holder, duration)
        self.transitions = (spec.lease_transitions or 0) + (holder != self.holder)
        self.acquired = _now() if holder != self.holder else (_micro(spec.acquire_time) or _now())
        self.version = version
        if not self._update():
            return False
        self.lost = False
        return True

    def _create(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        self.transitions, self.acquired = 0, _now()
        try:
            created = self.leases.create_namespaced_lease(self.namespace, self._body(None))
        except ApiException as exc:
            if exc.status == 409:  # another controller created it first
                return False
            raise _error(exc, f"create Lease {self.namespace}/{self.name}") from None
        self.version = created.metadata.resource_version
        self.lost = False
        return True

    def _body(self, version: str | None, holder: str | None = "") -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if version is not None:
            metadata["resourceVersion"] = version  # the precondition: 409 once anyone else wrote it
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.holder if holder == "" else holder,
                "leaseDurationSeconds": self.duration_s,
                "acquireTime": self.acquired,
                "renewTime": _now(),
                "leaseTransitions": self.transitions,
            },
        }

    def _update(self, holder: str | None = "") -> bool:
        """Replace the Lease carrying the resourceVersion we last saw; False on 409 (someone wrote it since)."""
        from kubernetes.client.exceptions import ApiException

        try:
            done = self.leases.replace_namespaced_lease(self.name, self.namespace, self._body(self.version, holder))
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise _error(exc, f"update Lease {self.namespace}/{self.name}") from None
        self.version = done.metadata.resource_version
        return True

    # ------------------------------------------------------------ holding it

    def ensure(self) -> None:
        """The fence, before a write: the Lease renewed by compare-and-swap, or LeaseLost."""
        with self._lock:
            if not self.lost and not self._update():
                self.lost = True
                log.error("lease %s/%s: %s lost it (someone else wrote it)", self.namespace, self.name, self.holder)
            if self.lost:
                raise LeaseLost(
                    f"Lease {self.namespace}/{self.name}: {self.holder} no longer holds it (taken over or lapsed); "
                    "this controller writes nothing more"
                )

    def start_renewing(self, every_s: float | None = None) -> None:
        """Renew in the background (a third of the duration by default) through long waits (pod
        readiness, an analysis window, the keep window, a review)."""
        every = every_s or self.duration_s / 3
        self._stop.clear()  # taken again after a release (the keep window): renewed again

        def renew() -> None:
            while not self._stop.wait(every):
                try:
                    self.ensure()
                except LeaseLost:
                    return
                except ReleaseError as exc:  # the API server did not answer: try again next period
                    log.warning("lease %s/%s: renewal failed: %s", self.namespace, self.name, exc)

        self._renewer = threading.Thread(target=renew, name=f"lease-{self.name}", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Give it back (holder cleared, by compare-and-swap: a Lease taken over meanwhile is left alone)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            if not self.lost and self._update(holder=None):
                log.info("lease %s/%s given back by %s", self.namespace, self.name, self.holder)
            self.lost = True


class Fenced:
    """An ApiClient whose every write (anything but GET) is fenced by the Lease: renewed first, or
    LeaseLost and nothing sent. Reads pass through."""

    def __init__(self, api: Any, lease: Lease):
        self.api, self.lease = api, lease

    @property
    def configuration(self) -> Any:
        return self.api.configuration

    def call_api(self, path: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if method != "GET":
            self.lease.ensure()
        return self.api.call_api(path, method, *args, **kwargs)


def _micro(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return str(value)


def _error(exc: Any, what: str) -> ReleaseError:
    return ReleaseError(f"{what}: HTTP {exc.status}: {exc.reason}")
