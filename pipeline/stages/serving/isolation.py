"""This host's side of local serving: which cores each process runs on (`placement`, `pin`), what
keeps every other process off the engines' cores while a layout is measured (`isolated`, with its
guardian), and what ends an engine's processes when their owner does (watchdogs, PDEATHSIG, the
record of every process group started, so the next start reaps what a killed owner left)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core.files import atomic_json
from pipeline.core.paths import home
from pipeline.core.specs import HardwareProfile, Layout
from pipeline.stages import affinity_guard
from pipeline.stages.serving.commands import device_sets

log = logging.getLogger(__name__)


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


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL me if the process that started me dies, even by SIGKILL."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def registry_dir() -> Path:
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


def group_is_engine(pgid: int) -> bool:
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


def _members(pgid: int) -> list[str]:
    """The command lines of the group's live processes (`group_members`, zombies left out)."""
    found = []
    for pid in group_members(pgid):
        proc = Path(f"/proc/{pid}")
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
        except (OSError, IndexError):
            continue
    return found


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
        if alive_group(pgid):  # named: a stop that waits out its grace says what made it wait
            log.warning("process group %d outlived SIGTERM by %.0f s, killed: %s", pgid, grace, _members(pgid))
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
    for record in registry_dir().glob("*.json"):
        try:
            info = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            record.unlink(missing_ok=True)
            continue
        if not _alive(info["owner"]) and group_is_engine(info["pgid"]):
            try:
                os.killpg(info["pgid"], signal.SIGKILL)
                reaped += 1
                log.warning("reaped engine process group %d left by dead owner %d", info["pgid"], info["owner"])
            except (ProcessLookupError, PermissionError):
                pass
            record.unlink(missing_ok=True)
    return reaped
