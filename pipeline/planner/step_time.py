"""Time of one vLLM engine step for a batch under a layout: a roofline per part of the model.

Each part of a layer (attention projections and router, the experts or dense MLP, attention over
the KV cache) takes the longer of its matmul time and its memory time on one device; every
collective is priced by one algorithm, a direct two-phase exchange over a fully connected node
(a latency by world size: what one all-reduce costs however small, growing with the ranks, plus the
algorithm's bandwidth term); a fixed overhead covers the engine core's scheduling, per tensor-parallel
worker and per sampled sequence, and the layers' launches where a step runs piecewise graphs. A
matmul that is thin, in rows (tokens) or in the columns of a device's tensor-parallel slice, cannot
fill the device. Every device of a replica works in lockstep, so the busiest device's time is the
step's time; with dp > 1 every dp rank steps together too (vLLM runs dummy batches on idle ranks),
so the step is the slowest rank's, prefills included, and the experts carry every rank's tokens.

Experts are placed as vLLM places them (`fused_moe/layer.py`, `determine_expert_map`): without
expert parallelism every rank holds a 1/tp slice of every expert and does 1/tp of every routed
token's work; with `--enable-expert-parallel` each of the ep = tp x dp ranks holds E/ep whole
experts, and the rank that drew the most routed tokens sets the pace. With dp = 1 the experts'
partial sums are combined by the tensor-parallel all-reduce either way; with dp > 1 the default
`allgather_reducescatter` backend all-gathers the dp ranks' tokens before the experts and
reduce-scatters their outputs after.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import (
    Architecture,
    DevicePerformance,
    HardwareProfile,
    Layout,
    ReleaseSpec,
    arg_number,
    weights_per_device_gb,
)

ACTIVATION_BYTES = 2  # bf16 activations cross the links
UNQUANTIZED_BYTES = 2  # lm_head, embeddings and router gates stay bf16 (the quantization's ignore list)


@dataclass(frozen=True)
class Batch:
    """What one step processes. `pairs` counts query-key pairs (the attention's work)."""

    tokens: int  # new tokens: prefill chunk tokens + one per decoding sequence
    pairs: float  # sum over new tokens of the context each attends to
    context: int  # KV tokens read: decoding sequences' contexts + prefill chunks' earlier tokens
    sampled: int  # sequences whose logits are computed this step


class Part(BaseModel):
    """One part of a step on one device: its work, its bytes and which of the two took longer."""

    name: str
    flops: float
    bytes: float
    seconds: float
    bound: str  # compute | memory | link | overhead


class StepCost(BaseModel):
    parts: list[Part]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)


def gemm_efficiency(rows: float, half_rows: float, cols: float = 0.0, half_cols: float = 0.0) -> float:
    """A matmul with few rows (tokens) cannot fill the device: rows / (rows + half_rows). A thin
    tensor-parallel slice has fewer output tiles per row, so below `half_cols` columns it needs
    proportionally more rows to fill it: half_rows x half_cols / cols (0: not counted)."""
    if rows <= 0:
        return 1.0
    thin = half_cols / cols if cols > 0 and half_cols > cols else 1.0
    return rows / (rows + half_rows * thin)


