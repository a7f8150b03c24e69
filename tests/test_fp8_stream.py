"""pipeline.stages.fp8_stream against a real llmcompressor.model_free_ptq run: same files, same tensors
(names, dtypes, shapes, bits), same index, same config.json, for FP8_DYNAMIC and FP8_BLOCK."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.core.errors import ArtifactError
from pipeline.stages import fp8_math, fp8_stream

IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK"]
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


# ---------------------------------------------------------------- fixtures


def make_checkpoint(path: Path, odd_columns: bool = False) -> Path:
    """A small Qwen3-MoE-layout BF16 checkpoint in two shards with an index.

    Rows that are not a multiple of 128 (k/v_proj 96, expert 192), an all-zero weight row, a
    fused 3-D expert layer (gate_up_proj / down_proj, which model_free_ptq splits per expert),
    norms, router gates, embeddings and lm_head. With odd_columns, a weight whose column count
    is not a multiple of 128 (fine per channel, refused for blocks).
    """
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    hidden, inter, experts = 256, 192, 4
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    shards[0]["model.embed_tokens.weight"] = rand(300, hidden)
    for layer in range(2):
        t, p = shards[layer], f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = rand(hidden)
        t[f"{p}.post_attention_layernorm.weight"] = rand(hidden)
        t[f"{p}.self_attn.q_proj.weight"] = rand(128, hidden)
        t[f"{p}.self_attn.k_proj.weight"] = rand(96, hidden)
        t[f"{p}.self_attn.v_proj.weight"] = rand(96, hidden)
        t[f"{p}.self_attn.o_proj.weight"] = rand(hidden, 128)
        t[f"{p}.self_attn.q_norm.weight"] = rand(32)
        t[f"{p}.self_attn.k_norm.weight"] = rand(32)
        t[f"{p}.mlp.gate.weight"] = rand(experts, hidden)
        if layer == 0:
            for e in range(experts):
                t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
                t[f"{p}.mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
                t[f"{p}.mlp.experts.{e}.down_proj.weight"] = rand(hidden, 128)
            t[f"{p}.mlp.experts.1.up_proj.weight"][7] = 0  # an all-zero row: scale falls back to eps
            t[f"{p}.mlp.experts.2.gate_proj.weight"][:, 5] *= 1000  # outliers
        else:
            t[f"{p}.mlp.experts.gate_up_proj"] = rand(experts, 2 * inter, hidden)
            t[f"{p}.mlp.experts.down_proj"] = rand(experts, hidden, 128)
        if odd_columns:
            t[f"{p}.mlp.shared_expert.down_proj.weight"] = rand(hidden, 200)
    shards[1]["model.norm.weight"] = rand(hidden)
    shards[1]["lm_head.weight"] = rand(300, hidden)
    weight_map = {}
    for name, tensors in zip(SHARDS, shards, strict=True):
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.nbytes for s in shards for t in s.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "manifest.json").write_text('{"kind": "model", "files": []}')
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_stream")
    return {"FP8_DYNAMIC": make_checkpoint(root / "odd", odd_columns=True), "FP8_BLOCK": make_checkpoint(root / "even")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """model_free_ptq output for (checkpoint, scheme), computed once per module."""
    from llmcompressor import model_free_ptq

    root = tmp_path_factory.mktemp("model_free_ptq")
    done: dict[tuple[Path, str], Path] = {}

    def get(src: Path, scheme: str) -> Path:
        key = (src, scheme)
        if key not in done:
            out = root / f"{len(done)}-{scheme}"
            model_free_ptq(src, out, scheme=scheme, ignore=IGNORE, max_workers=1, device="cpu")
            done[key] = out
        return done[key]

    return get


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_checkpoint(src: Path, ref: Path, mine: Path) -> int:
    """Everything model_free_ptq wrote, written the same (except manifest.json, never copied)."""
    ref_files = sorted(p.name for p in ref.iterdir() if p.name != "manifest.json")
    assert sorted(p.name for p in mine.iterdir()) == ref_files
    assert not (mine / "manifest.json").exists()
    assert json.loads((mine / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    index = json.loads((mine / "model.safetensors.index.json").read_text())
    assert index == json.loads((ref / "model.safetensors.index.json").read_text())
    for name in ref_files:
        if not name.endswith(".safetensors") and name not in ("config.json", "model.safetensors.index.json"):
            assert (mine / name).read_bytes() == (src / name).read_bytes(), name
    count = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(ref / shard, "pt") as a, safe_open(mine / shard, "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys()), shard
            for key in a.keys():
                x, y = a.get_tensor(key), b.get_tensor(key)
                assert (x.dtype, x.shape) == (y.dtype, y.shape), key
                assert torch.equal(fp8_bits(x), fp8_bits(y)), key
                count += 1
    return count


# ---------------------------------------------------------------- equality with model_free_ptq


@pytest.mark.parametrize("scheme", SCHEMES)
def test_synthetic_checkpoint_matches_model_free_ptq(synthetic, reference, tmp_path, scheme):
    src = synthetic[scheme]
    ref = reference(src, scheme)
    out = tmp_path / "out"
    out.mkdir()
    calls: list[tuple[str, int, int]] = []
    figures = fp8_stream.convert(src, out, scheme, IGNORE, max_workers=2, progress=lambda *a: calls.append(a))

    count = assert_same_checkpoint(src, ref, out)
    assert count == figures["tensors_quantized"] * 2 + figures["tensors_copied"]
    assert figures["tensors_quantized"] == (34 if scheme == "FP8_DYNAMIC" else 32)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized" and config["ignore"] == IGNORE
    with safe_open(out / SHARDS[0], "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.1.up_proj.weight").view(torch.uint8)[7].eq(0).all()
        scale = f.get_tensor("model.layers.0.mlp.experts.1.up_proj.weight_scale")
        if scheme == "FP8_DYNAMIC":
            assert scale.shape == (192, 1) and scale[7].item() == torch.finfo(torch.bfloat16).eps
        else:
            assert scale.shape == (2, 2)  # 192 rows -> 2 padded row blocks
    assert figures["bytes_read"] == sum((src / s).stat().st_size for s in SHARDS)
    assert figures["bytes_written"] == sum((out / s).stat().st_size for s in SHARDS)
    for shard in SHARDS:  # progress: per shard, monotonic, ending at the shard's size
        seen = [c for c in calls if c[0] == shard]
        assert seen and [c[1] for c in seen] == sorted(c[1] for c in seen)
        assert seen[-1][1] == seen[-1][2] == (src / shard).stat().st_size


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tiny_model_matches_model_free_ptq(tiny_model_dir, reference, tmp_path, scheme):
    ref = reference(tiny_model_dir, scheme)
    out = tmp_path / "out"
    out.mkdir()
    fp8_stream.convert(tiny_model_dir, out, scheme, IGNORE)
    assert assert_same_checkpoint(tiny_model_dir, ref, out) > 0
    assert (out / "model.safetensors.index.json").exists()  # written for a single-file model too


def reference_module(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight through llmcompressor's own per-module path (what model_free_ptq runs)."""
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free.lifecycle import calibrate_weight, initialize_quantized_linear

    module = initialize_quantized_linear(w, preset_name_to_scheme(scheme, ["Linear"]), "cpu")
    calibrate_weight(module)
    compress_module(module)
    state = module.state_dict()
    return state["weight"].contiguous(), state["weight_scale"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 256), (100, 192), (1, 128)])
