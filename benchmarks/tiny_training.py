"""Seconds per training step of the tiny model, per experts implementation and thread count, in one run.

    .venv/bin/python benchmarks/tiny_training.py [--steps 40] [--rounds 2] [--configs grouped_mm:2 eager:2]
    .venv/bin/python benchmarks/tiny_training.py --configs eager:2 eager:1 --busy

The tiny model's build (most of a fresh clone's first model test) is its training loop. The
configurations (transformers experts implementation : torch threads) take turns (A B A B ...)
on the same batches after a warm-up each, so a machine that gets busier in the middle hurts all
alike; prints each one's mean seconds per step and the ratio against the first. `--busy` keeps
one other process spinning on a core throughout, as the test suite's first tests do beside the
background build.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

import torch
from transformers import Qwen3MoeForCausalLM

from pipeline.stages import tiny_model as tm


def trainer(impl: str, cfg: tm.TinyConfig):
    torch.manual_seed(cfg.seed)
    tokenizer = tm.build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(tm.EOS)
    config = tm.hf_config(cfg, tm._pad_vocab(len(tokenizer)))
    config.pad_token_id = eos
    config._experts_implementation = impl
    model = Qwen3MoeForCausalLM(config).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def step(input_ids, labels) -> None:
        result = model(input_ids=input_ids, labels=labels, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        result.loss.backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["grouped_mm:2", "eager:2"], help="impl:threads")
    parser.add_argument("--busy", action="store_true", help="one other process spinning on a core throughout")
    args = parser.parse_args()
    cfg = tm.TinyConfig()
    tokenizer = tm.build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(tm.EOS)
    rng = random.Random(0)
    batches = []
    for _ in range(args.steps):
        chat = rng.random() < cfg.chat_fraction
        rows = [tm._training_example(rng, set(), chat, cfg.add_fraction) for _ in range(cfg.batch_size)]
        batches.append(tm._encode_batch(tokenizer, rows, eos))
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs]
    steps = {c: trainer(c[0], cfg) for c in configs}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        for (_impl, threads), step in steps.items():  # warm-up: allocator, thread pool
            torch.set_num_threads(threads)
            for ids, labels in batches[:5]:
                step(ids, labels)
        seconds: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        for round_ in range(args.rounds):
            for (impl, threads), step in steps.items():
                torch.set_num_threads(threads)
                started = time.perf_counter()
                for ids, labels in batches:
                    step(ids, labels)
                seconds[(impl, threads)].append((time.perf_counter() - started) / len(batches))
                print(f"round {round_ + 1}: {impl}:{threads} {seconds[(impl, threads)][-1]:.3f} s/step", flush=True)
    finally:
        if busy:
            busy.kill()
    reference = statistics.mean(seconds[configs[0]])
    print(f"\n{'impl:threads':<14} {'s/step':>7} {'x first':>8}" + ("   (beside a busy process)" if busy else ""))
    for (impl, threads), values in seconds.items():
        mean = statistics.mean(values)
        print(f"{impl + ':' + str(threads):<14} {mean:7.3f} {mean / reference:8.2f}")
    print(
        f"\nthe build's {cfg.steps} steps: "
        + ", ".join(f"{i}:{t} ~{statistics.mean(v) * cfg.steps:.0f} s" for (i, t), v in seconds.items())
    )


if __name__ == "__main__":
    main()
