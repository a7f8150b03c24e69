"""Seconds per training step of the tiny model, per transformers experts implementation, in one run.

    .venv/bin/python benchmarks/tiny_training.py [--steps 40] [--rounds 2]

The tiny model's build (most of a fresh clone's first model test) is its training loop. The
implementations take turns (A B A B ...) on the same batches after a warm-up each, so a machine
that gets busier in the middle hurts both alike; prints each one's mean seconds per step and the
ratio against the one the build uses (TinyConfig.experts_implementation).
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    parser.add_argument("--impl", nargs="+", default=["grouped_mm", "eager"])
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
    steps = {impl: trainer(impl, cfg) for impl in args.impl}
    for step in steps.values():  # warm-up: allocator, thread pool
        for ids, labels in batches[:5]:
            step(ids, labels)
    seconds: dict[str, list[float]] = {impl: [] for impl in args.impl}
    for round_ in range(args.rounds):
        for impl, step in steps.items():
            started = time.perf_counter()
            for ids, labels in batches:
                step(ids, labels)
            seconds[impl].append((time.perf_counter() - started) / len(batches))
            print(f"round {round_ + 1}: {impl:<11} {seconds[impl][-1]:.3f} s/step", flush=True)
    used = cfg.experts_implementation
    reference = statistics.mean(seconds[used])
    print(f"\n{'experts impl':<13} {'s/step':>7} {'x ' + used:>10}")
    for impl, values in seconds.items():
        mean = statistics.mean(values)
        print(f"{impl:<13} {mean:7.3f} {mean / reference:10.2f}")
    print(
        f"\nthe build's {cfg.steps} steps: "
        + ", ".join(f"{impl} ~{statistics.mean(v) * cfg.steps:.0f} s" for impl, v in seconds.items())
    )


if __name__ == "__main__":
    main()