def test_arithmetic_matches_llmcompressor_per_module(dtype, shape):
    """Edge values too: zero rows, wide dynamic range, subnormals, +-0, NaN and inf (exact path),
    columns that are not a multiple of the block width."""
    gen = torch.Generator().manual_seed(shape[0])
    cases = []
    w = torch.randn(*shape, generator=gen) * torch.logspace(-8, 3, shape[1])
    w[0] = 0
    cases.append(w)
    w = torch.randn(*shape, generator=gen) * 1e-6
    if shape[0] > 6:
        w[2, :4] = torch.tensor([448.0, -1e4, 1e-40, -0.0])
        w[3, 1], w[4, 0], w[5, 2] = float("nan"), float("inf"), -float("inf")
    cases.append(w)
    scratch = fp8_math.Scratch()
    for w in cases:
        w = w.to(dtype)
        for scheme, ours in (
            ("FP8_DYNAMIC", lambda x: fp8_math.quantize_channel(x, scratch)),
            ("FP8_BLOCK", lambda x: fp8_math.quantize_block(x, (128, 128), scratch)),
        ):
            ref_q, ref_s = reference_module(w.clone(), scheme)
            q, s = ours(w)
            assert (q.dtype, q.shape, s.dtype, s.shape) == (ref_q.dtype, ref_q.shape, ref_s.dtype, ref_s.shape)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), scheme
            assert torch.equal(s.view(torch.uint8), ref_s.view(torch.uint8)), scheme


