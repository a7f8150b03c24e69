"""The release spec: one YAML file describes a whole release, and every stage reads it.

Loading checks types (pydantic) and then feasibility (does the layout fit the node, do the
weights fit the device memory), so that a bad spec fails in seconds, before GPU time is
spent. Every problem is reported as one line, `file: dotted.field: what is wrong`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.core.errors import ReleaseError, SpecError
from pipeline.core.paths import CONFIGS_DIR

Scalar = str | int | float | bool | None
EngineArgs = dict[str, Scalar | dict[str, Any] | list[Any]]

SOURCE_PATTERN = re.compile(r"^(hf://[\w.-]+/[\w.-]+(@[\w./-]+)?|s3://[\w.-]+/.+|builtin://[\w.-]+|[^:]+)$")
FLAG_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
DURATION_PATTERN = re.compile(r"^(\d+)([smhd])$")
# Flags the layout owns: they come from tp/dp/ep/pp, never from free-form engine args.
LAYOUT_FLAGS = {
    "tensor-parallel-size",
    "data-parallel-size",
    "pipeline-parallel-size",
    "enable-expert-parallel",
    "port",
    "host",
    "model",
}
DEFAULT_IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
BYTES_PER_PARAM = {"FP8_DYNAMIC": 1.0, "FP8_BLOCK": 1.0}


class Strict(BaseModel):
    """Unknown keys are errors: a typo in a spec must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid")


class Architecture(Strict):
    """Facts about the model, used for feasibility checks before anything is loaded."""

    model_type: str = Field("qwen3_moe", description="transformers model_type")
    num_layers: Annotated[int, Field(gt=0)]
    hidden_size: Annotated[int, Field(gt=0)]
    num_attention_heads: Annotated[int, Field(gt=0)]
    num_kv_heads: Annotated[int, Field(gt=0)]
    head_dim: Annotated[int, Field(gt=0)]
    num_experts: Annotated[int, Field(ge=0, description="0 for a dense model")] = 0
    num_experts_per_tok: Annotated[int, Field(ge=0)] = 0
    moe_intermediate_size: Annotated[int, Field(ge=0)] = 0
    intermediate_size: Annotated[int, Field(ge=0, description="dense MLP width (dense models; the planner)")] = 0
    vocab_size: Annotated[int, Field(gt=0)]
    params_b: Annotated[float, Field(gt=0, description="total parameters, billions")]
    active_params_b: Annotated[float | None, Field(gt=0)] = None
    expert_imbalance: Annotated[
        float,
        Field(
            ge=1,
            description="routed tokens of the busiest expert-parallel rank / the mean, at large batches (the"
            " planner; small batches add their own statistical spread)",
        ),
    ] = 1.0
    expert_imbalance_range: tuple[float, float] | None = Field(
        None, description="(low, high) plausible values of expert_imbalance where it is not measured"
    )
    expert_imbalance_source: str = Field("", description="where expert_imbalance comes from, or 'assumed'")

    @model_validator(mode="after")
    def _moe_consistent(self) -> Architecture:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class ModelSpec(Strict):
    name: str
    source: str = Field(description="local dir, hf://org/name[@rev], s3://bucket/key or builtin://NAME")
    architecture: Architecture

    @field_validator("source")
    @classmethod
    def _source_form(cls, value: str) -> str:
        if not SOURCE_PATTERN.match(value):
            raise ValueError("expected a local path, hf://org/name[@revision], s3://bucket/prefix or builtin://NAME")
        return value


class QuantizationSpec(Strict):
    scheme: Literal["FP8_DYNAMIC", "FP8_BLOCK"] = "FP8_DYNAMIC"
    method: Literal["oneshot", "model_free", "streaming", "auto"] = Field(
        "auto", description="auto: oneshot when the model fits in the worker's memory, else streaming"
    )
    ignore: list[str] = Field(default_factory=lambda: list(DEFAULT_IGNORE))


class EvalTask(Strict):
    name: str
    num_fewshot: Annotated[int, Field(ge=0)] = 0
    metric: str | None = Field(None, description="lm-eval metric to gate on; default: the task's first")
    min_recovery: Annotated[float, Field(gt=0, le=2)] = 0.99
    floor: Annotated[float, Field(ge=0, le=1, description="absolute minimum score")] = 0.0
    served_min_recovery: Annotated[
        float | None,
        Field(
            gt=0,
            le=2,
            description="the minimum recovery on the serving-path check's first N items, where a few items "
            "moving is noise rather than a worse model (its other rule, served within two combined stderr of "
            "in-process, judges the rest); default: min_recovery",
        ),
    ] = None


