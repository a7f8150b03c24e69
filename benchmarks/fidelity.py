"""The same SLO search from every door, one after the other, in one run: does the figure measure
the engine, or its surroundings?

    .venv/bin/python benchmarks/fidelity.py [--spec configs/releases/tiny-qwen3-moe-cpu.yaml] [--layout single]

1. The release DAG: the local S3 server and `airflow standalone` up (as `make demo` runs them),
   `model_release` triggered over REST for one layout; its benchmark task's search is read from
   the run's benchmark.json once the run waits for approval. Then Airflow is stopped.
2. A shell: `model-release benchmark SPEC --layout L --model DIR` as a subprocess, on the very
   serving copy the DAG measured, with nothing else of the project running.
3. A re-benchmark's short search (`rebenchmark.max_probes`, starting at the DAG's answer as at
   the promoted rate, 1.25x steps): what `rebenchmark.measure` runs once the artifact is fetched.
4. A fixed-rate check with vLLM's own client against a fresh engine of the layout, probes twice
   as long as the search's: the answers should pass, and 1.2x the higher one must fail.
5. The independent client (benchmarks/open_loop_client.py: open-loop Poisson, aiohttp, streaming,
   nothing from pipeline/) against another fresh engine of the layout, with the same placement and
   isolation, pinned to the very cores vLLM's client runs on: at the DAG's answer and at 1.1x
   (`--check-seconds` long probes, 30 s or more: long enough for a queue to show), vLLM's client at
   the same rates in the same session, then the confirmed SLO search (from the DAG's answer,
   `--independent-probes` at most) with the independent client measuring every probe. Its answer is
   what the DAG's is compared with (#44: within 15%).

With `--release ID` (or `--release latest`), doors 1-4 are skipped: the release a `make demo` made is
checked as it stands, the independent client (and vLLM's beside it) at its chosen layout's answer
and 1.1x on a fresh engine of that layout, from the release's own staged artifact and recorded spec:

    .venv/bin/python benchmarks/fidelity.py --release latest

The target (#61): the answer is a lower bound on what the engine sustains. Under the independent
client the answer must hold the SLO and 1.1x it must break it: an answer too high (it fails) is
reported as loudly as one too low (1.1x holds), each with a non-zero exit.

Prints every door's answer (each bisected or a bound; unsteady or client-bound where marked),
their ratios, the spread of the repeats at each answer, the CPU that other processes used during
each door's probes (and which processes), and the fixed-rate verdicts with each client's send lag
and CPU per request (vLLM's: its forked child's whole CPU, start-up included; the independent
client's: its send/receive phase; benchmarks/client_cost.py compares the two per request alone).
Ratios within one run hold on a noisy machine; absolute rates do not.

    .venv/bin/python benchmarks/fidelity.py --spec configs/releases/tiny-qwen3-moe-cpu.yaml --layout single
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core import artifacts, measurements
from pipeline.core.errors import ArtifactError
from pipeline.core.paths import home
from pipeline.core.specs import load_spec
from pipeline.embedded import local_s3
from pipeline.embedded.airflow_standalone import Standalone, standalone_env
from pipeline.entry import flow
from pipeline.records.benchmark import LayoutResult, Probe
from pipeline.release import promote
from pipeline.release.registry import cached
from pipeline.stages import benchmark, dequant, interference

log = logging.getLogger("fidelity")


def dag_door(spec: Path, layout: str, port: int) -> tuple[dict, Path]:
    """One release run through Airflow, up to the approval; returns (layout result, serving dir)."""
    log.info("local S3 server at %s", local_s3.ensure_running())
    airflow = Standalone(standalone_env(port=port))
    try:
        airflow.start()
        admin = airflow.client("admin")
        run_id = admin.trigger({"spec": str(spec), "layouts": [layout]})
        log.info("DAG door: triggered model_release run %s (layout %s)", run_id, layout)
        state = admin.wait(
            run_id,
            until="approval",
            timeout=5400,
            on_progress=lambda states, t: log.info(
                "[%4.0f s] %s", t, {k: v for k, v in states.items() if v not in ("success", None)}
            ),
        )
        bench = json.loads((flow.run_dir(run_id) / "benchmark" / "benchmark.json").read_text())
        rel = cached().by_run(run_id)
        if state != "awaiting_approval" or rel is None:
            raise SystemExit(f"the release run ended {state} before its approval; see the Airflow logs")
        model = promote.serving_dir(promote.release_spec(rel), rel.staged())
        return next(r for r in bench["layouts"] if r["layout"] == layout), model
    finally:
        airflow.stop()


def shell_door(spec: Path, layout: str, model: Path, work: Path) -> dict:
    """`model-release benchmark` from a shell: the CLI a person (or a benchmark pod) runs."""
    run_id = f"fidelity-shell-{int(time.time())}"
    cmd = [
        str(ROOT / ".venv" / "bin" / "model-release"),
        "benchmark",
        str(spec),
        "--layout",
        layout,
        "--model",
        str(model),
        "--run-id",
        run_id,
        "--results",
        str(work),
    ]
    log.info("shell door: %s", " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    found = list(work.glob(f"*/benchmark/{layout}.json"))
    return json.loads(found[0].read_text())


def rebenchmark_door(spec: Path, layout_name: str, model: Path, promoted: float, work: Path) -> dict:
    loaded = load_spec(spec)
    layout = next(lay for lay in loaded.spec.layouts if lay.name == layout_name)
    log.info(
        "re-benchmark door: short search from %.3g req/s, %d probes at most",
        promoted,
        loaded.spec.rebenchmark.max_probes,
    )
    result = benchmark.benchmark_layout(
        loaded.spec, loaded.hardware, layout, model, work, max_probes=loaded.spec.rebenchmark.max_probes, prior=promoted
    )
    return json.loads(result.model_dump_json())


def fixed_rates(spec: Path, layout_name: str, model: Path, rates: list[float], work: Path) -> list[Probe]:
    loaded = load_spec(spec)
    layout = next(lay for lay in loaded.spec.layouts if lay.name == layout_name)
    out = []
    with benchmark.running_layout(loaded.spec, loaded.hardware, layout, model, work) as (_, prober):
        for i, rate in enumerate(rates):
            n = max(loaded.spec.workload.num_prompts, math.ceil(rate * loaded.spec.workload.min_probe_seconds * 2))
            out.append(prober(rate, n, 10_000 + i))
    return out


INDEPENDENT_CLIENT = ROOT / "benchmarks" / "open_loop_client.py"
ABOVE = 1.1  # the independent client must break the SLO at this x the answer: the answer is at most 10% low
MIN_CHECK_SECONDS = 30.0  # the independent client's runs at the answer and above: long enough for a queue to show


def lower_bound_verdict(answer: float | None, pairs: list[tuple[str, Probe]]) -> str:
    """The target in words, 'met' or what failed it: under the independent client the answer holds the
    SLO (else it is TOO HIGH: the fleet sized on it is short) and ABOVE x it breaks it (else TOO LOW)."""
    if not answer:
        return "lower-bound target NOT met: the DAG gave no answer to check"
    mine = {round(p.rate / answer, 3): p for client, p in pairs if client == "independent"}
    at, above = mine.get(1.0), mine.get(ABOVE)
    if at is None or above is None:
        return "lower-bound target NOT met: the independent client did not run at the answer and above it"
    said = f"{at.rate:.3g} req/s p90 TTFT {at.p90_ttft_ms:.0f} ms, {above.rate:.3g} p90 TTFT {above.p90_ttft_ms:.0f} ms"
    if not at.passed:
        why = "; ".join(at.reasons)
        return (
            f"lower-bound target NOT met: the answer is TOO HIGH, it fails under the independent client ({said}: {why})"
        )
    if above.passed:
        return (
            f"lower-bound target NOT met: the answer is TOO LOW, {ABOVE:g}x it holds under the independent client "
            f"({said})"
        )
    return f"lower-bound target met: the answer holds under the independent client and {ABOVE:g}x it fails ({said})"


def independent_door(
    spec: Path, layout_name: str, model: Path, answer: float, work: Path, check_seconds: float, max_probes: int
) -> tuple[dict, list[tuple[str, Probe]]]:
    """A fresh engine of the layout (placement and isolation as the search's). The independent client,
    pinned to the cores vLLM's client is pinned to, at `answer` and `ABOVE` x it, each beside vLLM's client
    at the same rate and length; then the SLO search with the independent client measuring its probes.
    Returns (the search's result as a LayoutResult's dict, [(client, probe)] of the fixed rates)."""
    loaded = load_spec(spec)
    layout = next(lay for lay in loaded.spec.layouts if lay.name == layout_name)
    slo, workload = loaded.spec.slo, loaded.spec.workload
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    work.mkdir(parents=True, exist_ok=True)
    checks: list[tuple[str, Probe]] = []
    with benchmark.running_layout(loaded.spec, loaded.hardware, layout, model, work) as (engine, prober):
        prober.bench.ensure()  # its cores are the ones the independent client gets
        cores = prober.bench.cores
        numbers = iter(range(1, 10_000))

        def independent(rate: float, n: int, seed: int) -> Probe:
            if not engine.alive():
                raise engine.exit_error("during the independent client's probe")
            out = work / f"independent-{next(numbers):02d}.json"
            cmd = [
                sys.executable, str(INDEPENDENT_CLIENT), "--url", engine.url, "--rate", f"{rate:.4f}",
                "--seconds", f"{n / rate:.4f}", "--input-len", str(workload.input_len),
                "--output-len", str(workload.output_len), "--vocab-size", str(vocab), "--seed", str(seed),
                "--out", str(out),
            ]  # fmt: skip
            window = interference.Window(engine_groups=set(engine.groups))  # the client: our reaped child
            pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, preexec_fn=pin)
            seen = window.close()
            probe = benchmark.parse_result(out, rate, n, slo, workload)
            probe.interference = seen
            return probe

        for i, rate in enumerate((answer, ABOVE * answer)):
            n = math.ceil(rate * check_seconds)
            checks.append(("independent", independent(rate, n, 20_000 + i)))
            checks.append(("vllm", prober(rate, n, 20_000 + i)))
        if max_probes < 1:  # the fixed rates only (--release)
            return {"probes": []}, checks
        log.info("independent door: the SLO search from %.3g req/s with the independent client", answer)
        outcome = benchmark.confirmed_search(independent, workload, slo, max_probes, prior=answer)
    result = LayoutResult(
        layout=layout.name, tp=layout.tp, dp=layout.dp, ep=layout.ep, pp=layout.pp, replicas=layout.replicas,
        devices=layout.devices, status="ok", capacity_rps=outcome.capacity, max_slo_rate=outcome.max_slo_rate,
        bound_only=outcome.bound_only, stop_reason=outcome.stop_reason, spread=outcome.spread,
        deciding_p90_ttft_ms=outcome.deciding_p90_ttft_ms, unsteady=outcome.unsteady,
        client_bound=outcome.client_bound, client_bound_rates=outcome.client_bound_rates, probes=outcome.probes,
        confirm_seconds=outcome.confirm_seconds, confirmed=outcome.confirmed, step_downs=outcome.step_downs,
    )  # fmt: skip
    return json.loads(result.model_dump_json()), checks


def marks(result: dict) -> str:
    """'unsteady', 'client-bound' where a door's answer carries those marks."""
    return ", ".join(m for m, key in (("unsteady", "unsteady"), ("client-bound", "client_bound")) if result.get(key))


def other_cpu(result: dict) -> tuple[float, float, str]:
    """Mean and max cores used by other processes over a door's counted probes, and who."""
    seen = [p["interference"] for p in result["probes"] if p.get("interference") and not p.get("superseded")]
    if not seen:
        return math.nan, math.nan, ""
    names: dict[str, float] = {}
    for s in seen:
        for name, cores in s["top_other"]:
            names[name] = names.get(name, 0.0) + cores / len(seen)
    top = ", ".join(f"{n} {c:.2f}" for n, c in sorted(names.items(), key=lambda kv: -kv[1])[:4])
    return statistics.mean(s["other"] for s in seen), max(s["other"] for s in seen), top


def client_run(client: str, p: Probe) -> dict:
    """One client's fixed-rate run as the records keep it (fidelity's `clients_at_answer`, lower_bound's `runs`)."""
    return {
        "client": client,
        "rate": p.rate,
        "achieved": p.achieved_rate,
        "p90_ttft_ms": p.p90_ttft_ms,
        "p90_tpot_ms": p.p90_tpot_ms,
        "client_lag_p90_ms": p.client_lag_p90_ms,
        "client_cpu_ms_per_request": p.client_cpu_ms_per_request,
        "client_bound": p.client_bound,
        "passed": p.passed,
        # where the CPU went during the run (cores): on a host whose client shares the frontend's core, a
        # costlier client leaves the API server less of it, and the two clients then measure different engines
        "cores": None
        if p.interference is None
        else {
            "engine_and_frontend": p.interference.engine,
            "client": p.interference.client,
            "other": p.interference.other,
            "busy": p.interference.busy,
        },
    }


def check_release(which: str, check_seconds: float) -> int:
    """The lower-bound target for a release already made (`make demo`): its chosen layout's answer and
    ABOVE x it under the independent client, nothing searched again. Exit 1 unless met."""
    reg = cached()
    if which == "latest":  # releases() lists the newest first
        rel = next((r for r in reg.releases() if r.data.chosen is not None), None)
        if rel is None:
            raise SystemExit(f"--release latest: no release with a chosen layout in {reg.safe_url}; run `make demo`")
    else:
        rel = reg.get(int(which))
    chosen = rel.chosen()
    if not chosen.max_slo_rate:
        raise SystemExit(f"release {rel.id}: its chosen layout {chosen.layout} has no max SLO rate to check")
    loaded = promote.release_spec(rel)
    staged = rel.staged()
    kept = home() / "serving-cache" / staged.manifest_hash[:16]  # the demo's serving copy (its S3 went with it)
    try:
        same = artifacts.verify(kept).content_hash() == staged.manifest_hash
    except ArtifactError:
        same = False
    if same:
        model = dequant.bf16_copy(kept) if loaded.hardware.kind == "cpu" else kept
    else:
        os.environ.update(local_s3.env())
        log.info("local S3 server at %s", local_s3.ensure_running())
        try:
            model = promote.serving_dir(loaded, staged)
        finally:
            local_s3.stop()
    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    spec = work / "spec.yaml"  # independent_door loads a spec file: the release's recorded one
    spec.write_text(rel.spec_yaml)
    log.info("release %d: layout %s, answer %.4g req/s (%s)", rel.id, chosen.layout, chosen.max_slo_rate, rel.name)
    _, pairs = independent_door(spec, chosen.layout, model, chosen.max_slo_rate, work, check_seconds, 0)
    print(f"\nrelease {rel.id} ({rel.name}), layout {chosen.layout}: answer {chosen.max_slo_rate:.4g} req/s")
    print(
        f"{'client':12} {'rate':>8} {'requests':>8} {'achieved':>8} {'p90 TTFT':>9} {'p90 TPOT':>9} {'lag p90':>8} "
        f"{'CPU ms/req':>10}  verdict"
    )
    for client, p in pairs:
        print(
            f"{client:12} {p.rate:8.4g} {p.num_prompts:8d} {p.achieved_rate:8.4g} {p.p90_ttft_ms:9.1f} "
            f"{p.p90_tpot_ms:9.1f} {p.client_lag_p90_ms if p.client_lag_p90_ms is not None else math.nan:8.1f} "
            f"{p.client_cpu_ms_per_request if p.client_cpu_ms_per_request is not None else math.nan:10.2f}  "
            f"{'pass' if p.passed else 'fail: ' + '; '.join(p.reasons)}{' [client-bound]' if p.client_bound else ''}"
        )
    target = lower_bound_verdict(chosen.max_slo_rate, pairs)
    print(f"\n{target}")
    path = measurements.record(
        "lower_bound",
        {
            "release": rel.id,
            "layout": chosen.layout,
            "answer": chosen.max_slo_rate,
            "check_seconds": check_seconds,
            "runs": [{**client_run(client, p), "requests": p.num_prompts} for client, p in pairs],
            "lower_bound": target,
        },
        summary=f"{chosen.layout} at {chosen.max_slo_rate:.4g} req/s: {target.split(':')[0]}",
    )
    print(f"record: {path}")
    return 0 if target.startswith("lower-bound target met") else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default=str(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml"))
    parser.add_argument("--layout", default="single")
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--also", type=float, nargs="*", default=[], help="more fixed rates to check (req/s)")
    parser.add_argument(
        "--check-seconds",
        type=float,
        default=MIN_CHECK_SECONDS,
        help=f"length of the two clients' probes at the answer and {ABOVE:g}x (at least {MIN_CHECK_SECONDS:g})",
    )
    parser.add_argument(
        "--independent-probes", type=int, default=12, help="probe budget of the independent client's search (0: none)"
    )
    parser.add_argument(
        "--release",
        help="check this release (an id, or 'latest') at its chosen answer and 1.1x only; no door is searched again",
    )
    args = parser.parse_args()
    if args.check_seconds < MIN_CHECK_SECONDS:
        parser.error(
            f"--check-seconds {args.check_seconds:g}: at least {MIN_CHECK_SECONDS:g} (a shorter run hides a queue)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    if args.release:
        return check_release(args.release, args.check_seconds)
    spec = Path(args.spec).resolve()
    os.environ.update(local_s3.env())  # this process fetches the staged artifact from the local S3 server too
    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    started = time.monotonic()
    dag, model = dag_door(spec, args.layout, args.port)  # fetches the serving copy while S3 still runs
    local_s3.stop()
    dag_s = time.monotonic() - started
    shell = shell_door(spec, args.layout, model, work / "shell")
    shell_s = time.monotonic() - started - dag_s
    rebench = (
        rebenchmark_door(spec, args.layout, model, dag["max_slo_rate"], work / "rebenchmark")
        if dag.get("max_slo_rate")
        else {"probes": []}
    )
    answers = [r["max_slo_rate"] for r in (dag, shell) if r.get("max_slo_rate")]
    rates = sorted({*answers, 1.2 * max(answers), *args.also}) if answers else list(args.also)
    checks = fixed_rates(spec, args.layout, model, rates, work / "fixed") if rates else []
    independent, pairs = (
        independent_door(
            spec, args.layout, model, dag["max_slo_rate"], work / "independent", args.check_seconds,
            args.independent_probes,
        )
        if dag.get("max_slo_rate")
        else ({"probes": []}, [])
    )  # fmt: skip

    print(f"\nlayout {args.layout} of {spec.name}: same machine, one run, doors one after the other")
    print(
        f"{'door':26} {'max SLO req/s':>13} {'bisected':>8} {'probes':>6} {'runs at answer: p90 TTFT ms':>28} "
        f"{'spread':>6} {'other CPU mean/max':>18}  who"
    )
    for name, r in (
        ("release DAG (Airflow up)", dag),
        ("model-release benchmark", shell),
        ("re-benchmark (short)", rebench),
        ("independent client search", independent),
    ):
        mean, peak, top = other_cpu(r)
        spread = r.get("spread")
        print(
            f"{name:26} {r.get('max_slo_rate') or math.nan:13.3g} {str(not r.get('bound_only')):>8} "
            f"{len(r['probes']):6d} {', '.join(f'{v:.0f}' for v in r.get('deciding_p90_ttft_ms', [])):>28} "
            f"{'-' if spread is None else f'{spread:.0%}':>6} {mean:8.2f} / {peak:.2f}  {top}"
            + (f"  [{marks(r)}]" if marks(r) else "")
        )
    if len(answers) == 2:
        ratio = dag["max_slo_rate"] / shell["max_slo_rate"]
        print(f"ratio DAG / shell: {ratio:.2f} (target within 15%: {'met' if abs(ratio - 1) <= 0.15 else 'NOT met'})")
    if dag.get("max_slo_rate") and independent.get("max_slo_rate"):
        ratio = dag["max_slo_rate"] / independent["max_slo_rate"]
        print(
            f"ratio DAG / independent client: {ratio:.2f} (target within 15%: "
            f"{'met' if abs(ratio - 1) <= 0.15 else 'NOT met'})"
        )
    if rebench.get("max_slo_rate") and shell.get("max_slo_rate"):
        print(f"ratio re-benchmark / shell: {rebench['max_slo_rate'] / shell['max_slo_rate']:.2f}")
    print(f"\nfixed-rate check, vllm bench serve against a fresh engine ({spec.name}, layout {args.layout}):")
    print(
        f"{'rate':>8} {'requests':>8} {'achieved':>8} {'p90 TTFT':>9} {'engine p90':>10} {'p90 TPOT':>9} "
        f"{'other CPU':>9}  verdict"
    )
    for p in checks:
        role = "answer" if p.rate in answers else ("1.2x answer" if answers and p.rate == 1.2 * max(answers) else "")
        print(
            f"{p.rate:8.3g} {p.num_prompts:8d} {p.achieved_rate:8.3g} {p.p90_ttft_ms:9.1f} "
            f"{(p.engine.p90_ttft_ms if p.engine and p.engine.p90_ttft_ms is not None else math.nan):10.1f} "
            f"{p.p90_tpot_ms:9.1f} {p.interference.other if p.interference else math.nan:9.2f}  "
            f"{'pass' if p.passed else 'fail: ' + '; '.join(p.reasons)}{f'  ({role})' if role else ''}"
        )
    if pairs:
        print(
            f"\nthe DAG's answer and {ABOVE:g}x on one fresh engine, both clients on the same cores "
            f"({args.check_seconds:g} s probes):"
        )
        print(
            f"{'client':12} {'rate':>8} {'achieved':>8} {'p90 TTFT':>9} {'p90 TPOT':>9} {'lag p90':>8} {'last':>7} "
            f"{'CPU ms/req':>10} {'other CPU':>9}  verdict"
        )
        for client, p in pairs:
            role = "answer" if p.rate == dag["max_slo_rate"] else f"{ABOVE:g}x answer"
            print(
                f"{client:12} {p.rate:8.3g} {p.achieved_rate:8.3g} {p.p90_ttft_ms:9.1f} {p.p90_tpot_ms:9.1f} "
                f"{p.client_lag_p90_ms if p.client_lag_p90_ms is not None else math.nan:8.1f} "
                f"{p.client_lag_end_ms if p.client_lag_end_ms is not None else math.nan:7.0f} "
                f"{p.client_cpu_ms_per_request if p.client_cpu_ms_per_request is not None else math.nan:10.2f} "
                f"{p.interference.other if p.interference else math.nan:9.2f}  "
                f"{'pass' if p.passed else 'fail: ' + '; '.join(p.reasons)}"
                f"{' [client-bound]' if p.client_bound else ''}  ({role})"
            )
    target = lower_bound_verdict(dag.get("max_slo_rate"), pairs)
    print(f"\n{target}")
    print(
        f"\nwall: DAG door {dag_s / 60:.1f} min, shell door {shell_s / 60:.1f} min, re-benchmark and fixed "
        f"rates {(time.monotonic() - started - dag_s - shell_s) / 60:.1f} min; files under {work}"
    )
    doors = []
    for name, r in (
        ("release DAG", dag),
        ("model-release benchmark", shell),
        ("re-benchmark", rebench),
        ("independent client", independent),
    ):
        mean, peak, _ = other_cpu(r)
        doors.append(
            {
                "door": name,
                "max_slo_rate": r.get("max_slo_rate"),
                "bisected": not r.get("bound_only"),
                "unsteady": bool(r.get("unsteady")),
                "client_bound": bool(r.get("client_bound")),
                "probes": len(r["probes"]),
                "p90_ttft_ms_at_answer": r.get("deciding_p90_ttft_ms", []),
                "spread": r.get("spread"),
                "other_cpu_mean": mean,
                "other_cpu_max": peak,
            }
        )
    fixed = [
        {"rate": p.rate, "achieved": p.achieved_rate, "p90_ttft_ms": p.p90_ttft_ms, "passed": p.passed} for p in checks
    ]
    at_answer = [client_run(client, p) for client, p in pairs]
    path = measurements.record(
        "fidelity",
        {
            "layout": args.layout,
            "doors": doors,
            "fixed_rates": fixed,
            "clients_at_answer": at_answer,
            "lower_bound": target,
        },
        summary=f"{args.layout}: "
        + ", ".join(f"{d['door']} {d['max_slo_rate'] or math.nan:.3g} req/s" for d in doors)
        + (f"; DAG / shell {dag['max_slo_rate'] / shell['max_slo_rate']:.2f}" if len(answers) == 2 else "")
        + (
            f"; DAG / independent {dag['max_slo_rate'] / independent['max_slo_rate']:.2f}"
            if dag.get("max_slo_rate") and independent.get("max_slo_rate")
            else ""
        ),
    )
    print(f"record: {path}")
    return 0 if target.startswith("lower-bound target met") else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
