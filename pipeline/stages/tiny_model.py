"""A tiny Qwen3-MoE that knows something, built offline on a CPU in about ten minutes, and shipped.

It has the production model's architecture family (Qwen3MoeForCausalLM: many experts, top-k
routing, router gates, GQA attention) at toy widths, a byte-level BPE tokenizer built with
the `tokenizers` library and a Qwen-style chat template, and it is trained briefly on two
synthetic tasks (2-digit addition and copying a word). A trained model makes the accuracy
gate meaningful: an FP8 candidate that is broken scores visibly lower than its baseline.

The held-out evaluation items ship in `configs/eval/` and are excluded from training.

The build is deterministic on one CPU, not across CPUs: torch picks other vectorised kernels per
instruction set (AVX2, AVX512), so float sums round differently and the bytes differ. So one build,
the reference, ships in `configs/models/tiny-qwen3-moe/` with its content hash: the suite, the demo
and `builtin://tiny-qwen3-moe` load those bytes on every machine, and everything measured on a build
(the spec's expert imbalance, the accuracy bars) is measured on them. The builder stays the way to
make it; `benchmarks/tiny_build_repeat.py` says how far a rebuild on the machine at hand is from it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import random
import string
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.core import artifacts
from pipeline.core.paths import CONFIGS_DIR, models_dir

log = logging.getLogger(__name__)

BUILDER_VERSION = "1"
EVAL_DIR = CONFIGS_DIR / "eval"
EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORD_LETTERS = string.ascii_lowercase


REFERENCE_DIR = CONFIGS_DIR / "models" / "tiny-qwen3-moe"


class ReferenceBuild(BaseModel):
    """What the shipped bytes are and what made them: re-commit them only when the builder changes."""

    content_hash: str = Field(description="the manifest's hash of paths, sizes and sha256s of the shipped files")
    builder_version: str = Field(description="BUILDER_VERSION of the builder that made them")
    built_with: dict[str, str] = Field(description="package -> version that decides the bytes (the main lock's pins)")
    built_on: str = Field(description="the CPU that trained it (the bytes depend on its instruction set)")


REFERENCE = ReferenceBuild(
    content_hash="94db1d994435e444884710afec8808112d8b64173b1f75648ff8423de3e3b99d",
    builder_version="1",
    built_with={"torch": "2.13.0+cpu", "transformers": "5.17.0", "tokenizers": "0.23.3", "safetensors": "0.8.0"},
    built_on="AMD EPYC, 2 cores, AVX2 without AVX512 (make test on a fresh clone of 1b3a689)",
)


def reference() -> Path:
    """The shipped tiny model, verified in full (7 MB: milliseconds) against the reference hash."""
    manifest = artifacts.verify(REFERENCE_DIR)
    if manifest.content_hash() != REFERENCE.content_hash:
        raise artifacts.ArtifactError(
            f"{REFERENCE_DIR}/{artifacts.MANIFEST}: content hash {manifest.content_hash()[:16]}... is not the "
            f"reference build's {REFERENCE.content_hash[:16]}... (tiny_model.REFERENCE); "
            f"`git checkout -- {REFERENCE_DIR}` restores it"
        )
    return REFERENCE_DIR


class TinyConfig(BaseModel):
    """Everything that determines the model's bytes on one CPU; its hash names the cache directory.
    The defaults are the reference build's config."""

    # seed 1 with batch 64: held-out add / copy 1.000 / 1.000 (seed 0 with batch 64: an earlier
    # 3-digit task at chance, 0.275, where seed 1 scored 0.61)
    seed: int = 1
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    steps: int = 1600  # (batch 96) 1100 gave 0.98 once and 0.765 in another run: too close to the phase change
    # 0.68x the seconds per step of batch 96 beside a busy core (benchmarks/tiny_training.py
    # --configs eager:1:96 eager:1:64 --busy: 0.234 vs 0.343 s), the same held-out accuracy
    batch_size: int = 64
    lr: float = 3e-3
    chat_fraction: float = 0.25
    add_fraction: float = 0.7  # addition needs more steps than copying
    eval_items: int = 200
    # transformers' default grouped_mm path is 25% slower per training step on CPU here
    # (0.30 vs 0.23 s measured); inference keeps the default
    experts_implementation: str = "eager"
    # fixed, so the same inputs give the same bytes on the same machine (builds compare by content
    # hash): floating-point sums split over another number of threads round differently, and the
    # suite's old hand-over from one thread to all, at whatever step its signal came, gave builds
    # that differed (a held-out task at 0.61 and 0.635 from one config). One thread keeps its pace beside
    # busy tests; a fresh clone's build runs while the engine venv installs.
    train_threads: int = 1


# ---------------------------------------------------------------- tokenizer