class ServedAccuracySpec(Strict):
    """lm-eval against each layout's own endpoint after its SLO search: the served model (engine,
    layout, tokenizer path, engine version) must answer as the checkpoint did on the same items."""

    enabled: bool = True
    limit: Annotated[
        int | None,
        Field(gt=0, description="the first N items of each task (of the gate's items); null: all the gate's"),
    ] = 50
    num_concurrent: Annotated[int, Field(gt=0, description="requests lm-eval keeps in flight")] = 4
    rollout_limit: Annotated[
        int | None,
        Field(
            gt=0,
            description="a local rollout's smoke test: the first N items at the new release's own engine before "
            "each step takes traffic (before the switch, with no live release); a failure aborts; null: no check",
        ),
    ] = 20


class EvaluationSpec(Strict):
    backend: Literal["hf", "vllm", "local-completions"] = "hf"
    tasks: Annotated[list[EvalTask], Field(min_length=1)]
    limit: Annotated[int | None, Field(gt=0)] = None
    seed: int = 1234
    batch_size: Annotated[int, Field(gt=0)] = 8
    tensor_parallel_size: Annotated[
        int | None,
        Field(
            ge=1, description="vllm backend: devices the evaluation engine shards over; default: the widest layout's tp"
        ),
    ] = None
    num_concurrent: Annotated[
        int, Field(gt=0, description="local-completions backend: requests lm-eval keeps in flight at the endpoint")
    ] = 4
    served: ServedAccuracySpec = Field(default_factory=ServedAccuracySpec)


class S3Target(Strict):
    connection_id: str = Field("spaces_default", description="Airflow connection (amazon provider type)")
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = Field(
        None, description="default: the connection's extra endpoint_url, else AWS_ENDPOINT_URL"
    )
    region: str | None = None
    create_bucket: bool = Field(
        False, description="create the bucket if missing (embedded default); production buckets exist"
    )
    stream: bool = Field(
        False,
        description="serving pods stream the weights from the bucket (vLLM's --load-format runai_streamer) "
        "instead of fetching them to node-local disk first; an init container checks every object's size and "
        "sha256 record against the manifest before the engine starts. Ignored where the artifact is on NFS",
    )
    read_connection_id: str | None = Field(
        None,
        description="the connection of a read-only key for the bucket: what serving pods get (required with "
        "stream; the staging connection can write)",
    )

    @model_validator(mode="after")
    def _stream_reads_only(self) -> S3Target:
        if self.stream and not self.read_connection_id:
            raise ValueError("read_connection_id: required with stream: true (engines get read-only credentials)")
        return self


class NfsTarget(Strict):
    path: str


class StagingSpec(Strict):
    s3: S3Target | None = None
    nfs: NfsTarget | None = None

    @model_validator(mode="after")
    def _one_target(self) -> StagingSpec:
        if self.s3 is None and self.nfs is None:
            raise ValueError("set at least one of s3 or nfs")
        return self


def _check_flags(args: EngineArgs) -> EngineArgs:
    for flag in args:
        if not FLAG_PATTERN.match(flag):
            raise ValueError(
                f"engine arg {flag!r}: expected a vllm flag name without dashes in front, e.g. max-model-len"
            )
        if flag in LAYOUT_FLAGS:
            raise ValueError(f"engine arg {flag!r} is set by the layout (tp/dp/ep/pp) or the launcher, not here")
    return args


class ServingSpec(Strict):
    engine: Literal["vllm"] = "vllm"
    engine_image: str = Field(description="container image of the engine (production)")
    engine_args: EngineArgs = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    port: Annotated[int, Field(gt=0, lt=65536)] = 8000
    kv_cache_reserve_gb: Annotated[float, Field(ge=0)] = 0.0

    @field_validator("engine_args")
    @classmethod
    def _flags(cls, value: EngineArgs) -> EngineArgs:
        return _check_flags(value)


