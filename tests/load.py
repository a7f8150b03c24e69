"""A steady client for the live endpoint: Poisson arrivals at a fixed rate, every answer counted.

What a rollout must not disturb: it runs in threads for as long as a test needs, and says how
many requests it sent, how many failed, and why."""

from __future__ import annotations

import json
import random
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor


class LoadClient:
    def __init__(self, url: str, rate: float, max_tokens: int = 16, prompt_repeats: int = 8, seed: int = 0):
        # a prompt is `prompt_repeats` sums of two 2-digit numbers: 6 tokens each (byte-level tokenizer)
        self.url, self.rate, self.max_tokens, self.prompt_repeats = url, rate, max_tokens, prompt_repeats
        self.random = random.Random(seed)
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=256)
        self.thread = threading.Thread(target=self._send, daemon=True)

    def __enter__(self) -> LoadClient:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()
        self.pool.shutdown(wait=True)

    def _send(self) -> None:
        while not self.stopping.wait(self.random.expovariate(self.rate)):
            a, b = self.random.randrange(10, 99), self.random.randrange(10, 99)
            self.pool.submit(self._one, f"{a}+{b}=" * self.prompt_repeats)
            with self.lock:
                self.sent += 1

    def _one(self, prompt: str, max_tokens: int | None = None) -> None:
        """One request of `max_tokens` (the client's own by default), counted."""
        max_tokens = max_tokens or self.max_tokens
        body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.loads(response.read())
            # every token asked for (ignore_eos); the text itself may decode to "" (special tokens)
            produced = answer["usage"]["completion_tokens"]
            ok = len(answer["choices"]) == 1 and produced == max_tokens
            error = "" if ok else f"{produced} of {max_tokens} tokens"
        except Exception as exc:  # noqa: BLE001 - every kind of failure is what is being counted
            ok, error = False, f"{type(exc).__name__}: {exc}"
        with self.lock:
            if ok:
                self.ok += 1
            else:
                self.errors.append(error)
