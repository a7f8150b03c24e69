"""CPU masks and priorities that a benchmark changes, and the guardian that gives them back when it dies.

`serving.isolated` confines every other process on the machine to the cores no engine computes on
while a layout is measured, and (as root, who may give a priority back) moves their threads to the
idle scheduling class (SCHED_IDLE: they run only when the core has nothing else to run, and a
waking API server preempts them at once) and their sessions' autogroups to nice 19, so that on the
core they share with the engine's API server and the load client they yield. Both are needed:
Airflow's DAG parsing waking for a quarter of a core failed probes the engine held otherwise;
nice 19 did not stop it (the fair class lets the running task finish its slice first); and with
the kernel's autogroups on, the class alone does not cross sessions (a core is shared between
the sessions' groups first: an idle-class spinner in another session took half the frontend core
and slowed the engine 30-75x). The benchmark's own process and its children (the load client)
keep their class, and the engines' and the client's sessions their nice. What it changes is written down first
(`snapshot`, one file, atomically),
and a guardian started from this file (`python -S affinity_guard.py STATE`, its own session, SIGTERM,
SIGINT and SIGHUP ignored, last in the OOM killer's line) blocks on a pipe whose only writer is the
benchmark: the read ends when the benchmark closes it or dies by any means, SIGKILL and the OOM
killer included. The guardian then gives back what the file says (`restore`), unless the benchmark
did so itself and removed the file. Standard library only: it runs without the project's packages.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PF_KTHREAD = 0x00200000  # include/linux/sched.h
YIELD = os.SCHED_IDLE  # the scheduling class others run in while a layout is measured
FAIR = (os.SCHED_OTHER, os.SCHED_BATCH)  # what may be moved to it (real-time threads are left alone)
GROUP_NICE = 19  # the nice other sessions' autogroups get meanwhile (the class alone does not cross groups)
RESET_ON_FORK = os.SCHED_RESET_ON_FORK  # a flag the policy may carry (PID 1 here does): kept, given back

Masks = dict[int, list[int]]  # thread id -> cores
Policies = dict[int, int]  # thread id -> scheduling policy


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def started(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): tells a pid apart from a reused one."""
    try:
        return int(_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def _parent(pid: int) -> int:
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return 0


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def others(skip_groups: set[int], skip: set[int] | None = None) -> list[int]:
    """User-space processes outside the process groups `skip_groups` and the pids `skip`. Kernel
    threads carry PF_KTHREAD in their stat flags (a command line can be empty for a moment in a
    process that is just exec'ing)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in (skip or ()) or _pgid(int(proc.name)) in skip_groups:
            continue
        try:
            flags = int(_stat(int(proc.name))[6])
        except (OSError, IndexError, ValueError):
            continue
        if not flags & PF_KTHREAD:
            out.append(int(proc.name))
    return out


def _per_thread(pid: int, read: Callable[[int], Any]) -> dict[int, Any]:
    """`read(tid)` for each thread of `pid`; empty when the process is gone."""
    out = {}
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return {}
    for tid in tids:
        with contextlib.suppress(OSError):
            out[tid] = read(tid)
    return out


def masks(pid: int) -> Masks:
    """Each thread's mask (sched_setaffinity is per thread on Linux: vLLM binds its OpenMP threads
    one core each); empty when the process is gone."""
    return _per_thread(pid, lambda tid: sorted(os.sched_getaffinity(tid)))


def policies(pid: int) -> Policies:
    """Each thread's scheduling policy (per thread on Linux, as masks are); empty when the process is gone."""
    return _per_thread(pid, os.sched_getscheduler)


def set_policy(tid: int, policy: int) -> None:
    with contextlib.suppress(OSError):
        os.sched_setscheduler(tid, policy, os.sched_param(0))


def lower(pid: int) -> None:
    """Every thread of `pid` in a fair class (not a real-time one) to YIELD."""
    for tid, policy in policies(pid).items():
        if policy & ~RESET_ON_FORK in FAIR:
            set_policy(tid, YIELD)


def session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def autogroup(pid: int) -> tuple[str, int] | None:
    """(name, nice) of the autogroup `pid` belongs to (one per session, where the kernel has them),
    or None. With autogroups on, a core is shared between the groups first, by each group's nice,
    and only then between a group's threads by their class: an idle-class thread in another
    session's group still gets a fair group's share (half the frontend core beside a busy API
    server, measured: `benchmarks/frontend_interference.py`)."""
    try:
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Set the nice of `pid`'s autogroup (its whole session, children born later included)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
        return True
    except OSError:
        return False


