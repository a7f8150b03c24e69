"""An independent load client: open-loop Poisson arrivals, streaming completions, nothing from pipeline/.

Why: the release's SLO search measures through vLLM's bench client, so a figure it finds could be
that client's as much as the engine's (#44). This script is the second opinion `benchmarks/fidelity.py`
runs beside it, on the same core: a plain aiohttp client small enough to read in one sitting.

    .venv/bin/python benchmarks/open_loop_client.py --url http://127.0.0.1:8000 --rate 300 --seconds 20 \
        --input-len 64 --output-len 16 --vocab-size 4096 --out result.json

Each request is a random prompt of `--input-len` token ids (so no tokenizer is needed and no prefix
is shared), `max_tokens=--output-len` with `ignore_eos`, streamed. Arrivals follow a Poisson schedule
fixed before the first send (exponential gaps from `--seed`, scaled so the last is due n / rate after
the start, as vLLM's client scales its own); every request is sent by its own task at its due time,
whatever the server does (open loop). Per request it records the send lag against that schedule,
TTFT (send to the first token's chunk), the end-to-end latency and the tokens streamed; TPOT is
(latency - TTFT) / (tokens - 1). The result is one JSON object with vLLM's `--save-detailed` key
names (duration, completed, failed, request_throughput, p50/p90/p99 TTFT and TPOT ms, ttfts,
latencies, output_lens (the server's usage count), start_times, queue_times = the send lags) plus the
client's own CPU seconds (`client_cpu_s`, the send/receive phase only), so either client's output
reads the same way.

`--burn-ms` spends that much CPU in the client's event loop on every streamed chunk: a client made
heavy on purpose, to check that its lag shows it (tests/test_measurement.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

import aiohttp


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics (numpy's default); nan for none."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def schedule(rate: float, n: int, seed: int) -> list[float]:
    """Due times (s from the start) of n Poisson arrivals at `rate`, scaled to end at n / rate."""
    rng = random.Random(seed)
    due, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        due.append(t)
    scale = n / rate / due[-1]
    return [d * scale for d in due]


def burn(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def one(session: aiohttp.ClientSession, url: str, body: dict, due: float, burn_ms: float, out: dict) -> None:
    """Send one request at its due time (perf_counter) and stream its answer into `out`."""
    start = time.perf_counter()
    out.update(start_time=start, queue_time=max(0.0, start - due), ttft=None, latency=None, tokens=0, error="")
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                out["error"] = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            buffer, usage_tokens = b"", 0
            async for chunk in response.content.iter_any():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        event_data = json.loads(data)
                        choices = event_data.get("choices") or []
                        # the first chunk with a choice is the first token, text or not: a byte-level
                        # tokenizer's token that ends inside a UTF-8 character streams as "" (waiting for
                        # text instead counted 1% of requests as failed and their TTFT late); vLLM's own
                        # client counts the same way
                        if choices:
                            now = time.perf_counter()
                            if out["ttft"] is None:
                                out["ttft"] = now - start
                            out["tokens"] += 1
                        if (event_data.get("usage") or {}).get("completion_tokens"):
                            usage_tokens = int(event_data["usage"]["completion_tokens"])
                if burn_ms:
                    burn(burn_ms)
            if out["ttft"] is None:
                out["error"] = "no token streamed"
            else:
                out["latency"] = time.perf_counter() - start
                out["tokens"] = usage_tokens or out["tokens"]  # the server's count where it gives one
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]


async def run(args: argparse.Namespace) -> dict:
    n = max(1, math.ceil(args.rate * args.seconds))
    rng = random.Random(args.seed)
    bodies = [
        {
            "model": args.model,
            "prompt": [rng.randrange(args.vocab_size) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({} if args.temperature is None else {"temperature": args.temperature}),
        }
        for _ in range(n)
    ]
    due = schedule(args.rate, n, args.seed)
    url = args.url.rstrip("/") + "/v1/completions"
    outs: list[dict] = [{} for _ in range(n)]
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            wait = t0 + due[i] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(session, url, bodies[i], t0 + due[i], args.burn_ms, outs[i])))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    ok = [o for o in outs if not o["error"] and o["ttft"] is not None and o["latency"] is not None]
    ttfts = [o["ttft"] * 1000 for o in ok]
    tpots = [(o["latency"] - o["ttft"]) / (o["tokens"] - 1) * 1000 for o in ok if o["tokens"] > 1]
    lags = [o["queue_time"] * 1000 for o in outs]
    result = {
        "client": "benchmarks/open_loop_client.py",
        "rate": args.rate,
        "num_prompts": n,
        "duration": duration,
        "completed": len(ok),
        "failed": n - len(ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(o["tokens"] for o in ok) / duration,
        "client_cpu_s": cpu,
        "send_lag_p90_ms": percentile(lags, 90),
        "send_lag_max_ms": max(lags),
        "p90_itl_ms": math.nan,
        "p90_e2el_ms": percentile([o["latency"] * 1000 for o in ok], 90),
        "ttfts": [o["ttft"] for o in outs],
        "latencies": [o["latency"] for o in outs],
        "output_lens": [o["tokens"] for o in outs],
        "start_times": [o["start_time"] for o in outs],
        "queue_times": [o["queue_time"] for o in outs],
        "errors": sorted({o["error"] for o in outs if o["error"]})[:5],
    }
    for p in (50, 90, 99):
        result[f"p{p}_ttft_ms"] = percentile(ttfts, p)
        result[f"p{p}_tpot_ms"] = percentile(tpots, p)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server's base URL (its /v1/completions is used)")
    parser.add_argument("--rate", type=float, required=True, help="offered Poisson rate, req/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="schedule length: rate x this many requests")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are drawn below this")
    parser.add_argument("--model", default="model", help="the served model name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature sent (default 0: greedy); --temperature -1 sends none, the server's "
        "default, as vLLM's bench client does",
    )
    parser.add_argument("--burn-ms", type=float, default=0.0, help="CPU ms spent in the client per streamed chunk")
    parser.add_argument("--out", help="write the result JSON here (else to stdout)")
    args = parser.parse_args()
    if args.rate <= 0 or args.seconds <= 0 or args.input_len <= 0 or args.output_len <= 0 or args.vocab_size <= 0:
        parser.error("--rate, --seconds, --input-len, --output-len and --vocab-size must be positive")
    args.temperature = None if args.temperature is not None and args.temperature < 0 else args.temperature
    result = asyncio.run(run(args))
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
        print(
            f"{result['completed']}/{result['num_prompts']} at {args.rate:g} req/s offered "
            f"({result['request_throughput']:.1f} achieved): p90 TTFT {result['p90_ttft_ms']:.1f} ms, "
            f"p90 TPOT {result['p90_tpot_ms']:.1f} ms, send lag p90 {result['send_lag_p90_ms']:.1f} ms, "
            f"client CPU {result['client_cpu_s'] * 1000 / result['num_prompts']:.2f} ms/request"
        )
    else:
        print(text)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
