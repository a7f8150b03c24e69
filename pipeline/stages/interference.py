"""Who used the machine during a probe: the engine, the load client, the search itself, or
something else.

Why: a latency probe measures the engine only when nothing else competes for the cores it
and its client run on. Machine-wide CPU time comes from /proc/stat (so processes that start
and exit inside the window are counted too, e.g. a DAG parse), the engine's from its process
groups, the client's from the owner's reaped children, the owner's from its own rusage.
Everything else is interference; the biggest other processes are named so a log says what it
was. Steal time (a shared VM's neighbours) is recorded beside it.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.records.benchmark import Interference
from pipeline.stages import serving

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_times() -> tuple[int, int]:
    """(busy, steal) jiffies summed over all CPUs."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _processes() -> dict[int, tuple[int, int, str, int]]:
    """pid -> (pgid, utime + stime jiffies, short name, start time) for every process that can be read."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            rest = stat.rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        name = " ".join(os.path.basename(a.decode(errors="replace")) for a in cmdline[:3] if a)[:60]
        out[int(proc.name)] = (
            int(rest[2]),
            int(rest[11]) + int(rest[12]),
            name or stat.split("(", 1)[1].split(")")[0],
            int(rest[19]),
        )
    return out


def frontend_seconds(groups: Iterable[int]) -> float:
    """CPU seconds so far of the processes in `groups` that are not vLLM's engine core or workers:
    the API servers (and a router in the group). A process that exited is not counted."""
    wanted = set(groups)
    return sum(
        jiffies / TICK
        for pgid, jiffies, name, _ in _processes().values()
        if pgid in wanted and not name.startswith(serving.ENGINE_TITLES)
    )


def _own_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Window:
    """Open before a probe, `close()` after it (once the client has been reaped)."""

    engine_groups: set[int]
    client_group: int | None = None  # a client that outlives the probe (bench-server); None: reaped children
    started: float = field(default_factory=time.monotonic)
    cpu: tuple[int, int] = field(default_factory=_cpu_times)
    procs: dict[int, tuple[int, int, str, int]] = field(default_factory=_processes)
    children: float = field(default_factory=lambda: _own_seconds(resource.RUSAGE_CHILDREN))
    self_s: float = field(default_factory=lambda: _own_seconds(resource.RUSAGE_SELF))

    def close(self, client_s: float | None = None) -> Interference:
        """`client_s`: the CPU seconds the probe's own client process used (reported by its parent,
        the bench server); the server itself is counted as client too. Without it, the client is
        whatever our reaped children used."""
        wall = max(time.monotonic() - self.started, 1e-6)
        busy1, steal1 = _cpu_times()
        procs = _processes()
        me = os.getpid()
        engine = client_jiffies = 0
        others: dict[str, int] = {}
        for pid, (pgid, jiffies, name, start) in procs.items():
            before = self.procs.get(pid)
            used = jiffies - before[1] if before and before[3] == start else jiffies  # a reused pid counts anew
            if pgid in self.engine_groups:
                engine += used
            elif self.client_group is not None and pgid == self.client_group:
                client_jiffies += used
            elif pid != me and used > 0:
                others[name] = others.get(name, 0) + used
        if client_s is None:
            client = _own_seconds(resource.RUSAGE_CHILDREN) - self.children
        else:
            client = client_s + client_jiffies / TICK
        owner = _own_seconds(resource.RUSAGE_SELF) - self.self_s
        busy = (busy1 - self.cpu[0]) / TICK
        engine_s = engine / TICK
        other = max(0.0, busy - engine_s - client - owner)
        top = sorted(others.items(), key=lambda kv: -kv[1])[:5]
        return Interference(
            wall_s=round(wall, 2),
            cores=os.cpu_count() or 1,
            busy=round(busy / wall, 3),
            steal=round((steal1 - self.cpu[1]) / TICK / wall, 3),
            engine=round(engine_s / wall, 3),
            client=round(client / wall, 3),
            owner=round(owner / wall, 3),
            other=round(other / wall, 3),
            load_avg_1m=round(os.getloadavg()[0], 2),
            top_other=[(name, round(j / TICK / wall, 3)) for name, j in top if j / TICK / wall >= 0.005],
        )
