"""Benchmark FP8_DYNAMIC conversion paths on a synthetic Qwen3-MoE BF16 checkpoint.

    .venv/bin/python benchmarks/quantize.py [--size-gb 2.0] [--workdir DIR] [--shard-gb 0.5]

Builds (once, cached in the workdir) a deterministic checkpoint in the Qwen3MoeForCausalLM
layout with a complete config.json, so transformers can load it, then runs each path in a
fresh subprocess and reports its wall time and peak RSS (the child's own VmHWM):

    copy          shutil.copytree of the checkpoint (the floor: read + write every byte)
    stream        pipeline.stages.fp8_stream.convert(scheme="FP8_DYNAMIC", max_workers=2)
    model_free    llmcompressor.model_free_ptq(scheme="FP8_DYNAMIC", max_workers=1, device="cpu")
    oneshot       transformers load + llmcompressor.oneshot(QuantizationModifier FP8_DYNAMIC) + save

copy and stream are quick and noisy, so they run --repeat times (median time, worst RSS).
Timed spans exclude Python imports (the RSS after imports is printed per path: most of the
streaming path's RSS is that fixed cost). The checkpoint was just written, so every path
reads it from the page cache; nothing is dropped, but dirty pages are synced before each run.
Finally it checks that the stream output equals model_free_ptq's, tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
SCHEME = "FP8_DYNAMIC"
PATHS = ("copy", "stream", "model_free", "oneshot")
FAST_PATHS = ("copy", "stream")  # repeated --repeat times, median reported

# model shape: Qwen3-30B-A3B-like widths, layer count chosen to reach --size-gb
DIMS = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=32, moe_inter=768, vocab=32000)


# ---------------------------------------------------------------- checkpoint


def _layer_tensors(i: int) -> list[tuple[str, tuple[int, ...]]]:
    d = DIMS
    h, p = d["hidden"], f"model.layers.{i}"
    out = [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (d["heads"] * d["head_dim"], h)),
        (f"{p}.self_attn.k_proj.weight", (d["kv_heads"] * d["head_dim"], h)),
        (f"{p}.self_attn.v_proj.weight", (d["kv_heads"] * d["head_dim"], h)),
        (f"{p}.self_attn.o_proj.weight", (h, d["heads"] * d["head_dim"])),
        (f"{p}.self_attn.q_norm.weight", (d["head_dim"],)),
        (f"{p}.self_attn.k_norm.weight", (d["head_dim"],)),
        (f"{p}.mlp.gate.weight", (d["experts"], h)),
    ]
    for e in range(d["experts"]):
        out += [
            (f"{p}.mlp.experts.{e}.gate_proj.weight", (d["moe_inter"], h)),
            (f"{p}.mlp.experts.{e}.up_proj.weight", (d["moe_inter"], h)),
            (f"{p}.mlp.experts.{e}.down_proj.weight", (h, d["moe_inter"])),
        ]
    return out


def _nbytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * 2


def plan_checkpoint(size_gb: float) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    d = DIMS
    edges = [
        ("model.embed_tokens.weight", (d["vocab"], d["hidden"])),
        ("lm_head.weight", (d["vocab"], d["hidden"])),
        ("model.norm.weight", (d["hidden"],)),
    ]
    per_layer = sum(_nbytes(s) for _, s in _layer_tensors(0))
    fixed = sum(_nbytes(s) for _, s in edges)
    layers = max(1, math.ceil((size_gb * 1e9 - fixed) / per_layer))
    tensors = [edges[0]] + [t for i in range(layers) for t in _layer_tensors(i)] + edges[2:] + [edges[1]]
    return layers, tensors


def build_checkpoint(path: Path, size_gb: float, shard_gb: float) -> None:
    """Deterministic BF16 checkpoint: shards of about shard_gb, an index, a full config.json."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    stamp = {"size_gb": size_gb, "shard_gb": shard_gb, "dims": DIMS, "version": 1}
    if (path / "bench-stamp.json").exists() and json.loads((path / "bench-stamp.json").read_text()) == stamp:
        return
    shutil.rmtree(path, ignore_errors=True)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    layers, tensors = plan_checkpoint(size_gb)
    limit = int(shard_gb * 1e9)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if groups[-1] and size + _nbytes(shape) > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += _nbytes(shape)
    gen = torch.Generator().manual_seed(1234)
    weight_map, total = {}, 0
    t0 = time.monotonic()
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {}
        for name, shape in group:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[1]))).to(torch.bfloat16)
            data[name] = t
            weight_map[name] = fname
            total += t.nbytes
        save_file(data, tmp / fname, metadata={"format": "pt"})
        del data
        print(f"  wrote {fname} ({len(group)} tensors)", flush=True)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    d = DIMS
    cfg = Qwen3MoeConfig(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=4 * d["hidden"],
        moe_intermediate_size=d["moe_inter"],
        num_hidden_layers=layers,
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        num_experts=d["experts"],
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (tmp / "bench-stamp.json").write_text(json.dumps(stamp))
    tmp.rename(path)
    print(
        f"  built {path} ({total / 1e9:.2f} GB, {len(groups)} shards, {layers} layers) in {time.monotonic() - t0:.0f}s",
        flush=True,
    )


# ---------------------------------------------------------------- children


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss_mb() -> float:
    """Peak RSS of this process image in MiB: VmHWM (ru_maxrss would carry the parent's peak across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(path: str, src: Path, out: Path) -> dict:
    """Run one path; return seconds (of the work only) and peak RSS."""
    import logging

    logging.disable(logging.WARNING)
    if path == "copy":
        base = _rss_mb()
        t0, cpu0 = time.monotonic(), _cpu()
        shutil.copytree(src, out)
    elif path == "model_free":
        from loguru import logger

        logger.remove()
        from llmcompressor import model_free_ptq

        base = _rss_mb()
        t0, cpu0 = time.monotonic(), _cpu()
        model_free_ptq(src, out, scheme=SCHEME, ignore=IGNORE, max_workers=1, device="cpu")
    elif path == "oneshot":
        import torch
        from loguru import logger

        logger.remove()
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import AutoModelForCausalLM

        base = _rss_mb()
        t0, cpu0 = time.monotonic(), _cpu()
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=SCHEME, ignore=IGNORE))
        model.save_pretrained(out, save_compressed=True)
    elif path == "stream":
        sys.path.insert(0, str(ROOT))
        import llmcompressor.entrypoints.model_free.converter  # noqa: F401  (import cost outside the timer)

        from pipeline.stages import fp8_stream

        base = _rss_mb()
        out.mkdir(parents=True)
        t0, cpu0 = time.monotonic(), _cpu()
        fp8_stream.convert(src, out, SCHEME, IGNORE, max_workers=2)
    elif path == "verify":
        return verify(src, out)
    else:
        raise SystemExit(f"unknown path {path}")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu0
    return {"seconds": time.monotonic() - t0, "cpu_s": cpu, "rss_mb": _rss_mb(), "base_rss_mb": base}


def verify(ref: Path, mine: Path) -> dict:
    """Tensor-by-tensor equality (names, dtypes, shapes, bits) plus index and quantization_config."""
    import torch
    from safetensors import safe_open

    problems = []
    ri = json.loads((ref / "model.safetensors.index.json").read_text())
    mi = json.loads((mine / "model.safetensors.index.json").read_text())
    if ri != mi:
        problems.append("index differs")
    rq = json.loads((ref / "config.json").read_text()).get("quantization_config")
    mq = json.loads((mine / "config.json").read_text()).get("quantization_config")
    if rq != mq:
        problems.append("quantization_config differs")
    count = 0
    for shard in sorted(set(ri["weight_map"].values())):
        with safe_open(ref / shard, "pt") as a, safe_open(mine / shard, "pt") as b:
            if set(a.keys()) != set(b.keys()):
                problems.append(f"{shard}: tensor names differ")
                continue
            for key in a.keys():
                x, y = a.get_tensor(key), b.get_tensor(key)
                if (
                    x.dtype != y.dtype
                    or x.shape != y.shape
                    or not torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                ):
                    problems.append(f"{shard}: {key} differs")
                count += 1
    return {"identical": not problems, "tensors": count, "problems": problems[:5]}


def run_child(path: str, src: Path, out: Path) -> dict:
    if path != "verify":
        shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", path, "--src", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}", "log": tail}


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--shard-gb", type=float, default=0.5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/model-release-bench"))
    parser.add_argument("--skip", action="append", default=[], choices=PATHS, help="path to leave out")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the fast paths (copy, stream); median reported")
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child == "build":
        build_checkpoint(args.out, args.size_gb, args.shard_gb)
        return
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.src, args.out)), flush=True)
        return

    src = args.workdir / f"src-{args.size_gb:g}gb-{args.shard_gb:g}"
    print(f"checkpoint: {src}", flush=True)
    # built in a child so this process stays small
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            "build",
            "--out",
            str(src),
            "--size-gb",
            str(args.size_gb),
            "--shard-gb",
            str(args.shard_gb),
        ],
        check=True,
    )
    shards = sorted(src.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in shards)
    largest = max(p.stat().st_size for p in shards)
    print(
        f"  {len(shards)} shards, {src_bytes / 1e6:.0f} MB of safetensors, largest shard {largest / 1e6:.0f} MB",
        flush=True,
    )

    results: dict[str, dict] = {}
    load = os.getloadavg()
    outs = {p: args.workdir / f"out-{p}" for p in PATHS}
    for path in PATHS:
        if path in args.skip:
            continue
        runs = []
        for _attempt in range(args.repeat if path in FAST_PATHS else 1):
            print(f"running {path} ...", flush=True)
            os.sync()  # start each path without the previous one's dirty pages still being written back
            runs.append(run_child(path, src, outs[path]))
            print(
                f"  {runs[-1]}"
                if "error" in runs[-1]
                else f"  {runs[-1]['seconds']:.2f}s, peak RSS {runs[-1]['rss_mb']:.0f} MiB",
                flush=True,
            )
            if "error" in runs[-1]:
                break
        if "error" in runs[-1]:
            results[path] = runs[-1]
        else:  # median time, worst peak RSS
            results[path] = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2] | {
                "rss_mb": max(r["rss_mb"] for r in runs),
                "runs": len(runs),
            }

    copy_s = results.get("copy", {}).get("seconds")
    rows = [
        (
            "path",
            "seconds",
            "MB/s read",
            "x copy",
            "peak RSS MiB",
            "RSS/largest shard",
            "RSS after imports MiB",
            "CPU s",
        )
    ]
    for path, r in results.items():
        if "error" in r:
            rows.append((path, "failed", "", "", "", "", "", r["error"][:60]))
            continue
        mbs = src_bytes / 1e6 / r["seconds"]
        ratio = f"{copy_s / r['seconds']:.2f}" if copy_s else "-"
        rows.append(
            (
                path + (f" (median of {r['runs']})" if r.get("runs", 1) > 1 else ""),
                f"{r['seconds']:.2f}",
                f"{mbs:.0f}",
                ratio,
                f"{r['rss_mb']:.0f}",
                f"{r['rss_mb'] * 2**20 / largest:.2f}",
                f"{r['base_rss_mb']:.0f}",
                f"{r['cpu_s']:.1f}",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print()
    print(
        f"FP8_DYNAMIC, {src_bytes / 1e9:.2f} GB BF16 in {len(shards)} shards (largest {largest / 1e6:.0f} MB), "
        f"{os.cpu_count()} CPUs (load average {load[0]:.1f} at start), page cache warm, sync before each run; "
        "CPU s = the child's user+sys time in the timed span"
    )
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))

    if (
        "stream" in results
        and "model_free" in results
        and "error" not in results["stream"]
        and "error" not in results["model_free"]
    ):
        v = run_child("verify", outs["model_free"], outs["stream"])
        if "error" in v:
            print(f"\nverification failed to run: {v['error']}")
        else:
            print(
                f"\nstream vs model_free_ptq: {'bit-identical' if v['identical'] else 'DIFFERENT'} "
                f"({v['tensors']} tensors, index and quantization_config compared)"
                f"{'' if v['identical'] else v['problems']}"
            )
    if "stream" in results and "error" not in results["stream"]:
        r = results["stream"]
        ok_speed = copy_s is not None and copy_s / r["seconds"] >= 0.5
        ok_rss = r["rss_mb"] * 2**20 <= 2 * largest
        print(
            f"target stream >= 0.5x copy throughput: {'met' if ok_speed else 'NOT met'}; "
            f"peak RSS <= 2x largest shard: {'met' if ok_rss else 'NOT met'}"
        )
    if not args.keep:
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
    from pipeline.core import measurements  # here, not at the top: the children's RSS after imports stays theirs

    record = measurements.record(
        "quantize",
        {
            "checkpoint": {"gb": src_bytes / 1e9, "shards": len(shards), "largest_shard_mb": largest / 1e6},
            "load_average_at_start": load[0],
            "paths": [
                {
                    "path": path,
                    **(
                        {"error": r["error"]}
                        if "error" in r
                        else {
                            "seconds": r["seconds"],
                            "mb_s_read": src_bytes / 1e6 / r["seconds"],
                            "x_copy": copy_s / r["seconds"] if copy_s else None,
                            "peak_rss_mib": r["rss_mb"],
                            "rss_per_largest_shard": r["rss_mb"] * 2**20 / largest,
                            "runs": r.get("runs", 1),
                        }
                    ),
                }
                for path, r in results.items()
            ],
        },
        summary=f"FP8_DYNAMIC on {src_bytes / 1e9:.2f} GB: "
        + ", ".join(
            f"{path} {copy_s / r['seconds']:.2f}x copy" for path, r in results.items() if "error" not in r and copy_s
        ),
    )
    print(f"record: {record}")


if __name__ == "__main__":
    main()