def build_tokenizer():
    """Byte-level BPE with no merges (every byte one token) plus Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out: Path) -> None:
    """Save, then name the class every transformers (4.x and 5.x) and vLLM can load.

    transformers 5 writes `tokenizer_class: TokenizersBackend`, a name 4.x does not know;
    `PreTrainedTokenizerFast` is understood by both and loads the same tokenizer.json.
    """
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").unlink(missing_ok=True)


# ---------------------------------------------------------------- tasks and data


def add_item(a: int, b: int) -> dict[str, Any]:
    return {"question": f"{a}+{b}=", "answer": str(a + b)}


def copy_item(word: str) -> dict[str, Any]:
    return {"question": f"copy {word}=", "answer": word}


def eval_items(seed: int = 1234, n: int = 200) -> dict[str, list[dict[str, Any]]]:
    """The held-out evaluation sets, deterministic from `seed` (these ship in configs/eval)."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100) for b in range(100)], n)
    add = [add_item(a, b) for a, b in pairs]
    words: list[str] = []
    while len(words) < n:
        word = "".join(rng.choice(WORD_LETTERS) for _ in range(rng.randint(3, 6)))
        if word not in words:
            words.append(word)
    copy = [copy_item(w) for w in words]
    mc = []
    for a, b in pairs:
        right = a + b
        wrong = sorted({right + d for d in (-10, -1, 1, 10) if right + d >= 0} - {right})[:3]
        choices = [str(c) for c in wrong] + [str(right)]
        rng.shuffle(choices)
        mc.append({"question": f"{a}+{b}=", "choices": choices, "label": choices.index(str(right))})
    return {"tiny_add": add, "tiny_copy": copy, "tiny_add_mc": mc, SPAN_TASK: span_items(rng, set(pairs))}


SPAN_TASK = "tiny_add_span_mc"
SPAN_ITEMS = 1200


def span_items(rng: random.Random, taken: set[tuple[int, int]], n: int = SPAN_ITEMS) -> list[dict[str, Any]]:
    """The off-ceiling task: additions across operand widths, the sum and its neighbours (-1, +1, +2)
    as choices, so the last digit tells them apart. Half within training's range (two numbers below
    100: pairs training draws from too, all but tiny_add's held-out ones), half beyond it (a 3-digit
    first operand, held out in kind). The tiny model knows the first half (~1.0) and guesses the
    second (~0.25-0.35: it learned no 3-digit sums), so it scores ~0.6-0.7, off the ceiling and chance
    alike, the same way in every build (0.662: 0.995 and 0.328 by half). Holding the first half out
    of training too changed the training stream enough that one build learned copying to 0.655 only.
    1200 items: a 10% relative loss is over 3 combined standard errors (SE ~0.014 a side at 0.66) and
    fails the gate (min_recovery 0.95); the items are in random order, so the first N that the served
    check scores are mixed too."""
    inside = rng.sample(sorted({(a, b) for a in range(100) for b in range(100)} - taken), n // 2)
    beyond = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], n - n // 2)
    items = []
    for a, b in inside + beyond:
        right = a + b
        choices = [str(right + d) for d in (-1, 0, 1, 2)]
        rng.shuffle(choices)
        items.append({"question": f"{a}+{b}=", "choices": choices, "label": choices.index(str(right))})
    rng.shuffle(items)
    return items


def write_eval_data(out: Path = EVAL_DIR) -> None:
    """(Re)write the shipped JSONL files; tests check the committed ones match."""
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in eval_items().items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def load_eval(name: str, eval_dir: Path = EVAL_DIR) -> list[dict[str, Any]]:
    path = eval_dir / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _training_example(rng: random.Random, held_out: set[str], chat: bool, add_fraction: float = 0.7) -> tuple[str, str]:
    while True:
        if rng.random() < add_fraction:
            item = add_item(rng.randrange(100), rng.randrange(100))
        else:
            item = copy_item("".join(rng.choice(WORD_LETTERS) for _ in range(rng.randint(2, 7))))
        if item["question"] not in held_out:
            break
    if chat:
        prompt = f"{IM_START}user\n{item['question']}{IM_END}\n{IM_START}assistant\n"
        return prompt, item["answer"] + IM_END
    return item["question"], item["answer"] + EOS


# ---------------------------------------------------------------- model


def hf_config(cfg: TinyConfig, vocab_size: int):
    from transformers import Qwen3MoeConfig

    # head_dim, rope_theta and torch_dtype reach PretrainedConfig through **kwargs, which its types omit
    settings: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size * 2,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        torch_dtype="bfloat16",
    )
    return Qwen3MoeConfig(**settings)


def _pad_vocab(n: int, multiple: int = 64) -> int:
    return int(math.ceil(n / multiple) * multiple)


