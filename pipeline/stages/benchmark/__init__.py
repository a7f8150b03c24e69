"""Benchmark stage: per layout, the highest Poisson request rate that holds the p90 SLO.

Load comes from vLLM's own client (`vllm bench serve`, random prompts at the spec's input and
output lengths, `--ignore-eos`, Poisson arrivals); this package only decides which rates to
probe and reads the JSON it saves. Split by job, as GuideLLM splits its benchmark package:

- its records (Probe, SearchOutcome, LayoutResult, LoadSplit, Selection, BenchmarkFile: what every other
  part hands on) live in `pipeline.records.benchmark`, where callers import them
- `verdict`: a probe's verdict (p90 intervals, keep-up, SLO reasons, client-bound), pure
- `search`: the SLO search, pure (a probe is a callable)
- `steady`: whether a probe's queue held still (its TTFT trend and backlog), pure
- `confirm`: the long run at the search's answer that confirms it (or steps it down), pure
- `selection`: per server / per device, the best layout, a rate as a reader must take it
- `client`: vLLM's bench client (command line, result parser, the client process)
- `outputs`: table, benchmark.json / .csv, the latency-vs-rate plot
- `orchestration`: one layout for real (engines, the Prober, search, served answers)

This door lists the public names callers use (`from pipeline.stages import benchmark`);
a test that stands in for a step patches it where it is looked up (`orchestration`).
"""

from pipeline.stages.benchmark.client import BenchClient, bench_client, bench_command, client_lag_ms, parse_result
from pipeline.stages.benchmark.confirm import confirmed_search
from pipeline.stages.benchmark.orchestration import Prober, benchmark_layout, running_layout
from pipeline.stages.benchmark.outputs import plot, table, write_outputs
from pipeline.stages.benchmark.search import RunProbe, hopeless, margin, slo_search, uniform_sweep
from pipeline.stages.benchmark.selection import finish, rate_text, select
from pipeline.stages.benchmark.verdict import judge, keep_up_share, kept_up, mark_client_bound, quantile_ci

__all__ = [
    "BenchClient",
    "Prober",
    "RunProbe",
    "bench_client",
    "bench_command",
    "benchmark_layout",
    "client_lag_ms",
    "confirmed_search",
    "finish",
    "hopeless",
    "judge",
    "keep_up_share",
    "kept_up",
    "margin",
    "mark_client_bound",
    "parse_result",
    "plot",
    "quantile_ci",
    "rate_text",
    "running_layout",
    "select",
    "slo_search",
    "table",
    "uniform_sweep",
    "write_outputs",
]
