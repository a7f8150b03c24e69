"""Quantize stage: BF16 checkpoint -> FP8 checkpoint (compressed-tensors format), verified.

Three doors, one recipe (scheme + ignore list):
- `oneshot`: llmcompressor builds the model and applies QuantizationModifier; needs the whole
  model in memory, and is the door for schemes that need calibration.
- `model_free`: llmcompressor's `model_free_ptq`, shard by shard on safetensors without
  building the model, for checkpoints larger than RAM.
- `streaming`: `pipeline.stages.fp8_stream`, one tensor at a time with shard-level parallelism,
  bit-identical to `model_free` for the data-free FP8 schemes and much faster.

The output directory is named by a hash of (source manifest, recipe, library versions), is
verified before it is published (atomic rename) and carries a manifest written last, so a
re-run with the same inputs returns at once and a killed run leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import psutil

from pipeline.core import artifacts, checkpoint
from pipeline.core.errors import ArtifactError, ReleaseError
from pipeline.core.paths import artifacts_dir
from pipeline.core.specs import ReleaseSpec
from pipeline.records.quantize import NumericCheck, QuantizeResult
from pipeline.records.sources import ModelSource

log = logging.getLogger(__name__)

FP8_MAX = 448.0
COPIED_FILES_SKIP = {"config.json", artifacts.MANIFEST, checkpoint.INDEX, "recipe.yaml"}
NUMERIC_PROMPTS = ["12+34=", "copy hello=", "The capital of France is", "<|im_start|>user\n7+8=<|im_end|>\n"]
# Check config fields against the spec before spending time on the weights.
# (transformers 5 writes num_local_experts where 4.x wrote num_experts)
ARCH_FIELDS = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "num_experts": ("num_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "num_attention_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
}
SCHEME_CONFIG = {  # what compressed-tensors writes for each preset
    "FP8_DYNAMIC": {"strategy": "channel", "input_strategy": "token"},
    "FP8_BLOCK": {"strategy": "block", "input_strategy": "group"},
}


def versions() -> dict[str, str]:
    names = ["llmcompressor", "compressed-tensors", "torch", "transformers", "model-release"]
    return {name: importlib.metadata.version(name) for name in names}


def recipe(spec: ReleaseSpec, method: str) -> dict[str, Any]:
    q = spec.quantization
    return {"scheme": q.scheme, "ignore": list(q.ignore), "targets": "Linear", "method": method}


def choose_method(spec: ReleaseSpec, source_bytes: int) -> str:
    """`auto`: build the model when it fits comfortably in memory, otherwise stream the shards."""
    method = spec.quantization.method
    if method != "auto":
        return method
    available = psutil.virtual_memory().available
    return "oneshot" if source_bytes * 3 < available else "streaming"


def output_dir(spec: ReleaseSpec, source: ModelSource, method: str) -> Path:
    key_data = {"source": source.manifest_hash, "recipe": recipe(spec, method), "versions": versions()}
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:16]
    return artifacts_dir() / f"{spec.name}-{key}"


def quantize(spec: ReleaseSpec, source: ModelSource, method: str | None = None) -> QuantizeResult:
    src = Path(source.path)
    if method is None:
        method = choose_method(spec, checkpoint.weights_bytes(src))
    final = output_dir(spec, source, method)
    if artifacts.is_complete(final):
        manifest = artifacts.verify(final)
        log.info("quantize: %s already built and verified; nothing to do", final)
        return QuantizeResult(**manifest.meta["result"], reused=True)

    check_architecture(spec, src)
    tensors = checkpoint.tensors(src)  # fails fast, naming a missing or truncated shard
    source_bytes = checkpoint.weights_bytes(src)
    check_free_space(final.parent, estimate_output_bytes(tensors, spec))
    artifacts.remove_stale_temps(final.parent)
    log.info(
        "quantize: %s -> %s with %s (%s), %.1f MB of weights in %d tensors",
        src,
        final,
        method,
        spec.quantization.scheme,
        source_bytes / 1e6,
        len(tensors),
    )

    with artifacts.publishing(final) as tmp:
        started = time.monotonic()
        run_method(method, src, tmp, spec)
        copy_side_files(src, tmp)
        seconds = time.monotonic() - started
        counts = verify_fp8(src, tmp, spec.quantization.scheme, spec.quantization.ignore)
        numeric = numeric_check(src, tmp, source_bytes)
        log.info(
            "quantize: verified %d quantized and %d kept tensors; logits rel. error max %s",
            counts["quantized"],
            counts["kept"],
            numeric.max_rel_error if numeric.skipped is None else numeric.skipped,
        )
        result = QuantizeResult(
            path=str(final),
            manifest_hash="",
            method=method,
            scheme=spec.quantization.scheme,
            source_manifest_hash=source.manifest_hash,
            reused=False,
            seconds=round(seconds, 2),
            source_bytes=source_bytes,
            output_bytes=checkpoint.weights_bytes(tmp),
            mb_per_s=round(source_bytes / 1e6 / max(seconds, 1e-9), 1),
            tensors_quantized=counts["quantized"],
            tensors_kept=counts["kept"],
            numeric_check=numeric,
        )
        # The manifest hash covers the files, so hash them once, then store the finished result.
        files = artifacts.scan(tmp)
        result.manifest_hash = artifacts.Manifest(kind="fp8-model", files=files).content_hash()
        artifacts.write_manifest(
            tmp,
            kind="fp8-model",
            files=files,
            meta={
                "recipe": recipe(spec, method),
                "versions": versions(),
                "source": source.model_dump(),
                "result": result.model_dump(exclude={"reused"}),
            },
        )
    log.info("quantize: published %s (%.1f MB/s of source)", final, result.mb_per_s)
    return result


def _llmcompressor_logs_to_stderr() -> None:
    """llmcompressor logs to stdout through loguru; keep stdout for results (the CLI prints JSON)."""
    import sys

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{time:YYYY-MM-DDTHH:mm:ss} | llmcompressor | {level} - {message}")


def run_method(method: str, src: Path, out: Path, spec: ReleaseSpec) -> None:
    scheme, ignore = spec.quantization.scheme, list(spec.quantization.ignore)
    if method in ("oneshot", "model_free"):
        import llmcompressor  # noqa: F401  (configures loguru on import)

        _llmcompressor_logs_to_stderr()
    if method == "oneshot":
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore))
        model.save_pretrained(out, save_compressed=True)
    elif method == "model_free":
        from llmcompressor import model_free_ptq

        model_free_ptq(src, out, scheme=scheme, ignore=ignore, max_workers=2, device="cpu")
        (out / artifacts.MANIFEST).unlink(missing_ok=True)  # copied from the source; ours comes last
    elif method == "streaming":
        from pipeline.stages import fp8_stream

        last = [0.0]

        def progress(shard: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] > 5 or done == total:
                last[0] = now
                log.info("quantize: %s %.0f/%.0f MB", shard, done / 1e6, total / 1e6)

        fp8_stream.convert(src, out, scheme, ignore, max_workers=2, progress=progress)
    else:
        raise ReleaseError(f"quantization.method: unknown method {method!r} (oneshot, model_free, streaming)")


def copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, chat template and generation config travel with the weights."""
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in COPIED_FILES_SKIP:
            if not (out / path.name).exists():
                shutil.copy2(path, out / path.name)


