"""vLLM's bench client: the `vllm bench serve` command line, its saved result read as a `Probe`,
and the client process (`vllm_cli.py bench-server`, vLLM imported once, forked per probe)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from pipeline.core.errors import ReleaseError
from pipeline.core.specs import HardwareProfile, SloSpec, WorkloadSpec
from pipeline.records.benchmark import Probe
from pipeline.stages import serving
from pipeline.stages.benchmark import steady
from pipeline.stages.benchmark.verdict import judge, mark_client_bound, quantile_ci


def per_request_tpot_ms(data: dict[str, Any]) -> list[float]:
    out: list[float] = []
    columns = (data.get("ttfts", []), data.get("latencies", []), data.get("output_lens", []))
    if not columns[1] or not columns[2]:
        return out  # a result without per-request latencies (a recorded probe's TTFTs only): no TPOT interval
    for ttft, latency, n in zip(*columns, strict=True):
        if n and n > 1 and latency:
            out.append((latency - ttft) / (n - 1) * 1000)
    return out


def bench_command(
    base: list[str],
    url: str,
    model_dir: str,
    workload: WorkloadSpec,
    slo: SloSpec,
    rate: float,
    num_prompts: int,
    seed: int,
    result_dir: Path,
    name: str,
) -> list[str]:
    return [
        *base,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "model",
        "--tokenizer",
        model_dir,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf" if math.isinf(rate) else f"{rate:.4f}",
        "--burstiness",
        "1.0" if workload.arrival == "poisson" else "1000",
        "--seed",
        str(seed),
        "--metric-percentiles",
        "50,90,99",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--goodput",
        f"ttft:{slo.max_p90_ttft_ms:g}",
        f"tpot:{slo.max_p90_tpot_ms:g}",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        name,
        "--disable-tqdm",
        "--num-warmups",
        "2",
        "--ready-check-timeout-sec",
        "0",
    ]


def client_lag_ms(data: dict[str, Any], rate: float) -> tuple[float | None, float | None]:
    """(p90 per-request send lag, last send's lag against the schedule's end), ms, from a client's
    detailed result. vLLM's client records per request `queue_times` (from its schedule releasing the
    request to the send: its event loop's backlog) and `start_times` (the sends). Its Poisson schedule
    is scaled to end n / rate after it starts, so on schedule the sends span n / rate less the first
    one's wait (1 / rate on average): a client that cannot keep up sends the last ones late, and the
    span less n / rate is a lower bound of that lag (never an alarm at a low rate's long waits)."""
    lags = sorted(q * 1000 for q in data.get("queue_times") or [] if q is not None)
    p90 = lags[min(len(lags) - 1, math.ceil(0.9 * len(lags)) - 1)] if lags else None
    starts = [t for t in data.get("start_times") or [] if t is not None]
    end = None
    if len(starts) > 1 and not math.isinf(rate) and rate > 0:
        end = max(0.0, (max(starts) - min(starts) - len(starts) / rate) * 1000)
    return (None if p90 is None else round(p90, 2)), (None if end is None else round(end, 2))


def parse_result(
    path: Path, rate: float, num_prompts: int, slo: SloSpec, workload: WorkloadSpec | None = None
) -> Probe:
    """A probe from a client's saved result (vLLM's `--save-detailed` keys), judged with its TTFT trend
    carried over the confirmation's length (`steady`: the spec's with `workload`, else the SLO's floor);
    with `workload`, marked client-bound by the client's send lag (`mark_client_bound`)."""
    data = json.loads(path.read_text())
    completed, failed = int(data.get("completed", 0)), int(data.get("failed", 0) or 0)
    total = max(completed + failed, num_prompts)
    probe = Probe(
        rate=rate,
        num_prompts=num_prompts,
        achieved_rate=float(data["request_throughput"]),
        completed=completed,
        failed=failed,
        failed_fraction=(total - completed) / total,
        duration_s=float(data["duration"]),
        output_tok_s=float(data.get("output_throughput", 0.0)),
        goodput=data.get("request_goodput"),
        **{f"p{p}_{m}_ms": float(data.get(f"p{p}_{m}_ms", math.nan)) for p in (50, 90, 99) for m in ("ttft", "tpot")},
        p90_itl_ms=float(data.get("p90_itl_ms", math.nan)),
        p90_e2el_ms=float(data.get("p90_e2el_ms", math.nan)),
        result_file=str(path),
    )
    ttfts = [t * 1000 for t in data.get("ttfts", []) if t]
    probe.p90_ttft_ci_ms = quantile_ci(ttfts)
    probe.p90_tpot_ci_ms = quantile_ci(per_request_tpot_ms(data))
    probe.client_lag_p90_ms, probe.client_lag_end_ms = client_lag_ms(data, rate)
    if data.get("client_cpu_s") is not None:  # a client that measures its own CPU (the Prober's is from wait4)
        probe.client_cpu_ms_per_request = round(float(data["client_cpu_s"]) * 1000 / max(num_prompts, 1), 3)
    if not math.isinf(rate):
        seen = steady.measure(data)
        horizon = steady.confirm_seconds(workload, slo) if workload else slo.confirm_floor_seconds
        probe.ttft_trend_ms_per_s, probe.backlog_end = seen.trend_ms_per_s, seen.backlog_end
        probe.projected_p90_ttft_ms = steady.projected(probe.p90_ttft_ms, seen.trend_ms_per_s, horizon)
    judge(probe, slo)
    if workload is not None:
        mark_client_bound(probe, slo, workload)
    return probe


class BenchClient:
    """vLLM's bench client, imported once (`vllm_cli.py bench-server`) and forked per probe.

    Each probe still runs `vllm bench serve` in a fresh process, on `cores`; the server answers
    with its exit code and CPU seconds (wait4), which the probe's accounting counts as the
    client's. Started on first use; `close()` (or our death: PDEATHSIG) ends it and any probe."""

    def __init__(self, base: list[str], env: dict[str, str], cores: list[int] | None = None):
        self.base, self.env, self.cores = base, env, cores or []
        self.proc: subprocess.Popen[str] | None = None
        self.ready = False

    def launch(self, cores: list[int] | None = None) -> None:
        """Start the server without waiting for its vLLM import (~20 s here), on `cores` meanwhile
        (default: its own): a layout's benchmark launches it on cores its engines leave idle while
        they load, so the import costs no probe and no engine time. `ensure()` waits for it."""
        if self.proc is not None and self.proc.poll() is None:
            return
        start_cores = cores or self.cores

        def preexec() -> None:
            serving.die_with_parent()
            if start_cores:
                os.sched_setaffinity(0, start_cores)

        self.ready = False
        self.proc = subprocess.Popen(
            [*self.base, "bench-server"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            preexec_fn=preexec,
        )

    def ensure(self) -> None:
        """A started server, ready for a probe, on its own cores."""
        if self.proc is None or self.proc.poll() is not None:
            self.launch()
        assert self.proc is not None
        if self.ready:
            return
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip().startswith("{"):
            self.close()
            raise ReleaseError(f"vllm bench client did not start ({' '.join(self.base)} bench-server)")
        if self.cores:
            serving.pin(self.proc.pid, self.cores)  # from the cores it loaded on (or was confined to)
        self.ready = True

    @property
    def group(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def run(self, argv: list[str], log_path: Path, timeout: float = 1800) -> tuple[int, float]:
        """`vllm bench serve` with `argv` (after `bench serve`... as on the command line), output
        to `log_path`. -> (exit code, CPU seconds it used)."""
        self.ensure()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
        self.proc.stdin.flush()
        answer: list[str] = []
        stdout = self.proc.stdout
        reader = threading.Thread(target=lambda: answer.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not answer or not answer[0].strip():
            self.close()  # a probe past its time, or a dead server: nothing of it may outlive the probe
            raise ReleaseError(f"vllm bench serve gave no answer within {timeout:.0f} s (see {log_path})")
        result = json.loads(answer[0])
        return int(result["rc"]), float(result["cpu_s"])

    def serve(self, argv: list[str], out_dir: Path, name: str, what: str = "") -> tuple[Path, float]:
        """`run`, with its result file `out_dir/name` (log beside it) required. -> (result file, CPU
        seconds); a failed run is a ReleaseError with the log's tail (`what`: what it measured)."""
        code, cpu_s = self.run(argv, out_dir / f"{name}.log")
        if code != 0 or not (out_dir / name).exists():
            text = (out_dir / f"{name}.log").read_text(errors="replace")
            raise ReleaseError(f"vllm bench serve failed{what} ({code}):\n{text[-2000:]}")
        return out_dir / name, cpu_s

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            self.ready = False


def bench_client(hw: HardwareProfile, engine_env: dict[str, str], cores: list[int] | None = None) -> BenchClient:
    """vLLM's own client, through vllm_cli.py (its SSE fix matters behind nginx): the engine venv's
    python here, the worker image's own python (which has vLLM) in a benchmark pod."""
    python = str(serving.SERVE_PYTHON) if hw.kind == "cpu" else sys.executable
    env = {**os.environ, **engine_env}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return BenchClient([python, str(serving.VLLM_CLI)], env, cores)