class Layout(Strict):
    """One way to serve the model on one node: replica groups of tp x dp x pp devices each."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    tp: Annotated[int, Field(ge=1)] = 1
    dp: Annotated[int, Field(ge=1)] = 1
    ep: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1
    replicas: Annotated[int, Field(ge=1, description="replica groups per node, behind one endpoint")] = 1
    engine_args: EngineArgs = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("engine_args")
    @classmethod
    def _flags(cls, value: EngineArgs) -> EngineArgs:
        return _check_flags(value)

    @property
    def devices_per_replica(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def devices(self) -> int:
        return self.devices_per_replica * self.replicas


class WorkloadSpec(Strict):
    input_len: Annotated[int, Field(gt=0)]
    output_len: Annotated[int, Field(gt=0)]
    num_prompts: Annotated[int, Field(gt=0)] = 200
    min_probe_seconds: Annotated[
        float,
        Field(ge=0, description="a probe sends at least rate x this many requests, so the queue reaches steady state"),
    ] = 30.0
    confirm_seconds: Annotated[
        float | None,
        Field(
            gt=0,
            description="length of the run at the answer that confirms it before the search reports it; at least "
            "the SLO's floor (SloSpec.confirm_floor_seconds: a queue growing at the resolution's overload pushes "
            "the p90 TTFT past its limit within it); null: the floor",
        ),
    ] = None
    arrival: Literal["poisson", "constant"] = "poisson"
    seed: int = 0
    repeats: Annotated[
        int,
        Field(
            ge=0,
            le=5,
            description="extra runs at the answer; one failing repeat moves it down, and their spread is reported",
        ),
    ] = 1
    max_interference: Annotated[
        float,
        Field(
            gt=0,
            description="cores other processes (or a hypervisor's steal) "
            "may use during a probe before it is measured again",
        ),
    ] = 0.25
    interference_retries: Annotated[int, Field(ge=0, le=5)] = 2
    max_spread: Annotated[
        float,
        Field(
            gt=0,
            description="the runs at the answer may differ by this much (max / min - 1 of their p90 TTFT); more, "
            "and they are measured again with probes twice as long; an answer that stays over it is marked unsteady",
        ),
    ] = 0.25
    max_client_lag: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="share of the SLO's p90 TTFT the load client may send requests late (p90 of its per-request "
            "lag, or its last send against the schedule's end) before a probe is marked client-bound",
        ),
    ] = 0.1


class SloSpec(Strict):
    """The limits a layout must hold. `max_` names a limit; a measured p90 (a probe's, a release's)
    is `p90_ttft_ms`: one name per fact. A spec with the limits' old names (`p90_ttft_ms`,
    `p90_tpot_ms`) is read as these; both names at once is refused."""

    max_p90_ttft_ms: Annotated[float, Field(gt=0, description="the p90 time to first token must stay at or below")]
    max_p90_tpot_ms: Annotated[float, Field(gt=0, description="the p90 time per output token must stay at or below")]
    max_failed_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.01
    min_rate_per_server: Annotated[float, Field(ge=0, description="req/s the best layout must reach")] = 0.0
    resolution: Annotated[float, Field(gt=0, lt=1)] = 0.05

    @model_validator(mode="before")
    @classmethod
    def limits_by_their_name(cls, data: Any) -> Any:
        return limits_by_their_name(data)

    @property
    def confirm_floor_seconds(self) -> float:
        """The shortest run that shows an answer `resolution` above what the engine sustains (#61).

        Offered (1 + m) x the rate mu it serves, the backlog grows by m x mu requests a second and each
        waits 1 / mu longer: TTFT grows by m seconds a second, whatever mu (the engine's rate cancels,
        so the floor in seconds is the SLO's alone; in requests it is rate x seconds). The p90 of a run of
        T seconds is near the TTFT at 0.9 T, so the run must last limit / (0.9 m) to push the p90 past
        the limit from an empty queue, with m the resolution (an overload the answer does not claim to
        resolve may pass): 11.1 s for 500 ms at 5%, 67 s for 3 s. (On this repository's 2-core host the
        model matched an independent client's 30 s runs: 4% over -> p90 1.08 s, 10% over -> 3.3 s.)"""
        return self.max_p90_ttft_ms / 1000 / (0.9 * self.resolution)


def limits_by_their_name(data: Any) -> Any:
    """Specs and run params written before the SLO limits were named `max_` (a release's stored spec,
    which a rollback or a re-benchmark reads again) said `p90_ttft_ms`: read as the limit. Both names
    at once is an error (which one was meant?); a None under the old name is no value."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old in ("p90_ttft_ms", "p90_tpot_ms"):
        if old in data:
            value = data.pop(old)
            if value is None:
                continue
            if data.get(f"max_{old}") is not None:
                raise ValueError(f"{old} and max_{old} both given: {old} is the old name of max_{old}")
            data[f"max_{old}"] = value
    return data


class GatewayRef(Strict):
    """The Gateway (Gateway API) that carries the model's traffic on Kubernetes: the rollout moves
    traffic between releases by the weights of the model's HTTPRoute attached to it."""

    name: str = Field(description="the Gateway's name (its listener must allow routes from promotion.namespace)")
    namespace: str | None = Field(None, description="the Gateway's namespace; unset: promotion.namespace")
    section_name: str | None = Field(None, description="one listener of the Gateway; unset: every listener")


class PromotionSpec(Strict):
    target: Literal["local", "kubernetes"] = "local"
    namespace: str = "model-release"
    gateway: GatewayRef | None = Field(
        None, description="kubernetes target: the Gateway the model's HTTPRoute attaches to (required there)"
    )
    requires_approval: bool = True
    reviewers: list[str] = Field(default_factory=list)
    approval_timeout: Annotated[str, Field(pattern=DURATION_PATTERN.pattern)] = "24h"
    kubernetes_conn_id: str | None = Field(
        "kubernetes_default", description="Airflow connection of the cluster; None: kubeconfig or in-cluster config"
    )
    rollout_timeout: Annotated[str, Field(pattern=DURATION_PATTERN.pattern)] = "45m"


class RolloutSpec(Strict):
    """How a new release takes traffic from the live one: in steps, each held for an analysis window
    in which the new release's live p90s (from Prometheus) must meet the SLO, or traffic goes back."""

    steps: Annotated[
        list[Annotated[float, Field(gt=0, le=1)]],
        Field(min_length=1, description="fractions of traffic on the new release, increasing, ending at 1.0"),
    ] = Field(default_factory=lambda: [0.1, 0.5, 1.0])
    analysis_window: Annotated[
        str, Field(pattern=DURATION_PATTERN.pattern, description="how long each step is held and analysed")
    ] = "5m"
    min_requests: Annotated[
        int, Field(ge=1, description="requests the new release must finish in a window for a verdict")
    ] = 20
    max_error_fraction: Annotated[float, Field(ge=0, lt=1, description="aborted or failed / finished requests")] = 0.01
    max_vs_live: Annotated[
        float | None,
        Field(gt=1, description="new p90s may be at most this multiple of the old release's in the same window"),
    ] = None
    prometheus_url: str | None = Field(
        None, description="the cluster's Prometheus (kubernetes target); the local target starts its own"
    )
    scrape_interval: Annotated[
        str,
        Field(
            pattern=DURATION_PATTERN.pattern,
            description="the cluster Prometheus' scrape interval: a step waits two after its window",
        ),
    ] = "30s"
    spare_servers: Annotated[
        int, Field(ge=0, description="servers a step may run beyond the live fleet (old ones go as new are ready)")
    ] = 1
    instant_abort: bool = Field(
        False,
        description="keep every old server through every step, so an abort anywhere only moves traffic back "
        "(no reloads); refused at plan time when spare_servers cannot hold the old fleet beside each step's new one",
    )
    scale_down_delay: Annotated[
        str,
        Field(
            pattern=DURATION_PATTERN.pattern,
            description="after the last step's analysis passed, the old release keeps the servers it had while "
            "that step was judged for this long (a rollback then only moves traffic back); then it goes to zero "
            "servers, its objects kept until the next release replaces them",
        ),
    ] = "0s"
    review_timeout: Annotated[
        str | None,
        Field(
            pattern=DURATION_PATTERN.pattern,
            description="in the release DAG, each step's analysis goes to the promotion's reviewers (Continue / "
            "Abort, Airflow's Required actions) for this long, then the verdict stands; unset: no step reviews",
        ),
    ] = None

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[float]) -> list[float]:
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"{steps}: fractions must increase")
        if steps[-1] != 1.0:
            raise ValueError(f"{steps}: the last step must be 1.0 (all traffic on the new release)")
        return steps


class NotifySpec(Strict):
    """Where a re-benchmark verdict goes: the registry always; also e-mail or Slack via an Airflow connection."""

    kind: Literal["log", "smtp", "slack"] = "log"
    connection_id: str | None = Field(None, description="Airflow connection (smtp or slack webhook)")
    to: list[str] = Field(default_factory=list, description="e-mail recipients (smtp)")
    from_email: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> NotifySpec:
        if self.kind != "log" and not self.connection_id:
            raise ValueError(f"kind {self.kind!r} needs connection_id")
        if self.kind == "smtp" and not self.to:
            raise ValueError("kind 'smtp' needs at least one address in to")
        return self


# Airflow's cron presets (a CronTriggerTimetable takes these or a cron expression)
SCHEDULE_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")


class RebenchmarkSpec(Strict):
    schedule: str = Field("@daily", description="a cron expression or an Airflow preset (@daily, ...)")
    tolerance: Annotated[float, Field(gt=0, lt=1, description="allowed drop of the max SLO rate")] = 0.10
    auto_rollback: bool = False
    max_probes: Annotated[
        int, Field(ge=3, description="runs of the short search, which starts at the promoted rate and steps by 1.25x")
    ] = 8
    notify: NotifySpec = Field(default_factory=NotifySpec)

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        from croniter import croniter

        if value in SCHEDULE_PRESETS or (not value.startswith("@") and croniter.is_valid(value)):
            return value
        raise ValueError(
            f"{value!r} is neither a cron expression (e.g. '0 3 * * 2') nor an Airflow preset "
            f"({', '.join(SCHEDULE_PRESETS)})"
        )


class AutoscaleSpec(Strict):
    """Scale-out of the serving fleet on Kubernetes (KEDA, pipeline/k8s/autoscaler.py): between the
    servers the mean rate needs and capacity.max_servers, each server loaded to `utilisation` of its
    measured max SLO rate; the spare (1/utilisation - 1) is what carries a spike while new servers start."""

    utilisation: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="target load per server as a fraction of its measured max SLO rate (the scaler's target)",
        ),
    ] = 0.7
    spike_factor: Annotated[
        float,
        Field(
            gt=1,
            description="traffic may grow to this multiple of its level within spike_within (e.g. 1.5: 'peak x 1.5 "
            "within 10 minutes'); capacity checks the fleet's spare covers it for the scale-up lead time",
        ),
    ] = 1.5
    spike_within: Annotated[
        str, Field(pattern=DURATION_PATTERN.pattern, description="the time the spike takes to reach spike_factor")
    ] = "10m"