def train(cfg: TinyConfig, out: Path) -> dict[str, Any]:
    """Build, train and save the model and tokenizer into `out`; return training figures. The same
    `cfg` gives the same bytes on the same machine (its thread count fixed, deterministic kernels);
    the process's own settings are restored after."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.train_threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(cfg, out)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(cfg: TinyConfig, out: Path) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = hf_config(cfg, _pad_vocab(len(tokenizer)))
    config.eos_token_id = [eos_id, im_end_id]
    config.pad_token_id = eos_id
    config._experts_implementation = cfg.experts_implementation
    model = Qwen3MoeForCausalLM(config).float()
    model.train()
    held_out = {row["question"] for name in ("tiny_add", "tiny_copy") for row in load_eval(name)}

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps)))
    )
    start = time.monotonic()
    losses: list[float] = []
    for step in range(cfg.steps):
        # Whole batches are chat-formatted or plain: mixing them pads every row to chat length.
        chat = rng.random() < cfg.chat_fraction
        batch = [_training_example(rng, held_out, chat, cfg.add_fraction) for _ in range(cfg.batch_size)]
        input_ids, labels = _encode_batch(tokenizer, batch, eos_id)
        config.output_router_logits = True
        result = model(input_ids=input_ids, labels=labels, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(result.loss.detach()))
        if (step + 1) % 100 == 0 or step == 0:
            elapsed = time.monotonic() - start
            log.info(
                "tiny model: step %d/%d loss %.3f (%.1f steps/s, %.0f s left)",
                step + 1,
                cfg.steps,
                sum(losses[-100:]) / len(losses[-100:]),
                (step + 1) / elapsed,
                (cfg.steps - step - 1) * elapsed / (step + 1),
            )
    config.output_router_logits = False
    model.eval()
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    GenerationConfig(eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id, do_sample=False).save_pretrained(out)
    return {"train_seconds": round(time.monotonic() - start, 1), "final_loss": round(sum(losses[-100:]) / 100, 4)}


def _encode_batch(tokenizer, batch: list[tuple[str, str]], pad_id: int):
    """Right-padded ids with labels only on answer tokens (the prompt is not something to learn)."""
    import torch

    rows = []
    for prompt, answer in batch:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        a = tokenizer.encode(answer, add_special_tokens=False)
        rows.append((p + a, [-100] * len(p) + a))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (seq, lab) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, labels


# ---------------------------------------------------------------- accuracy


def greedy_accuracy(model_dir: Path, task: str = "tiny_add", limit: int | None = None, batch_size: int = 50) -> float:
    """Exact-match accuracy of greedy answers on a shipped generation task (transformers, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    # from_pretrained is typed as the base class; generate() lives on the class it returns
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    rows = load_eval(task)[:limit]
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        enc = tokenizer([r["question"] for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(ans.strip() == r["answer"] for ans, r in zip(answers, chunk, strict=True))
    return correct / len(rows)


# ---------------------------------------------------------------- build + cache


def cache_dir(cfg: TinyConfig) -> Path:
    import hashlib

    key = hashlib.sha256(f"{BUILDER_VERSION}:{cfg.model_dump_json()}".encode()).hexdigest()[:12]
    return models_dir() / f"tiny-qwen3-moe-{key}"


def build(out: Path | None = None, cfg: TinyConfig | None = None) -> Path:
    """Return a finished tiny model directory, building it (atomically) if it is not cached.

    Builders of the same directory take turns on a lock file beside it, so a second caller (two
    DAG runs, the demo beside the tests) waits for the first build and reuses it instead of
    training the same bytes again.
    """
    cfg = cfg or TinyConfig()
    final = Path(out) if out else cache_dir(cfg)
    if artifacts.is_complete(final):
        return _cached(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("tiny model: another process is building %s; waiting for it", final)
            started = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            log.info("tiny model: waited %.0f s for the other build", time.monotonic() - started)
        if artifacts.is_complete(final):
            return _cached(final)
        if final.exists():
            raise artifacts.ArtifactError(f"{final}: exists but has no manifest; remove it or choose another --out")
        _train_and_publish(final, cfg)
    return final


def _cached(final: Path) -> Path:
    artifacts.verify(final, deep=False)
    log.info("tiny model: cached at %s", final)
    return final


def _train_and_publish(final: Path, cfg: TinyConfig) -> None:
    artifacts.remove_stale_temps(final.parent)
    with artifacts.publishing(final) as tmp:
        figures = train(cfg, tmp)
        accuracy = {task: greedy_accuracy(tmp, task) for task in ("tiny_add", "tiny_copy")}
        log.info("tiny model: held-out accuracy %s", accuracy)
        artifacts.write_manifest(
            tmp,
            kind="model",
            meta={
                "builder": f"tiny-qwen3-moe v{BUILDER_VERSION}",
                "config": cfg.model_dump(),
                **figures,
                "accuracy": accuracy,
            },
        )
