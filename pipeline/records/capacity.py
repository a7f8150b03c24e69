"""The capacity plan's records: a fleet and its cost, the change against what is live, the
autoscaler's numbers and lead time, and the plan the report, the approval, the registry and the CLI
show (`pipeline/stages/capacity.py` holds the arithmetic and its rationale)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = [
    "CapacityPlan",
    "CostChange",
    "FleetCost",
    "LeadTime",
    "Scaling",
    "Source",
]

Source = Literal["measured", "given", "recorded"]


class FleetCost(BaseModel):
    """One release's (or layout's) fleet at the spec's peak and what its tokens cost."""

    label: str = Field(description="candidate, live release N, or a layout's name")
    layout: str | None = Field(
        None, description="the layout it is sized for; None: a live release with no recorded layout"
    )
    rate_per_server: float = Field(description="max SLO req/s per server it is sized from")
    rate_source: Source = Field(
        "measured", description="measured by this run, given on the command line, or recorded by a release"
    )
    servers_exact: float = Field(description="peak x (1 + headroom) / rate, before rounding up")
    servers: int = Field(description="servers_exact rounded up, at least capacity.min_servers")
    fleet_rps: float = Field(description="what the fleet holds within the SLO: servers x rate")
    within_max: bool = Field(True, description="needs no more than capacity.max_servers")
    usd_per_hour: float | None = Field(None, description="servers x price per server-hour, USD; None: no price")
    usd_per_m_input_at_slo: float | None = Field(
        None, description="USD per million input tokens, one server busy at its max SLO rate"
    )
    usd_per_m_output_at_slo: float | None = Field(
        None, description="USD per million output tokens, one server busy at its max SLO rate"
    )
    usd_per_m_input_at_mean: float | None = Field(
        None, description="USD per million input tokens, the fleet's $/hour over the mean rate"
    )
    usd_per_m_output_at_mean: float | None = Field(
        None, description="USD per million output tokens, the fleet's $/hour over the mean rate"
    )

    @property
    def name(self) -> str:
        """How every view names the row: 'candidate (single)', 'live release 3 (single)', or the layout."""
        if self.layout is None or self.label == self.layout:
            return self.label
        return f"{self.label} ({self.layout})"


class CostChange(BaseModel):
    """Candidate vs live: what the reviewer is asked to buy."""

    servers_from: int = Field(description="the live release's servers at the peak")
    servers_to: int = Field(description="the candidate's servers at the peak")
    usd_per_hour_pct: float | None = Field(description="change of the fleet's $/hour, %; None: a price is missing")
    usd_per_m_input_pct: float | None = Field(description="change of $/M input tokens at the SLO rate, %")
    usd_per_m_output_pct: float | None = Field(description="change of $/M output tokens at the SLO rate, %")

    def summary(self) -> str:
        """The approval subject's phrase, e.g. '3 -> 2 servers, -33% $/M output tokens'."""
        out = f"{self.servers_from} -> {self.servers_to} servers"
        if self.usd_per_m_output_pct is not None:
            out += f", {self.usd_per_m_output_pct:+.0f}% $/M output tokens"
        return out


class LeadTime(BaseModel):
    """How long a scale-up takes to add serving capacity, and where each part comes from."""

    detect_s: float = Field(description="half the rate window + one scrape + one HPA sync: the metric's lag")
    load_s: float | None = Field(description="engine start to healthy; None: unknown")
    load_source: str = Field(description="where load_s comes from: measured by this run, given, measured by release N")
    provision_low_s: float | None = Field(None, description="a node to add, the fast end (hardware node_provisioning)")
    provision_high_s: float | None = Field(None, description="a node to add (hardware node_provisioning)")
    provision_source: str = Field(
        "unknown: the hardware profile has no node_provisioning",
        description="where the provisioning figures come from (sourced or assumed), or why there are none",
    )

    @property
    def node_up_s(self) -> float | None:
        """A server on a node that is already up: detection and the load."""
        return None if self.load_s is None else self.detect_s + self.load_s

    @property
    def node_to_add_s(self) -> float | None:
        """A node to add, at the slow end of its provisioning time."""
        if self.load_s is None or self.provision_high_s is None:
            return None
        return self.detect_s + self.provision_high_s + self.load_s

    @property
    def node_to_add_at_least_s(self) -> float | None:
        """What a node to add takes even when the load time is unknown (a bound enough to refuse on)."""
        return None if self.provision_high_s is None else self.detect_s + self.provision_high_s + (self.load_s or 0)


