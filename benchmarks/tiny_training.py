"""Seconds per training step of the tiny model, per experts implementation and thread count, in one run.

    .venv/bin/python benchmarks/tiny_training.py [--steps 40] [--rounds 2] [--configs grouped_mm:2 eager:2]
    .venv/bin/python benchmarks/tiny_training.py --configs eager:2 eager:1 --busy
    .venv/bin/python benchmarks/tiny_training.py --configs eager:1:96 eager:1:64 --busy

The tiny model's build (most of a fresh clone's first model test) is its training loop. The
configurations (transformers experts implementation : torch threads [: batch size, default the
build's]) take turns (A B A B ...) on the same batches (a smaller batch: the first rows of each)
after a warm-up each, so a machine that gets busier in the middle hurts all
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

from pipeline.core import measurements
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
    parser.add_argument("--configs", nargs="+", default=["grouped_mm:2", "eager:2"], help="impl:threads[:batch]")
    parser.add_argument("--busy", action="store_true", help="one other process spinning on a core throughout")
    args = parser.parse_args()
    cfg = tm.TinyConfig()
    tokenizer = tm.build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(tm.EOS)
    rng = random.Random(0)
    configs = [_config(c, cfg.batch_size) for c in args.configs]
    widest = max(b for _, _, b in configs)
    rows_per_step = []
    for _ in range(args.steps):
        chat = rng.random() < cfg.chat_fraction
        rows_per_step.append([tm._training_example(rng, set(), chat, cfg.add_fraction) for _ in range(widest)])
    batches = {b: [tm._encode_batch(tokenizer, rows[:b], eos) for rows in rows_per_step] for _, _, b in configs}
    steps = {c: trainer(c[0], cfg) for c in configs}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        for (_impl, threads, batch), step in steps.items():  # warm-up: allocator, thread pool
            torch.set_num_threads(threads)
            for ids, labels in batches[batch][:5]:
                step(ids, labels)
        seconds: dict[tuple[str, int, int], list[float]] = {c: [] for c in configs}
        for round_ in range(args.rounds):
            for c, step in steps.items():
                torch.set_num_threads(c[1])
                started = time.perf_counter()
                for ids, labels in batches[c[2]]:
                    step(ids, labels)
                seconds[c].append((time.perf_counter() - started) / args.steps)
                print(f"round {round_ + 1}: {_name(c)} {seconds[c][-1]:.3f} s/step", flush=True)
    finally:
        if busy:
            busy.kill()
    reference = statistics.mean(seconds[configs[0]])
    print(f"\n{'impl:threads:batch':<20} {'s/step':>7} {'x first':>8}" + ("   (beside a busy process)" if busy else ""))
    for c, values in seconds.items():
        mean = statistics.mean(values)
        print(f"{_name(c):<20} {mean:7.3f} {mean / reference:8.2f}")
    print(
        f"\nthe build's {cfg.steps} steps: "
        + ", ".join(f"{_name(c)} ~{statistics.mean(v) * cfg.steps:.0f} s" for c, v in seconds.items())
    )
    path = measurements.record(
        "tiny_training",
        {
            "busy": args.busy,
            "steps_per_round": args.steps,
            "configs": [
                {
                    "impl:threads:batch": _name(c),
                    "s_per_step": statistics.mean(v),
                    "x_first": statistics.mean(v) / reference,
                    "build_s": statistics.mean(v) * cfg.steps,
                }
                for c, v in seconds.items()
            ],
        },
        summary=", ".join(f"{_name(c)} {statistics.mean(v):.3f} s/step" for c, v in seconds.items())
        + (" (beside a busy process)" if args.busy else ""),
    )
    print(f"record: {path}")


def _config(text: str, default_batch: int) -> tuple[str, int, int]:
    impl, threads, *batch = text.split(":")
    return impl, int(threads), int(batch[0]) if batch else default_batch


def _name(config: tuple[str, int, int]) -> str:
    return ":".join(map(str, config))


if __name__ == "__main__":
    main()
