"""The local target's route: an nginx "front" on the spec's port, the CPU analogue of a
Kubernetes Service and HTTPRoute in front of Deployments.

It listens for as long as any release is live and proxies to the current release's engine
replicas, or during a rollout step to both releases' by weight; a switch is an nginx reload (no
dropped connections) that counts once the front answers with its new marker. Its access log is
what the rollout reads of the requests an engine failed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from pipeline.core.errors import LocalDeployFailed
from pipeline.core.rollout import Deployment
from pipeline.core.specs import ReleaseSpec
from pipeline.release.local_engines import _tail, state_dir
from pipeline.stages import serving


def endpoint(spec: ReleaseSpec) -> str:
    return f"http://127.0.0.1:{spec.serving.port}"


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
    return pid if serving.alive_group(pid) and serving.group_is_engine(pid) else None


def _front_release(spec: ReleaseSpec) -> str | None:
    try:
        with urllib.request.urlopen(f"{endpoint(spec)}/__release", timeout=3) as response:
            return response.read().decode()
    except OSError:
        return None


def _accepting_workers(master: int) -> set[int]:
    """nginx's worker processes under `master` that may still accept connections. After a reload an
    old worker finishes its requests but accepts none once its title reads "shutting down" (nginx
    sets it as it closes its listening sockets), or once it has exited."""
    workers = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state, parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            title = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(parent) == master and state != "Z" and b"shutting down" not in title:
            workers.add(int(proc.name))
    return workers


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
    old_workers: set[int] = set()
    if pid is not None:
        old_workers = _accepting_workers(pid)
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
        # the new worker answers `marker` while an old one may still accept a connection (and send it
        # to a backend the caller stops next: a 502): switched once the old ones accept no more
        if _front_release(spec) == marker and not old_workers & _accepting_workers(pid or 0):
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


def front_failures(name: str, since: float, until: float) -> int:
    """Requests the front answered with a failure between two wall-clock times, from its access log:
    5xx (an engine that reset or aborted a request: nginx's 502) and 499 (the client gave up)."""
    path = state_dir(name) / "front" / "access.log"
    if not path.exists():
        return 0
    failed = 0
    for line in path.read_text(errors="replace").splitlines():
        match = serving.FRONT_LOG.match(line)
        if match and since <= float(match["time"]) <= until:
            failed += int(match["status"]) >= 500 or match["status"] == "499"
    return failed