class CapacitySpec(Strict):
    """The traffic the fleet must carry: sizes the fleet from the measured max SLO rate per server."""

    peak_rps: Annotated[float, Field(gt=0, description="requests/s the fleet must serve at its busiest")]
    mean_rps: Annotated[float, Field(gt=0, description="expected average requests/s (what a day costs)")]
    headroom: Annotated[float, Field(ge=0, le=4, description="spare capacity above the peak, as a fraction of it")] = (
        0.2
    )
    min_servers: Annotated[int, Field(ge=1)] = 1
    max_servers: Annotated[int | None, Field(ge=1, description="a candidate needing more fails the SLO gate")] = None
    autoscale: AutoscaleSpec | None = Field(
        None, description="scale the fleet with traffic (KEDA on Kubernetes) between the mean's servers and max_servers"
    )

    @model_validator(mode="after")
    def _consistent(self) -> CapacitySpec:
        if self.mean_rps > self.peak_rps:
            raise ValueError(f"mean_rps {self.mean_rps:g} is above peak_rps {self.peak_rps:g}")
        if self.max_servers is not None and self.max_servers < self.min_servers:
            raise ValueError(f"max_servers {self.max_servers} is below min_servers {self.min_servers}")
        if self.autoscale is not None and self.max_servers is None:
            raise ValueError("autoscale needs max_servers: the most servers the scaler may run")
        return self


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


