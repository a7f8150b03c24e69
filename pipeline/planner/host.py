"""What a request costs the host outside the engine, and what that does to a layout's engines.

Why: the step-time model describes an engine alone, but every request also costs CPU time in
the API server (HTTP, tokenizing, streaming each token), the router and the load client. Where
a layout leaves cores free for that work (cpu-local's one replica: the engine on one core, the
rest on the other), it costs the engine nothing until those cores saturate; where the engines
take every core (two replicas, one core each), it runs on the engines' cores and each step
waits for it, losing more than its CPU time (on the tiny model ~4x at a tenth of a core: a woken
API server takes its turn from the engine's processes, and each switch costs the step). The
host's CPU is not proportional to the rate: part of it is paid while a replica serves at all (the
API server's loop turns once per engine step whatever it carries), so it is a line, cores a
replica plus milliseconds a request, through the CPU measured at two rates. All of it is measured
on the engine at hand (the profile's steady loads: the API server's and the client's CPU seconds,
and the median TPOT with that work moved onto the engine's core against the same load beside it).
A host on cores of its own is no bound up to a rate a load showed it carrying (the profile's host
check): a polling API server and client read near a full core long before they fall behind, so
their CPU line alone caps the rate too low. On a GPU server the host has cores to spare, but each
replica's API server is one process (vLLM's default `--api-server-count 1`): its requests' CPU time
is a bound of that replica at one core, however many cores the host has; two replicas have two.
The engine core's own CPU time per step and per sequence is in the step time (step_time.py).
"""

from __future__ import annotations

import math

from pydantic import BaseModel

from pipeline.core.specs import HardwareProfile, Layout

SATURATED = 0.9  # of a core's time: beyond it the host's queue grows without bound


class HostShare(BaseModel):
    """Where a layout's host work runs and what it costs."""

    ms_per_request: float
    busy_cores: float = 0.0  # a replica's, while it serves, whatever the rate
    colocated_cost: float = 1.0  # x ms_per_request an engine core loses when the host work shares it
    carried_rate: float = 0.0  # per replica: a rate a load showed one replica's host carrying on its own cores
    replicas: int
    engine_cores: int
    spare_cores: float | None  # cores no engine uses; None: a GPU server, one core per replica's API server

    @property
    def carried(self) -> float:
        """The carried rate where it applies: one replica on cores of its own, as the profile measures it."""
        return self.carried_rate if self.spare_cores and self.replicas == 1 else 0.0

    def load(self, rate_per_replica: float) -> float:
        """Cores of host work at a per-replica rate."""
        return self.replicas * (self.busy_cores + rate_per_replica * self.ms_per_request / 1e3)

    def slowdown(self, rate_per_replica: float) -> float:
        """How much longer each engine step takes at that rate. With spare cores the host work is kept
        on them (serving.placement): 1 until they saturate, then inf, except up to a rate a load showed
        a replica's host carrying there (one replica: what the profile measures). Without, the engines'
        cores lose its share of their time, inf once it saturates them."""
        load = self.load(rate_per_replica)
        if load <= 0:
            return 1.0
        if self.spare_cores is None:  # a GPU server: each replica's API server process, one core
            return 1.0 if load / self.replicas < SATURATED else math.inf
        if self.spare_cores:
            carried = 0 < self.carried and rate_per_replica <= self.carried
            return 1.0 if carried or load < self.spare_cores * SATURATED else math.inf
        share = self.colocated_cost * load / self.engine_cores
        return 1 / (1 - share) if share < SATURATED else math.inf

    def binds(self, rate_per_replica: float) -> bool:
        """Whether the host work is what holds the rate there: the spare cores within 2% of saturating
        (the rate search's resolution is 1%), or the engines' steps slowed by more than 10%."""
        if self.spare_cores or self.spare_cores is None:
            return math.isinf(self.slowdown(rate_per_replica * 1.02))
        return self.slowdown(rate_per_replica) > 1.1

    def describe(self, rate_per_replica: float) -> str:
        where = (
            "one API server process a replica"
            if self.spare_cores is None
            else "their own cores"
            if self.spare_cores
            else f"the engines' cores, x{self.colocated_cost:.3g} there"
        )
        busy = f" + {self.busy_cores:.2g} cores a replica" if self.busy_cores else ""
        carried = f"; carried {self.carried:.3g} req/s there" if self.carried else ""
        return (
            f"host CPU {self.ms_per_request:.3g} ms a request{busy} ({self.load(rate_per_replica):.2f} cores at this"
            f" rate, on {where}{carried})"
        )


def share(hw: HardwareProfile, layout: Layout) -> HostShare:
    """The host work of `layout` on `hw` as its performance figures say (profiled: measured)."""
    perf = hw.performance
    spare = float(max(0, hw.devices - layout.devices)) if hw.kind == "cpu" else None
    return HostShare(
        ms_per_request=perf.host_ms_per_request if perf else 0.0,
        busy_cores=perf.host_busy_cores if perf else 0.0,
        colocated_cost=perf.host_colocated_cost if perf else 1.0,
        carried_rate=perf.host_carried_rps if perf else 0.0,
        replicas=layout.replicas,
        engine_cores=layout.devices,
        spare_cores=spare,
    )
