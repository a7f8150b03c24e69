"""The benchmark's records: a probe, one SLO search's outcome, a layout's result, the selection.

Typed so that the search's whole state feeds the report, the plot, the gate and the tests alike;
they cross XCom, pod results and benchmark.json as themselves (inf as the string "Infinity")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.records.plan import LayoutPrediction, PredictionCheck
from pipeline.records.served_accuracy import ServedAccuracy

__all__ = [
    "BenchmarkFile",
    "EngineView",
    "Interference",
    "LayoutResult",
    "LoadSplit",
    "Probe",
    "SearchOutcome",
    "Selection",
    "SelectionVerdict",
]


class EngineView(BaseModel):
    """What the engine measured during one probe (all replicas together)."""

    requests: int = Field(description="requests the engine finished in the window")
    p90_ttft_ms: float | None = Field(None, description="engine-side p90 time to first token (histogram)")
    mean_queue_ms: float | None = Field(None, description="engine-side mean time a request waited in the queue, ms")
    mean_prefill_ms: float | None = Field(None, description="engine-side mean prefill time per request, ms")
    mean_decode_ms: float | None = Field(None, description="engine-side mean decode time per request, ms")
    p90_itl_ms: float | None = Field(None, description="engine-side p90 inter-token latency (histogram), ms")
    mean_e2e_ms: float | None = Field(None, description="engine-side mean end-to-end request latency, ms")


class Interference(BaseModel):
    """CPU use during one probe, in cores (CPU seconds / wall seconds)."""

    wall_s: float = Field(description="the probe window's wall time, s: what the core figures divide by")
    cores: int = Field(description="CPUs of the machine")
    busy: float = Field(description="all processes and the kernel, cores")
    steal: float = Field(0.0, description="taken by the hypervisor for other guests, cores")
    engine: float = Field(description="the engine's process groups")
    client: float = Field(description="the load client (vllm bench serve)")
    owner: float = Field(description="the search's own process (its task process when run by Airflow)")
    other: float = Field(description="everything else: the interference")
    load_avg_1m: float = Field(description="the machine's 1-minute load average at the window's end")
    top_other: list[tuple[str, float]] = Field(default_factory=list, description="biggest other processes, cores")


class Probe(BaseModel):
    """One `vllm bench serve` run at one offered rate."""

    # the saturation probe's rate is inf; JSON (XCom, files) carries it as the string "Infinity"
    model_config = ConfigDict(ser_json_inf_nan="strings")

    rate: float = Field(description="offered Poisson rate, req/s (inf for the saturation probe)")
    num_prompts: int = Field(description="requests the client sent (its --num-prompts)")
    achieved_rate: float = Field(description="completed requests / duration")
    completed: int = Field(description="requests that completed")
    failed: int = Field(description="requests the client counted as failed")
    failed_fraction: float = Field(
        description="share of the requests sent that did not complete (slo.max_failed_fraction)"
    )
    duration_s: float = Field(description="the client's run, first send to last answer, s")
    output_tok_s: float = Field(description="output tokens per second over the run")
    goodput: float | None = Field(None, description="req/s that met both SLO limits per request (vLLM's --goodput)")
    p50_ttft_ms: float = Field(description="client-side median time to first token, ms")
    p90_ttft_ms: float = Field(description="client-side p90 time to first token, ms: what the SLO judges")
    p99_ttft_ms: float = Field(description="client-side p99 time to first token, ms")
    p50_tpot_ms: float = Field(description="client-side median time per output token after the first, ms")
    p90_tpot_ms: float = Field(description="client-side p90 time per output token, ms: what the SLO judges")
    p99_tpot_ms: float = Field(description="client-side p99 time per output token, ms")
    p90_itl_ms: float = Field(description="client-side p90 inter-token latency, ms")
    p90_e2el_ms: float = Field(description="client-side p90 end-to-end request latency, ms")
    p90_ttft_ci_ms: tuple[float, float] | None = Field(None, description="95% order-statistic interval of the p90")
    p90_tpot_ci_ms: tuple[float, float] | None = Field(None, description="95% order-statistic interval of the p90 TPOT")
    passed: bool = Field(
        False,
        description="held the SLO: both p90s and the failed share within limits, and it kept up with the offered rate",
    )
    conclusive: bool = Field(True, description="false when a limit still fell inside a p90 interval")
    reasons: list[str] = Field(
        default_factory=list,
        description="why it failed, one per rule missed (a limit, keeping up, inconclusive); empty when it passed",
    )
    result_file: str = Field("", description="path of the client's saved result (vllm bench serve --save-result)")
    interference: Interference | None = Field(None, description="CPU use of the engine, the client and others")
    engine: EngineView | None = Field(None, description="the engine's own histograms for this probe (/metrics)")
    clean: bool = Field(True, description="other processes stayed under the interference limit")
    superseded: bool = Field(
        False, description="run again at the same rate (inconclusive, unclean, or unsteady at the answer); not counted"
    )
    client_lag_p90_ms: float | None = Field(
        None,
        description="p90 of how late the client sent each request against its schedule (vLLM's client: its "
        "queue_times, from the schedule's release of a request to its send)",
    )
    client_lag_end_ms: float | None = Field(
        None, description="how far the client's last send fell behind the schedule's end, at least (span less n / rate)"
    )
    client_cpu_ms_per_request: float | None = Field(
        None, description="the client's CPU time per request (its whole process, start-up included)"
    )
    client_bound: bool = Field(
        False,
        description="the client sent late by more than workload.max_client_lag of the p90 TTFT limit: the "
        "latencies may be the client's as much as the engine's",
    )
    client_note: str = Field("", description="why the probe is client-bound (its lags against the limit)")
    ttft_trend_ms_per_s: float | None = Field(
        None,
        description="Theil-Sen slope of TTFT against send time over the probe's last three quarters, ms per s "
        "(steady.trend): a queue that grows shows here before it shows in the p90",
    )
    backlog_end: int | None = Field(
        None, description="requests sent and not yet answered (no first token) at the last send"
    )
    projected_p90_ttft_ms: float | None = Field(
        None,
        description="the p90 TTFT with the trend carried over the confirmation's length (p90 + max(0, trend) x "
        "seconds): what the verdict judges beside the p90",
    )
    confirmation: bool = Field(
        False, description="a run at the search's answer, as long as workload.confirm_seconds, that confirms it"
    )
    warmup: bool = Field(
        False,
        description="a fresh engine's first run, before its confirmation, not counted (also superseded): the "
        "search's engine is warm from the search, and a cold one stalls in its first seconds",
    )


class LoadSplit(BaseModel):
    """One replica's start, split by its engine log: where a release's load time goes (#48), so a
    slower load shows whether the weights, the engine's init or what comes before them grew."""

    to_healthy_s: float = Field(description="process start to the first healthy /health: the replica's load time")
    start_to_load_s: float | None = Field(
        None, description="process start to vLLM's 'Starting to load model' (imports, engine process); to the second"
    )
    weights_s: float | None = Field(None, description="vLLM's 'Loading weights took': reading the weights")
    init_engine_s: float | None = Field(
        None, description="vLLM's 'init engine ... took': memory profile, KV cache, compile and warm-up"
    )

    def phases(self) -> str:
        """'to load start 20 s, weights 0.15 s, engine init 6.4 s': the phases the log gave."""
        named = (
            ("to load start", self.start_to_load_s),
            ("weights", self.weights_s),
            ("engine init", self.init_engine_s),
        )
        return ", ".join(f"{label} {value:.3g} s" for label, value in named if value is not None)


class LayoutResult(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    layout: str = Field(description="the layout's name (the spec's, or a generated one)")
    tp: int = Field(description="tensor-parallel size")
    dp: int = Field(description="data-parallel size")
    ep: int = Field(description="expert-parallel size (above 1: vLLM's --enable-expert-parallel)")
    pp: int = Field(description="pipeline-parallel size")
    replicas: int = Field(description="replica groups behind the layout's one endpoint")
    devices: int = Field(description="devices of all its replicas: tp x dp x pp x replicas")
    status: str = Field(
        description="ok; failed (engine did not start, died, client errors); cancelled (an engine was stopped "
        "from outside by SIGTERM/SIGINT: a shutdown or a cancelled task)"
    )
    error: str | None = Field(None, description="why it failed or was cancelled; None when ok")
    load_seconds: list[float] = Field(default_factory=list, description="per replica, process start to healthy")
    load_splits: list[LoadSplit] = Field(
        default_factory=list, description="per replica, its load time split by its engine log (LoadSplit)"
    )
    weights_source: str = Field(
        "", description="where the engines read the weights: 'local path' (the staged copy on this machine's disk)"
    )
    capacity_rps: float | None = Field(None, description="highest throughput any counted probe achieved, req/s")
    max_slo_rate: float | None = Field(None, description="req/s at the layout's endpoint (all its replicas)")
    per_server: float | None = Field(
        None, description="max_slo_rate x the copies of the layout a node holds: req/s per server"
    )
    per_device: float | None = Field(None, description="per_server / the node's devices, req/s")
    bound_only: bool = Field(
        False,
        description="the answer is a lower bound (no probe above it failed, or the probe budget ran out before "
        "it was narrowed), not a narrowed value; with no answer, the search ran out of probes while the SLO failed",
    )
    extrapolated: bool = Field(
        False,
        description="a lower bound that the line through the two highest passes puts within half the resolution "
        "below the SLO's edge (no probe above it failed): as near the edge as a narrowed answer by the search's "
        "own model, which calibration trusts and the report does not",
    )
    stop_reason: str = Field("", description="how the search ended, with its notes (SearchOutcome.stop_reason)")
    burst_rps: float | None = Field(None, description="throughput of the opening burst (the search's scale only)")
    deciding_p90_ttft_ms: list[float] = Field(default_factory=list, description="p90 TTFT of each run at the answer")
    spread: float | None = Field(None, description="max/min - 1 of the runs at the answer")
    unsteady: bool = Field(
        False,
        description="the runs at the answer differ by more than workload.max_spread even with probes twice as "
        "long: the answer holds in its worst run, but the edge is not known that well",
    )
    client_bound: bool = Field(
        False, description="a run at the answer, or the fail that capped it, was client-bound (Probe.client_bound)"
    )
    client_bound_rates: list[float] = Field(default_factory=list, description="rates with a client-bound run")
    unclean_rates: list[float] = Field(default_factory=list, description="rates never measured without interference")
    confirm_seconds: float | None = Field(
        None, description="length of the runs that confirmed the answer (workload.confirm_seconds or its floor), s"
    )
    confirmed: bool | None = Field(
        None,
        description="a run at the answer as long as confirm_seconds held the SLO and its trend (Probe.confirmation); "
        "false: every confirmation down to the step-down cap failed and there is no answer; None: none ran",
    )
    step_downs: int = Field(0, description="times a failed confirmation moved the answer down before one held")
    searched_rate: float | None = Field(
        None,
        description="the search's answer, req/s, before its confirmation: the confirmation runs a resolution "
        "under it (slo.resolution), so the answer reported is a lower bound on what an instance sustains; None: "
        "no confirmation ran",
    )
    confirm_engine: Literal["searched", "fresh"] | None = Field(
        None,
        description="the engine instance the confirmation ran on: the search's own, or a fresh one started after "
        "it stopped (workload.confirm_on_fresh_engine); None: none ran",
    )
    confirm_wall_s: float | None = Field(
        None,
        description="wall seconds from the search's answer to the confirmation's verdict, a fresh engine's start "
        "included: what the confirmation adds to the release",
    )
    placement: dict[str, str] = Field(default_factory=dict, description="what ran on which cores (cpu profile)")
    prediction: LayoutPrediction | None = Field(
        None, description="the planner's figures for this layout, made before the measurement; the search's prior"
    )
    prediction_error: float | None = Field(None, description="measured / predicted - 1")
    served_accuracy: ServedAccuracy | None = Field(
        None, description="lm-eval at this layout's endpoint after its search; a failure fails the layout"
    )
    probes: list[Probe] = Field(
        default_factory=list, description="every probe run, superseded ones included (a LayoutSelection drops them)"
    )
    seconds: float = Field(
        0.0, description="wall time of the layout's benchmark: engine start, search, served check, teardown, s"
    )

    @property
    def predicted_rate(self) -> float | None:
        """The planner's max SLO rate at this endpoint (calibrated), where a prediction was made."""
        return self.prediction.predicted_max_slo_rate if self.prediction else None

    def counted(self) -> list[Probe]:
        """The probes that count: not superseded by a run again (interference, too few requests)."""
        return [p for p in self.probes if not p.superseded]

    def last_run_at(self, rate: float | None) -> Probe | None:
        """The last counted run at `rate`: what a rate's verdict rests on."""
        at = [p for p in self.counted() if p.rate == rate]
        return at[-1] if at else None

    def deciding_probe(self) -> Probe | None:
        """The probe that decided the max SLO rate."""
        return self.last_run_at(self.max_slo_rate)

    def prediction_check(self) -> PredictionCheck:
        """Its prediction beside what it measured, as the registry keeps it."""
        return PredictionCheck(
            layout=self.layout,
            prediction=self.prediction,
            max_slo_rate=self.max_slo_rate,
            bound_only=self.bound_only,
            extrapolated=self.extrapolated,
            client_bound=self.client_bound,
        )


class SelectionVerdict(BaseModel):
    """The selection's verdict: the best layout, whether it holds the spec's minimum, and why."""

    best: str | None = Field(description="the ok layout with the highest rate per server; None: no layout had a rate")
    passed: bool = Field(
        description="best holds slo.min_rate_per_server (in a release run, and its fleet fits capacity:)"
    )
    reason: str = Field(description="the verdict in words: the best layout's rate, or why it fails")


class Selection(SelectionVerdict):
    layouts: list[LayoutResult] = Field(description="every layout measured, with its probes")


class BenchmarkFile(BaseModel):
    """benchmark.json: every layout measured, with its probes, and the selection's verdict: what the
    report renders from."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    layouts: list[LayoutResult] = Field(description="every layout measured, with its probes")
    selection: SelectionVerdict | None = Field(None, description="the selection's verdict; None: a re-benchmark's file")


class SearchOutcome(BaseModel):
    """What one SLO search found, and the evidence for it."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    probes: list[Probe] = Field(description="every probe run, in order, superseded ones included")
    burst_rps: float | None = Field(None, description="throughput of the opening burst: the scale, never a bracket")
    capacity: float | None = Field(None, description="highest throughput any probe achieved, req/s")
    max_slo_rate: float | None = Field(
        None, description="the answer: the highest offered req/s the SLO held at; None: it held at none"
    )
    bound_only: bool = Field(False, description="the answer is a lower bound (see LayoutResult.bound_only)")
    extrapolated: bool = Field(False, description="a lower bound closed by the passes' line (LayoutResult's)")
    stop_reason: str = Field("", description="how the search ended, plus notes (unsteady, client-bound, unclean rates)")
    deciding_p90_ttft_ms: list[float] = Field(
        default_factory=list, description="p90 TTFT of every counted run at the answer"
    )
    spread: float | None = Field(None, description="max/min - 1 of those p90s: how well repeats agree")
    unsteady: bool = Field(False, description="see LayoutResult.unsteady")
    client_bound: bool = Field(False, description="see LayoutResult.client_bound")
    client_bound_rates: list[float] = Field(default_factory=list, description="rates with a client-bound run")
    unclean_rates: list[float] = Field(
        default_factory=list, description="rates where interference stayed above the limit on every try"
    )
    confirm_seconds: float | None = Field(None, description="length of the confirmation runs, s (see LayoutResult)")
    confirmed: bool | None = Field(None, description="see LayoutResult.confirmed")
    step_downs: int = Field(0, description="see LayoutResult.step_downs")
    searched_rate: float | None = Field(None, description="see LayoutResult.searched_rate")