class CandidatesSpec(Strict):
    """Layouts generated beside the spec's own, for the planner to rank before anything is measured:
    every feasible tp x ep x replicas shape of the node (up to `max_tp`), with every combination of
    the knob grid; each is a named layout (`tp1-x2-seqs16`), so run params and overrides name it."""

    max_tp: Annotated[int | None, Field(ge=1, description="largest tensor-parallel size to generate")] = None
    engine_args: dict[str, Annotated[list[Scalar], Field(min_length=1)]] = Field(
        default_factory=dict, description="knob grid: engine arg -> values, e.g. max-num-seqs: [16, 64]"
    )
    top_k: Annotated[
        int | None,
        Field(
            ge=1,
            description="measure only the k layouts with the best predicted rate per server (the live "
            "release's layout is always measured); null: every layout",
        ),
    ] = None

    @field_validator("engine_args")
    @classmethod
    def _flags(cls, value: dict[str, list[Scalar]]) -> dict[str, list[Scalar]]:
        _check_flags(dict.fromkeys(value, ""))
        return value


KNOB_NAMES = {"max-num-seqs": "seqs", "max-num-batched-tokens": "tokens"}


class ReleaseSpec(Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    description: str = ""
    model: ModelSpec
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    evaluation: EvaluationSpec
    staging: StagingSpec
    serving: ServingSpec
    layouts: Annotated[list[Layout], Field(min_length=1)]
    workload: WorkloadSpec
    slo: SloSpec
    hardware: str = Field(description="profile name in configs/hardware/")
    promotion: PromotionSpec = Field(default_factory=PromotionSpec)
    rebenchmark: RebenchmarkSpec = Field(default_factory=RebenchmarkSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    capacity: CapacitySpec | None = Field(None, description="the fleet to size and price; needs the hardware's price")
    candidates: CandidatesSpec | None = Field(
        None, description="generated layouts and how many of all layouts to measure (planner ranks them)"
    )
    execution: Literal["local", "kubernetes"] = "local"


class LoadedSpec(BaseModel):
    """A validated spec together with where it came from and its resolved hardware profile."""

    path: Path
    spec: ReleaseSpec
    hardware: HardwareProfile

    def layout(self, name: str) -> Layout:
        """The spec's layout of that name; a ReleaseError naming the file and the known names if none."""
        for layout in self.spec.layouts:
            if layout.name == name:
                return layout
        known = ", ".join(layout.name for layout in self.spec.layouts)
        raise ReleaseError(f"{self.path}: layouts: no layout named {name!r} (known: {known})")


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError([f"{path}: file not found"]) from None
    return _parse_yaml(text, path)


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError([f"{path}: {where}: YAML syntax error: {problem}"]) from None


def _validate(model: type[BaseModel], data: Any, path: Path) -> Any:
    if not isinstance(data, dict):
        raise SpecError([f"{path}: (top level): expected a mapping, got {type(data).__name__}"])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field (typo?)"
            problems.append(f"{path}: {_format_loc(err['loc'])}: {msg}")
        raise SpecError(problems) from None


def hardware_path(name: str, spec_path: Path) -> Path:
    """A profile next to the spec's configs tree wins over the project's own."""
    local = spec_path.resolve().parent.parent / "hardware" / f"{name}.yaml"
    return local if local.exists() else CONFIGS_DIR / "hardware" / f"{name}.yaml"


def load_hardware(name: str, spec_path: Path) -> HardwareProfile:
    path = hardware_path(name, spec_path)
    if not path.exists():
        known = sorted(p.stem for p in (CONFIGS_DIR / "hardware").glob("*.yaml"))
        raise SpecError([f"{spec_path}: hardware: unknown profile {name!r} (known: {', '.join(known)})"])
    return _validate(HardwareProfile, _read_yaml(path), path)


def load_spec(path: str | Path) -> LoadedSpec:
    """Load, type-check and feasibility-check a release spec; raise SpecError listing every problem."""
    path = Path(path)
    spec = _validate(ReleaseSpec, _read_yaml(path), path)
    hardware = load_hardware(spec.hardware, path)
    problems: list[str] = []
    local = local_source(spec.model.source, path.parent)
    if local is not None and not (local / "config.json").is_file():
        what = "not a model directory (no config.json)" if local.is_dir() else "no such directory"
        problems.append(f"{path}: model.source: {local}: {what}")
    return _checked(path, spec, hardware, hardware_path(spec.hardware, path), problems)


def load_recorded(
    spec_path: str, spec_yaml: str, hw_path: str | None, hardware_yaml: str | None, model_source: str | None
) -> LoadedSpec:
    """A spec from the texts a release recorded (pipeline/release/registry.py), with the hardware
    profile and the resolved model source it was built with: no file is read or written, so a spec
    or profile edited, moved or deleted since changes nothing. A release that recorded no profile
    (opened before they were kept) reads the one on disk now; its source stays as written."""
    path = Path(spec_path)
    spec = _validate(ReleaseSpec, _parse_yaml(spec_yaml, path), path)
    if model_source is not None:
        spec.model.source = model_source
    if hw_path is None or hardware_yaml is None:
        return _checked(path, spec, load_hardware(spec.hardware, path), hardware_path(spec.hardware, path), [])
    hardware = _validate(HardwareProfile, _parse_yaml(hardware_yaml, Path(hw_path)), Path(hw_path))
    return _checked(path, spec, hardware, Path(hw_path), [])


def resolved_source(loaded: LoadedSpec) -> str:
    """The model source as the release used it: a local directory as an absolute path (a relative
    one means nothing once the spec is read from the registry), a URI as written."""
    local = local_source(loaded.spec.model.source, loaded.path.parent)
    return str(local.resolve()) if local is not None else loaded.spec.model.source


def _checked(
    path: Path, spec: ReleaseSpec, hardware: HardwareProfile, hw_path: Path, problems: list[str]
) -> LoadedSpec:
    """Feasibility on that hardware, the defaults that depend on it and the generated layouts."""
    problems = [*(f"{path}: {field}: {msg}" for field, msg in feasibility_problems(spec, hardware)), *problems]
    floor = spec.slo.confirm_floor_seconds
    if spec.workload.confirm_seconds is not None and spec.workload.confirm_seconds < floor:
        problems.append(
            f"{path}: workload.confirm_seconds: {spec.workload.confirm_seconds:g} s is below the floor of "
            f"{floor:.1f} s the SLO sets (slo.max_p90_ttft_ms / (0.9 x slo.resolution): a queue growing at the "
            "resolution's overload takes that long to push the p90 TTFT past its limit); raise it or leave it out"
        )
    if spec.capacity is not None and hardware.price_per_server_hour is None:
        problems.append(
            f"{hw_path}: price_per_server_hour: missing, and {path.name} asks for a cost "
            "(capacity:); set the operator's price of one server-hour in USD"
        )
    if problems:
        raise SpecError(problems)
    if spec.evaluation.tensor_parallel_size is None:  # the weights fit where the widest layout fits them
        spec.evaluation.tensor_parallel_size = max(layout.tp for layout in spec.layouts)
    spec.layouts = [*spec.layouts, *generated_layouts(spec, hardware)]
    return LoadedSpec(path=path.resolve(), spec=spec, hardware=hardware)


def feasible_shapes(spec: ReleaseSpec, hw: HardwareProfile, max_tp: int | None = None) -> list[Layout]:
    """tp x ep x replicas that validate on this hardware (pp = dp = 1), named by shape."""
    arch = spec.model.architecture
    found: list[Layout] = []
    tp = 1
    while tp <= min(hw.devices, max_tp or hw.devices):
        for ep in sorted({1, tp} if arch.is_moe else {1}):
            for replicas in range(1, hw.devices // tp + 1):
                name = f"tp{tp}" + (f"-ep{ep}" if ep > 1 else "") + (f"-x{replicas}" if replicas > 1 else "")
                found.append(Layout(name=name, tp=tp, ep=ep, replicas=replicas))
        tp *= 2
    return [layout for layout in found if _fits(spec, hw, layout)]


def _fits(spec: ReleaseSpec, hw: HardwareProfile, layout: Layout) -> bool:
    trial = spec.model_copy(update={"layouts": [layout]})
    return not [p for p in feasibility_problems(trial, hw) if p[0].startswith("layouts")]


def generated_layouts(spec: ReleaseSpec, hw: HardwareProfile) -> list[Layout]:
    """The `candidates:` section's layouts: feasible shapes x the knob grid, minus any the spec
    already lists (same shape and engine args, or the same name)."""
    if spec.candidates is None:
        return []
    import itertools

    grid = spec.candidates.engine_args
    combos = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())] or [{}]
    own = {(lay.tp, lay.ep, lay.dp, lay.pp, lay.replicas, _args_key(lay.engine_args)) for lay in spec.layouts}
    names = {lay.name for lay in spec.layouts}
    out = []
    for shape in feasible_shapes(spec, hw, spec.candidates.max_tp):
        for args in combos:
            suffix = "".join(
                f"-{KNOB_NAMES.get(k, k.replace('-', ''))}{re.sub(r'[^a-z0-9]', '', str(v).lower())}"
                for k, v in args.items()
            )
            layout = shape.model_copy(update={"name": shape.name + suffix, "engine_args": args})
            same = (layout.tp, layout.ep, layout.dp, layout.pp, layout.replicas, _args_key(args))
            if same in own or layout.name in names or not _fits(spec, hw, layout):
                continue
            names.add(layout.name)
            out.append(layout)
    return out


def _args_key(args: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in args.items()))


