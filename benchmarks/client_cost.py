"""What the load client costs per request, against a zero-work streaming stub, in one run: vLLM's
bench client as the SLO search runs it (forked by `vllm_cli.py bench-server`, argv from
`benchmark.bench_command`) and the independent client (`benchmarks/open_loop_client.py`).

    .venv/bin/python benchmarks/client_cost.py [--rates 100 200 300] [--seconds 8]

The stub is testkit/simserver.py with no work (service rate 1e6 req/s, 0 ms between tokens), on core
0; each client runs on core 1 (the frontend core the search's client shares with the API server on
the tiny spec's `single`). Per rate each client runs twice, for 1/4 of `--seconds` and for all of
it: the CPU per request is the difference of the two runs' CPU over the difference of their
requests, so start-up (vLLM's tokenizer and prompt sampling in its forked child) cancels out. It
also prints each longer run's p90 send lag (what `benchmark.mark_client_bound` reads) and p90
TTFT: against a stub that answers at once, the latency is the client's and the stub's own. Ratio
vLLM / independent per rate; ratios hold within one run on a noisy machine, absolute figures do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import measurements
from pipeline.core.specs import load_spec
from pipeline.stages import benchmark, serving, tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"the stub on port {port} did not start")


def pinned(cores: list[int]):
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 200.0, 300.0])
    parser.add_argument("--seconds", type=float, default=8.0, help="the longer run's schedule; the shorter is 1/4")
    args = parser.parse_args()
    loaded = load_spec(ROOT / "configs" / "releases" / "tiny-qwen3-moe-cpu.yaml")
    workload, slo = loaded.spec.workload, loaded.spec.slo
    model = tiny_model.reference()
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    cores = sorted(os.sched_getaffinity(0))
    stub_cores, client_cores = (cores[:1], cores[1:2]) if len(cores) > 1 else ([], [])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stub = subprocess.Popen(
        [sys.executable, str(ROOT / "testkit" / "simserver.py"), "--port", str(port), "--mu", "1e6", "--tpot-ms", "0"],
        preexec_fn=pinned(stub_cores),
    )
    vllm = benchmark.bench_client(loaded.hardware, serving.cpu_engine_env(), client_cores)
    rows = []
    try:
        wait_for(port, stub)
        vllm.ensure()  # its vLLM import, once, outside every measurement
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)

            def vllm_run(rate: float, n: int, name: str) -> tuple[float, dict]:
                argv = benchmark.bench_command(vllm.base, url, str(model), workload, slo, rate, n, 7, out, name)[
                    len(vllm.base) :
                ]
                path, cpu_s = vllm.serve(argv, out, name)
                return cpu_s, json.loads(path.read_text())

            def own_run(rate: float, n: int, name: str) -> tuple[float, dict]:
                cmd = [
                    sys.executable, str(ROOT / "benchmarks" / "open_loop_client.py"), "--url", url,
                    "--rate", str(rate), "--seconds", str(n / rate), "--input-len", str(workload.input_len),
                    "--output-len", str(workload.output_len), "--vocab-size", str(vocab), "--seed", "7",
                    "--out", str(out / name),
                ]  # fmt: skip
                before = os.times()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, preexec_fn=pinned(client_cores))
                after = os.times()
                cpu_s = after.children_user + after.children_system - before.children_user - before.children_system
                return cpu_s, json.loads((out / name).read_text())

            for rate in args.rates:
                n_long = math.ceil(rate * args.seconds)
                n_short = max(1, n_long // 4)
                row: dict = {"rate": rate, "requests": [n_short, n_long]}
                for client, run in (("vllm", vllm_run), ("independent", own_run)):
                    short_cpu, _ = run(rate, n_short, f"{client}-{rate:g}-short.json")
                    long_cpu, data = run(rate, n_long, f"{client}-{rate:g}-long.json")
                    lag_p90, lag_end = benchmark.client_lag_ms(data, rate)
                    row[client] = {
                        "cpu_ms_per_request": round((long_cpu - short_cpu) * 1000 / (n_long - n_short), 3),
                        "cores_at_rate": round((long_cpu - short_cpu) / (n_long - n_short) * rate, 3),
                        "send_lag_p90_ms": lag_p90,
                        "send_lag_end_ms": lag_end,
                        "p90_ttft_ms": round(float(data.get("p90_ttft_ms", math.nan)), 2),
                        "achieved_rate": round(float(data["request_throughput"]), 2),
                        "failed": int(data.get("failed") or 0),
                        "records_queue_times": "queue_times" in data and "start_times" in data,
                    }
                rows.append(row)
                v, o = row["vllm"], row["independent"]
                print(
                    f"{rate:6g} req/s  vLLM client {v['cpu_ms_per_request']:.2f} ms CPU/request "
                    f"({v['cores_at_rate']:.2f} cores), lag p90 {v['send_lag_p90_ms']} ms, p90 TTFT "
                    f"{v['p90_ttft_ms']:.1f} ms | independent {o['cpu_ms_per_request']:.2f} ms/request "
                    f"({o['cores_at_rate']:.2f} cores), lag p90 {o['send_lag_p90_ms']} ms, p90 TTFT "
                    f"{o['p90_ttft_ms']:.1f} ms | CPU ratio vLLM / independent "
                    f"{v['cpu_ms_per_request'] / max(o['cpu_ms_per_request'], 1e-9):.2f}",
                    flush=True,
                )
    finally:
        vllm.close()
        stub.kill()
        stub.wait()
    ratios = [r["vllm"]["cpu_ms_per_request"] / max(r["independent"]["cpu_ms_per_request"], 1e-9) for r in rows]
    path = measurements.record(
        "client_cost",
        {
            "stub": "testkit/simserver.py --mu 1e6 --tpot-ms 0",
            "stub_cores": stub_cores,
            "client_cores": client_cores,
            "input_len": workload.input_len,
            "output_len": workload.output_len,
            "rows": [{"rate": r["rate"], "client": c, **r[c]} for r in rows for c in ("vllm", "independent")],
        },
        summary="CPU ms per request, vLLM's bench client / the independent client: "
        + ", ".join(
            f"{r['rate']:g} req/s {r['vllm']['cpu_ms_per_request']:.2f} / {r['independent']['cpu_ms_per_request']:.2f}"
            f" ({x:.2f}x)"
            for r, x in zip(rows, ratios, strict=True)
        ),
    )
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
