"""Fleet size and token cost from a measured max SLO rate per server, next to what is live.

Reviewers decide on a fleet, not on one server: how many servers the peak needs and what a million
tokens cost is what "2x requests/s per server" means in money. The arithmetic, stated once here and
in the report's footnote:

- servers = max(min_servers, ceil(peak_rps x (1 + headroom) / rate_per_server))
- $/hour = servers x price_per_server_hour (the operator's price; none is invented or fetched)
- $/M tokens of a kind charges the whole server-hour to that kind:
  price / (rate x tokens per request x 3600) x 1e6. Input and output figures are each the full
  cost per token of that kind, so they are not additive.
  At the SLO rate: one server busy at its max SLO rate (the best a server can do within the SLO).
  At the mean rate: the peak-sized fleet's $/hour over the mean traffic (what a day really costs).

With `capacity.autoscale` the fleet follows traffic (KEDA, pipeline/k8s/autoscaler.py) and `Scaling`
says whether it can: target = rate x utilisation per server, min = the mean's servers at the target,
max = max_servers. A spike (traffic x f within W) is taken as a straight ramp (one that speeds up to
reach f in W grows less in its first minutes): during a scale-up's lead time D it grows the load by
(f - 1) x min(D, W) / W, which the fleet must carry on its spare: 1 / utilisation - 1, less the
HPA's 10% tolerance where a cluster keeps it, and less where the peak pins the fleet at
max_servers. D = detection (half the query's rate window, one scrape, one HPA sync) + the load
time, for a server on a standing node; + the node's provisioning time, for a node to add.
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.core.specs import CapacitySpec, HardwareProfile, LoadedSpec, WorkloadSpec, duration_seconds
from pipeline.records.capacity import CapacityPlan, CostChange, FleetCost, LeadTime, Scaling, Source
from pipeline.records.selection import ChosenFigures

HPA_SYNC_S = 15  # the horizontal pod autoscaler's default sync period: how often it asks KEDA's metrics
# the HPA's default tolerance: where the scaler's zero tolerance is not honoured (Kubernetes before
# HPAConfigurableTolerance), a server may carry 10% above the target before one is added
HPA_TOLERANCE = 0.1


def rate_window_s(scrape_interval_s: int) -> int:
    """The scaler's rate() window: four scrapes (Prometheus needs two samples), at least a minute."""
    return max(60, 4 * scrape_interval_s)


def scaling(loaded: LoadedSpec, rate_per_server: float, load_s: float | None, load_source: str) -> Scaling | None:
    """The autoscaler's numbers for `rate_per_server` (spec capacity.autoscale); None without it."""
    cap = loaded.spec.capacity
    if cap is None or cap.autoscale is None or cap.max_servers is None:
        return None
    auto, hw = cap.autoscale, loaded.hardware
    target = rate_per_server * auto.utilisation
    peak_servers = math.ceil(cap.peak_rps / target - 1e-9)
    # at the peak the fleet holds min(peak_servers, max) servers: its spare is what they hold beyond
    # the peak, the HPA's tolerance taken off (a server may run that much above the target)
    busiest = min(peak_servers, cap.max_servers) * rate_per_server
    spare = max(0.0, min(1 / (auto.utilisation * (1 + HPA_TOLERANCE)), busiest / cap.peak_rps) - 1)
    window = duration_seconds(auto.spike_within)
    growth = auto.spike_factor - 1
    scrape = duration_seconds(loaded.spec.rollout.scrape_interval)
    node = hw.node_provisioning
    lead = LeadTime(
        detect_s=rate_window_s(scrape) / 2 + scrape + HPA_SYNC_S,
        load_s=load_s,
        load_source=load_source,
        provision_low_s=node.low_seconds if node else None,
        provision_high_s=node.high_seconds if node else None,
        provision_source=(
            f"{'assumed' if node.assumed else 'sourced'}: {hw.name} node_provisioning"
            if node
            else LeadTime.model_fields["provision_source"].default
        ),
    )
    return Scaling(
        rate_per_server=rate_per_server,
        utilisation=auto.utilisation,
        target_rps=round(target, 6),
        min_servers=max(cap.min_servers, math.ceil(cap.mean_rps / target - 1e-9)),
        max_servers=cap.max_servers,
        fallback_servers=min(cap.max_servers, max(peak_servers, fleet_servers(cap, rate_per_server))),
        peak_servers=peak_servers,
        spike_factor=auto.spike_factor,
        spike_within_s=window,
        spike_top_servers=math.ceil(cap.peak_rps * auto.spike_factor / rate_per_server - 1e-9),
        spare=round(spare, 6),
        covered_s=None if spare >= growth else round(window * spare / growth, 1),
        lead=lead,
    )


