"""A hardware profile (`configs/hardware/*.yaml`, named by the spec's `hardware:`): the node, its
devices, and the datasheet figures the planner reads."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.specs.base import Strict


class Efficiency(Strict):
    """Fractions of the datasheet peaks that real kernels reach; one set per hardware profile."""

    compute: Annotated[float, Field(gt=0, le=1)] = 0.5
    memory: Annotated[float, Field(gt=0, le=1)] = 0.75
    link: Annotated[float, Field(gt=0, le=1)] = 0.7
    gemm_half_rows: Annotated[
        float, Field(ge=0, description="rows (tokens) at which a matmul reaches half its large-size efficiency")
    ] = 32.0
    gemm_half_cols: Annotated[
        float,
        Field(
            ge=0,
            description="per-device output columns of a tensor-parallel slice below which a matmul needs"
            " proportionally more rows to fill the device (gemm_half_rows x gemm_half_cols / columns): a thin"
            " slice has fewer output tiles; 0: the slice's width costs nothing",
        ),
    ] = 0.0


RANGED_FIGURES = (
    "link_gb_s",
    "link_latency_us",
    "step_overhead_ms",
    "sequence_overhead_us",
    "efficiency.compute",
    "efficiency.memory",
    "efficiency.link",
    "efficiency.gemm_half_rows",
    "efficiency.gemm_half_cols",
    "step_overhead_per_rank_ms",
    "piecewise_layer_us",
    "host_ms_per_request",
)
PER_WORLD_SIZE = ("all_reduce_latency_us",)  # ranged per layout class: all_reduce_latency_us.8


def ranged_figure(name: str) -> bool:
    """A name `ranges:` may carry: a ranged figure, or a per-world-size one with its size (`.8`)."""
    head, _, size = name.rpartition(".")
    return name in RANGED_FIGURES or (head in PER_WORLD_SIZE and size.isdigit())


class DevicePerformance(Strict):
    """What the planner's step-time model needs to know about one device and its links."""

    peak_tflops: Annotated[dict[str, float], Field(description="dense matmul peak by weight dtype: fp8, bf16")]
    memory_gb_s: Annotated[float, Field(gt=0, description="device memory (HBM) bandwidth")]
    link_gb_s: Annotated[float, Field(ge=0, description="one direction of the link between two devices; 0: none")]
    link_latency_us: Annotated[float, Field(ge=0)] = 5.0
    step_overhead_ms: Annotated[float, Field(ge=0, description="fixed cost of one engine step (scheduling, launch)")]
    step_overhead_per_rank_ms: Annotated[
        float,
        Field(
            ge=0,
            description="engine core time a step adds per tensor-parallel worker beyond the first (the scheduler"
            " output broadcast to each worker and the wait for each one's result)",
        ),
    ] = 0.0
    all_reduce_latency_us: dict[int, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="fixed cost of one all-reduce by world size (2, 4, 8): the latency term that grows with the"
        " ranks; a size not given falls back to 2 x link_latency_us",
    )
    piecewise_layer_us: Annotated[
        float,
        Field(
            ge=0,
            description="launch time a step pays per layer when it runs piecewise graphs (attention launched"
            " outside the graph): mixed prefill steps, and every step where full graphs are off",
        ),
    ] = 0.0
    sequence_overhead_us: Annotated[
        float, Field(ge=0, description="per sequence a step samples: sampling, detokenizing and streaming its token")
    ] = 0.0
    request_overhead_ms: Annotated[
        float, Field(ge=0, description="a request's way in and out of the server (HTTP, tokenizing), on its TTFT")
    ] = 0.0
    admission_ms: Annotated[
        float, Field(ge=0, description="engine time a request costs the step that admits it (input processing)")
    ] = 0.0
    host_ms_per_request: Annotated[
        float,
        Field(ge=0, description="CPU time a request costs outside the engine: API server, router, load client"),
    ] = 0.0
    host_busy_cores: Annotated[
        float,
        Field(
            ge=0,
            description="cores of host work a replica costs while it serves, whatever the rate (the API server's"
            " loop turning once per engine step, the client's): with host_ms_per_request, a line through the CPU"
            " measured at two rates",
        ),
    ] = 0.0
    host_carried_rps: Annotated[
        float,
        Field(
            ge=0,
            description="the rate a replica's host work was seen carrying on cores of its own (a profile's load,"
            " judged on pace): up to it the host is not a bound, whatever its CPU line says; 0: never checked",
        ),
    ] = 0.0
    host_colocated_cost: Annotated[
        float,
        Field(
            ge=1,
            description="x that CPU time an engine loses when the host work runs on its cores (woken frontends"
            " waiting behind polling engine processes, context switches): 1 is its own time only",
        ),
    ] = 1.0
    efficiency: Efficiency = Field(default_factory=Efficiency)
    sources: dict[str, str] = Field(default_factory=dict, description="where each figure was found")
    ranges: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="(low, high) plausible values of an assumed figure (link_latency_us, step_overhead_ms,"
        " efficiency.compute, ...): the planner's prediction intervals",
    )

    @field_validator("ranges")
    @classmethod
    def _ranges(cls, value: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        known = [*RANGED_FIGURES, *(f"{name}.<world size>" for name in PER_WORLD_SIZE)]
        for name, (low, high) in value.items():
            if not ranged_figure(name):
                raise ValueError(f"ranges: {name!r} is not a ranged figure (known: {', '.join(sorted(known))})")
            if not 0 <= low <= high:
                raise ValueError(f"ranges.{name}: give [low, high] with 0 <= low <= high, got [{low}, {high}]")
        return value

    @field_validator("peak_tflops")
    @classmethod
    def _dtypes(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = set(value) - {"fp8", "bf16"}
        if unknown or "bf16" not in value or any(v <= 0 for v in value.values()):
            raise ValueError(
                "give positive peaks for bf16 (and fp8 where the device has it): {fp8: 2614.9, bf16: 1307.4}"
            )
        return value


class NodeProvisioning(Strict):
    """How long a node to add takes, from the cluster autoscaler's request until a pod on it can start
    loading weights (node up, devices allocatable, engine image pulled): a scale-up's lead time."""

    low_seconds: Annotated[float, Field(gt=0, description="the fast end")]
    high_seconds: Annotated[float, Field(gt=0, description="the slow end: what capacity's checks use")]
    assumed: bool = Field(description="true: no published or measured figure; the range is a judgement")
    source: str = Field(min_length=1, description="where the figures come from, or why they are assumed")

    @model_validator(mode="after")
    def _ordered(self) -> NodeProvisioning:
        if self.high_seconds < self.low_seconds:
            raise ValueError(f"high_seconds {self.high_seconds:g} is below low_seconds {self.low_seconds:g}")
        return self


class HardwareProfile(Strict):
    """A node type: how many devices, how much memory each, how Kubernetes names and places them."""

    name: str
    kind: Literal["gpu", "cpu"]
    devices: Annotated[int, Field(gt=0)]
    device_memory_gb: Annotated[float, Field(gt=0)]
    device_resource: str | None = Field(None, description="Kubernetes extended resource, e.g. amd.com/gpu")
    visible_devices_env: str | None = Field(None, description="e.g. HIP_VISIBLE_DEVICES")
    numa_groups: list[list[int]] = Field(default_factory=list, description="device ids that share a NUMA node")
    node_labels: dict[str, str] = Field(default_factory=dict)
    taints: list[dict[str, str]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    price_per_server_hour: Annotated[
        float | None, Field(gt=0, description="the operator's price of one server for an hour, in USD")
    ] = None
    price_note: str = Field("", description="where the price comes from (a contract, a list price, an example)")
    performance: DevicePerformance | None = Field(None, description="datasheet figures for the planner")
    node_provisioning: NodeProvisioning | None = Field(
        None, description="a node to add: time until a pod on it can start loading (scale-up lead time)"
    )