def local_source(source: str, spec_dir: Path) -> Path | None:
    """A local model source as a path (relative ones from the spec's directory); None for a URI."""
    if "://" in source:
        return None
    path = Path(source).expanduser()
    return path if path.is_absolute() else spec_dir / path


def weights_per_device_gb(spec: ReleaseSpec, layout: Layout) -> float:
    """Quantized weight bytes one device holds: the checkpoint split by tp x pp (with dp = 1, ep moves experts,
    not bytes); with dp > 1 and ep the experts split over the ep ranks and the rest over tp only."""
    arch = spec.model.architecture
    total_gb = arch.params_b * BYTES_PER_PARAM[spec.quantization.scheme]
    if layout.dp > 1 and layout.ep > 1 and arch.is_moe:
        experts_gb = min(
            total_gb,
            arch.num_layers * arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size
            * BYTES_PER_PARAM[spec.quantization.scheme] / 1e9,
        )  # fmt: skip
        return experts_gb / (layout.ep * layout.pp) + (total_gb - experts_gb) / (layout.tp * layout.pp)
    return total_gb / (layout.tp * layout.pp)


def arg_number(args: dict[str, Any], key: str, default: float | None = None) -> float | None:
    """A numeric engine arg (`--max-model-len 256` may be written 256 or "256"), or the default."""
    value = args.get(key)
    if value is None or isinstance(value, dict | list | bool):
        return default
    return float(value)