def autogroups(pids: list[int], keep: set[int]) -> dict[str, dict[str, Any]]:
    """name -> {"nice", "pids"}: the autogroups of `pids`, less any that holds a process of `keep`
    (an engine's, the load client's: each in a session of its own)."""
    kept = {group[0] for pid in keep if (group := autogroup(pid))}
    out: dict[str, dict[str, Any]] = {}
    for pid in pids:
        group = autogroup(pid)
        if group and group[0] not in kept:
            out.setdefault(group[0], {"nice": group[1], "pids": []})["pids"].append(pid)
    return out


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it (the benchmark and its load client: never lowered)."""
    out = {pid}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            chain, here = [], int(proc.name)
            for _ in range(64):
                if here in out or here <= 1:
                    break
                chain.append(here)
                here = _parent(here)
            if here in out:
                out.update(chain)
    return out


def set_masks(pid: int, cores: list[int], own: Masks | None = None) -> None:
    """Every thread of `pid` onto `own`'s mask for it when given, else onto `cores`."""
    for tid in masks(pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, (own or {}).get(tid, cores))


def snapshot(skip_groups: set[int], skip: set[int]) -> dict[str, tuple[int | None, Masks, Policies]]:
    """pid -> (start time, each thread's mask, each thread's policy) of every process `others` lists."""
    out = {}
    for pid in others(skip_groups, skip):
        seen = masks(pid)
        if seen:
            out[str(pid)] = (started(pid), seen, policies(pid))
    return out


def restore(state: dict) -> int:
    """Give back what `state` (`serving.isolated`'s file: `cores`, `engine_groups`, `seen`, `lowered`)
    changed: each thread still confined to `cores` gets the mask its process's thread had before (a
    thread born meanwhile: its process's first thread's), and a process born meanwhile the mask of its
    nearest ancestor that was there before (the machine's, when none is). A thread moved elsewhere
    since was moved by someone else, and stays. Likewise with `lowered`, each thread still in the
    YIELD class gets its own fair class back (a process born meanwhile: its nearest older
    ancestor's, SCHED_OTHER when none), and each autogroup in `autogroups` still at GROUP_NICE its
    nice. -> how many processes got a mask, a class or a group's nice back."""
    cores = sorted(state["cores"])
    machine = list(range(os.cpu_count() or 1))
    starts = {int(pid): start for pid, (start, *_) in state["seen"].items()}
    saved_masks = {int(pid): {int(t): m for t, m in kept[1].items()} for pid, kept in state["seen"].items()}
    saved_policies = {  # absent in a state file written before policies were kept
        int(pid): {int(t): n for t, n in (kept[2] if len(kept) > 2 else {}).items()}
        for pid, kept in state["seen"].items()
    }

    def was_there(pid: int) -> bool:
        return pid in starts and starts[pid] == started(pid)

    def saved(table: dict[int, dict[int, Any]], pid: int, fallback: Any) -> tuple[dict[int, Any] | None, Any]:
        """(`pid`'s own threads' saved values, or None; the value for a thread it did not have then:
        its first thread's, else its nearest older ancestor's first thread's, else `fallback`)."""
        if was_there(pid) and table.get(pid):
            return table[pid], table[pid].get(pid, next(iter(table[pid].values())))
        for _ in range(64):  # a chain of parents, never a loop, but bounded all the same
            pid = _parent(pid)
            if pid <= 0:
                break
            if was_there(pid) and table.get(pid):
                return None, table[pid].get(pid, next(iter(table[pid].values())))
        return None, fallback

    given = set()
    for name, kept in state.get("autogroups", {}).items() if state.get("lowered") else ():
        for pid in kept["pids"]:  # any member still there names the group (a reused pid does not)
            group = autogroup(pid) if was_there(pid) else None
            if group and group[0] == name:
                if group[1] == GROUP_NICE != kept["nice"] and set_autogroup_nice(pid, kept["nice"]):
                    given.add(pid)
                break
    for pid in others(set(state["engine_groups"])):
        now = masks(pid)
        confined = [tid for tid, mask in now.items() if mask == cores]
        if confined:
            own, first = saved(saved_masks, pid, machine)
            back = {tid: (own or {}).get(tid, first) for tid in confined}
            if any(back[tid] != cores for tid in confined):
                for tid in confined:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(tid, back[tid])
                given.add(pid)
        if not state.get("lowered"):
            continue
        yielded = [tid for tid, policy in policies(pid).items() if policy == YIELD]
        if yielded:
            own_policy, first_policy = saved(saved_policies, pid, os.SCHED_OTHER)
            for tid in yielded:
                value = (own_policy or {}).get(tid, first_policy)
                if value & ~RESET_ON_FORK in FAIR:  # a thread that was idle-class before stays so
                    set_policy(tid, value)
                    given.add(pid)
    return len(given)


def main(state_file: str) -> None:
    """The guardian: wait for the benchmark's pipe (stdin) to close, then restore what the state
    file still says and remove it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError):  # the OOM killer takes anyone before us (root may lower it)
        Path("/proc/self/oom_score_adj").write_text("-1000")
    while os.read(0, 4096):
        pass
    path = Path(state_file)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):  # the benchmark gave everything back itself and removed the file
        return
    restore(state)
    path.unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1])