def fleet_servers(capacity: CapacitySpec, rate_per_server: float, share: float = 1.0, running: int = 0) -> int:
    """The one sizing rule `capacity`, `rollout-plan` and the ScaledObjects share: servers for
    `share` of the peak with the spec's headroom at `rate_per_server`, at least `min_servers` for
    the whole fleet (one for a part of it), and never fewer than `running` (what the live fleet runs
    now: KEDA may have grown it above the plan, and a new release must not take its traffic on fewer)."""
    if share <= 0:
        return running
    exact = share * capacity.peak_rps * (1 + capacity.headroom) / rate_per_server
    # 1e-9: a rate that divides the peak exactly must not round up to one more server
    floor = capacity.min_servers if share >= 1 else 1
    return max(floor, math.ceil(exact - 1e-9), running)


def _usd_per_m(usd_per_hour: float | None, rps: float, tokens_per_request: int) -> float | None:
    if usd_per_hour is None or rps <= 0:
        return None
    return usd_per_hour / (rps * tokens_per_request * 3600) * 1e6


def fleet(
    label: str,
    rate_per_server: float,
    capacity: CapacitySpec,
    workload: WorkloadSpec,
    price: float | None,
    *,
    layout: str | None = None,
    source: Source = "measured",
) -> FleetCost:
    """Size and price the fleet for one rate per server (the arithmetic in the module docstring)."""
    if rate_per_server <= 0:
        raise ValueError(f"{label}: rate per server must be positive, got {rate_per_server:g}")
    exact = capacity.peak_rps * (1 + capacity.headroom) / rate_per_server
    servers = fleet_servers(capacity, rate_per_server)
    per_hour = servers * price if price is not None else None
    return FleetCost(
        label=label,
        layout=layout,
        rate_per_server=rate_per_server,
        rate_source=source,
        servers_exact=round(exact, 4),
        servers=servers,
        fleet_rps=round(servers * rate_per_server, 4),
        within_max=capacity.max_servers is None or servers <= capacity.max_servers,
        usd_per_hour=per_hour,
        usd_per_m_input_at_slo=_usd_per_m(price, rate_per_server, workload.input_len),
        usd_per_m_output_at_slo=_usd_per_m(price, rate_per_server, workload.output_len),
        usd_per_m_input_at_mean=_usd_per_m(per_hour, capacity.mean_rps, workload.input_len),
        usd_per_m_output_at_mean=_usd_per_m(per_hour, capacity.mean_rps, workload.output_len),
    )


