"""Checks that span fields and the hardware: does each layout fit the node, do the weights and a
sequence's KV cache fit a device's memory; and the layouts that fit, generated for the planner.
Pure: no file is read, so the planner asks the same questions of layouts it makes up."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipeline.core.specs.hardware import HardwareProfile
from pipeline.core.specs.model import BYTES_PER_PARAM
from pipeline.core.specs.release import ReleaseSpec
from pipeline.core.specs.serving import Layout

KNOB_NAMES = {"max-num-seqs": "seqs", "max-num-batched-tokens": "tokens"}


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