# ---------------------------------------------------------------- failures


def test_truncated_shard_is_named_and_nothing_is_written(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["FP8_BLOCK"], src)
    shard = src / SHARDS[1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ArtifactError, match=SHARDS[1]) as info:
        fp8_stream.convert(src, out, "FP8_BLOCK", IGNORE)
    assert "truncated" in str(info.value) and "\n" not in str(info.value)
    assert list(out.iterdir()) == []


def test_block_scheme_refuses_columns_not_a_multiple_of_128(synthetic, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ArtifactError, match=r"model-00001-of-00002\.safetensors.*shared_expert\.down_proj"):
        fp8_stream.convert(synthetic["FP8_DYNAMIC"], out, "FP8_BLOCK", IGNORE)
    assert list(out.iterdir()) == []
    # ignoring the module is the fix
    fp8_stream.convert(synthetic["FP8_DYNAMIC"], out, "FP8_BLOCK", IGNORE + ["re:.*shared_expert.down_proj$"])


def test_interrupted_conversion_leaves_no_shard_under_its_final_name_and_can_be_rerun(
    synthetic, reference, tmp_path, monkeypatch
):
    src = synthetic["FP8_DYNAMIC"]
    out = tmp_path / "out"
    out.mkdir()
    real = fp8_math.quantize_channel
    calls = {"n": 0}

    def failing(w, scratch=None):
        calls["n"] += 1
        if calls["n"] == 3:  # the first shard quantizes 17 weights: fail in its middle
            raise RuntimeError("disk on fire")
        return real(w, scratch)

    monkeypatch.setattr(fp8_stream, "quantize_channel", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        fp8_stream.convert(src, out, "FP8_DYNAMIC", IGNORE, max_workers=2)
    assert not any(p.name.endswith(".safetensors") or p.name.endswith(".partial") for p in out.iterdir())
    assert not (out / "model.safetensors.index.json").exists()

    monkeypatch.setattr(fp8_stream, "quantize_channel", real)
    (out / SHARDS[0]).with_name(SHARDS[0] + ".partial").write_bytes(b"left over by a killed run")
    fp8_stream.convert(src, out, "FP8_DYNAMIC", IGNORE)
    assert_same_checkpoint(src, reference(src, "FP8_DYNAMIC"), out)


def test_output_directory_must_exist_and_hold_only_our_files(synthetic, tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        fp8_stream.convert(synthetic["FP8_BLOCK"], tmp_path / "missing", "FP8_BLOCK", IGNORE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="notes.txt"):
        fp8_stream.convert(synthetic["FP8_BLOCK"], out, "FP8_BLOCK", IGNORE)


def test_copy_falls_back_to_read_write_without_copy_file_range(synthetic, reference, tmp_path, monkeypatch):
    import errno

    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(fp8_stream.os, "copy_file_range", unsupported, raising=False)
    src = synthetic["FP8_BLOCK"]
    out = tmp_path / "out"
    out.mkdir()
    figures = fp8_stream.convert(src, out, "FP8_BLOCK", IGNORE, max_workers=1)
    assert figures["tensors_copied"] > 0
    assert_same_checkpoint(src, reference(src, "FP8_BLOCK"), out)