def _pct(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return round((new / old - 1) * 100, 2)


def change(candidate: FleetCost, live: FleetCost) -> CostChange:
    return CostChange(
        servers_from=live.servers,
        servers_to=candidate.servers,
        usd_per_hour_pct=_pct(candidate.usd_per_hour, live.usd_per_hour),
        usd_per_m_input_pct=_pct(candidate.usd_per_m_input_at_slo, live.usd_per_m_input_at_slo),
        usd_per_m_output_pct=_pct(candidate.usd_per_m_output_at_slo, live.usd_per_m_output_at_slo),
    )


def plan(
    loaded: LoadedSpec,
    layouts: dict[str, float],
    chosen: str | None,
    live: tuple[str, str | None, float, float | None] | None = None,
    *,
    source: Source = "measured",
    load_seconds: dict[str, float] | None = None,
    load_source: str = "measured",
) -> CapacityPlan | None:
    """The plan for a spec with `capacity:`; None without it.

    `layouts`: max SLO req/s per server by layout name (those with a rate); `chosen`: the candidate
    among them; `live`: (label, layout, rate per server, its recorded price or None for today's);
    `load_seconds`: a layout's slowest replica's load time, engine start to healthy, by layout name
    (`load_source` says where it comes from): the autoscaler's lead time.
    """
    spec, hw = loaded.spec, loaded.hardware
    if spec.capacity is None:
        return None
    cap, work, price = spec.capacity, spec.workload, hw.price_per_server_hour
    rows = [fleet(name, rate, cap, work, price, layout=name, source=source) for name, rate in layouts.items()]
    candidate = next((r.model_copy(update={"label": "candidate"}) for r in rows if r.layout == chosen), None)
    live_cost = None
    if live is not None:
        label, live_layout, rate, live_price = live
        live_cost = fleet(label, rate, cap, work, live_price or price, layout=live_layout, source="recorded")
    return CapacityPlan(
        peak_rps=cap.peak_rps,
        mean_rps=cap.mean_rps,
        headroom=cap.headroom,
        min_servers=cap.min_servers,
        max_servers=cap.max_servers,
        input_len=work.input_len,
        output_len=work.output_len,
        hardware=hw.name,
        price_per_server_hour=price,
        price_note=hw.price_note,
        candidate=candidate,
        layouts=rows,
        live=live_cost,
        change=change(candidate, live_cost) if candidate and live_cost else None,
        scaling=_candidate_scaling(loaded, candidate, load_seconds or {}, load_source),
    )


def _candidate_scaling(
    loaded: LoadedSpec, candidate: FleetCost | None, load_seconds: dict[str, float], load_source: str
) -> Scaling | None:
    if candidate is None:
        return None
    load = load_seconds.get(candidate.layout or "")
    source = load_source if load is not None else "none recorded for the layout"
    return scaling(loaded, candidate.rate_per_server, load, source)


def money(value: float | None) -> str:
    """Dollars as every view prints them: cents above a dollar, three significant digits below."""
    if value is None:
        return "-"
    return f"${value:,.2f}" if value >= 0.995 else f"${value:#.3g}"


def rows(p: CapacityPlan) -> list[FleetCost]:
    """Live first, then the candidate, then the other layouts: the order every view uses."""
    out = [r for r in (p.live, p.candidate) if r is not None]
    return out + [r for r in p.layouts if p.candidate is None or r.layout != p.candidate.layout]


def table(p: CapacityPlan) -> str:
    """Plain-text table: what `model-release capacity` and the task log print."""
    price = f"${p.price_per_server_hour:g}/server-hour" if p.price_per_server_hour else "no price"
    head = (
        f"peak {p.peak_rps:g} req/s + {p.headroom:.0%} headroom, mean {p.mean_rps:g} req/s, "
        f"{p.input_len} in / {p.output_len} out tokens, {p.hardware} at {price}"
        + (f" ({p.price_note})" if p.price_note else "")
        + (f"; max {p.max_servers} servers" if p.max_servers else "")
    )
    lines = [
        head,
        f"{'':28} {'req/s/server':>12} {'servers':>8} {'$/hour':>10} {'$/M in @SLO':>12} {'$/M out @SLO':>13} "
        f"{'$/M in @mean':>13} {'$/M out @mean':>14}",
    ]
    for r in rows(p):
        name = r.name
        flag = "" if r.within_max else "  > max servers"
        lines.append(
            f"{name[:28]:28} {r.rate_per_server:>12.4g} {r.servers:>8d} {money(r.usd_per_hour):>10} "
            f"{money(r.usd_per_m_input_at_slo):>12} {money(r.usd_per_m_output_at_slo):>13} "
            f"{money(r.usd_per_m_input_at_mean):>13} {money(r.usd_per_m_output_at_mean):>14}{flag}"
        )
    if p.change:
        c = p.change
        lines.append(
            f"vs live: {c.summary()}; $/hour {_signed(c.usd_per_hour_pct)}, $/M input tokens "
            f"{_signed(c.usd_per_m_input_pct)}"
        )
    lines.append("$/M tokens of a kind charges the whole server-hour to that kind (input and output do not add up).")
    if p.scaling:
        lines += p.scaling.lines()
    return "\n".join(lines)


def _signed(pct: float | None) -> str:
    return "-" if pct is None else f"{pct:+.1f}%"


def chart(p: CapacityPlan, path: Path) -> Path | None:
    """Bars live vs candidate: servers at peak, $/hour, $/M output tokens at the mean rate."""
    bars = [r for r in (p.live, p.candidate) if r is not None]
    if not bars:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    candidates: list[tuple[str, list[float | None]]] = [
        ("servers at peak", [float(r.servers) for r in bars]),
        ("$ per hour", [r.usd_per_hour for r in bars]),
        ("$ per M output tokens (mean rate)", [r.usd_per_m_output_at_mean for r in bars]),
    ]
    panels = [(title, [v for v in values if v is not None]) for title, values in candidates if None not in values]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.6))
    axes = [axes] if len(panels) == 1 else list(axes)
    names = [r.label.replace("live release", "live") for r in bars]
    colors = ["#9e9e9e", "#1f77b4"][-len(bars) :] if p.live else ["#1f77b4"]
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize=9)
        for i, value in enumerate(values):
            ax.annotate(f"{value:.3g}", (i, value), ha="center", va="bottom", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.margins(y=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def versus_live(
    release_id: int, chosen: ChosenFigures | None, plan: CapacityPlan | None, hw: HardwareProfile
) -> tuple[str, str | None, float, float | None] | None:
    """What `plan` compares with: the live release's label, layout, recorded rate and price (from its
    chosen figures and recorded plan); None when it has no measured rate."""
    rate = recorded_rate(chosen)
    if rate is None or chosen is None:
        return None
    return f"live release {release_id}", chosen.layout, rate, recorded_price(plan, hw)


def recorded_rate(chosen: ChosenFigures | None) -> float | None:
    """A release's measured max SLO rate per server from its chosen figures, if it has one."""
    rate = chosen.rate_per_server if chosen else None
    return float(rate) if rate is not None and rate > 0 else None


def recorded_price(plan: CapacityPlan | None, hw: HardwareProfile) -> float | None:
    """The price a release was sized with (its recorded plan), else the profile's today."""
    return (plan.price_per_server_hour if plan else None) or hw.price_per_server_hour