def kv_reserve_gb(spec: ReleaseSpec, layout: Layout) -> float:
    """KV cache one device needs for one full-length sequence, or the spec's explicit reserve if larger."""
    arch = spec.model.architecture
    args = {**spec.serving.engine_args, **layout.engine_args}
    max_len = int(arg_number(args, "max-model-len") or spec.workload.input_len + spec.workload.output_len)
    kv_bytes = 1 if str(args.get("kv-cache-dtype", "auto")).startswith("fp8") else 2
    kv_heads_per_device = max(1, arch.num_kv_heads // layout.tp)
    layers_per_device = arch.num_layers / layout.pp
    per_token = 2 * layers_per_device * kv_heads_per_device * arch.head_dim * kv_bytes
    return max(per_token * max_len / 1e9, spec.serving.kv_cache_reserve_gb)


def feasibility_problems(spec: ReleaseSpec, hw: HardwareProfile) -> list[tuple[str, str]]:
    """Checks that need more than one field; returns (dotted field, message) pairs."""
    problems: list[tuple[str, str]] = []
    arch = spec.model.architecture
    names = [layout.name for layout in spec.layouts]
    for i, layout in enumerate(spec.layouts):
        at = f"layouts[{i}]"
        if names.count(layout.name) > 1:
            problems.append((f"{at}.name", f"duplicate layout name {layout.name!r}"))
        if layout.devices > hw.devices:
            field = "tp" if layout.tp > hw.devices else "replicas"
            problems.append(
                (
                    f"{at}.{field}",
                    f"tp x dp x pp x replicas = {layout.tp}x{layout.dp}x{layout.pp}x{layout.replicas}"
                    f" = {layout.devices} devices, but hardware {hw.name!r} has {hw.devices}",
                )
            )
        if arch.num_attention_heads % layout.tp:
            problems.append(
                (f"{at}.tp", f"{arch.num_attention_heads} attention heads do not split over tp={layout.tp}")
            )
        if layout.ep > 1:
            if not arch.is_moe:
                problems.append(
                    (f"{at}.ep", "expert parallelism needs a MoE model (model.architecture.num_experts is 0)")
                )
            elif arch.num_experts % layout.ep:
                problems.append((f"{at}.ep", f"ep={layout.ep} does not divide the {arch.num_experts} experts"))
            if layout.ep != layout.tp * layout.dp:
                problems.append(
                    (
                        f"{at}.ep",
                        f"vLLM's --enable-expert-parallel shards experts over tp x dp ranks: ep must be"
                        f" {layout.tp * layout.dp} or 1, got {layout.ep}",
                    )
                )
        args = {**spec.serving.engine_args, **layout.engine_args}
        util = arg_number(args, "gpu-memory-utilization", 0.9) or 0.9
        budget = hw.device_memory_gb * util
        need = weights_per_device_gb(spec, layout) + kv_reserve_gb(spec, layout)
        if need > budget:
            problems.append(
                (
                    f"{at}.tp",
                    f"weights {weights_per_device_gb(spec, layout):.1f} GB + KV reserve"
                    f" {kv_reserve_gb(spec, layout):.1f} GB per device exceed {budget:.1f} GB"
                    f" ({util:.2f} of {hw.device_memory_gb:g} GB on {hw.name!r}); raise tp or pp",
                )
            )
        latency = hw.performance.all_reduce_latency_us if hw.performance else {}
        if latency and layout.tp > 1 and layout.tp not in latency:
            problems.append(
                (
                    f"hardware {hw.name}: performance.all_reduce_latency_us.{layout.tp}",
                    f"layout {layout.name!r} runs tp={layout.tp}, but the profile gives all-reduce latencies for"
                    f" world sizes {sorted(latency)} only",
                )
            )
        max_len = arg_number(args, "max-model-len")
        if max_len is not None and int(max_len) < spec.workload.input_len + spec.workload.output_len:
            problems.append(
                (
                    f"{at}.engine_args.max-model-len"
                    if "max-model-len" in layout.engine_args
                    else "serving.engine_args.max-model-len",
                    f"{max_len:g} is shorter than the workload's input_len + output_len"
                    f" = {spec.workload.input_len + spec.workload.output_len}",
                )
            )
    if spec.promotion.requires_approval and not spec.promotion.reviewers:
        problems.append(("promotion.reviewers", "set at least one reviewer when requires_approval is true"))
    eval_tp = spec.evaluation.tensor_parallel_size
    if eval_tp is not None and (eval_tp > hw.devices or arch.num_attention_heads % eval_tp):
        problems.append(
            (
                "evaluation.tensor_parallel_size",
                f"{eval_tp} must divide the {arch.num_attention_heads} attention heads and fit the "
                f"{hw.devices} devices of {hw.name!r}",
            )
        )
    if spec.evaluation.backend == "hf" and hw.kind == "gpu" and arch.params_b > 100:
        problems.append(
            ("evaluation.backend", "'hf' runs in-process; use 'vllm' or 'local-completions' for a model this large")
        )
    if spec.promotion.target == "kubernetes" and hw.device_resource is None:
        problems.append(("hardware", f"profile {hw.name!r} has no device_resource for Kubernetes scheduling"))
    if spec.promotion.target == "kubernetes" and not spec.rollout.prometheus_url:
        problems.append(
            ("rollout.prometheus_url", "the cluster's Prometheus is needed to judge each rollout step on Kubernetes")
        )
    if spec.promotion.target == "kubernetes" and spec.promotion.gateway is None:
        problems.append(
            (
                "promotion.gateway",
                "name the Gateway (Gateway API) that carries the model's traffic: the rollout moves it between "
                "releases by the weights of the model's HTTPRoute",
            )
        )
    tasks = [task.name for task in spec.evaluation.tasks]
    for i, name in enumerate(tasks):
        if tasks.count(name) > 1:
            problems.append((f"evaluation.tasks[{i}].name", f"duplicate task {name!r}"))
    return problems


def duration_seconds(text: str) -> int:
    match = DURATION_PATTERN.match(text)
    if match is None:
        raise ReleaseError(f"{text!r}: not a duration like 90s, 45m, 2h")
    number, unit = match.groups()
    return int(number) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
