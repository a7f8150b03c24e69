"""One rollout controller per model at a time, taken before the registry is read.

A release DAG, a rollback DAG, a task's retry, a zombie first try and `model-release recover` all
act through `controlling`: on the local target the model's switch lock (an flock beside its
engines' state, the one `local_target.switching` takes), on Kubernetes the model's Lease
(`pipeline.k8s.lease`), whose fence makes every write of a controller that lost it fail. A
second controller waits up to `wait_s`, then is refused with the holder named (LeaseHeld).

The keep window gives the lock back while it waits (`Held.released`): a rollback meanwhile need
not wait hours for it; the controller takes it again before it scales anything down, and finds
the route changed if someone rolled back.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from typing import Any

from pipeline.core.errors import LeaseHeld
from pipeline.core.specs import LoadedSpec
from pipeline.k8s import deploy as k8s_deploy
from pipeline.k8s.lease import Fenced, Lease, holder_identity
from pipeline.release import local_target

WAIT_S = 120.0  # how long a second controller waits for the first before it is refused
POLL_S = 2.0


class Held:
    """A model's controller lock, held: `api` is what the controller writes the cluster through
    (fenced by the Lease; None on the local target)."""

    def __init__(self, holder: str, api: Any = None, lease: Lease | None = None, local: _LocalLock | None = None):
        self.holder, self.api, self.lease, self.local = holder, api, lease, local

    @contextlib.contextmanager
    def released(self, wait_s: float) -> Iterator[None]:
        """Give the lock back for a while (the keep window), then take it again (waiting `wait_s`)."""
        if self.lease is not None:
            self.lease.release()
        elif self.local is not None:
            self.local.unlock()
        try:
            yield
        finally:
            if self.lease is not None:
                self.lease.acquire(wait_s, POLL_S)
                self.lease.start_renewing()
            elif self.local is not None:
                self.local.lock(wait_s, self.holder)


@contextlib.contextmanager
def controlling(
    name: str, target: str, loaded: LoadedSpec, actor: str, client: Any = None, wait_s: float = WAIT_S
) -> Iterator[Held]:
    """Hold model `name`'s controller lock on `target` for the block; LeaseHeld naming the holder
    when another controller keeps it past `wait_s`."""
    holder = holder_identity(actor)
    if target == "kubernetes":
        spec = loaded.spec
        api = client or k8s_deploy.api_client(spec.promotion.kubernetes_conn_id)
        lease = Lease(api, spec.promotion.namespace, name, holder)
        lease.acquire(wait_s, POLL_S)
        lease.start_renewing()
        try:
            yield Held(holder, Fenced(api, lease), lease=lease)
        finally:
            lease.release()
        return
    local = _LocalLock(name)
    local.lock(wait_s, holder)
    try:
        yield Held(holder, local=local)
    finally:
        local.unlock()
        local.close()


class _LocalLock:
    """The local target's switch lock (`local_target.switching`'s file), with its holder beside it."""

    def __init__(self, name: str):
        self.name = name
        self.dir = local_target.state_dir(name)
        self.handle = open(self.dir / "switch.lock", "a")  # noqa: SIM115 - held across the block
        self.held = False

    def lock(self, wait_s: float, holder: str) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    who = self._holder()
                    raise LeaseHeld(
                        f"model {self.name}: another controller holds its switch lock: {who} (waited {wait_s:.0f} s)",
                        who,
                    ) from None
                time.sleep(min(POLL_S, max(0.05, deadline - time.monotonic())))
        self.held = True
        (self.dir / "switch.holder").write_text(holder)

    def _holder(self) -> str:
        path = self.dir / "switch.holder"
        return path.read_text().strip() if path.exists() else "an unnamed process (local_target.switching)"

    def unlock(self) -> None:
        if self.held:
            (self.dir / "switch.holder").unlink(missing_ok=True)
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.held = False

    def close(self) -> None:
        self.handle.close()
