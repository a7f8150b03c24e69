"""A simulated OpenAI-compatible streaming server with a known queueing model.

Prefill is one FIFO server with exponential service times (rate `mu` req/s): with Poisson
arrivals at `lam` that is an M/M/1 queue, whose time in system is exponential with rate
mu - lam, so p90 TTFT = ln(10) / (mu - lam). Decode streams `max_tokens` tokens at a fixed
`tpot_ms`, concurrently, so TPOT always holds. The true highest rate that keeps p90 TTFT
under a limit L is therefore mu - ln(10)/L, which is what a search should find.

Run: python testkit/simserver.py --port 8123 --mu 60 --tpot-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time

from aiohttp import web


def true_max_rate(mu: float, p90_ttft_ms: float) -> float:
    return mu - math.log(10) / (p90_ttft_ms / 1000)


def make_app(mu: float, tpot_ms: float, seed: int = 0) -> web.Application:
    rng = random.Random(seed)
    queue: asyncio.Queue = asyncio.Queue()
    gaps: list[float] = []  # ms between a stream's chunks as written: tpot_ms plus what the loaded machine added

    async def prefill_worker(app):
        async def work():
            while True:
                done = await queue.get()
                await asyncio.sleep(rng.expovariate(mu))
                done.set_result(None)

        task = asyncio.create_task(work())
        yield
        task.cancel()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = int(body.get("max_tokens") or 16)
        done = asyncio.get_running_loop().create_future()
        await queue.put(done)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await done
        last = time.perf_counter()
        for i in range(tokens):
            if i:
                await asyncio.sleep(tpot_ms / 1000)
                now = time.perf_counter()
                gaps.append((now - last) * 1000)
                last = now
            chunk = {
                "id": "sim",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "text": " x", "finish_reason": None if i < tokens - 1 else "length"}],
            }
            if i == tokens - 1:
                chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        """The token gaps it served (a sleep overruns on a loaded machine: a test compares with these)."""
        ordered = sorted(gaps)
        return web.json_response(
            {"gaps": len(ordered), "median_gap_ms": ordered[len(ordered) // 2] if ordered else None}
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "model", "object": "model"}]})

    app = web.Application()
    app.cleanup_ctx.append(prefill_worker)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mu", type=float, default=60.0)
    parser.add_argument("--tpot-ms", type=float, default=5.0)
    args = parser.parse_args()
    web.run_app(make_app(args.mu, args.tpot_ms), host="127.0.0.1", port=args.port, print=None)