class Scaling(BaseModel):
    """The autoscaler's numbers for one rate per server and whether the fleet meets the spec's spike."""

    rate_per_server: float = Field(description="the candidate's max SLO req/s per server it scales on")
    utilisation: float = Field(description="target load per server as a share of its max SLO rate (capacity.autoscale)")
    target_rps: float = Field(description="load per server the scaler aims at: rate x utilisation")
    min_servers: int = Field(description="servers for the mean rate at the target (at least capacity.min_servers)")
    max_servers: int = Field(description="the most servers the scaler may run (capacity.max_servers)")
    fallback_servers: int = Field(
        description="what KEDA sets without metrics: the peak's servers at the target or the peak-sized fleet, "
        "whichever is more (at most max)"
    )
    peak_servers: int = Field(description="what the scaler wants at the peak: ceil(peak / target)")
    spike_factor: float = Field(
        description="traffic may grow to this multiple of its level in a spike (capacity.autoscale)"
    )
    spike_within_s: int = Field(description="the time the spike takes to reach spike_factor, s")
    spike_top_servers: int = Field(description="servers the spike's top needs at their max SLO rate")
    spare: float = Field(description="load growth the fleet carries at its busiest before new servers are in")
    covered_s: float | None = Field(description="the longest lead time the spare covers at the spike; None: any")
    lead: LeadTime = Field(description="how long a scale-up takes, and where each part comes from")

    def growth(self, lead_s: float) -> float:
        """Load growth during `lead_s` of the spike (a straight ramp to spike_factor in spike_within_s)."""
        return (self.spike_factor - 1) * min(lead_s, self.spike_within_s) / self.spike_within_s

    def covers(self, lead_s: float | None) -> bool | None:
        return None if lead_s is None else self.growth(lead_s) <= self.spare + 1e-9

    def problems(self) -> list[str]:
        """What the fleet cannot do, for the SLO gate: each a fact, not an estimate left unknown."""
        out = []
        if self.min_servers > self.max_servers:
            out.append(
                f"the mean rate needs {self.min_servers} servers at the autoscale target "
                f"({self.target_rps:.3g} req/s each); capacity.max_servers is {self.max_servers}"
            )
        if self.spike_top_servers > self.max_servers:
            out.append(
                f"a spike to {self.spike_factor:g} x the peak needs {self.spike_top_servers} servers at their max SLO "
                f"rate; capacity.max_servers is {self.max_servers}"
            )
        lead = self.lead.node_to_add_at_least_s
        kind = "a node to add"
        if lead is None:
            lead, kind = self.lead.node_up_s, "a server on a standing node"
        if lead is not None and not self.covers(lead):
            out.append(
                f"scale-up lead time for {kind} is {'at least ' if self.lead.load_s is None else ''}{lead:.0f} s; "
                f"the spare {self.spare:.0%} covers {self.covered_s:.0f} s of a spike to {self.spike_factor:g} x "
                f"within {self.spike_within_s} s (capacity.autoscale.utilisation {self.utilisation:g})"
            )
        return out

    def lines(self) -> list[str]:
        """What `capacity` prints under the fleet table."""
        lead = self.lead

        def secs(value: float | None) -> str:
            return "unknown" if value is None else f"{value:.0f} s"

        def verdict(value: float | None) -> str:
            ok = self.covers(value)
            return "unknown" if ok is None else f"{value:.0f} s, {'covered' if ok else 'NOT covered'}"

        covered = "any lead time" if self.covered_s is None else f"{self.covered_s:.0f} s of lead time"
        provision = (
            f"{lead.provision_low_s:.0f}-{lead.provision_high_s:.0f} s ({lead.provision_source})"
            if lead.provision_high_s is not None and lead.provision_low_s is not None
            else lead.provision_source
        )
        return [
            f"autoscale: target {self.target_rps:.3g} req/s per server ({self.utilisation:.0%} of "
            f"{self.rate_per_server:.4g}); servers {self.min_servers}-{self.max_servers} (mean at the target - "
            f"max_servers), {self.peak_servers} at the peak, {self.fallback_servers} without metrics",
            f"spike x{self.spike_factor:g} within {self.spike_within_s} s: top needs {self.spike_top_servers} servers "
            f"(max {self.max_servers}); spare {self.spare:.0%} at the busiest covers {covered}",
            f"scale-up lead time: detection {lead.detect_s:.0f} s; load {secs(lead.load_s)} ({lead.load_source}); "
            f"node provisioning {provision}",
            f"  server on a standing node: {verdict(lead.node_up_s)}; node to add: {verdict(lead.node_to_add_s)}"
            + (
                f" (at least {verdict(lead.node_to_add_at_least_s)})"
                if lead.node_to_add_s is None and lead.node_to_add_at_least_s is not None
                else ""
            ),
        ]


class CapacityPlan(BaseModel):
    """Everything the report, the approval, the registry and the CLI show about fleet and cost."""

    peak_rps: float = Field(description="req/s the fleet must serve at its busiest (capacity.peak_rps)")
    mean_rps: float = Field(description="expected average req/s: what a day costs (capacity.mean_rps)")
    headroom: float = Field(description="spare capacity above the peak, as a fraction of it")
    min_servers: int = Field(description="the fewest servers a fleet has (capacity.min_servers)")
    max_servers: int | None = Field(description="a candidate needing more fails the SLO gate; None: no limit")
    input_len: int = Field(description="input tokens per request (workload): the $/M input figures' basis")
    output_len: int = Field(description="output tokens per request (workload): the $/M output figures' basis")
    hardware: str = Field(description="the hardware profile's name")
    price_per_server_hour: float | None = Field(
        description="the profile's price of one server for an hour, USD; None: none"
    )
    price_note: str = Field("", description="where the price comes from (the hardware profile's note)")
    candidate: FleetCost | None = Field(None, description="the chosen layout's fleet; None: no layout chosen")
    layouts: list[FleetCost] = Field(default_factory=list, description="every layout that has a rate")
    live: FleetCost | None = Field(
        None, description="the live release's fleet at its recorded rate and price; None: nothing live with a rate"
    )
    change: CostChange | None = Field(None, description="candidate vs live; None without either")
    scaling: Scaling | None = Field(None, description="the candidate's autoscaler and its spike check (autoscale:)")

    def refusal(self) -> str | None:
        """Why the SLO gate must refuse the candidate on fleet size or scale-out, or None."""
        c = self.candidate
        if c is None:
            return None
        if not c.within_max:
            return (
                f"layout {c.layout} needs {c.servers} servers for the peak ({self.peak_rps:g} req/s + "
                f"{self.headroom:.0%} headroom at {c.rate_per_server:.3g} req/s per server); "
                f"capacity.max_servers is {self.max_servers}"
            )
        problems = self.scaling.problems() if self.scaling else []
        return f"layout {c.layout} cannot scale out in time: {'; '.join(problems)}" if problems else None