def roofline(name: str, flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> Part:
    compute, memory = flops / flops_per_s, nbytes / bytes_per_s
    return Part(
        name=name,
        flops=flops,
        bytes=nbytes,
        seconds=max(compute, memory),
        bound="compute" if compute >= memory else "memory",
    )


def all_reduce_seconds(nbytes: float, devices: int, link_bytes_per_s: float, latency_s: float) -> float:
    """Two-phase all-reduce over a fully connected node: a reduce-scatter then an all-gather, each rank
    exchanging its 1/n share with its n-1 peers over n-1 links at once: `latency_s` (the whole
    all-reduce's fixed cost at this world size) + 2 bytes / (n link). vLLM's custom all-reduce
    (2-stage kernel, `csrc/custom_all_reduce.cuh`) runs this on xGMI for decode-sized tensors;
    RCCL's rings over all seven links of an 8-GPU node move the same bytes for the large ones."""
    if devices <= 1:
        return 0.0
    return latency_s + 2 * nbytes / (devices * link_bytes_per_s)


def all_gather_seconds(nbytes_per_rank: float, devices: int, link_bytes_per_s: float, latency_s: float) -> float:
    """One phase of the same exchange: each rank sends its own bytes to each peer over its own link
    (an all-gather; a reduce-scatter of the gathered tensor moves the same)."""
    if devices <= 1:
        return 0.0
    return latency_s + nbytes_per_rank / link_bytes_per_s


def dispatch_bytes(tokens_per_rank: float, dp: int, hidden_size: int) -> float:
    """Bytes one rank receives in the dp > 1 dispatch (all-gather of hidden states) and sends in the
    combine (reduce-scatter): the other dp - 1 ranks' tokens, bf16."""
    return (dp - 1) * tokens_per_rank * hidden_size * ACTIVATION_BYTES


def experts_touched(num_experts: int, per_token: int, tokens: float) -> float:
    """Expected distinct experts a batch routes to (uniform top-k routing): their weights are read."""
    return num_experts * (1 - (1 - per_token / num_experts) ** tokens)


def rank_imbalance(assignments: float, ep: int, skew: float) -> float:
    """Busiest of ep ranks' routed (token, expert) pairs over the mean. The routing's own skew (`skew`,
    from a routing profile or a cited figure) times the spread of few draws: each rank's share is
    ~Binomial(A, 1/ep), and the largest of ep such is about mean + sqrt(2 ln ep) sd, i.e.
    1 + sqrt(2 ln(ep) (ep - 1) / A) of the mean; never more than all of it on one rank (ep)."""
    if ep <= 1 or assignments <= 0:
        return 1.0
    spread = 1 + math.sqrt(2 * math.log(ep) * (ep - 1) / assignments)
    return min(float(ep), skew * spread)


@dataclass(frozen=True)
class ExpertLoad:
    """The busiest rank's share of one layer's experts: what sets the layer's pace."""

    routed: float  # routed (token, expert) pairs this rank computes
    rows: float  # rows of each expert GEMM: tokens per active expert
    experts_read: float  # experts whose weights (or slices) this rank reads
    weight_fraction: float  # of each expert's weights this rank holds: 1/tp sliced, 1 whole
    imbalance: float  # the busiest rank's routed pairs over the mean


def expert_load(arch: Architecture, tokens: float, tp: int, ep: int) -> ExpertLoad:
    """`tokens` reach the experts of one layer (every dp rank's, with dp > 1)."""
    k, e = arch.num_experts_per_tok, arch.num_experts
    assignments = tokens * k
    touched = experts_touched(e, k, tokens)
    rows = assignments / touched if touched else 0.0
    if ep <= 1:  # every rank: a 1/tp slice of every touched expert, all the routed tokens
        return ExpertLoad(routed=assignments, rows=rows, experts_read=touched, weight_fraction=1 / tp, imbalance=1.0)
    imbalance = rank_imbalance(assignments, ep, arch.expert_imbalance)
    share = imbalance / ep
    return ExpertLoad(
        routed=assignments * share,
        rows=rows,
        experts_read=min(e / ep, touched * share),
        weight_fraction=1.0,
        imbalance=imbalance,
    )


class StepModel:
    """The per-device constants of one replica of a layout, so a step costs a few multiplications. With
    dp > 1 a step is one dp rank's: its own batch through attention, every dp rank's through the experts."""

    def __init__(
        self, arch: Architecture, layout: Layout, perf: DevicePerformance, weight_bytes: float, kv_bytes: float
    ) -> None:
        if layout.pp != 1:
            raise ReleaseError(f"layout {layout.name!r}: the planner models pp=1 only (got pp={layout.pp})")
        if layout.dp > 1 and (layout.ep <= 1 or not arch.is_moe):
            raise ReleaseError(
                f"layout {layout.name!r}: the planner models dp > 1 only with expert parallelism on a MoE model"
            )
        self.arch, self.layout, self.perf = arch, layout, perf
        tp = layout.tp
        self.heads = arch.num_attention_heads / tp
        self.kv_heads = max(1.0, arch.num_kv_heads / tp)  # tp beyond the KV heads replicates them
        hd, h = arch.head_dim, arch.hidden_size
        self.attn_params = h * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * h
        self.router_params = h * arch.num_experts
        self.expert_params = 3 * h * (arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size)
        self.weight_bytes, self.kv_bytes = weight_bytes, kv_bytes
        dtype = "fp8" if weight_bytes == 1 and "fp8" in perf.peak_tflops else "bf16"
        eff = perf.efficiency
        self.peak = perf.peak_tflops[dtype] * 1e12 * eff.compute
        self.peak_bf16 = perf.peak_tflops["bf16"] * 1e12 * eff.compute
        self.bandwidth = perf.memory_gb_s * 1e9 * eff.memory
        self.link = perf.link_gb_s * 1e9 * eff.link
        # the dp dispatch's all-gather and reduce-scatter are collectives over the dp ranks (RCCL's, like a
        # large all-reduce): each pays the fixed cost of a collective at that world size, else one phase
        self.latency = perf.all_reduce_latency_us.get(layout.dp, perf.link_latency_us) * 1e-6
        self.all_reduce_latency = perf.all_reduce_latency_us.get(tp, 2 * perf.link_latency_us) * 1e-6
        self.half_rows, self.half_cols = eff.gemm_half_rows, eff.gemm_half_cols
        # the per-device output columns of the tensor-parallel slices: attention's qkv, an expert's gate+up
        self.attn_cols = (self.heads + 2 * self.kv_heads) * hd
        inter = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
        self.expert_cols = 2 * inter / (1 if layout.ep > 1 else tp)
        self.step_overhead_s = (perf.step_overhead_ms + perf.step_overhead_per_rank_ms * (tp - 1)) / 1e3
        self.piecewise_s = perf.piecewise_layer_us * 1e-6 * arch.num_layers
        self.full_graphs = full_graphs(layout.engine_args)
        self.kv_bytes_per_token = arch.num_layers * 2 * self.kv_heads * hd * kv_bytes  # on each device
        self.sequence_s = perf.sequence_overhead_us * 1e-6
        self.request_overhead_s = perf.request_overhead_ms / 1e3  # added to every TTFT by the simulation
        self.admission_s = perf.admission_ms / 1e3  # added to the step that admits a request, by the simulation
        # attention's work and bytes per (query, key) pair and per KV token read, every layer: a step's only
        # parts that depend on more than its token and sampled counts
        self.attn_flops_per_pair = arch.num_layers * 4 * self.heads * hd
        self.attn_bytes_per_token = arch.num_layers * 2 * self.kv_heads * hd * kv_bytes
        self._fixed: dict[tuple[int, int], tuple[float, float]] = {}  # seconds()'s parts by (tokens, sampled)
        self._own: dict[tuple[int, int], tuple[float, float]] = {}  # _own_seconds()'s, the same way
        self._experts: dict[tuple[int, int], float] = {}  # lockstep experts by (busiest rank's, all ranks') tokens
        self._links: dict[int, float] = {}  # link_seconds by tokens
        self._bounds: dict[tuple[int, int, int | None], list[tuple[str, float]]] = {}  # bounds() but attention

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts a batch routes to (uniform top-k routing): their weights are read."""
        arch = self.arch
        if not arch.is_moe:
            return 1.0
        return experts_touched(arch.num_experts, arch.num_experts_per_tok, tokens)

    def expert_load(self, tokens: int, expert_tokens: int | None = None) -> ExpertLoad:
        """The busiest rank's expert work for a step of `tokens` on each dp rank (`expert_tokens`: every dp
        rank's together, when they differ)."""
        total = tokens * self.layout.dp if expert_tokens is None else expert_tokens
        return expert_load(self.arch, total, self.layout.tp, self.layout.ep)

    def _terms(self, batch: Batch, expert_tokens: int | None = None) -> list[tuple[str, float, float, float, float]]:
        """(part, flops, bytes, flop/s, byte/s) of one step on one device, every layer counted."""
        return self._token_terms(batch.tokens, expert_tokens) + self._batch_terms(batch)

    def _token_terms(self, t: int, expert_tokens: int | None = None) -> list[tuple[str, float, float, float, float]]:
        """The parts that depend on the step's new tokens alone (the projections and the experts)."""
        arch, n = self.arch, self.arch.num_layers
        if arch.is_moe:
            load = self.expert_load(t, expert_tokens)
            rows = load.rows  # tokens per *active* expert: what one expert's GEMM carries
            mlp_flops = 2 * load.routed * self.expert_params * load.weight_fraction
            mlp_bytes = load.experts_read * self.expert_params * load.weight_fraction * self.weight_bytes
        else:
            rows = t
            mlp_flops = 2 * t * self.expert_params / self.layout.tp
            mlp_bytes = self.expert_params * self.weight_bytes / self.layout.tp
        return [
            (
                "attention projections + router",
                n * 2 * t * (self.attn_params + self.router_params),
                n * (self.attn_params * self.weight_bytes + self.router_params * UNQUANTIZED_BYTES),
                self.peak * gemm_efficiency(t, self.half_rows, self.attn_cols, self.half_cols),
                self.bandwidth,
            ),
            (
                "experts" if arch.is_moe else "mlp",
                n * mlp_flops,
                n * mlp_bytes,
                self.peak * gemm_efficiency(rows, self.half_rows, self.expert_cols, self.half_cols),
                self.bandwidth,
            ),
        ]

    def _batch_terms(self, batch: Batch) -> list[tuple[str, float, float, float, float]]:
        """The parts that depend on the whole batch (attention over its contexts, the sampled logits)."""
        arch, t, n = self.arch, batch.tokens, self.arch.num_layers
        head_params = arch.vocab_size * arch.hidden_size / self.layout.tp
        return [
            (
                "attention",
                n * 4 * self.heads * arch.head_dim * batch.pairs,
                n * 2 * self.kv_heads * arch.head_dim * self.kv_bytes * (batch.context + t),
                self.peak_bf16,
                self.bandwidth,
            ),
            (
                "lm_head",
                2 * batch.sampled * head_params,
                head_params * UNQUANTIZED_BYTES,
                self.peak_bf16 * gemm_efficiency(batch.sampled, self.half_rows),
                self.bandwidth,
            ),
        ]

    def all_reduce_seconds(self, tokens: int) -> float:
        """Two tensor-parallel all-reduces of the hidden states per layer (after attention, after the MLP)."""
        nbytes = tokens * self.arch.hidden_size * ACTIVATION_BYTES
        return self.arch.num_layers * 2 * all_reduce_seconds(nbytes, self.layout.tp, self.link, self.all_reduce_latency)

    def dispatch_seconds(self, tokens: int) -> float:
        """dp > 1: the experts' all-gather of every dp rank's tokens and the reduce-scatter back, per layer
        (`tokens`: the most any rank holds; the gather waits for it)."""
        dp = self.layout.dp
        if dp <= 1:
            return 0.0
        per_rank = tokens * self.arch.hidden_size * ACTIVATION_BYTES
        return self.arch.num_layers * 2 * all_gather_seconds(per_rank, dp, self.link, self.latency)

    def link_seconds(self, tokens: int) -> float:
        return self.all_reduce_seconds(tokens) + self.dispatch_seconds(tokens)

    def overhead_seconds(self, batch: Batch) -> float:
        """The engine core's time per step, per worker and per sampled sequence, and the layers' launches
        on a step that runs piecewise graphs: one with a prefill in it, or any where full graphs are off."""
        piecewise = not self.full_graphs or batch.sampled < batch.tokens
        return self.step_overhead_s + self.sequence_s * batch.sampled + (self.piecewise_s if piecewise else 0.0)

    def lockstep_seconds(self, batches: list[Batch]) -> float:
        """dp > 1: one step of every dp rank together (an idle rank's batch has no tokens: it runs a dummy
        pass). Each rank's own parts (projections, attention, lm_head, its overhead) on its batch; the
        experts on every rank's tokens; the step waits for the slowest rank at every layer."""
        total = sum(b.tokens for b in batches)
        busiest = max(b.tokens for b in batches)
        own = max(self._own_seconds(b) for b in batches)
        return own + self._experts_seconds(busiest, total) + self._link(busiest)

    def _experts_seconds(self, busiest: int, total: int) -> float:
        """dp > 1: the experts' time on every rank's tokens, the busiest rank's pace (cached by the counts)."""
        key = (busiest, total)
        experts = self._experts.get(key)
        if experts is None:
            experts = 0.0
            if self.arch.is_moe:
                _, f, b, fps, bps = self._token_terms(max(1, busiest), max(1, total))[1]
                experts = max(f / fps, b / bps)
            self._experts[key] = experts
        return experts

    def _link(self, tokens: int) -> float:
        link = self._links.get(tokens)
        if link is None:
            link = self._links[tokens] = self.link_seconds(tokens)
        return link

    def _attention(self, pairs: float, read: int) -> float:
        """Attention's time over `pairs` (query, key) pairs reading `read` KV tokens: _batch_terms()'s first
        part with its arithmetic (the same floats)."""
        return max(self.attn_flops_per_pair * pairs / self.peak_bf16, self.attn_bytes_per_token * read / self.bandwidth)

    def _own_seconds(self, batch: Batch) -> float:
        """A rank's parts outside the experts and the links: its overhead and projections (cached by the
        batch's token and sampled counts), then attention, then lm_head, summed in that order."""
        if not batch.tokens:
            return self.step_overhead_s
        key = (batch.tokens, batch.sampled)
        own = self._own.get(key)
        if own is None:
            _, f, b, fps, bps = self._token_terms(batch.tokens, batch.tokens)[0]
            lm = self._batch_terms(batch)[1]
            own = self._own[key] = (
                self.overhead_seconds(batch) + max(f / fps, b / bps),
                max(lm[1] / lm[3], lm[2] / lm[4]),
            )
        prefix, lm_s = own
        return prefix + self._attention(batch.pairs, batch.context + batch.tokens) + lm_s

    def _fixed_parts(self, tokens: int, sampled: int) -> tuple[float, float]:
        """seconds()'s parts that depend on the step's token and sampled counts alone, computed once per
        pair: (overhead + link + projections + experts, summed in seconds()'s order; lm_head)."""
        fixed = self._fixed.get((tokens, sampled))
        if fixed is None:
            batch = Batch(tokens=tokens, pairs=0.0, context=0, sampled=sampled)
            total = self.overhead_seconds(batch) + self.link_seconds(tokens)
            for _, f, b, fps, bps in self._token_terms(tokens):
                total += max(f / fps, b / bps)
            lm = self._batch_terms(batch)[1]
            fixed = self._fixed[(tokens, sampled)] = (total, max(lm[1] / lm[3], lm[2] / lm[4]))
        return fixed

    def seconds(self, batch: Batch) -> float:
        """The step's time; the simulation calls this once per step (millions of times in a plan with
        intervals), so it builds no records, and what depends on the step's token and sampled counts alone
        (overhead, link, projections, experts, lm_head) is computed once per pair; summed in _terms()'s
        order: overhead + link, the token parts, attention, lm_head."""
        prefix, lm = self._fixed_parts(batch.tokens, batch.sampled)
        return prefix + self._attention(batch.pairs, batch.context + batch.tokens) + lm

    def decode_run(
        self, decoding: int, context: int, now: float, busy: float, until: float, steps: int, factor: float = 1.0
    ) -> tuple[int, float, float]:
        """Up to `steps` decode-only steps of one replica (`decoding` sequences, each one token, `context` KV
        tokens before the first), each starting before `until` (the next arrival): what the simulation's
        step loop computes for them, float for float, without building batches.
        -> (steps run, now, busy) after them."""
        prefix, lm = self._fixed_parts(decoding, decoding)
        per_pair, per_token = self.attn_flops_per_pair, self.attn_bytes_per_token
        peak, bandwidth = self.peak_bf16, self.bandwidth
        done = 0
        while done < steps and now < until:
            read = context + decoding
            seconds = (prefix + max(per_pair * read / peak, per_token * read / bandwidth) + lm) * factor
            now += seconds
            busy += seconds
            context += decoding
            done += 1
        return done, now, busy

    def lockstep_decode_run(
        self,
        decoding: list[int],
        contexts: list[int],
        now: float,
        busy: float,
        until: float,
        steps: int,
        factor: float = 1.0,
    ) -> tuple[int, float, float]:
        """decode_run() for the dp ranks of a lockstep replica: rank r decodes `decoding[r]` sequences (0:
        a dummy pass) over `contexts[r]` KV tokens; each step is lockstep_seconds() of their batches."""
        busiest, total = max(decoding), sum(decoding)
        tail = self._experts_seconds(busiest, total)
        link = self._link(busiest)
        idle = self.step_overhead_s
        own_parts = []
        for d in decoding:
            if d:
                self._own_seconds(Batch(tokens=d, pairs=0.0, context=0, sampled=d))  # fills the cache
                own_parts.append(self._own[(d, d)])
            else:
                own_parts.append((0.0, 0.0))
        per_pair, per_token = self.attn_flops_per_pair, self.attn_bytes_per_token
        peak, bandwidth = self.peak_bf16, self.bandwidth
        contexts = list(contexts)
        done = 0
        while done < steps and now < until:
            own = -math.inf
            for r, d in enumerate(decoding):
                if d:
                    read = contexts[r] + d
                    prefix, lm = own_parts[r]
                    rank = prefix + max(per_pair * read / peak, per_token * read / bandwidth) + lm
                    contexts[r] += d
                else:
                    rank = idle
                if rank > own:
                    own = rank
            seconds = float(own + tail + link) * factor
            now += seconds
            busy += seconds
            done += 1
        return done, now, busy

    def bounds(self, batch: Batch, expert_tokens: int | None = None) -> list[tuple[str, float]]:
        """cost()'s (bound, seconds) per part, in its order and with its arithmetic, without its records:
        a prediction's time-by-bound sums this over every step of a simulation (~10^4 steps each), so the
        parts but attention are computed once per (tokens, sampled, expert_tokens)."""
        key = (batch.tokens, batch.sampled, expert_tokens)
        fixed = self._bounds.get(key)
        if fixed is None:
            fixed = []
            shape = Batch(tokens=batch.tokens, pairs=0.0, context=0, sampled=batch.sampled)
            terms = self._terms(shape, expert_tokens)
            for _, flops, nbytes, flops_per_s, bytes_per_s in terms[:2] + terms[3:]:
                compute, memory = flops / flops_per_s, nbytes / bytes_per_s
                fixed.append(("compute" if compute >= memory else "memory", max(compute, memory)))
            fixed.append(("link", self.all_reduce_seconds(batch.tokens)))
            if self.layout.dp > 1:
                fixed.append(("link", self.dispatch_seconds(batch.tokens)))
            fixed.append(("overhead", self.overhead_seconds(batch)))
            self._bounds[key] = fixed
        compute = self.attn_flops_per_pair * batch.pairs / self.peak_bf16
        memory = self.attn_bytes_per_token * (batch.context + batch.tokens) / self.bandwidth
        attention = ("compute" if compute >= memory else "memory", max(compute, memory))
        return [*fixed[:2], attention, *fixed[2:]]

    def cost(self, batch: Batch) -> StepCost:
        """The same step, part by part, for the plan's explanation and the tests."""
        parts = [roofline(*term) for term in self._terms(batch)]
        h, n, t = self.arch.hidden_size, self.arch.num_layers, batch.tokens
        parts.append(
            Part(
                name="all-reduce",
                flops=0.0,
                bytes=t * h * ACTIVATION_BYTES * 2 * n if self.layout.tp > 1 else 0.0,
                seconds=self.all_reduce_seconds(t),
                bound="link",
            )
        )
        if self.layout.dp > 1:
            parts.append(
                Part(
                    name="dispatch + combine",
                    flops=0.0,
                    bytes=2 * n * dispatch_bytes(t, self.layout.dp, h),
                    seconds=self.dispatch_seconds(t),
                    bound="link",
                )
            )
        parts.append(
            Part(
                name="step overhead",
                flops=0.0,
                bytes=0.0,
                seconds=self.overhead_seconds(batch),
                bound="overhead",
            )
        )
        return StepCost(parts=parts)


class Limits(BaseModel):
    """The scheduler limits of one replica, what the simulation admits requests under."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int


class Engine(Limits):
    """A replica's limits from vLLM's engine args or their defaults for the hardware, and which were defaults."""

    notes: list[str]
    infeasible: str = ""  # why vLLM would refuse to start this replica ("": it starts)


def full_graphs(engine_args: Mapping[str, object]) -> bool:
    """Whether a layout's engine runs full graphs for decode steps: vLLM V1's default (FULL_AND_PIECEWISE)
    unless its args turn them off (`compilation-config: {full_cuda_graph: false}`, a piecewise or none
    `cudagraph_mode`, `enforce-eager`)."""
    if engine_args.get("enforce-eager") in (True, "true", "True"):
        return False
    config = engine_args.get("compilation-config")
    if isinstance(config, dict):
        if config.get("full_cuda_graph") is False:
            return False
        mode = str(config.get("cudagraph_mode", "")).upper()
        if mode in ("PIECEWISE", "NONE"):
            return False
    return True


def weight_bytes_per_param(spec: ReleaseSpec) -> float:
    return 1.0 if spec.quantization.scheme.startswith("FP8") else 2.0


def engine_limits(spec: ReleaseSpec, layout: Layout, hw: HardwareProfile, model: StepModel) -> Engine:
    """vLLM's V1 defaults for an OpenAI server (1024 seqs / 8192 tokens on devices of 70 GiB or more,
    256 / 2048 below), unless the spec sets them; KV capacity from device memory left by the weights."""
    args = {**spec.serving.engine_args, **layout.engine_args}
    big = hw.kind == "gpu" and hw.device_memory_gb >= 70
    notes = []
    seqs = arg_number(args, "max-num-seqs")
    tokens = arg_number(args, "max-num-batched-tokens")
    if seqs is None:
        notes.append(f"max-num-seqs: vLLM default {1024 if big else 256}")
    if tokens is None:
        notes.append(f"max-num-batched-tokens: vLLM default {8192 if big else 2048}")
    util = arg_number(args, "gpu-memory-utilization", 0.9) or 0.9
    free_gb = hw.device_memory_gb * util - weights_per_device_gb(spec, layout)
    kv_tokens = int(max(0.0, free_gb) * 1e9 / model.kv_bytes_per_token)
    max_len = int(arg_number(args, "max-model-len") or spec.workload.input_len + spec.workload.output_len)
    infeasible = ""
    if kv_tokens < max_len:  # vLLM refuses to start: its KV cache cannot hold one max-length sequence
        infeasible = (
            f"infeasible: KV cache {kv_tokens} tokens per device cannot hold one {max_len}-token sequence"
            f" (max-model-len); vLLM refuses to start"
        )
    return Engine(
        max_num_seqs=int(seqs or (1024 if big else 256)),
        max_num_batched_tokens=int(tokens or (8192 if big else 2048)),
        kv_capacity_tokens=kv_tokens,
        notes=notes,
        infeasible=infeasible,
    )


def step_model(spec: ReleaseSpec, layout: Layout, hw: HardwareProfile) -> StepModel:
    if hw.performance is None:
        raise ReleaseError(f"hardware {hw.name!r}: no performance: section (peak_tflops, memory_gb_s, ...)")
    args = {**spec.serving.engine_args, **layout.engine_args}
    kv_bytes = 1.0 if str(args.get("kv-cache-dtype", "auto")).startswith("fp8") else 2.0
    model = StepModel(spec.model.architecture, layout, hw.performance, weight_bytes_per_param(spec), kv_bytes)
    model.full_graphs = full_graphs(args)
    return model