def check_architecture(spec: ReleaseSpec, src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    arch = spec.model.architecture
    if config.get("model_type") != arch.model_type:
        raise ReleaseError(
            f"model.architecture.model_type: spec says {arch.model_type!r}, "
            f"{src / 'config.json'} has {config.get('model_type')!r}"
        )
    for field, keys in ARCH_FIELDS.items():
        for key in keys:
            if key in config and config[key] != getattr(arch, field):
                raise ReleaseError(
                    f"model.architecture.{field}: spec says {getattr(arch, field)}, "
                    f"{src / 'config.json'} has {key}={config[key]}"
                )


def _is_target(name: str, ignore: list[str]) -> bool:
    """A weight llmcompressor quantizes: a 2-D Linear weight whose module is not ignored."""
    module = name.removesuffix(".weight")
    return (
        name.endswith(".weight")
        and not module.endswith("norm")
        and not checkpoint.is_embedding(module)
        and not checkpoint.matches(module, ignore)
    )


def estimate_output_bytes(tensors: dict[str, checkpoint.TensorInfo], spec: ReleaseSpec) -> int:
    total = 0
    for name, info in tensors.items():
        if len(info.shape) == 2 and _is_target(name, spec.quantization.ignore):
            total += info.shape[0] * info.shape[1] + 2 * info.shape[0] + 1024
        else:
            total += info.nbytes
    return total


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_free_space(parent: Path, needed: int) -> None:
    parent.mkdir(parents=True, exist_ok=True)
    free = free_bytes(parent)
    if free < needed * 1.05 + 64e6:
        raise ReleaseError(f"{parent}: {free / 1e9:.2f} GB free, the FP8 output needs about {needed / 1e9:.2f} GB")


def verify_fp8(src: Path, out: Path, scheme: str, ignore: list[str]) -> dict[str, int]:
    """Check the output against the recipe and the source; raise ArtifactError naming the first problem."""
    import torch
    from safetensors import safe_open

    config_path = out / "config.json"
    qc = json.loads(config_path.read_text()).get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        raise ArtifactError(f"{config_path}: no compressed-tensors quantization_config")
    if qc.get("format") != "float-quantized" or len(qc.get("config_groups", {})) != 1:
        raise ArtifactError(f"{config_path}: quantization_config is not one float-quantized group")
    group = next(iter(qc["config_groups"].values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    want = SCHEME_CONFIG[scheme]
    if (weights.get("num_bits"), weights.get("type"), weights.get("strategy")) != (8, "float", want["strategy"]):
        raise ArtifactError(
            f"{config_path}: weights are {weights.get('type')}{weights.get('num_bits')}/"
            f"{weights.get('strategy')}, the recipe {scheme} needs float8/{want['strategy']}"
        )
    if not inputs.get("dynamic") or inputs.get("strategy") != want["input_strategy"]:
        raise ArtifactError(
            f"{config_path}: activations are not dynamic per-{want['input_strategy']} as {scheme} needs"
        )

    src_tensors = checkpoint.tensors(src)
    out_tensors = checkpoint.tensors(out)  # every listed shard exists and is complete
    handles: dict[Path, Any] = {}

    def load(root: Path, info: checkpoint.TensorInfo):
        path = root / info.shard
        if path not in handles:
            handles[path] = safe_open(str(path), "pt")
        return handles[path].get_tensor(info.name)

    counts = {"quantized": 0, "kept": 0}
    expected_names = set()
    for name, info in src_tensors.items():
        module = name.removesuffix(".weight")
        where = f"{out}: {name}"
        if len(info.shape) == 2 and _is_target(name, ignore):
            expected_names |= {name, f"{module}.weight_scale"}
            got = out_tensors.get(name)
            if got is None or got.dtype != "F8_E4M3" or got.shape != info.shape:
                raise ArtifactError(
                    f"{where}: expected a float8_e4m3fn weight of shape {info.shape}, "
                    f"found {got.dtype if got else 'nothing'}"
                )
            scale = out_tensors.get(f"{module}.weight_scale")
            if scale is None:
                raise ArtifactError(f"{where}: quantized weight has no {module}.weight_scale")
            counts["quantized"] += 1
        else:
            expected_names.add(name)
            got = out_tensors.get(name)
            if got is None:
                raise ArtifactError(f"{where}: missing from the output (it is kept unquantized)")
            if got.dtype != info.dtype:
                kind = "embedding" if checkpoint.is_embedding(module) else "ignored module"
                hint = f"; add {module} to quantization.ignore" if checkpoint.is_embedding(module) else ""
                raise ArtifactError(f"{where}: {kind} was quantized to {got.dtype}, it must stay {info.dtype}{hint}")
            if not torch.equal(load(src, info), load(out, got)):
                raise ArtifactError(f"{where}: kept tensor differs from the source")
            counts["kept"] += 1
    extra = sorted(set(out_tensors) - expected_names)
    if extra:
        raise ArtifactError(f"{out}: unexpected tensor {extra[0]} (and {len(extra) - 1} more)")
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in COPIED_FILES_SKIP:
            if not (out / path.name).is_file():
                raise ArtifactError(f"{out / path.name}: not copied from the source")
    return counts


def numeric_check(src: Path, out: Path, source_bytes: int) -> NumericCheck:
    """Logits of the FP8 model vs the source on a few prompts; skipped when the model is too big to load here."""
    if source_bytes * 4 > psutil.virtual_memory().available:
        return NumericCheck(skipped=f"{source_bytes / 1e9:.1f} GB checkpoint is too large to load on this worker")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    fp8 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    errors, agree, total = [], 0, 0
    with torch.no_grad():
        for prompt in NUMERIC_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            a, b = ref(ids).logits[0], fp8(ids).logits[0]
            errors.append(float(torch.linalg.norm(b - a) / torch.linalg.norm(a)))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
    return NumericCheck(
        prompts=len(errors),
        max_rel_error=round(max(errors), 5),
        mean_rel_error=round(sum(errors) / len(errors), 5),
        top1_agreement=round(agree / total, 4),
    )
